"""kvcache-simulator replay of the leaf policies as keys and counts.

A third engine for :func:`prefixjax.replay.replay` (same
:class:`~prefixjax.replay.ReplayPlan` in, same
:class:`~prefixjax.replay.ReplayPoint` list out, hits equal request for
request). :mod:`prefixjax.replay_fast` keeps the trie (cached children,
leaf keys, chain walks); under these two policies the hits need much less,
because both order nodes by a key that never puts a node after its own
parent:

``lru_leaf`` (kvcache-simulator's ``lru``): the Mattson stack distance
  (Mattson, Gecsei, Slutz and Traiger, "Evaluation techniques for storage
  hierarchies", IBM Systems Journal 9(2), 1970). Rank every node seen so
  far by (last request that touched it, then shallower first): a node's
  parent is touched whenever it is, and in the same request, so it always
  ranks above it. Evicting the least recently used leaf therefore evicts
  the lowest-ranked node, and as long as a request's blocks fit the cache
  (capacity >= its blocks) the cache after every request is the top
  ``capacity`` of that ranking, whatever the capacity. So one pass gives
  every node's rank when each request starts, and a block is cached at
  capacity ``C`` iff its rank is below ``C``: every capacity at once.

  The rank is counted in linear time: request ``r`` occupies positions
  ``start(r) ..`` with its deepest block first, so a node's last position
  orders it; a node's rank is the number of nodes whose last position lies
  between its own and the request's start. Every position is filled once
  and emptied at most once (when its node is touched again), so that count
  is the positions in between minus the emptied ones, a Fenwick tree (a
  binary indexed tree) over emptied positions: per block one ``[log E]``
  gather and one ``[log E]`` scatter-add. A request longer than a step
  (``W`` blocks) empties its ancestors' positions in an earlier step;
  they all lay in the counted range, so the step adds them back (their
  number is carried).

  Capacities below the longest request break the "top ``C``" argument
  (the request evicts its own blocks); :func:`replay_keys` leaves those to
  the chain engine.

``belady_leaf`` (kvcache-simulator's ``optimal``): a node's key is the
  request of its next use, and a parent's is never later than its
  child's. So the largest key among cached nodes is always a leaf's, the
  victim's key is the cache's largest, and the hits of request ``r`` are
  exactly the cached nodes with key ``r`` (its blocks seen before that are
  still cached: a prefix of the request, since ties are evicted deepest
  first). The cache is then a multiset of keys: a count per key. A
  request reads its hits (the count at its own index), moves them to their
  next uses, and inserts its missing blocks in order, each evicting one
  largest key when the cache is full, as long as that key is later than
  the block's own (else the Belady bypass stops the request). The missing
  blocks' keys never decrease along the request, and the victims' never
  increase, so the victims of a step are a run of buckets from the top:
  one loop round per bucket (usually one: the never-used bucket). The
  request's own blocks have keys no later than the block being inserted,
  so they never qualify, which is kvcache-simulator's protected path. The
  largest nonempty key is found through counts per 32 keys, per 1,024 keys
  and so on (a 32-wide read per level).
  Which of several never-used leaves is evicted does not change any hit,
  so keys alone decide the hits; this holds at every capacity.

Dimensions: ``S`` steps (request chunks), ``W`` blocks per step, ``C``
capacities, ``E`` block events, ``K`` keys (kept requests + 2).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import replay_fast
from prefixjax.paging import barrier, gather, scatter, scatter_add
from prefixjax.replay import (
  ReplayPlan,
  ReplayPoint,
  _capacities,
  _point_kept,
  _timed_run,
)
from prefixjax.replay_fast import chunk_points, chunks, column

__all__ = ["KEY_POLICIES", "lru_hit_capacities", "replay_keys"]

KEY_POLICIES = ("lru_leaf", "belady_leaf")
"""Policies this engine serves."""

_NONE = -1
_UNSEEN = np.iinfo(np.int32).max  # the rank of a node never seen before
_CAPACITIES = "capacities"  # the vmap axis of the belady_leaf scan
_WIDTH = 32  # blocks per scan step (16 to 64 measure alike on Mooncake)
_FAN = 32  # keys per count one level up (the belady_leaf top search)


# ---------------------------------------------------------------------------
# lru_leaf: stack ranks.


def _rank_step(s, x, *, num_events):
  """One chunk: every block's rank when its request started, then the
  chunk's positions move to the request's."""
  nodes, pos, first, start = x
  i32 = jnp.int32
  levels = jnp.arange(max(num_events.bit_length(), 1), dtype=i32)[None, :]

  def reads():
    last = gather(s["last"], nodes, _NONE)  # [W] last position, -1 unseen
    # Emptied positions <= last: the Fenwick prefix over 1-based last + 1
    # sums the nodes (i >> k) << k for every set bit k of i.
    i = jnp.where(last >= 0, last + 1, 0)[:, None]
    on = ((i >> levels) & 1) == 1
    terms = gather(s["tree"], jnp.where(on, (i >> levels) << levels, -1))
    return last, jnp.sum(terms, axis=1), nodes >= 0

  last, emptied_below, valid = barrier(start, *reads())
  ancestors = jnp.where(first, 0, s["ancestors"])
  seen = valid & (last >= 0)
  # Nodes last touched strictly between `last` and `start`: the positions
  # in between, less the emptied ones there, plus the ancestors emptied by
  # this request's earlier steps.
  between = (start - 1 - last) - (s["emptied"] - emptied_below)
  rank = jnp.where(seen, between + ancestors, _UNSEEN)
  # Empty the old positions: add 1 at every node covering 1-based last + 1,
  # ((m + 1) << k) for each k where bit k of m = last is clear.
  m = last[:, None] >> levels
  covers = (m + 1) << levels
  ok = seen[:, None] & ((m & 1) == 0) & (covers <= num_events)
  n_seen = jnp.sum(seen.astype(i32))
  # The running maximum over the request so far: a block is in its
  # request's hit run at capacity C iff this is below C.
  run_max = jnp.maximum(
    jax.lax.cummax(rank), jnp.where(first, i32(-1), s["run_max"])
  )
  s = {
    "tree": scatter_add(s["tree"], covers.reshape(-1), i32(1), ok.reshape(-1)),
    "last": scatter(s["last"], nodes, pos, valid),
    "ancestors": ancestors + n_seen,
    "emptied": s["emptied"] + n_seen,
    "run_max": run_max[-1],
  }
  return s, run_max


@functools.partial(jax.jit, static_argnames=("num_nodes", "num_events"))
def _ranks(xs, *, num_nodes, num_events):
  """``[S, W]`` the running maximum rank of each block's request prefix."""
  i32 = jnp.int32
  s = {
    "tree": jnp.zeros((num_events + 1,), i32),
    "last": jnp.full((num_nodes,), _NONE, i32),
    "ancestors": i32(0),
    "emptied": i32(0),
    "run_max": i32(-1),
  }
  step = functools.partial(_rank_step, num_events=num_events)
  return jax.lax.scan(step, s, xs)[1]


