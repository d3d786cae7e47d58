"""Per-operation cost of the paging verbs inside ``lax.scan``, by pool size.

Each scenario is a scan whose step applies a fixed mix of verbs to a pool of
``num_blocks`` blocks; the time per step over the number of verbs in it is
the per-op cost. The paging core promises O(blocks touched) per verb, so the
figures must stay flat (within 2x) as the pool grows from 4,096 to 262,144
blocks; a pool-sized copy per step would show up as a 64x growth.

Usage::

  python benchmarks/paging_ops.py [--steps 2000] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse

import _timing
import jax
import jax.numpy as jnp

from prefixjax.cache import paging

BLOCK_SIZE = 16
MAX_SEQS = 64
MAX_BLOCKS_PER_SEQ = 64


def _scenarios():
  """name -> (verbs per step, setup(state) -> state, step(state, i))."""
  k = BLOCK_SIZE

  def no_setup(state):
    return state

  def allocate_release(state, i):
    seq = i % MAX_SEQS
    state, _ = paging.allocate(state, seq, jnp.int32(8 * k))
    state, _ = paging.release(state, seq)
    return state

  def append_blocks(state, i):
    seq = i % MAX_SEQS
    state, _ = paging.allocate(state, seq, jnp.int32(k // 2))
    state, _ = paging.append(state, seq, jnp.int32(4 * k))
    state, _ = paging.release(state, seq)
    return state

  def fork_setup(state):
    state, _ = paging.allocate(state, 0, 10 * k + 3)
    return state

  def fork_copy(state, i):
    child = 1 + i % (MAX_SEQS - 1)
    state, _ = paging.fork(state, jnp.int32(0), child)
    state, _ = paging.copy_on_write(state, child)
    state, _ = paging.release(state, child)
    return state

  return {
    "allocate(8 blocks)+release": (2, no_setup, allocate_release),
    "allocate+append(4 blocks)+release": (3, no_setup, append_blocks),
    "fork+copy_on_write+release": (3, fork_setup, fork_copy),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  _timing.add_scan_args(parser)
  parser.add_argument("--json", help="write the table as JSON here")
  args = parser.parse_args(argv)

  rows = []
  for name, (verbs, setup, step) in _scenarios().items():
    for pool in args.pools:
      state = setup(
        paging.init(
          num_blocks=pool,
          block_size=BLOCK_SIZE,
          max_seqs=MAX_SEQS,
          max_blocks_per_seq=MAX_BLOCKS_PER_SEQ,
        )
      )

      @jax.jit
      def run(state, step=step):
        def body(state, i):
          return step(state, i), None

        return jax.lax.scan(body, state, jnp.arange(args.steps))[0]

      seconds, final = _timing.time_median(run, state, repeats=args.repeats)
      errors = paging.check_invariants(final) if pool <= 65_536 else []
      if errors:
        raise SystemExit(f"{name} pool {pool}: invariants broken: {errors}")
      per_op_us = seconds / (args.steps * verbs) * 1e6
      rows.append(dict(scenario=name, num_blocks=pool, us_per_op=per_op_us))
      print(f"{name:36s} N={pool:>7,d}  {per_op_us:7.2f} us/op", flush=True)

  print()
  print(
    f"{_timing.machine()}, {args.steps} steps x {args.repeats} repeats, median"
  )
  _timing.print_flatness_table(
    rows,
    _scenarios(),
    args.pools,
    value="us_per_op",
    name_width=36,
    cell_width=10,
  )
  _timing.write_json(args.json, rows)


if __name__ == "__main__":
  main()
