"""Replay plans: a trace laid out once, on the host, for the engines.

A :class:`ReplayPlan` is the kvcache-simulator view of a trace: every block
of every kept request as a flat event, its trie node (a block's identity
is its whole prefix, numbered by :class:`prefixjax.workloads.
PrefixNumbering`), its token weight and the next request that uses it.
:func:`plan_trace` builds it from any :class:`~prefixjax.workloads.Trace`
(hash ids, token ids, or lengths only); :func:`prepare_replay` from
per-request id rows. The points helpers turn per-event or per-request hits
into :class:`~prefixjax.replay.frame.ReplayPoint` s with the window and
underfill rules of kvcache-simulator 0.1.3, and :func:`replay_ceiling` is
the unbounded cache.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from prefixjax._checks import check_block_size
from prefixjax.replay.frame import (
  ReplayPoint,
  check_warmup_fraction,
  warmup_requests,
)
from prefixjax.workloads import Trace, trace_cache

__all__ = [
  "ReplayPlan",
  "plan_trace",
  "points_of_events",
  "points_of_kept",
  "prepare_replay",
  "replay_ceiling",
]


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
  """A trace prepared for replay: flat block events on the host.

  Attributes:
    node: ``[E]`` int32 trie node of each block event (1-based; 0 = root).
    parent: ``[V]`` int32 parent node of every node (``parent[0] = 0``).
    weight: ``[E]`` int32 tokens of each block.
    next_use: ``[E]`` int32 index of the next kept request using the same
      node, or ``num_kept + 1`` if none.
    first: ``[E]`` bool, the event is the first block of its request.
    request: ``[E]`` int32 kept-request index of each event.
    kept: ``[R_kept]`` int64 original index of each kept request.
    num_requests: requests in the original trace.
    warmup_requests: kept requests before the measured window.
    block_size: tokens per block.
  """

  node: np.ndarray  # [E] int32
  parent: np.ndarray  # [V] int32
  weight: np.ndarray  # [E] int32
  next_use: np.ndarray  # [E] int32
  first: np.ndarray  # [E] bool
  request: np.ndarray  # [E] int32
  kept: np.ndarray  # [R_kept] int64
  num_requests: int
  warmup_requests: int
  block_size: int

  @property
  def num_events(self) -> int:
    return int(self.node.shape[0])

  @property
  def num_kept(self) -> int:
    return int(self.kept.shape[0])

  @property
  def unique_blocks(self) -> int:
    """Distinct trie nodes (kvcache-simulator's ``uniqueBlocks``)."""
    return int(self.parent.shape[0]) - 1

  @property
  def measured_tokens(self) -> int:
    measured = self.request >= self.warmup_requests
    return int(self.weight[measured].astype(np.int64).sum())

  @property
  def measured_requests(self) -> int:
    return self.num_kept - self.warmup_requests


def prepare_replay(
  hash_ids: Sequence[Sequence[int]],
  input_lengths: Sequence[int],
  *,
  block_size: int,
  warmup_fraction: float = 0.5,
) -> ReplayPlan:
  """Numbers trie nodes and lays a trace out as flat block events.

  Args:
    hash_ids: per request, its chained per-block ids (Mooncake
      ``hash_ids``, or ``Trace.block_hash_ids(block_size)``).
    input_lengths: per request, prompt tokens.
    block_size: tokens per block (for the token weight of each block).
    warmup_fraction: share of the kept requests before the measured window,
      in ``[0, 1]``.

  Returns:
    A :class:`ReplayPlan`.

  Raises:
    ValueError: mismatched lengths, a bad ``block_size`` or
      ``warmup_fraction``, blocks with ``input_length <= 0``, or a trace
      with no blocks at all.
  """
  if len(hash_ids) != len(input_lengths):
    raise ValueError(
      f"{len(hash_ids)} hash-id rows but {len(input_lengths)} input lengths"
    )
  _check_arguments(block_size, warmup_fraction)
  events = _events(hash_ids, input_lengths, block_size)
  return _plan(events, len(hash_ids), block_size, warmup_fraction)


def _check_arguments(block_size, warmup_fraction) -> None:
  check_block_size(block_size)
  check_warmup_fraction(warmup_fraction)


def _plan(events, num_requests, block_size, warmup_fraction) -> ReplayPlan:
  return ReplayPlan(
    **events,
    num_requests=num_requests,
    warmup_requests=warmup_requests(len(events["kept"]), warmup_fraction),
    block_size=block_size,
  )


def _events(hash_ids, input_lengths, block_size) -> dict[str, np.ndarray]:
  """:func:`prepare_replay`'s arrays (checked arguments)."""
  rows = hash_ids  # a Trace's rows are already int64 vectors
  if not all(
    type(row) is np.ndarray and row.dtype == np.int64 and row.ndim == 1
    for row in rows
  ):
    rows = []
    for index, ids in enumerate(hash_ids):
      try:
        rows.append(np.asarray(ids, np.int64).reshape(-1))
      except (OverflowError, ValueError, TypeError):
        raise ValueError(
          f"hash_ids[{index}] must be integers that fit in int64"
        ) from None
  lengths = np.fromiter(map(len, rows), np.int64, len(rows))
  inputs = _input_lengths(input_lengths)
  empty_prompt = (lengths > 0) & (inputs <= 0)
  if empty_prompt.any():
    index = int(np.argmax(empty_prompt))
    raise ValueError(
      f"request {index} has {int(lengths[index])} blocks but "
      f"input_length={int(inputs[index])}"
    )
  covered = -(-np.maximum(inputs, 0) // block_size)
  too_many = lengths > covered
  if too_many.any():
    index = int(np.argmax(too_many))
    raise ValueError(
      f"request {index} has {int(lengths[index])} blocks but "
      f"input_length={int(inputs[index])} covers at most "
      f"ceil({int(inputs[index])} / {block_size}) = {int(covered[index])} "
      f"blocks of block_size={block_size}"
    )
  kept = np.flatnonzero(lengths > 0)
  if not kept.size:
    raise ValueError("the trace has no blocks to replay")
  lens = lengths[kept]
  ids = np.concatenate(rows)  # the requests not kept have no blocks
  request_arr = np.repeat(np.arange(kept.size), lens).astype(np.int32)
  depth = np.arange(ids.size) - np.repeat(np.cumsum(lens) - lens, lens)
  remaining = inputs[kept][request_arr] - depth * block_size
  weights = np.where(remaining > 0, np.minimum(block_size, remaining), 1)
  node_arr, parent = _number_prefixes(ids, depth)
  # Next use of each event's node: the next kept request containing it.
  never = len(kept) + 1
  next_use = np.full(node_arr.shape, never, np.int32)
  order = np.lexsort((request_arr, node_arr))  # by node, then request
  same = node_arr[order][1:] == node_arr[order][:-1]
  later = np.where(same, request_arr[order][1:], never)
  next_use[order[:-1]] = later
  return dict(
    node=node_arr,
    parent=parent,
    weight=weights.astype(np.int32),
    next_use=next_use,
    first=depth == 0,
    request=request_arr,
    kept=kept.astype(np.int64),
  )


def _input_lengths(input_lengths) -> np.ndarray:
  """``[R]`` int64 prompt lengths; refuses what is not a whole number."""
  try:
    arr = np.asarray(input_lengths)
  except ValueError:  # ragged
    arr = np.asarray(input_lengths, object)
  if arr.ndim != 1:
    raise ValueError(
      f"input_lengths must be one number per request, got shape {arr.shape}"
    )
  if arr.dtype.kind in "iu":
    if arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63:
      raise ValueError("input_lengths must be integers that fit in int64")
    return arr.astype(np.int64)
  if arr.dtype.kind != "f":
    raise ValueError(
      f"input_lengths must be integers (prompt token counts), got dtype "
      f"{arr.dtype}"
    )
  whole = np.isfinite(arr) & (np.abs(arr) < 2.0**62)
  whole[whole] = arr[whole] == np.round(arr[whole])
  if not whole.all():
    index = int(np.argmin(whole))
    raise ValueError(
      f"input_lengths[{index}]={arr[index].item()!r} must be a whole number (a "
      "prompt's token count)"
    )
  return arr.astype(np.int64)


def _number_prefixes(ids: np.ndarray, depth: np.ndarray):
  """Trie nodes of flat block events, numbered in order of first sight.

  The rule of :class:`~prefixjax.workloads.PrefixNumbering` (node
  ``(parent, id)``, numbered ``1, 2, ...`` as first seen, 0 the root),
  vectorised over one depth at a time: a node's depth is fixed, so equal
  ``(parent, id)`` pairs are found with one ``np.unique`` per depth, then
  the nodes are ranked by their first event.

  Args:
    ids: ``[E]`` int64 block ids, requests one after another.
    depth: ``[E]`` the block's position in its request.

  Returns:
    ``[E]`` int32 node of each event and ``[V]`` int32 parent of each node.
  """
  num_events = ids.shape[0]
  temp = np.zeros(num_events, np.int64)  # per-depth numbering, 1-based
  parents, firsts = [np.zeros(1, np.int64)], [np.full(1, -1, np.int64)]
  by_depth = np.argsort(depth, kind="stable")  # event order within a depth
  bounds = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2))
  next_id = 1
  for d in range(bounds.shape[0] - 1):
    sel = by_depth[bounds[d] : bounds[d + 1]]
    par = temp[sel - 1] if d else np.zeros(sel.shape[0], np.int64)
    key = ids[sel]
    # Group equal (parent, id) pairs: a stable sort puts each group's
    # earliest event first (a plain np.unique over rows is 10x slower).
    order = np.lexsort((key, par))
    p, k = par[order], key[order]
    starts = np.r_[True, (p[1:] != p[:-1]) | (k[1:] != k[:-1])]
    group = np.cumsum(starts) - 1
    temp[sel[order]] = next_id + group
    parents.append(p[starts])
    firsts.append(sel[order[starts]])
    next_id += int(starts.sum())
  parent_temp = np.concatenate(parents)
  first_event = np.concatenate(firsts)
  # Final ids: ranked by first event (each event adds at most one node).
  final = np.empty(next_id, np.int64)
  final[np.argsort(first_event, kind="stable")] = np.arange(next_id)
  parent = np.empty(next_id, np.int64)
  parent[final] = final[parent_temp]
  return final[temp].astype(np.int32), parent.astype(np.int32)


