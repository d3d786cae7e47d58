"""Whole-process start-up: the 12 Mooncake points end to end, side by side.

What a user waits for, from typing the command to the table: the process
start, imports, trace loading, compilation (or loading compiled programs
from the persistent cache) and the run. Each variant is a fresh process,
timed from outside, several times (best and median reported):

* ``kvcache-sim C++``: a Python process that imports kvcache-simulator
  0.1.3, parses the trace and runs its C++ sweep of the 12 points (its
  C++ core built beforehand, as a user who ran it once has it);
* ``prefixjax cold``: ``prefixjax replay`` with an empty compilation cache
  folder (every program compiled);
* ``prefixjax warm``: the same command again, its programs in the cache;
* ``import jax``: a process that imports jax and runs one tiny op (the
  floor every JAX program pays).

Then the bucketed shapes (issue 13, section 4): ``--limit 300`` and then
``--limit 310`` of the trace (capacities 100 and 200) in new processes
sharing one fresh cache folder. The engines pad trace-sized arrays to
powers of two, so the second finds every program in the cache; each
run's own load / compile / run split is printed.

Usage: ``python benchmarks/replay_startup.py [--runs 5] [--json OUT]``.
Needs ``../shared/traces/mooncake_conversation_trace.jsonl`` and (for the
first row) ``pip install kvcache-simulator==0.1.3``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared/traces/mooncake_conversation_trace.jsonl"
CAPACITIES = ("1827", "9139", "18279", "36558")

KVCACHE_SIM = """
import sys
from kvcache_sim.cpp_backend import run_cpp_sweep
from kvcache_sim.plan import build_execution_plan
from kvcache_sim.trace import parse_trace_file
trace = parse_trace_file(sys.argv[1], block_size=512)
plan = build_execution_plan(trace, 0.5)
out = run_cpp_sweep(trace, capacities=[1827, 9139, 18279, 36558],
                    policies=["fifo", "lru", "optimal"],
                    warmup_requests=plan.warmup_requests)
print(len(out.results))
"""

IMPORT_JAX = "import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()"


def _time(argv, runs: int) -> list[float]:
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    times.append(time.perf_counter() - start)
  return times


def _prefixjax(
  cache: pathlib.Path, *extra: str, capacities=CAPACITIES
) -> list[str]:
  """The replay command with its compilation and trace caches in
  ``cache`` (so "cold" starts with both empty)."""
  return [
    sys.executable,
    "-m",
    "prefixjax",
    "replay",
    "--trace",
    str(TRACE),
    "--capacity",
    *capacities,
    *extra,
    "--compile-cache",
    str(cache / "jax"),
    "--trace-cache",
    str(cache / "traces"),
  ]


def _split(stdout: str) -> str:
  """The ``load ... compile ... run`` line a replay prints last."""
  lines = [line for line in stdout.splitlines() if line.startswith("load ")]
  return lines[0] if lines else "?"


def _buckets(runs: int) -> dict[str, list]:
  """``--limit 300`` then ``--limit 310`` in new processes sharing a fresh
  cache folder, ``runs`` times: wall seconds and each run's own split."""
  out: dict[str, list] = {"limit 300": [], "limit 310": [], "splits": []}
  for _ in range(runs):
    with tempfile.TemporaryDirectory() as tmp:
      cache = pathlib.Path(tmp) / "cache"
      for limit in ("300", "310"):
        argv = _prefixjax(cache, "--limit", limit, capacities=("100", "200"))
        start = time.perf_counter()
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        out[f"limit {limit}"].append(time.perf_counter() - start)
        out["splits"].append(f"--limit {limit}: {_split(done.stdout)}")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  if not TRACE.exists():
    print(f"trace not found: {TRACE}")
    return 1
  # Byte-compiled modules, as pip leaves an install (this machine sets
  # PYTHONDONTWRITEBYTECODE, so an editable checkout would otherwise
  # compile its sources in every process: 0.04-0.06 s).
  subprocess.run(
    [sys.executable, "-m", "compileall", "-q", str(ROOT / "prefixjax")],
    check=True,
  )
  try:
    import kvcache_sim  # noqa: F401

    kv = [sys.executable, "-c", KVCACHE_SIM, str(TRACE)]
    subprocess.run(kv, check=True, capture_output=True)  # builds its core
  except ImportError:
    print("kvcache-simulator is not installed: skipping its row")
    kv = None
  # One round runs every variant once, in turn, so a drift of the
  # machine's speed moves all of them alike (the ratio is taken per round).
  names = ["import jax", "kvcache-sim C++", "prefixjax cold", "prefixjax warm"]
  rows: dict[str, list[float]] = {n: [] for n in names if kv or "C++" not in n}
  for _ in range(args.runs):
    rows["import jax"] += _time([sys.executable, "-c", IMPORT_JAX], 1)
    if kv:
      rows["kvcache-sim C++"] += _time(kv, 1)
    with tempfile.TemporaryDirectory() as tmp:
      cache = pathlib.Path(tmp) / "cache"
      rows["prefixjax cold"] += _time(_prefixjax(cache), 1)
      rows["prefixjax warm"] += _time(_prefixjax(cache), 1)
  # The split a warm run reports itself (load / compile / run).
  with tempfile.TemporaryDirectory() as tmp:
    cache = pathlib.Path(tmp) / "cache"
    subprocess.run(_prefixjax(cache), check=True, capture_output=True)
    out = subprocess.run(
      _prefixjax(cache), check=True, capture_output=True, text=True
    ).stdout
  buckets = _buckets(args.runs)
  print(f"{'variant':>16} {'best':>7} {'median':>7}  (s, {args.runs} runs)")
  for name, times in rows.items():
    print(f"{name:>16} {min(times):7.2f} {statistics.median(times):7.2f}")
  if "kvcache-sim C++" in rows:
    ratios = [
      w / c
      for w, c in zip(
        rows["prefixjax warm"], rows["kvcache-sim C++"], strict=True
      )
    ]
    print(
      "prefixjax warm / kvcache-sim C++, per round: median "
      f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-"
      f"{max(ratios):.2f}x (target <= 1.5x)"
    )
  print(f"warm run's own split: {_split(out)}")
  print("a new trace length in the same bucket (fresh cache each round):")
  for name in ("limit 300", "limit 310"):
    times = buckets[name]
    print(f"{name:>16} {min(times):7.2f} {statistics.median(times):7.2f}")
  for line in buckets["splits"]:
    print(f"  {line}")
  if args.json:
    report = {**rows, "buckets": buckets}
    pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
