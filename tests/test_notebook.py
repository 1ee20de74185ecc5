"""The example notebook: the slow tier executes it on CPU, and its setup
cell finds the repository from Colab's working folder."""

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


def _find_repository():
  """The setup cell's find_repository, defined alone (nothing installed)."""
  import json
  cell = "".join(json.loads(NOTEBOOK.read_text())["cells"][1]["source"])
  definition = cell[cell.index("def find_repository"):cell.index("\nif ")]
  namespace = {"pathlib": pathlib}
  exec(definition, namespace)
  return namespace["find_repository"]


def test_the_setup_cell_finds_the_repository_from_colabs_folder(
    tmp_path, monkeypatch):
  """Colab runs notebooks in /content, beside the clone, not in examples/."""
  find = _find_repository()
  root = NOTEBOOK.parents[1]
  monkeypatch.chdir(root / "examples")
  assert find() == root
  content = tmp_path / "content"
  content.mkdir()
  (content / "sample_data").mkdir()
  (content / "lazyattn-jax").symlink_to(root)
  monkeypatch.chdir(content)
  assert find() == content / "lazyattn-jax"
  (content / "lazyattn-jax").unlink()
  with pytest.raises(RuntimeError, match="lazyattn-jax not found"):
    find()
