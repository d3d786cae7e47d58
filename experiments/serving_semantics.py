"""How much do the simulator's rules change the hit rate? One trace, three
semantics: kvcache-simulator's (``lru_leaf``: the capacity counts cached
blocks only, every block of a request is inserted), vLLM v1's (``lru``: the
pool also holds the running request, hits capped at ``P - 1`` tokens, free
queue order) and SGLang's (``lru_leaf`` over whole radix nodes, with its
conservative allocation).

Usage::

  python experiments/serving_semantics.py [--trace PATH] [--block-size N]
      [--capacity C ...] [--limit R] [--out results/serving_semantics]

Without ``--trace`` it uses the built-in generated workload (block 16).
Writes ``OUT.json`` (points per semantics) and ``OUT.png`` (hit rate against
capacity, one line per semantics; needs ``prefixjax[plot]``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from prefixjax import replay as rp
from prefixjax.workloads import default_workload, load_trace


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--trace", help="trace file (default: built-in workload)")
  p.add_argument("--block-size", type=int, default=None)
  p.add_argument("--capacity", type=int, nargs="+", default=None)
  p.add_argument("--limit", type=int, default=None, help="first R requests")
  p.add_argument("--warmup-fraction", type=float, default=0.5)
  p.add_argument("--out", default="results/serving_semantics")
  return p.parse_args(argv)


def run(trace, block_size, capacities, warmup_fraction):
  """``{semantics: [ReplayPoint, ...]}`` and the seconds each took."""
  common = dict(
    block_size=block_size,
    capacities=capacities,
    warmup_fraction=warmup_fraction,
  )
  policy = {"kvcache-sim": "lru_leaf"}
  points, seconds = {}, {}
  for name in rp.SEMANTICS:
    start = time.perf_counter()
    points[name] = list(
      rp.replay(trace, semantics=name, policy=policy.get(name), **common)
    )
    seconds[name] = time.perf_counter() - start
    print(f"  {name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)
  return points, seconds


def main(argv=None) -> int:
  args = _args(argv)
  if args.trace:
    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    block_size = trace.hash_block_size if trace.has_hash_ids else None
    block_size = block_size or args.block_size or 16
  else:
    trace = default_workload(num_requests=args.limit or 2000)
    block_size = args.block_size or 16
  smallest = int(-(-int(trace.kv_tokens.max()) // block_size))
  capacities = args.capacity or [smallest * f for f in (1, 2, 4, 8, 16, 64)]
  if min(capacities) < smallest:
    raise SystemExit(
      f"capacity {min(capacities)} cannot hold the largest request "
      f"({smallest} blocks of {block_size} tokens)"
    )
  print(
    f"{trace.name}: {len(trace):,} requests, block {block_size}, "
    f"capacities {capacities}",
    flush=True,
  )
  points, seconds = run(trace, block_size, capacities, args.warmup_fraction)
  header = f"{'capacity':>9} " + " ".join(f"{n:>12}" for n in points)
  print(header + "\n" + "-" * len(header))
  for i, capacity in enumerate(capacities):
    rates = " ".join(f"{pts[i].hit_rate:>12.2%}" for pts in points.values())
    print(f"{capacity:>9,} {rates}")
  rows = [
    {
      "semantics": name,
      "policy": f"{name} ({p.policy})",
      "capacity_blocks": p.capacity_blocks,
      "block_size": p.block_size,
      "hit_tokens": p.hit_tokens,
      "total_tokens": p.total_tokens,
      "hit_rate": p.hit_rate,
      "mode": "underfilled" if p.underfilled else "measured",
    }
    for name, pts in points.items()
    for p in pts
  ]
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  payload = {"trace": trace.name, "points": rows, "seconds": seconds}
  out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
  print(f"wrote {out.with_suffix('.json')}")
  try:
    from prefixjax.plots import plot_hit_rates

    plot_hit_rates(
      rows,
      str(out.with_suffix(".png")),
      title=f"{trace.name}, block {block_size}: three semantics",
    )
    print(f"wrote {out.with_suffix('.png')}")
  except ImportError as err:
    print(f"no plot: {err}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
