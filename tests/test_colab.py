"""The Colab notebooks: well formed, and each runs headless, top to bottom.

The execution tests run every notebook in a fresh Jupyter kernel (nbclient),
as Colab would, with the interpreter of this test run: a ``python3``
kernelspec written for the test points at :data:`sys.executable`. The
kernel starts in an empty folder that must stay empty (the notebooks write
into a ``tempfile.mkdtemp`` folder ``OUT``), and nothing under ``colab/``
changes (no outputs saved into the notebooks).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import tomllib

import pytest
import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))

# What each notebook leaves in its OUT folder (glob patterns; each must
# match a non-empty file).
WRITES = {
  "quickstart.ipynb": (
    "hit_rates.png",
    "semantics.png",
    "sweep/results.csv",
    "sweep/plots/hit_rate_*.png",
  ),
  "sweep.ipynb": (
    "sweep/results.csv",
    "sweep/results.json",
    "sweep/plots/hit_rate_*.png",
    "sweep/plots/block_size_*.png",
    "sweep/plots/schedulers_*.png",
  ),
  "kernels.ipynb": (),
  "engine.ipynb": ("engine_steps.png", "ckpt/meta"),
}

# Seconds a notebook may take on a CPU runtime (issue 15: under 5 minutes;
# each takes well under one on the 2-core CI machine).
BUDGET_S = 300

# Appended to the in-memory copy that runs: which interpreter the kernel
# used, where it started, and its OUT folder.
REPORT = (
  "import json as _j, os as _o, sys as _s\n"
  'print("REPORT" + _j.dumps({"prefix": _s.prefix, '
  '"executable": _s.executable, "cwd": _o.getcwd(), "out": str(OUT)}))'
)


def _cells(path):
  return json.loads(path.read_text())["cells"]


def _install_cell(path):
  return next(c for c in _cells(path) if c["cell_type"] == "code")


def test_there_are_notebooks():
  assert NOTEBOOKS
  assert {p.name for p in NOTEBOOKS} == set(WRITES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_have_unique_ids_and_no_outputs(path):
  notebook = json.loads(path.read_text())
  assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5)
  assert notebook["metadata"]["kernelspec"]["name"] == "python3"
  ids = [cell.get("id") for cell in notebook["cells"]]
  assert all(ids) and len(set(ids)) == len(ids), ids
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_valid_nbformat(path):
  import nbformat

  nbformat.validate(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_starts_with_the_quickstart_install_cell(path):
  first = _cells(path)[0]
  assert first["cell_type"] == "markdown"
  want = _install_cell(ROOT / "colab" / "quickstart.ipynb")["source"]
  assert _install_cell(path)["source"] == want


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_finds_the_checkout_wherever_the_kernel_starts(
  path, monkeypatch
):
  """The first code cell is a no-op when prefixjax is importable, and finds
  the checkout from any folder inside it (the pip target it would use)."""
  install = _install_cell(path)
  namespace: dict = {}
  exec(compile("".join(install["source"]), "install", "exec"), namespace)
  try:
    for start in (ROOT, ROOT / "colab", ROOT / "prefixjax" / "replay"):
      monkeypatch.chdir(start)
      assert namespace["_checkout"]() == ROOT
    assert namespace["OUT"].is_dir() and not any(namespace["OUT"].iterdir())
  finally:
    shutil.rmtree(namespace["OUT"], ignore_errors=True)


def test_sweep_notebook_copy_of_the_quickstart_spec_is_current():
  """sweep.ipynb writes its copy of experiments/quickstart.toml when the
  checkout is absent (pip from git); it must say the same."""
  cell = next(
    c for c in _cells(ROOT / "colab" / "sweep.ipynb") if c["id"] == "spec-text"
  )
  tree = ast.parse("".join(cell["source"]))
  (assign,) = [n for n in tree.body if isinstance(n, ast.Assign)]
  assert assign.targets[0].id == "QUICKSTART_TOML"
  copy = tomllib.loads(ast.literal_eval(assign.value))
  shipped = ROOT / "experiments" / "quickstart.toml"
  assert copy == tomllib.loads(shipped.read_text())


def _git_status(folder: pathlib.Path) -> str | None:
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    return None
  run = subprocess.run(
    ["git", "status", "--porcelain", "--untracked-files=all", "--", "."],
    cwd=folder,
    capture_output=True,
    text=True,
  )
  return run.stdout if run.returncode == 0 else None


@pytest.fixture
def kernel_env(tmp_path_factory, monkeypatch):
  """A ``python3`` kernelspec on this interpreter, and the kernel's env.

  The kernelspec goes first on ``JUPYTER_PATH``, ahead of any user or
  system ``python3``. The kernel gets its own temporary folder (``OUT``
  lands there), its own IPython folder, one CPU device as in Colab
  (``conftest`` asks this process for eight) and a cold start, as in
  Colab too (not the compilation cache ``conftest`` shares across the run).
  """
  home = tmp_path_factory.mktemp("kernel")
  spec = home / "jupyter" / "kernels" / "python3"
  spec.mkdir(parents=True)
  argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
  spec.joinpath("kernel.json").write_text(
    json.dumps(
      {"argv": argv, "display_name": "Python 3 (tests)", "language": "python"}
    )
  )
  monkeypatch.setenv("JUPYTER_PATH", str(home / "jupyter"))
  temp = home / "tmp"
  temp.mkdir()
  env = dict(os.environ)
  # One device as in Colab; the suite's compile flags (tests/xla_flags.py).
  env["XLA_FLAGS"] = xla_flags.with_devices(None)
  # A cold start as in Colab: not the suite's compilation cache (conftest).
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["PREFIXJAX_COMPILE_CACHE"] = "off"
  env.update(
    TMPDIR=str(temp),
    IPYTHONDIR=str(home / "ipython"),
    PYTHONDONTWRITEBYTECODE="1",
  )
  return env, temp


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, kernel_env):
  import nbclient  # the test extra's; a missing one fails, not skips
  import nbformat

  env, temp = kernel_env
  before = _git_status(ROOT / "colab")
  raw = path.read_bytes()
  notebook = nbformat.read(path, as_version=4)
  notebook.cells.append(nbformat.v4.new_code_cell(REPORT))
  client = nbclient.NotebookClient(
    notebook,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(tmp_path)}},
  )
  start = time.perf_counter()
  client.execute(env=env)  # raises CellExecutionError on any cell's error
  seconds = time.perf_counter() - start
  print(f"{path.name}: {seconds:.1f} s")
  assert seconds < BUDGET_S, f"{path.name} took {seconds:.0f} s"

  (line,) = [
    text
    for out in notebook.cells[-1].outputs
    if out.get("name") == "stdout"
    for text in out["text"].splitlines()
    if text.startswith("REPORT")
  ]
  report = json.loads(line.removeprefix("REPORT"))
  # The kernel ran this interpreter, in the folder it was given.
  assert report["prefix"] == sys.prefix
  assert report["executable"] == sys.executable
  assert pathlib.Path(report["cwd"]).resolve() == tmp_path.resolve()
  # It wrote into its temporary OUT only: the start folder stays empty.
  assert list(tmp_path.iterdir()) == []
  out = pathlib.Path(report["out"])
  assert out.is_dir() and out.resolve().is_relative_to(temp.resolve())
  for pattern in WRITES[path.name]:
    found = sorted(out.glob(pattern))
    assert found, f"{path.name} wrote nothing matching {pattern} in OUT"
    assert all(f.stat().st_size > 0 for f in found), found
  # Nothing new under colab/ (the notebook on disk keeps no outputs).
  assert _git_status(ROOT / "colab") == before
  assert path.read_bytes() == raw
