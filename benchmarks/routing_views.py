"""Exact against approximate cache views, per router, as the cache shrinks.

Every cache-reading router (``cache_aware``, ``kv_cost``, ``e2``,
``llm_d``) routes the built-in workload (``default_workload``: Zipf system
prompts mixed with multi-turn chat) to 4 replicas twice: reading the
replicas' real prefix caches (``mode="exact"``) and its own approximate
view (``mode="approximate"``, :class:`prefixjax.routing.ApproxView`). The
token hit rates and their difference are printed per (blocks per replica,
seed, router). Poisson arrivals at ``--rate`` on the steps clock (25 ms a
step), vLLM 0.33 engines of 16 sequences and 1,024 batched tokens.

Usage: ``python benchmarks/routing_views.py [--blocks 128 256 512]
[--seeds 1 2 3] [--requests 200] [--json OUT]`` (about 3 minutes per
block count on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json

from prefixjax.routing import simulate_cluster
from prefixjax.serving import ServingConfig
from prefixjax.workloads import default_workload

ROUTERS = ("cache_aware", "kv_cost", "e2", "llm_d")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--requests", type=int, default=200)
  parser.add_argument("--rate", type=float, default=16.0)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  rows = []
  print(
    f"{'blocks':>6} {'seed':>4} {'router':>12} {'exact':>7} "
    f"{'approx':>7} {'diff':>7}"
  )
  for blocks in args.blocks:
    config = ServingConfig(
      num_gpu_blocks=blocks,
      block_size=16,
      max_num_seqs=16,
      max_num_batched_tokens=1024,
      max_model_len=min(1024, 16 * (blocks - 1)),
    )
    for seed in args.seeds:
      trace = default_workload(num_requests=args.requests, seed=seed)
      for router in ROUTERS:
        hit = {}
        for mode in ("exact", "approximate"):
          res = simulate_cluster(
            trace,
            config,
            replicas=4,
            router=router,
            mode=mode,
            arrivals="poisson",
            rate=args.rate,
            step_time_ms=25.0,
            seed=seed,
          )
          hit[mode] = res.metrics()["token_hit_rate"]
        row = dict(
          blocks=blocks,
          seed=seed,
          router=router,
          exact=hit["exact"],
          approximate=hit["approximate"],
          diff=hit["exact"] - hit["approximate"],
        )
        rows.append(row)
        print(
          f"{blocks:>6} {seed:>4} {router:>12} {row['exact']:>7.3f} "
          f"{row['approximate']:>7.3f} {row['diff']:>+7.3f}",
          flush=True,
        )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
