"""Serving simulator speed: simulated requests per second, one config.

Serves the built-in workload (``default_workload``) through
:func:`prefixjax.serving.simulate` with vLLM's FCFS loop, all requests at
step 0, ``max_num_seqs`` in ``--seqs`` (16-64 running sequences), and
reports the wall time of a second, compiled run (the first includes the
compile) and simulated requests per second. Compare: vLLM's own
``Scheduler`` driven on CPU with a fabricated model output runs about 250
requests/s at 16 sequences, Vidur 240-290 (issue 14's measurements).

``--batch 1 16 64``: instead, ``simulate_batch`` of that many
configurations (200 requests, 16 sequences, per-configuration budgets and
Poisson rates) vmapped in one program, and one after another (second,
compiled calls; with ``--semantics sglang`` SGLang's loop).

``--semantics sglang``: SGLang 0.5.23's loop instead (4096 pages,
``max_num_seqs`` as ``--max-running-requests``, chunked prefill 2048).

One configuration at a time runs with XLA:CPU's pools at one thread, as
``prefixjax simulate`` does (:func:`prefixjax._host.one_xla_thread`; a
``PJRT_NPROC`` already in the environment wins); ``--batch`` keeps a
thread per core, for the configurations it runs side by side. The table's
header names the setting.

Usage: ``python benchmarks/simulate_scaling.py [--requests 2000]
[--seqs 16 64] [--semantics vllm|sglang] [--batch 1 16] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from prefixjax._host import one_xla_thread, xla_threads  # no CPU client yet

# before JAX creates its CPU client: the flags read without argparse (its
# parser below takes no abbreviations, so "--batch" is always spelled out)
if not any(a.split("=")[0] == "--batch" for a in sys.argv[1:]):
  one_xla_thread()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from prefixjax import serving  # noqa: E402
from prefixjax.serving import ServingConfig  # noqa: E402
from prefixjax.workloads import default_workload  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], allow_abbrev=False
  )
  p.add_argument("--requests", type=int, nargs="+", default=[1000, 2000])
  p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
  p.add_argument("--semantics", default="vllm", choices=("vllm", "sglang"))
  p.add_argument("--batch", type=int, nargs="+", metavar="B")
  p.add_argument("--json", metavar="OUT")
  args = p.parse_args()
  if args.batch:
    return batch(args.batch, args.semantics)
  rows = []
  print(
    f"jax {jax.__version__} on {jax.default_backend()} "
    f"({platform.processor() or platform.machine()}, {xla_threads()}), "
    f"{args.semantics} semantics"
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
        semantics=args.semantics,
      )
      t0 = time.perf_counter()
      first = serving.simulate(trace, config)
      t1 = time.perf_counter()
      again = serving.simulate(trace, config)
      t2 = time.perf_counter()
      assert first.ok and again.ok and again.num_steps == first.num_steps
      row = dict(
        semantics=args.semantics,
        xla_threads=xla_threads(),
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


def batch_inputs(b: int, semantics: str):
  """``--batch``'s ``b`` configurations: ``(configs, simulate_batch
  keywords)``, budgets 512-960, Poisson rates 2-50 req/s, seeds 0.."""
  base = dict(
    num_gpu_blocks=2049,
    block_size=16,
    max_num_seqs=16,
    max_model_len=4096,
    semantics=semantics,
  )
  configs = [
    ServingConfig(**base, max_num_batched_tokens=512 + 64 * (i % 8))
    for i in range(b)
  ]
  kw = dict(
    arrivals="poisson",
    rate=[float(r) for r in np.linspace(2, 50, b)],
    seed=list(range(b)),
    step_time_ms=20.0,
  )
  return configs, kw


def batch(sizes, semantics: str) -> None:
  trace = default_workload(num_requests=200, seed=0)
  print(
    f"jax {jax.__version__} on {jax.default_backend()} ({xla_threads()}), "
    f"{semantics} semantics, 200 requests"
  )
  print(f"{'configs':>8} {'vmapped s':>10} {'one by one s':>13}")
  for b in sizes:
    configs, kw = batch_inputs(b, semantics)
    secs = []
    for vectorize in (True, False):
      serving.simulate_batch(trace, configs, vectorize=vectorize, **kw)
      t0 = time.perf_counter()  # the second call: compiled
      serving.simulate_batch(trace, configs, vectorize=vectorize, **kw)
      secs.append(time.perf_counter() - t0)
    print(f"{b:>8} {secs[0]:>10.2f} {secs[1]:>13.2f}", flush=True)


if __name__ == "__main__":
  main()
