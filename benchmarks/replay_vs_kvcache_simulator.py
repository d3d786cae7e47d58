"""Our on-device replay against kvcache-simulator's Python and C++ backends.

Runs the 12 published points (fifo / lru / optimal x capacities 1,827 /
9,139 / 18,279 / 36,558 blocks) of the Mooncake conversation trace, block
512, warm-up 0.5, through:

* kvcache-simulator 0.1.3's Python backend (``simulate_policy``),
* its C++ backend (``run_cpp_sweep``; compiled on first use, not timed),
* prefixjax (``replay``'s default engines: ``fifo`` one jitted scan of
  insertion-queue keys over the blocks seen before, ``lru_leaf`` one pass
  of stack distances for all capacities, ``belady_leaf`` one scan of
  per-key counts; ``fifo`` and ``belady_leaf`` keep the capacities as an
  array axis; compile time reported separately),

prints the hit tokens side by side (they must be equal) and the time ratios,
then measures how the cost grows with the number of configurations (1 vs
256 capacities, from the longest request's blocks up, so ``lru_leaf`` stays
on its stack-distance engine) on a prefix of the trace.

Usage::

  python benchmarks/replay_vs_kvcache_simulator.py [--trace PATH]
      [--scaling-requests 1500] [--json OUT] [--cpu-threads 1]

Needs ``pip install kvcache-simulator==0.1.3`` (in the test extra) and a C++
compiler for its C++ backend; missing pieces are reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import jax
import numpy as np

from prefixjax import replay as rp
from prefixjax.workloads import load_mooncake

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared/traces/mooncake_conversation_trace.jsonl"
CAPACITIES = (1827, 9139, 18279, 36558)
POLICIES = ("fifo", "lru_leaf", "belady_leaf")


def _theirs_python(path, block_size):
  from kvcache_sim.plan import build_execution_plan
  from kvcache_sim.policies import simulate_policy
  from kvcache_sim.trace import parse_trace_file

  trace = parse_trace_file(str(path), block_size=block_size)
  plan = build_execution_plan(trace, 0.5)
  hits = {}
  start = time.perf_counter()
  for policy in POLICIES:
    name = rp.KVCACHE_SIM_POLICY_NAMES[policy]
    for capacity in CAPACITIES:
      hits[policy, capacity] = simulate_policy(plan, name, capacity).hitTokens
  return hits, time.perf_counter() - start, (trace, plan)


def _theirs_cpp(trace, plan):
  from kvcache_sim.cpp_backend import run_cpp_sweep

  names = [rp.KVCACHE_SIM_POLICY_NAMES[p] for p in POLICIES]
  kwargs = dict(
    capacities=list(CAPACITIES),
    policies=names,
    warmup_requests=plan.warmup_requests,
  )
  run_cpp_sweep(trace, **kwargs)  # compiles the core on first use
  times, out = [], None
  for _ in range(3):
    start = time.perf_counter()
    out = run_cpp_sweep(trace, **kwargs)
    times.append(time.perf_counter() - start)
  back = {v: k for k, v in rp.KVCACHE_SIM_POLICY_NAMES.items()}
  hits = {
    (back[name], capacity): result.hitTokens
    for (name, capacity), result in out.results.items()
  }
  return hits, float(np.median(times))


def _ours(trace):
  plan = rp.prepare_replay(trace.hash_ids, trace.input_lengths, block_size=512)
  hits, compile_s, run_s = {}, {}, {}
  for policy in POLICIES:
    first = rp.replay(plan, policy=policy, capacities=CAPACITIES)
    compile_s[policy] = first.timing.compile_s  # the first call compiles
    runs = []
    for _ in range(2):
      points = rp.replay(plan, policy=policy, capacities=CAPACITIES)
      runs.append(points.timing.run_s)
    run_s[policy] = min(runs)
    for capacity, point in zip(CAPACITIES, points, strict=True):
      hits[policy, capacity] = point.hit_tokens
  return hits, compile_s, run_s


def _scaling(trace, num_requests):
  small = trace.slice(0, num_requests)
  plan = rp.prepare_replay(small.hash_ids, small.input_lengths, block_size=512)
  starts = np.flatnonzero(plan.first)
  longest = int(np.diff(np.r_[starts, plan.num_events]).max())
  low = max(50, longest)
  rows = []
  for policy in POLICIES:
    row = {"policy": policy}
    for configs in (1, 256):
      caps = np.linspace(low, plan.unique_blocks, configs).astype(int).tolist()
      rp.replay(plan, policy=policy, capacities=caps)  # compile
      runs = []
      for _ in range(3):  # the best of three: this machine is noisy
        result = rp.replay(plan, policy=policy, capacities=caps)
        runs.append(result.timing.run_s)
      row[configs] = min(runs)
    rows.append(row)
    print(
      f"  {policy:12s} 1 config {row[1]:.3f} s, 256 configs {row[256]:.3f} s"
      f" -> {row[256] / row[1]:.1f}x",
      flush=True,
    )
  return plan, rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trace", default=str(DEFAULT_TRACE))
  parser.add_argument("--scaling-requests", type=int, default=1500)
  parser.add_argument("--json")
  parser.add_argument(
    "--cpu-threads",
    type=int,
    default=1,
    help="XLA:CPU threads, as `prefixjax replay --cpu-threads` (0: all)",
  )
  args = parser.parse_args(argv)
  if args.cpu_threads:  # read by XLA when its CPU backend starts
    os.environ["NPROC"] = str(args.cpu_threads)
  path = pathlib.Path(args.trace)
  if not path.is_file():
    raise SystemExit(f"trace not found: {path}")
  print(
    f"jax {jax.__version__} on {jax.default_backend()} "
    f"({platform.machine()}), trace {path.name}, XLA:CPU threads "
    f"{args.cpu_threads or 'all'}",
    flush=True,
  )
  trace = load_mooncake(path)
  ours, compile_s, run_s = _ours(trace)
  print(f"prefixjax run per policy: {run_s}", flush=True)
  try:
    py_hits, py_s, (their_trace, their_plan) = _theirs_python(path, 512)
  except ImportError:
    py_hits, py_s, their_trace = None, None, None
    print("kvcache-simulator is not installed: skipping its backends")
  cpp_hits, cpp_s = None, None
  if their_trace is not None:
    try:
      cpp_hits, cpp_s = _theirs_cpp(their_trace, their_plan)
    except Exception as err:  # no compiler, or its API changed
      print(f"C++ backend unavailable: {err}")

  print()
  print(
    f"{'policy':12s} {'capacity':>9} {'prefixjax':>12} {'python':>12} "
    f"{'c++':>12}  equal"
  )
  all_equal = True
  for policy in POLICIES:
    for capacity in CAPACITIES:
      mine = ours[policy, capacity]
      py = py_hits.get((policy, capacity)) if py_hits else None
      cpp = cpp_hits.get((policy, capacity)) if cpp_hits else None
      equal = all(x is None or x == mine for x in (py, cpp))
      all_equal &= equal
      print(
        f"{policy:12s} {capacity:>9,} {mine:>12,} "
        f"{py if py is not None else '-':>12} "
        f"{cpp if cpp is not None else '-':>12}  {'yes' if equal else 'NO'}"
      )
  total_run = sum(run_s.values())
  total_compile = sum(compile_s.values())
  print()
  print(
    f"prefixjax: run {total_run:.2f} s for 12 points "
    f"({', '.join(f'{p} {t:.2f}' for p, t in run_s.items())}), compile "
    f"{total_compile:.2f} s"
  )
  if py_s is not None:
    print(
      f"kvcache-simulator python: {py_s:.2f} s -> prefixjax is "
      f"{py_s / total_run:.2f}x faster (target >= 20x)"
    )
  if cpp_s is not None:
    print(
      f"kvcache-simulator c++:    {cpp_s:.2f} s -> prefixjax is "
      f"{cpp_s / total_run:.2f}x faster (target > 1x)"
    )
  print(
    f"\nscaling, 1 vs 256 capacities, first {args.scaling_requests} requests:"
  )
  _, scaling = _scaling(trace, args.scaling_requests)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "jax": jax.__version__,
          "hits_equal": all_equal,
          "prefixjax_run_s": run_s,
          "prefixjax_compile_s": compile_s,
          "kvcache_sim_python_s": py_s,
          "kvcache_sim_cpp_s": cpp_s,
          "scaling": scaling,
        },
        f,
        indent=2,
      )
  if not all_equal:
    raise SystemExit("hit tokens differ")


if __name__ == "__main__":
  main()
