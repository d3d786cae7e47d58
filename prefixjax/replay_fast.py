"""kvcache-simulator replay, a request (or a chunk of one) per scan step.

A faster engine for :func:`prefixjax.replay.replay` (same
:class:`~prefixjax.replay.ReplayPlan` in, same
:class:`~prefixjax.replay.ReplayPoint` list out, hits equal request for
request): where ``replay`` spends one scan step per block event, this
engine serves ``W`` blocks of a request per step in a few ``[W]``-wide
vectorised operations, after the design of :mod:`prefixjax.vllm_replay`
(a request longer than ``W`` blocks takes several consecutive steps). The
scan is ``vmap``-ed over capacities.

``fifo`` (kvcache-simulator's ``fifo``): a flat set plus an insertion
queue; every block of the request not cached (in order) is inserted,
evicting the oldest insertion when full. Insertions get consecutive queue
keys ``tail, tail + 1, ...`` and evictions always take the oldest, so the
cached set is exactly the nodes whose *latest* queue key is at least
``head``: the state is one ``[V]`` array ``key_of`` and two counters, and
an eviction is ``head += 1`` with no write at all. A request's blocks are
distinct nodes, so a block's key is the same at the request's start and
just before its turn; it is cached at the start iff its key is at least the
start's ``head`` (the hit run), and just before its turn iff its key is at
least ``head + max(0, i_j - f)``, where ``f`` is the free room when the
step starts and ``i_j`` the insertions of the step before column ``j``.
That is the sequential subtlety: a block cached at the start can be evicted
by an earlier insertion of the same request and is then inserted again,
shifting every later eviction. Marking such blocks as insertions only adds
insertions, so iterating "mark, recount" from the blocks missing at the
start reaches the exact (least) fixed point; a step loops only when such an
eviction happens. Per step: one gather (through
:func:`prefixjax.paging.barrier`), cumsums, one scatter; nothing depends on
the number of nodes.

Dimensions: ``S`` steps (request chunks), ``W`` blocks per step, ``C``
capacities, ``V`` trie nodes + 1 (the root).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.paging import barrier, gather, scatter
from prefixjax.replay import REPLAY_POLICIES, ReplayPlan, ReplayPoint, _point

__all__ = ["FAST_POLICIES", "replay_fast"]

FAST_POLICIES = ("fifo",)
"""Policies this engine serves."""

_NONE = -1
_WIDTH = 32  # blocks per scan step (16 to 64 measure alike on Mooncake)


def _chunk_rows(plan: ReplayPlan, width: int):
  """Requests cut into ``[S, W]`` chunks of nodes (-1 padded).

  Returns the chunk rows, ``[S]`` whether each chunk starts its request,
  ``[S]`` each chunk's kept request, and ``[E]`` each event's column in
  its request.
  """
  starts = np.flatnonzero(plan.first)
  lengths = np.diff(np.r_[starts, plan.num_events])
  cols = np.arange(plan.num_events) - np.repeat(starts, lengths)
  per_request = -(-lengths // width)
  first_chunk = np.cumsum(per_request) - per_request
  chunk = first_chunk[plan.request] + cols // width
  num_chunks = int(per_request.sum())
  nodes = np.full((num_chunks, width), _NONE, np.int32)
  nodes[chunk, cols % width] = plan.node
  first = np.zeros(num_chunks, bool)
  first[first_chunk] = True
  request = np.repeat(np.arange(plan.num_kept), per_request)
  return nodes, first, request.astype(np.int32), cols


def _fifo_step(s, x, *, capacity):
  """Serves one chunk of a request; returns the state and its hit blocks.

  A block is cached when its request starts iff its key is at least the
  request's starting ``head`` (the request has not touched it yet), and
  just before its turn iff its key is at least the ``head`` of that
  moment.
  """
  nodes, first, warm = x
  valid = nodes >= 0
  head, tail = s["head"], s["tail"]
  head0 = jnp.where(first, head, s["head0"])
  (key,) = barrier(head, gather(s["key_of"], nodes, _NONE))
  cached0 = valid & (key >= head0)
  run = jnp.argmin(jnp.append(cached0, False)).astype(jnp.int32)
  in_run = s["in_run"] | first
  hits = jnp.where(in_run, run, 0)
  free = jnp.maximum(capacity - (tail - head), 0)

  def evicted(insert):
    before = jnp.cumsum(insert.astype(jnp.int32)) - insert.astype(jnp.int32)
    return valid & (key < head + jnp.maximum(before - free, 0))

  insert0 = valid & (key < head) & (capacity > 0)
  insert1 = evicted(insert0) & (capacity > 0)

  def body(carry):
    insert, _ = carry
    new = evicted(insert) & (capacity > 0)
    return new, jnp.any(new != insert)

  insert, _ = jax.lax.while_loop(
    lambda carry: carry[1], body, (insert1, jnp.any(insert1 != insert0))
  )
  count = jnp.sum(insert.astype(jnp.int32))
  rank = jnp.cumsum(insert.astype(jnp.int32)) - insert.astype(jnp.int32)
  s = dict(s)
  s["key_of"] = scatter(s["key_of"], nodes, tail + rank, insert)
  s["head"] = head + jnp.maximum(count - free, 0)
  s["tail"] = tail + count
  s["head0"] = head0
  s["in_run"] = in_run & (run == jnp.sum(valid.astype(jnp.int32)))
  size = s["tail"] - s["head"]
  s["filled"] = s["filled"] | (warm & (count > 0) & (size >= capacity))
  return s, hits


def _run(xs, capacity, *, policy, num_nodes):
  """``[S]`` hit blocks per step and whether the cache filled in warm-up."""
  del policy
  s = {
    "key_of": jnp.full((num_nodes,), _NONE, jnp.int32),
    "head": jnp.int32(0),
    "tail": jnp.int32(0),
    "head0": jnp.int32(0),
    "in_run": jnp.bool_(False),
    "filled": jnp.bool_(False),
  }
  step = functools.partial(_fifo_step, capacity=capacity)
  s, hits = jax.lax.scan(step, s, xs)
  return hits, s["filled"]


@functools.partial(jax.jit, static_argnames=("policy", "num_nodes"))
def _run_all(xs, capacities, *, policy, num_nodes):
  """``[C, S]`` hit blocks per chunk and ``[C]`` filled flags.

  ``vmap`` over capacities: one step serves every capacity, which amortises
  XLA:CPU's per-op cost (the fix-up loop runs while any capacity needs
  it; it rarely does).
  """
  run = lambda c: _run(xs, c, policy=policy, num_nodes=num_nodes)
  return jax.vmap(run)(capacities)


def replay_fast(
  plan: ReplayPlan,
  *,
  policy: str,
  capacities: Sequence[int],
  timings: dict | None = None,
  width: int = _WIDTH,
) -> list[ReplayPoint]:
  """Like :func:`prefixjax.replay.replay`, one request per scan step.

  Args:
    plan: from :func:`prefixjax.replay.prepare_replay`.
    policy: one of :data:`FAST_POLICIES`.
    capacities: cache sizes in blocks (>= 0).
    timings: if given, ``compile_s`` and ``run_s`` are added to it.
    width: blocks per scan step (a longer request takes several steps).

  Returns:
    One :class:`~prefixjax.replay.ReplayPoint` per capacity, in order,
    equal to ``replay``'s.

  Example:
    >>> from prefixjax import replay as rp
    >>> from prefixjax.replay_fast import replay_fast
    >>> plan = rp.prepare_replay([[1, 2], [1, 2, 3], [1, 4]], [20, 30, 17],
    ...                          block_size=10, warmup_fraction=0.0)
    >>> [p.per_request_hit_tokens.tolist() for p in replay_fast(
    ...     plan, policy="fifo", capacities=[8])]
    [[0, 20, 10]]
  """
  if policy not in REPLAY_POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {REPLAY_POLICIES}")
  if policy not in FAST_POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {FAST_POLICIES}")
  capacities = [int(c) for c in capacities]
  if not capacities:
    raise ValueError("capacities must not be empty")
  if min(capacities) < 0:
    raise ValueError(f"capacities={capacities} must be >= 0")
  clipped = np.minimum(np.asarray(capacities), plan.unique_blocks + 1)
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ValueError(f"width={width!r} must be an int >= 1")
  nodes, first, request, cols = _chunk_rows(plan, width)
  warm = request < plan.warmup_requests
  xs = (jnp.asarray(nodes), jnp.asarray(first), jnp.asarray(warm))
  static = dict(policy=policy, num_nodes=plan.unique_blocks + 1)
  start = time.perf_counter()
  probe = jnp.zeros((len(capacities),), jnp.int32)
  compiled = _run_all.lower(xs, probe, **static).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  hits, filled = jax.block_until_ready(
    compiled(xs, jnp.asarray(clipped, jnp.int32))
  )
  run_s = time.perf_counter() - start
  if timings is not None:
    timings["compile_s"] = timings.get("compile_s", 0.0) + compile_s
    timings["run_s"] = timings.get("run_s", 0.0) + run_s
  hits = np.asarray(hits, np.int64)
  filled = np.asarray(filled)
  points = []
  for i, capacity in enumerate(capacities):
    per_kept = np.zeros(plan.num_kept, np.int64)
    np.add.at(per_kept, request, hits[i])
    event_hits = np.where(cols < per_kept[plan.request], plan.weight, 0)
    points.append(_point(plan, policy, capacity, event_hits, bool(filled[i])))
  return points
