"""The README's Python examples run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(
  r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL
)


def test_readme_has_python_examples():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch):
  code = BLOCKS[index]
  traces = ROOT.parent / "shared" / "traces"
  if "../shared/traces" in code and not traces.is_dir():
    pytest.skip(f"needs the shared traces folder {traces}")
  monkeypatch.chdir(ROOT)
  exec(compile(code, f"README.md block {index}", "exec"), {})
