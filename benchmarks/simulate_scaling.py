"""Serving simulator speed: simulated requests per second, one config.

Serves the built-in workload (``default_workload``) through
:func:`prefixjax.serving.simulate` with vLLM's FCFS loop, all requests at
step 0, ``max_num_seqs`` in ``--seqs`` (16-64 running sequences), and
reports the wall time of a second, compiled run (the first includes the
compile) and simulated requests per second. Compare: vLLM's own
``Scheduler`` driven on CPU with a fabricated model output runs about 250
requests/s at 16 sequences, Vidur 240-290 (issue 14's measurements).

Not yet measured here: 256 configurations in one vmapped program (the
simulator has no configuration axis yet).

Usage: ``python benchmarks/simulate_scaling.py [--requests 2000]
[--seqs 16 64] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax

from prefixjax import serving
from prefixjax.serving import ServingConfig
from prefixjax.workloads import default_workload


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, nargs="+", default=[1000, 2000])
  p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
  p.add_argument("--json", metavar="OUT")
  args = p.parse_args()
  rows = []
  print(
    f"jax {jax.__version__} on {jax.default_backend()} "
    f"({platform.processor() or platform.machine()})"
  )
  print(
    f"{'requests':>9} {'seqs':>5} {'steps':>7} {'compile+run s':>14} "
    f"{'run s':>8} {'req/s':>8} {'steps/s':>8}"
  )
  for n in args.requests:
    trace = default_workload(num_requests=n, seed=0)
    for seqs in args.seqs:
      config = ServingConfig(
        num_gpu_blocks=4097,
        block_size=16,
        max_num_seqs=seqs,
        max_num_batched_tokens=2048,
        max_model_len=4096,
      )
      t0 = time.perf_counter()
      first = serving.simulate(trace, config)
      t1 = time.perf_counter()
      again = serving.simulate(trace, config)
      t2 = time.perf_counter()
      assert first.ok and again.ok and again.num_steps == first.num_steps
      row = dict(
        requests=n,
        seqs=seqs,
        steps=again.num_steps,
        first_s=t1 - t0,
        run_s=t2 - t1,
        requests_per_s=n / (t2 - t1),
        steps_per_s=again.num_steps / (t2 - t1),
      )
      rows.append(row)
      print(
        f"{n:>9} {seqs:>5} {row['steps']:>7} {row['first_s']:>14.2f} "
        f"{row['run_s']:>8.2f} {row['requests_per_s']:>8.0f} "
        f"{row['steps_per_s']:>8.0f}",
        flush=True,
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
