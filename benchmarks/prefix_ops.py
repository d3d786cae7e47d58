"""Per-request cost of the prefix-cache verbs inside ``lax.scan``, by pool.

Each step serves one request with five verbs: ``allocate_with_prefix``
(match + touch + pop + identity eviction), ``publish`` (prompt blocks),
``append`` (3 decode tokens filling the last block), ``publish`` (that
block), ``release``. Prompts are 8 blocks: a
4-block prefix shared by all requests (hits after the first) and 4 unique
blocks (misses, published, later evicted). Keys are chained on the device
beforehand (not timed). Two scenarios:

* ``cold pool``: fresh blocks come from never-used blocks (no evictions
  until the pool wraps around; it does for the 4,096 pool);
* ``full pool``: the pool is first filled with cached blocks, so every
  fresh block drops an old identity (index delete per popped block).

The verbs promise O(blocks touched) per request, so the per-request time
must stay flat (within 2x) from 4,096 to 262,144 blocks; a pool-sized copy
per step would grow 64x. On XLA:CPU large fusions may be multi-threaded,
which adds noise; run under ``taskset -c 0`` too.

Usage::

  python benchmarks/prefix_ops.py [--steps 2000] [--repeats 5] [--json OUT]
      [--policy lru|fifo|belady|...]
"""

from __future__ import annotations

import argparse
import os

import _timing
import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.cache import hashing, policies
from prefixjax.cache import prefix_cache as pc

BLOCK_SIZE = 16
MAX_SEQS = 8
MAX_BLOCKS_PER_SEQ = 8
SHARED = 4  # shared prefix blocks per prompt
PROMPT_TOKENS = MAX_BLOCKS_PER_SEQ * BLOCK_SIZE - 3  # last block partial
DECODE_TOKENS = 3  # fills the last block
VERBS = 5  # per request


def _keys(first_id: int, count: int, shared: int = SHARED) -> jax.Array:
  """``[count, M, 2]`` keys: ``shared`` common prefix ids, then unique."""
  m = MAX_BLOCKS_PER_SEQ
  ids = np.zeros((count, m), np.int64)
  ids[:, :shared] = np.arange(shared)
  ids[:, shared:] = (
    2**40 + first_id + np.arange(count * (m - shared)).reshape(count, -1)
  )
  lanes = jnp.asarray(hashing.int64_to_lanes(ids))
  keys = jax.jit(jax.vmap(lambda x: hashing.chain_block_ids(x)[0]))(lanes)
  return keys


@jax.jit
def _serve(state, keys):
  """One request per row of ``keys`` ``[R, M, 2]``, in a scan."""

  def step(state, k):
    seq = jnp.int32(0)
    n = jnp.int32(PROMPT_TOKENS)
    state, a = pc.allocate_with_prefix(state, seq, k, n)
    state, _ = pc.publish(state, seq, k, n)  # early: the prompt's blocks
    state, _ = pc.append(state, seq, jnp.int32(DECODE_TOKENS))
    state, _ = pc.publish(state, seq, k, n + DECODE_TOKENS)  # the last one
    state, _ = pc.release(state, seq)
    return state, a.status

  state, status = jax.lax.scan(step, state, keys)
  return state, jnp.max(status)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  _timing.add_scan_args(parser)
  parser.add_argument("--check", action="store_true", help="check invariants")
  parser.add_argument(
    "--free-order",
    choices=pc.FREE_ORDERS,
    help="default: 'prepend_unhashed' (vLLM 0.33's order; 'append' is 0.22's)",
  )
  parser.add_argument(
    "--policy",
    default="lru",
    choices=policies.policy_names(),
    help="eviction policy (fifo and belady use the victim tree)",
  )
  parser.add_argument("--json", help="write the table as JSON here")
  args = parser.parse_args(argv)

  rows = []
  scenarios = ("cold pool", "full pool")
  keys = _keys(0, args.steps)
  for scenario in scenarios:
    for pool in args.pools:
      state = pc.init(
        pool,
        BLOCK_SIZE,
        MAX_SEQS,
        MAX_BLOCKS_PER_SEQ,
        free_order=args.free_order,
        policy=args.policy,
      )
      if scenario == "full pool":
        # Cache every block: requests of 8 unique blocks until the pool has
        # been cycled through (none of these ids occur later).
        fill = _keys(2**36, pool // MAX_BLOCKS_PER_SEQ + 1, shared=0)
        state, _ = _serve(state, fill)
      seconds, (final, status) = _timing.time_median(
        _serve, state, keys, repeats=args.repeats
      )
      if int(status) != 0:
        raise SystemExit(f"{scenario} pool {pool}: status {int(status)}")
      stats = pc.stats_dict(final)
      if args.check or pool <= 4_096:
        errors = pc.check_invariants(final)
        if errors:
          raise SystemExit(f"{scenario} pool {pool}: {errors[:5]}")
      us = seconds / args.steps * 1e6
      rows.append(
        dict(
          scenario=scenario,
          num_blocks=pool,
          us_per_request=us,
          evictions=stats["evictions"],
          hit_blocks=stats["hit_blocks"],
        )
      )
      print(
        f"{scenario:10s} N={pool:>7,d}  {us:8.2f} us/request "
        f"({us / VERBS:6.2f} us/verb)  evictions={stats['evictions']:,d}",
        flush=True,
      )

  affinity = (
    sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  )
  print()
  print(
    f"{_timing.machine()}, cpus {affinity}, "
    f"{args.steps} requests x {args.repeats} repeats, median, "
    f"policy={args.policy}, free_order={state.free_order}"
  )
  _timing.print_flatness_table(
    rows,
    scenarios,
    args.pools,
    value="us_per_request",
    name_width=12,
    cell_width=12,
  )
  _timing.write_json(args.json, rows)


if __name__ == "__main__":
  main()
