"""The Colab notebooks' code cells run as written (shell lines skipped)."""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_have_unique_ids_and_no_outputs(path):
  notebook = json.loads(path.read_text())
  assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5)
  ids = [cell.get("id") for cell in notebook["cells"]]
  assert all(ids) and len(set(ids)) == len(ids), ids
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None


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
  # Figures go to the notebook's temporary folder, nothing into the
  # folder the kernel started in (a checkout, in real use).
  out = namespace["OUT"]
  assert (out / "hit_rates.png").stat().st_size > 10_000
  assert (out / "semantics.png").stat().st_size > 10_000
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_finds_the_checkout_wherever_the_kernel_starts(
  path, monkeypatch
):
  """The first code cell is a no-op when prefixjax is importable, and finds
  the checkout from any folder inside it (the pip target it would use)."""
  cells = json.loads(path.read_text())["cells"]
  install = next(c for c in cells if c["cell_type"] == "code")
  namespace: dict = {}
  exec(compile("".join(install["source"]), "install", "exec"), namespace)
  for start in (ROOT, ROOT / "colab", ROOT / "prefixjax" / "replay"):
    monkeypatch.chdir(start)
    assert namespace["_checkout"]() == ROOT
  assert namespace["OUT"].is_dir() and not any(namespace["OUT"].iterdir())