# ---------------------------------------------------------------------------
# belady_leaf: a count per next-use key.


def _levels(num_keys):
  """Sizes of the count levels: per key, per 32 keys, ..., the top <= 32."""
  sizes = [num_keys]
  while sizes[-1] > _FAN:
    sizes.append(-(-sizes[-1] // _FAN))
  return sizes


def _top_key(levels):
  """The largest key with a nonzero count, or -1: one reduction over the
  top level, then a 32-wide gather per level below it."""
  i32 = jnp.int32
  top = levels[-1]
  at = jnp.max(jnp.where(top > 0, jnp.arange(top.shape[0], dtype=i32), -1))
  for level in reversed(levels[:-1]):
    keys = jnp.maximum(at, 0) * _FAN + jnp.arange(_FAN, dtype=i32)
    row = gather(level, keys)
    at = jnp.where(at >= 0, jnp.max(jnp.where(row > 0, keys, -1)), -1)
  return at


def _add(levels, idx, delta, mask):
  """Adds ``delta`` at keys ``idx`` (where ``mask``) on every level."""
  return tuple(
    scatter_add(level, idx // _FAN**i, delta, mask)
    for i, level in enumerate(levels)
  )


def _belady_step(s, x, *, capacity):
  """One chunk under ``belady_leaf`` at one capacity; returns its hits."""
  keys, first, request, offset, warm = x
  i32 = jnp.int32
  width = keys.shape[0]
  col = jnp.arange(width, dtype=i32)
  valid = keys >= 0
  # The request's hits: every cached node keyed by it (read once, at its
  # first chunk, before anything moves).
  (own,) = barrier(request, gather(s["levels"][0], request[None]))
  hit_n = jnp.where(first, own[0], s["hit_n"])
  stop = s["stop"] & ~first
  hit = valid & (offset + col < hit_n)
  miss = valid & ~hit & ~stop
  misses = jnp.sum(miss.astype(i32))
  lead = jnp.clip(hit_n - offset, 0, width)  # the chunk's first miss
  free = jnp.maximum(capacity - s["size"], 0)
  need = jnp.maximum(misses - free, 0)
  # Victim v makes room for the miss free + v, whose key it must exceed.
  incoming = keys[jnp.clip(lead + free + col, 0, width - 1)]

  def evict_bucket(carry):
    levels, taken, go = carry
    top = _top_key(levels)
    (in_top,) = barrier(top, gather(levels[0], top[None]))
    later = (col >= taken) & (col < need) & (incoming < top)
    take = jnp.where(
      go & (top >= 0), jnp.minimum(in_top[0], jnp.sum(later.astype(i32))), 0
    )
    levels = _add(levels, top[None], -take, take > 0)
    # An emptied bucket may leave victims for the next one down.
    go = go & (take > 0) & (take == in_top[0]) & (taken + take < need)
    return levels, taken + take, go

  def evicting(carry):
    return jax.lax.pmax(carry[2].astype(i32), _CAPACITIES) > 0

  levels, evicted, _ = jax.lax.while_loop(
    evicting, evict_bucket, (s["levels"], i32(0), need > 0)
  )
  inserted = jnp.minimum(misses, free + evicted)
  placed = miss & (col < lead + inserted)
  # Hits move to their next use, insertions join at theirs, and the
  # request's own bucket empties (its nodes were all hits).
  moved = hit | placed
  idx = jnp.concatenate([keys, request[None]])
  delta = jnp.concatenate([moved.astype(i32), -own * first.astype(i32)])
  mask = jnp.concatenate([moved, first[None]])
  levels = _add(levels, idx, delta, mask)
  size = s["size"] + inserted - evicted
  s = {
    "levels": levels,
    "size": size,
    "hit_n": hit_n,
    "stop": stop | (inserted < misses),
    "filled": s["filled"] | (warm & (inserted > 0) & (size >= capacity)),
  }
  return s, jnp.sum(hit.astype(i32))


@functools.partial(jax.jit, static_argnames=("num_keys",))
def _belady_all(xs, capacities, *, num_keys):
  """``[C, S]`` hit blocks per chunk and ``[C]`` filled flags."""
  i32 = jnp.int32

  def run(capacity):
    s = {
      "levels": tuple(jnp.zeros((n,), i32) for n in _levels(num_keys)),
      "size": i32(0),
      "hit_n": i32(0),
      "stop": jnp.bool_(False),
      "filled": jnp.bool_(False),
    }
    step = functools.partial(_belady_step, capacity=capacity)
    s, hits = jax.lax.scan(step, s, xs)
    return hits, s["filled"]

  return jax.vmap(run, axis_name=_CAPACITIES)(capacities)


# ---------------------------------------------------------------------------
# Host side.


def lru_hit_capacities(
  plan: ReplayPlan, *, width: int = _WIDTH, timings: dict | None = None
) -> np.ndarray:
  """Per block event, the smallest ``lru_leaf`` capacity at which it hits.

  A block is in its request's hit run at capacity ``C`` iff ``C`` is at
  least this (``np.iinfo(np.int32).max`` for a block never seen before),
  for every ``C`` of at least the longest request's blocks (see the module
  docstring): one pass gives the whole capacity curve.

  Args:
    plan: from :func:`prefixjax.replay.prepare_replay`.
    width: blocks per scan step.
    timings: if given, ``compile_s`` and ``run_s`` are added to it.

  Returns:
    ``[E]`` int64.
  """
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ValueError(f"width={width!r} must be an int >= 1")
  rows, first, request, _ = chunks(plan, width)
  starts = np.flatnonzero(plan.first)
  lengths = np.diff(np.r_[starts, plan.num_events])
  # Linear time: request r fills positions start(r) .. start(r) + n - 1,
  # its deepest block first.
  ends = np.repeat(2 * starts + lengths - 1, lengths)
  position = (ends - np.arange(plan.num_events)).astype(np.int32)
  xs = (
    jnp.asarray(column(rows, plan.node)),
    jnp.asarray(column(rows, position)),
    jnp.asarray(first),
    jnp.asarray(starts[request].astype(np.int32)),
  )
  static = dict(num_nodes=plan.unique_blocks + 1, num_events=plan.num_events)
  start = time.perf_counter()
  compiled = _ranks.lower(xs, **static).compile()
  run_max = _timed_run(compiled, (xs,), time.perf_counter() - start, timings)
  run_max = np.asarray(run_max)[rows >= 0].astype(np.int64)
  return np.where(run_max == _UNSEEN, _UNSEEN, run_max + 1)


def _lru_points(plan, capacities, hit_capacity) -> list[ReplayPoint]:
  """Points from :func:`lru_hit_capacities` (capacities >= the longest
  request's blocks)."""
  caps = np.asarray(capacities, np.int64)
  order = np.argsort(caps, kind="stable")
  # Event e hits at the sorted capacities from `first_hit[e]` on.
  first_hit = np.searchsorted(caps[order], hit_capacity, side="left")
  per_kept = np.zeros((plan.num_kept, len(caps) + 1), np.int64)
  np.add.at(per_kept, (plan.request, first_hit), plan.weight)
  per_kept = np.cumsum(per_kept, axis=1)[:, :-1]
  # The cache fills in warm-up at C iff a warm request ends with at least
  # C nodes seen and misses at C (its last block's hit capacity > C).
  _, first_seen = np.unique(plan.node, return_index=True)
  new = np.bincount(plan.request[first_seen], minlength=plan.num_kept)
  seen = np.cumsum(new)
  ends = np.r_[np.flatnonzero(plan.first)[1:], plan.num_events] - 1
  warm = slice(0, plan.warmup_requests)
  fills_up_to = np.minimum(seen[warm], hit_capacity[ends][warm] - 1)
  fills_up_to = int(fills_up_to.max()) if fills_up_to.size else -1
  points = [None] * len(caps)
  for j, i in enumerate(order):
    points[i] = _point_kept(
      plan, "lru_leaf", int(caps[i]), per_kept[:, j], caps[i] <= fills_up_to
    )
  return points


def _belady_points(plan, capacities, clipped, width, timings):
  rows, first, request, offset = chunks(plan, width)
  xs = (
    jnp.asarray(column(rows, plan.next_use)),
    jnp.asarray(first),
    jnp.asarray(request),
    jnp.asarray(offset),
    jnp.asarray(request < plan.warmup_requests),
  )
  num_keys = plan.num_kept + 2  # next uses run to num_kept + 1 (never)
  start = time.perf_counter()
  probe = jnp.zeros((len(capacities),), jnp.int32)
  compiled = _belady_all.lower(xs, probe, num_keys=num_keys).compile()
  hits, filled = _timed_run(
    compiled,
    (xs, jnp.asarray(clipped, jnp.int32)),
    time.perf_counter() - start,
    timings,
  )
  return chunk_points(plan, "belady_leaf", capacities, request, hits, filled)


def replay_keys(
  plan: ReplayPlan,
  *,
  policy: str,
  capacities: Sequence[int],
  timings: dict | None = None,
  width: int = _WIDTH,
) -> list[ReplayPoint]:
  """Like :func:`prefixjax.replay.replay`, from keys and counts.

  ``lru_leaf`` capacities below the longest request's blocks go to
  :func:`prefixjax.replay_fast.replay_fast` (see the module docstring).

  Args:
    plan: from :func:`prefixjax.replay.prepare_replay`.
    policy: one of :data:`KEY_POLICIES`.
    capacities: cache sizes in blocks (>= 0).
    timings: if given, ``compile_s`` and ``run_s`` are added to it.
    width: blocks per scan step (a longer request takes several steps).

  Returns:
    One :class:`~prefixjax.replay.ReplayPoint` per capacity, in order,
    equal to ``replay``'s.

  Example:
    >>> from prefixjax import replay as rp
    >>> from prefixjax.replay_keys import replay_keys
    >>> plan = rp.prepare_replay([[1, 2], [1, 2, 3], [1, 4]], [20, 30, 17],
    ...                          block_size=10, warmup_fraction=0.0)
    >>> [p.per_request_hit_tokens.tolist() for p in replay_keys(
    ...     plan, policy="lru_leaf", capacities=[3, 8])]
    [[0, 20, 10], [0, 20, 10]]
  """
  if policy not in KEY_POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {KEY_POLICIES}")
  capacities, clipped = _capacities(plan, capacities)
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ValueError(f"width={width!r} must be an int >= 1")
  if policy == "belady_leaf":
    return _belady_points(plan, capacities, clipped, width, timings)
  starts = np.flatnonzero(plan.first)
  longest = int(np.diff(np.r_[starts, plan.num_events]).max())
  stack = [i for i, c in enumerate(capacities) if c >= longest]
  rest = [i for i, c in enumerate(capacities) if c < longest]
  points: list = [None] * len(capacities)
  if stack:
    hit_capacity = lru_hit_capacities(plan, width=width, timings=timings)
    for i, point in zip(
      stack,
      _lru_points(plan, [capacities[i] for i in stack], hit_capacity),
      strict=True,
    ):
      points[i] = point
  if rest:
    chained = replay_fast.replay_fast(
      plan,
      policy=policy,
      capacities=[capacities[i] for i in rest],
      timings=timings,
    )
    for i, point in zip(rest, chained, strict=True):
      points[i] = point
  return points
