"""Sweep runner cost: a 256-point replay + simulate sweep against its largest
single point (issue 15: at most 8x, compile counted separately).

The sweep (built-in workload, ``--requests`` requests):
* replay: 3 kvcache-sim policies x 64 capacities (192 points, 3 groups);
* simulate: FCFS, 64 configurations (``max_num_batched_tokens`` x Poisson
  rate x seed) sharing the static shapes (one group).

Each group runs twice (the first run compiles; the second is the run time,
with the compiled programs in memory), and so does every point alone; the
ratio is second-run sweep time over the slowest single point's second run.

Usage: ``python benchmarks/sweep_scaling.py [--requests 300] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax

from prefixjax.sweep import parse_spec, run_sweep


def _spec(requests: int, replay: bool, simulate: bool, only=None):
  caps = [16 * (i + 1) for i in range(64)]
  body = {"workloads": {"w": {"generator": "default", "requests": requests}}}
  if replay:
    body["replay"] = {
      "policy": ["fifo", "lru_leaf", "belady_leaf"],
      "capacity": caps if only is None else only.get("capacity", caps[-1]),
      "warmup_fraction": 0.25,
    }
    if only is not None:
      body["replay"]["policy"] = only["policy"]
  if simulate:
    grid = {
      "max_num_batched_tokens": [512, 1024, 2048, 4096],
      "rate": [5.0, 10.0, 20.0, 40.0],
      "seed": [0, 1, 2, 3],
    }
    if only is not None:
      grid = {k: only[k] for k in grid}
    body["simulate"] = {
      "num_blocks": 1024,
      "max_num_seqs": 32,
      "max_model_len": 2048,
      "clock": "roofline",
      "arrivals": "poisson",
      **grid,
    }
  return parse_spec(body)


def _twice(spec):
  start = time.perf_counter()
  run_sweep(spec, plots=False, progress=False)
  first = time.perf_counter() - start
  start = time.perf_counter()
  result = run_sweep(spec, plots=False, progress=False)
  return first, time.perf_counter() - start, result


def measure(requests, *, alone=None, vectorize=None, on_single=None):
  """The 256-point sweep twice, then single points alone: the replay points
  at each policy's smallest and largest capacity, and the simulate points
  that ``alone(row)`` keeps (default: every one; their costs differ, a low
  rate spreads the requests over more engine steps). ``vectorize``: the
  specs' ``[sweep] vectorize`` (None: automatic). ``on_single(singles)``
  is called after each single point. Returns the benchmark's record."""

  def spec_of(*modes, only=None):
    spec = _spec(requests, *modes, only=only)
    if vectorize is not None:
      spec = dataclasses.replace(spec, vectorize=vectorize)
    return spec

  spec = spec_of(True, True)
  assert len(spec.points) == 256, len(spec.points)
  first, second, result = _twice(spec)
  singles = []
  for row in result.rows:
    if row["mode"] == "replay":
      # One program per policy: its smallest and largest capacities.
      if row["capacity"] not in (16, 1024):
        continue
      one = spec_of(True, False, only=row)
    else:
      if alone is not None and not alone(row):
        continue
      one = spec_of(False, True, only=row)
    f1, s1, _ = _twice(one)
    singles.append(
      {
        **{k: row[k] for k in ("mode", "policy") if k in row},
        "capacity": row.get("capacity"),
        **{
          k: row.get(k)
          for k in ("max_num_batched_tokens", "rate", "seed")
          if row["mode"] == "simulate"
        },
        "first_s": f1,
        "second_s": s1,
      }
    )
    if on_single is not None:
      on_single(singles)
  worst = max(s["second_s"] for s in singles)
  return {
    "machine": f"jax {jax.__version__} on {jax.default_backend()} "
    f"({platform.processor() or platform.machine()})",
    "points": len(spec.points),
    "requests": requests,
    "sweep_first_s": first,
    "sweep_second_s": second,
    "singles": singles,
    "largest_single_s": worst,
    "ratio": second / worst,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=300)
  p.add_argument("--json", metavar="OUT")
  args = p.parse_args()
  out = measure(args.requests)
  print(json.dumps(out, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
