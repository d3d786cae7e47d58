"""The built-in demo: parallel sampling on the paging core, by block size.

For each block size the demo replays a generated parallel-sampling workload
(groups of ``n`` samples sharing one prompt) through the paging core inside
one jitted ``lax.scan``: the first sample of a group is allocated for the
prompt, the others are forked from it (sharing every prompt block), then all
samples decode one token at a time, round robin, so the first write into the
shared partial prompt block goes through copy on write. It reports the peak
number of blocks in use with sharing and what the same samples would need
without it, the copies made, and internal fragmentation, so the classic
block-size trade-off (small blocks: less waste; large blocks: fewer table
entries) is visible at a glance.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.cache import paging
from prefixjax.workloads import Trace, generate_workload

ALLOCATE, APPEND, FORK, RELEASE = range(4)


@dataclasses.dataclass(frozen=True)
class DemoRow:
  """One block size's results."""

  block_size: int
  num_blocks: int
  operations: int
  peak_blocks: int
  peak_blocks_unshared: int
  copies: int
  out_of_blocks: int
  fragmentation: float
  compile_s: float
  run_s: float

  @property
  def saved(self) -> float:
    """Fraction of peak blocks that sharing saved."""
    return 1.0 - self.peak_blocks / max(self.peak_blocks_unshared, 1)


def _group_ops(trace: Trace) -> tuple[np.ndarray, list[list[int]]]:
  """Host-side op stream: ``[L, 3]`` int32 rows ``(kind, seq, arg)``.

  Also returns, per group, the total tokens of each sample at the end, used
  for the unshared-peak and fragmentation figures.
  """
  sessions = np.asarray(trace.session_ids)
  ops: list[tuple[int, int, int]] = []
  groups: list[list[int]] = []
  for group in np.unique(sessions):
    members = np.nonzero(sessions == group)[0]
    prompt = int(trace.input_lengths[members[0]])
    outputs = [int(trace.output_lengths[r]) for r in members]
    ops.append((ALLOCATE, 0, prompt))
    for child in range(1, len(members)):
      ops.append((FORK, 0, child))
    for step in range(max(outputs)):
      for sample, out in enumerate(outputs):
        if step < out:
          ops.append((APPEND, sample, 1))
    for sample in range(len(members)):
      ops.append((RELEASE, sample, 0))
    groups.append([prompt + out for out in outputs])
  return np.asarray(ops, np.int32), groups


@jax.jit
def _run(state: paging.PagingState, ops: jax.Array):
  def step(state, op):
    kind, seq, arg = op[0], op[1], op[2]

    def do_allocate(s):
      s, r = paging.allocate(s, seq, arg)
      return s, (r.status, jnp.int32(0))

    def do_append(s):
      s, r = paging.append(s, seq, arg)
      return s, (r.status, r.num_copies)

    def do_fork(s):
      s, status = paging.fork(s, seq, arg)
      return s, (status, jnp.int32(0))

    def do_release(s):
      s, r = paging.release(s, seq)
      return s, (r.status, jnp.int32(0))

    state, (status, copies) = jax.lax.switch(
      kind, [do_allocate, do_append, do_fork, do_release], state
    )
    return state, (status, copies, state.num_free)

  return jax.lax.scan(step, state, ops)


def run_demo(
  *,
  block_sizes=(8, 16, 32, 64),
  num_requests: int = 64,
  samples: int = 4,
  seed: int = 0,
  pool_tokens: int = 65_536,
) -> list[DemoRow]:
  """Runs the demo and returns one :class:`DemoRow` per block size.

  Args:
    block_sizes: token slots per block to compare.
    num_requests: requests in the generated workload (a multiple of
      ``samples`` keeps groups whole).
    samples: parallel samples per prompt (``n``).
    seed: workload seed.
    pool_tokens: KV pool size in tokens; each block size gets
      ``pool_tokens // block_size`` blocks plus the null block.

  Returns:
    A list of :class:`DemoRow`.
  """
  if num_requests < samples:
    raise ValueError(f"{num_requests=} must be >= {samples=}")
  trace = generate_workload(
    "parallel_sampling", num_requests=num_requests, seed=seed, n=samples
  )
  ops, groups = _group_ops(trace)
  longest = max(max(g) for g in groups)
  rows = []
  for block_size in block_sizes:
    num_blocks = pool_tokens // block_size + 1
    max_blocks_per_seq = -(-longest // block_size)
    state = paging.init(
      num_blocks=num_blocks,
      block_size=block_size,
      max_seqs=samples,
      max_blocks_per_seq=max_blocks_per_seq,
    )
    start = time.perf_counter()
    compiled = _run.lower(state, ops).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    final, (status, copies, num_free) = jax.block_until_ready(
      compiled(state, ops)
    )
    run_s = time.perf_counter() - start
    errors = paging.check_invariants(final)
    if errors:
      raise RuntimeError(f"paging invariants broken: {errors}")
    status = np.asarray(status)
    peak = int(num_blocks - 1 - np.asarray(num_free).min())
    unshared = max(sum(-(-t // block_size) for t in g) for g in groups)
    held_slots = max(
      sum(-(-t // block_size) * block_size for t in g) for g in groups
    )
    used = max(sum(g) for g in groups)
    rows.append(
      DemoRow(
        block_size=block_size,
        num_blocks=num_blocks,
        operations=len(ops),
        peak_blocks=peak,
        peak_blocks_unshared=unshared,
        copies=int(np.asarray(copies).sum()),
        out_of_blocks=int((status == paging.Status.OUT_OF_BLOCKS).sum()),
        fragmentation=1.0 - used / held_slots,
        compile_s=compile_s,
        run_s=run_s,
      )
    )
  return rows


def format_table(rows: list[DemoRow]) -> str:
  """A fixed-width text table of demo rows."""
  header = (
    f"{'block':>5} {'pool':>6} {'ops':>7} {'peak blocks':>11} "
    f"{'unshared':>8} {'saved':>6} {'CoW':>5} {'OOB':>4} {'frag':>6} "
    f"{'us/op':>6}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r.block_size:>5} {r.num_blocks:>6} {r.operations:>7} "
      f"{r.peak_blocks:>11} {r.peak_blocks_unshared:>8} {r.saved:>6.1%} "
      f"{r.copies:>5} {r.out_of_blocks:>4} {r.fragmentation:>6.1%} "
      f"{r.run_s / r.operations * 1e6:>6.2f}"
    )
  return "\n".join(lines)
