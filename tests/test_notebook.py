"""The slow tier executes the example notebook on CPU."""

from __future__ import annotations

import pathlib

import pytest
import nbformat
from nbclient import NotebookClient

from tests import fast_compile

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "examples" / "rag_demo.ipynb"


@pytest.mark.slow
def test_rag_demo_notebook_runs_and_plots():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={
      "metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute(env=fast_compile.default_env())  # it runs the 135M model
  outputs = [o for cell in nb.cells if cell.cell_type == "code"
             for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "cache hits: [True, True, True]" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)
