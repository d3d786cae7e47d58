"""The Colab notebooks' code cells run as written (shell lines skipped)."""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
  pytest.importorskip("matplotlib", reason="the notebooks plot")
  monkeypatch.chdir(tmp_path)
  # IPython's display is Colab's; a stand-in keeps the test light.
  namespace: dict = {"Image": lambda name: pathlib.Path(name).read_bytes()}
  cells = json.loads(path.read_text())["cells"]
  for number, cell in enumerate(cells):
    if cell["cell_type"] != "code":
      continue
    lines = [
      line
      for line in cell["source"]
      if not line.lstrip().startswith(("!", "from IPython"))
    ]
    exec(
      compile("".join(lines), f"{path.name} cell {number}", "exec"), namespace
    )
  assert (tmp_path / "hit_rates.png").stat().st_size > 10_000
  assert (tmp_path / "semantics.png").stat().st_size > 10_000