def plan_trace(
  trace: Trace, *, block_size: int | None = None, warmup_fraction: float = 0.5
) -> ReplayPlan:
  """The :class:`ReplayPlan` of a trace.

  A hash-id trace (Mooncake) is replayed by its ids at its own hash block
  size; a token-id trace by :meth:`Trace.block_hash_ids` at ``block_size``
  (default 16); a length-only trace as blocks that are all distinct (it
  carries no prefix information, so nothing can hit).

  Raises:
    ValueError: ``block_size`` differs from a hash-id trace's.
  """
  if trace.has_hash_ids:
    if block_size is not None and block_size != trace.hash_block_size:
      raise ValueError(
        f"block_size={block_size} differs from the hash block size "
        f"{trace.hash_block_size} of trace {trace.name!r}: hash ids name "
        "blocks of that size only"
      )
    block_size = trace.hash_block_size
  else:
    block_size = 16 if block_size is None else block_size
  _check_arguments(block_size, warmup_fraction)

  def events():
    if trace.has_hash_ids:
      hash_ids = trace.hash_ids
    elif trace.has_token_ids:
      hash_ids = trace.block_hash_ids(block_size)
    else:
      hash_ids = [
        np.arange(-(-int(n) // block_size)) + (i << 32)
        for i, n in enumerate(trace.input_lengths)
      ]
    return _events(hash_ids, trace.input_lengths, block_size)

  # A trace read from the trace cache keeps its plan beside it.
  arrays = trace_cache.derived(
    trace,
    f"replay plan, block size {block_size}",
    (sys.modules[__name__],),
    events,
  )
  return _plan(arrays, len(trace), block_size, warmup_fraction)


def points_of_events(plan, policy, capacity, event_hits, filled) -> ReplayPoint:
  """The point of ``[E]`` hit tokens per block event."""
  # bincount, not np.add.at (about 20x slower): float64 sums of integer
  # token counts are exact below 2**53.
  per_kept = np.rint(
    np.bincount(
      plan.request,
      weights=np.asarray(event_hits, np.float64),
      minlength=plan.num_kept,
    )
  ).astype(np.int64)
  return points_of_kept(plan, policy, capacity, per_kept, filled)


def points_of_kept(plan, policy, capacity, per_kept, filled) -> ReplayPoint:
  """The point of ``[R_kept]`` hit tokens per kept request: counted over
  the measured window; 0 for no cache or a cache that never filled in
  warm-up (kvcache-simulator's underfill rule)."""
  per_request = np.zeros(plan.num_requests, np.int64)
  per_request[plan.kept] = per_kept
  total = plan.measured_tokens
  measured = int(per_kept[plan.warmup_requests :].sum())
  no_cache = capacity <= 0
  underfilled = not no_cache and (not filled or total <= 0)
  return ReplayPoint(
    policy=policy,
    capacity_blocks=capacity,
    block_size=plan.block_size,
    hit_tokens=0 if (underfilled or no_cache) else measured,
    total_tokens=total,
    measured_requests=plan.measured_requests,
    underfilled=underfilled,
    per_request_hit_tokens=per_request,
  )


def clip_capacities(plan: ReplayPlan, capacities) -> np.ndarray:
  """``[C]`` int32 capacities clipped to the trie's nodes + 1 (a larger
  capacity behaves like it)."""
  return np.minimum(np.asarray(capacities), plan.unique_blocks + 1).astype(
    np.int32
  )


def replay_ceiling(plan: ReplayPlan) -> ReplayPoint:
  """The unbounded cache: every block ever seen stays cached.

  Host-side numpy (no eviction, so it is a pure function of first
  appearances): a request's hit is its run of blocks seen earlier. Reported
  over the measured window, never underfilled.
  """
  seen_before = np.zeros(plan.num_events, bool)
  first_seen = np.full(plan.unique_blocks + 1, np.iinfo(np.int32).max)
  if plan.num_events and np.all(plan.request[1:] >= plan.request[:-1]):
    # Events in request order: a node's first event has its first request.
    nodes, first = np.unique(plan.node, return_index=True)
    first_seen[nodes] = plan.request[first]
  else:
    np.minimum.at(first_seen, plan.node, plan.request)
  seen_before = first_seen[plan.node] < plan.request
  # The run from each request's start: a cumulative AND within the request.
  starts = np.flatnonzero(plan.first)
  missed = (~seen_before).astype(np.int64)
  run_break = np.cumsum(missed)
  base = np.repeat(
    run_break[starts] - missed[starts], np.diff(np.r_[starts, plan.num_events])
  )
  in_run = run_break == base
  event_hits = np.where(in_run, plan.weight, 0)
  point = points_of_events(
    plan, "ceiling", plan.unique_blocks, event_hits, True
  )
  measured = int(
    event_hits[plan.request >= plan.warmup_requests].astype(np.int64).sum()
  )
  return dataclasses.replace(point, hit_tokens=measured, underfilled=False)
