"""A command-line refusal as the benchmarks make it: exit status 2, the
message on stderr's last line, no traceback."""

from __future__ import annotations

import pytest


def assert_refused(capsys, parse, argv, message):
  """`parse(argv)` exits 2 with `message` in stderr's last line."""
  with pytest.raises(SystemExit) as exit_info:
    parse(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err.strip().splitlines()[-1], err
  assert "Traceback" not in err
