"""Cache replay with kvcache-simulator semantics, as one jitted scan.

A hit-rate study replays a trace, one request at a time, through a cache of
``capacity`` blocks under an eviction policy. This module does it on the
device: the trace becomes flat arrays of block events, every policy is a
fixed set of O(1) array updates per event, and one ``lax.scan`` over the
events is ``vmap``-ed over capacities, so many points cost one compiled
program.

Semantics are those of PyPI ``kvcache-simulator`` 0.1.3 (KVCache.AI), the
published anchor for the Mooncake trace; the rules (read from its source and
modelled in plain Python in ``tests/reference_models/kvcache_sim.py``) are:

* A block's identity is its whole prefix: trie node ``(parent, hash id)``.
  Block ``j`` of a request weighs ``min(K, input_length - j * K)`` tokens,
  at least 1. Requests without blocks are dropped.
* Requests are replayed in order; a request's hit is the run of cached
  blocks from its start; then its missing blocks are inserted. The capacity
  counts cached blocks only. Hits are summed over the requests after the
  first ``floor(R * warmup_fraction)``; a cache that never became full
  during warm-up is *underfilled* and reports 0 hit tokens, as the
  simulator does.
* ``fifo`` (its ``fifo``): a flat set and an insertion queue; every missing
  block is inserted, evicting the oldest insertion when full.
* ``lru_leaf`` (its ``lru``) and ``belady_leaf`` (its ``optimal``): the
  cache is a rooted subtree of the trie; only leaves are evicted; a block is
  inserted only if its parent is cached, and a request stops inserting at
  its first failure. The request's hit blocks are protected while it
  inserts. ``lru_leaf`` evicts the least recently touched leaf (hits touch
  root first); ``belady_leaf`` evicts the leaf whose next use is furthest
  away, unless the block being inserted is needed no later (then nothing
  is evicted and the request stops inserting).

Data structures (``V`` = trie nodes + 1, ``E`` = block events, ``C`` =
capacity):

* Both leaf policies keep the evictable leaves in buckets by key (linked
  lists through the nodes) plus a segment tree of bucket counts over the key
  domain, so the victim is found by one O(log) descent and every update is
  O(log) lanes, whatever the cache size. ``lru_leaf`` keys are a clock
  ticked on every touch (unique; the leftmost key is the least recent
  leaf); ``belady_leaf`` keys are next-use request indices (the rightmost
  key is the furthest). Ties between leaves with the same next use cannot
  change a hit (only never-used-again leaves tie), so any is taken. A
  linked list in recency order is not enough for ``lru_leaf``: a parent
  touched by another request's path is more recent than its children, so
  when it becomes a leaf it belongs somewhere in the middle.
* ``fifo`` keeps a ring buffer of ``C`` node ids.

All updates are masked gathers and scatters, with reads materialised by
:func:`prefixjax.paging.barrier` before in-place writes, so the per-event
cost does not grow with the number of nodes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.paging import barrier, gather, scatter, scatter_add

__all__ = [
  "KVCACHE_SIM_POLICY_NAMES",
  "REPLAY_POLICIES",
  "ReplayPlan",
  "ReplayPoint",
  "prepare_replay",
  "replay",
  "replay_ceiling",
]

REPLAY_POLICIES = ("fifo", "lru_leaf", "belady_leaf")
"""Policies of the kvcache-simulator replay semantics."""

KVCACHE_SIM_POLICY_NAMES = {
  "fifo": "fifo",
  "lru_leaf": "lru",
  "belady_leaf": "optimal",
}
"""Our policy name -> kvcache-simulator's name for the same rule."""

_NONE = -1


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


@dataclasses.dataclass(frozen=True)
class ReplayPoint:
  """One (policy, capacity) result.

  Attributes:
    policy: our policy name.
    capacity_blocks: cache capacity in blocks.
    block_size: tokens per block.
    hit_tokens: hit tokens over the measured requests (0 if underfilled).
    total_tokens: tokens of the measured requests.
    measured_requests: requests in the measured window.
    underfilled: the cache never became full during warm-up.
    per_request_hit_tokens: ``[R]`` int64 hit tokens of every request of the
      original trace (warm-up included, computed even when underfilled).
  """

  policy: str
  capacity_blocks: int
  block_size: int
  hit_tokens: int
  total_tokens: int
  measured_requests: int
  underfilled: bool
  per_request_hit_tokens: np.ndarray

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


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
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    raise TypeError(f"block_size={block_size!r} must be an int")
  if block_size < 1:
    raise ValueError(f"block_size={block_size} must be >= 1")
  if not 0.0 <= warmup_fraction <= 1.0:
    raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1]")
  edges: dict[tuple[int, int], int] = {}
  parent = [0]
  nodes: list[int] = []
  weights: list[int] = []
  firsts: list[bool] = []
  requests: list[int] = []
  kept: list[int] = []
  for index, (ids, length) in enumerate(
    zip(hash_ids, input_lengths, strict=True)
  ):
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if not ids:
      continue
    length = int(length)
    if length <= 0:
      raise ValueError(
        f"request {index} has {len(ids)} blocks but input_length={length}"
      )
    node = 0
    for j, hash_id in enumerate(ids):
      key = (node, int(hash_id))
      node = edges.get(key, 0)
      if not node:
        node = len(parent)
        edges[key] = node
        parent.append(key[0])
      nodes.append(node)
      remaining = length - j * block_size
      weights.append(min(block_size, remaining) if remaining > 0 else 1)
      firsts.append(j == 0)
      requests.append(len(kept))
    kept.append(index)
  if not kept:
    raise ValueError("the trace has no blocks to replay")
  node_arr = np.asarray(nodes, np.int32)
  request_arr = np.asarray(requests, np.int32)
  # Next use of each event's node: the next kept request containing it.
  never = len(kept) + 1
  next_use = np.full(node_arr.shape, never, np.int32)
  order = np.lexsort((request_arr, node_arr))  # by node, then request
  same = node_arr[order][1:] == node_arr[order][:-1]
  later = np.where(same, request_arr[order][1:], never)
  next_use[order[:-1]] = later
  return ReplayPlan(
    node=node_arr,
    parent=np.asarray(parent, np.int32),
    weight=np.asarray(weights, np.int32),
    next_use=next_use,
    first=np.asarray(firsts, bool),
    request=request_arr,
    kept=np.asarray(kept, np.int64),
    num_requests=len(hash_ids),
    warmup_requests=math.floor(len(kept) * warmup_fraction),
    block_size=block_size,
  )


# ---------------------------------------------------------------------------
# Device-side building blocks.
#
# XLA:CPU copies a whole array inside the scan when a write to it is not
# ordered after every read of its previous value, or when a cheap read is
# duplicated into a consumer scheduled after the write (see
# ``prefixjax.paging.barrier``). ``_Tape`` enforces the discipline that
# prevents both: every read is materialised through a barrier as soon as it
# is made, and every write's mask passes through a barrier together with all
# reads of that array since its last write.


class _Tape:
  """Carry dict plus read/write bookkeeping for one scan step."""

  def __init__(self, carry: dict, anchor: jax.Array, static: dict):
    self.s = dict(carry)
    self.anchor = anchor
    self.static = static
    self.pending: dict[str, list] = {}

  def read(self, name: str, idx, fill=_NONE):
    """``s[name][idx]`` (scalar ``idx``), materialised."""
    return self.compute([name], lambda: _one(self.s[name], idx, fill))

  def compute(self, names, fn):
    """Materialises ``fn()``, a value computed from arrays ``names``."""
    (value,) = barrier(self.anchor, fn())
    for name in names:
      self.pending.setdefault(name, []).append(value)
    return value

  def _guard(self, name, do):
    reads = self.pending.pop(name, [])
    if reads:
      do = barrier(self.anchor, do, *reads)[0]
    return do

  def set(self, name: str, idx, value, do):
    """``s[name][idx] = value`` where ``do`` (scalar ``idx``)."""
    do = self._guard(name, do)
    self.s[name] = _set(self.s[name], idx, value, do)

  def add(self, name: str, idx, delta, do):
    """``s[name][idx] += delta`` where ``do``; ``idx`` scalar or ``[L]``."""
    idx = jnp.atleast_1d(idx)
    do = self._guard(name, do)
    self.s[name] = scatter_add(
      self.s[name], idx, delta, jnp.broadcast_to(do, idx.shape)
    )


def _one(x, i, fill=_NONE):
  return gather(x, i[None], fill)[0]


def _set(x, i, value, do):
  return scatter(x, i[None], value, do)


def _seg_update(t: _Tape, key, delta, do):
  levels = t.static["levels"]
  idx = (t.static["leaf0"] + key) >> jnp.arange(levels + 1, dtype=jnp.int32)
  t.add("seg", idx, delta, do)


def _seg_find(t: _Tape, rightmost: bool):
  """The largest (``rightmost``) or smallest key with a nonzero count, or -1."""

  def descend():
    seg = t.s["seg"]
    i = jnp.int32(1)
    for _ in range(t.static["levels"]):
      if rightmost:
        go_right = _one(seg, 2 * i + 1, 0) > 0
      else:
        go_right = _one(seg, 2 * i, 0) == 0
      i = jnp.where(go_right, 2 * i + 1, 2 * i)
    found = _one(seg, jnp.int32(1), 0) > 0
    return jnp.where(found, i - t.static["leaf0"], _NONE)

  return t.compute(["seg"], descend)


def _leaf_add(t: _Tape, x, key, do):
  """Makes ``x`` an evictable leaf with ``key``: first in its key's bucket."""
  t.set("key", x, key, do)
  head = t.read("bucket", key)
  t.set("nxt", x, head, do)
  t.set("prv", x, _NONE, do)
  t.set("prv", head, x, do)
  t.set("bucket", key, x, do)
  _seg_update(t, key, 1, do)


def _leaf_remove(t: _Tape, x, do):
  """Takes leaf ``x`` out of its key's bucket."""
  key = t.read("key", x, 0)
  p = t.read("prv", x)
  q = t.read("nxt", x)
  t.set("nxt", p, q, do & (p != _NONE))
  t.set("bucket", key, q, do & (p == _NONE))
  t.set("prv", q, p, do)
  t.set("nxt", x, _NONE, do)
  t.set("prv", x, _NONE, do)
  _seg_update(t, key, -1, do)


def _init_carry(policy, num_nodes, num_keys, capacity, max_capacity):
  i32 = jnp.int32
  s = {
    "present": jnp.zeros((num_nodes,), jnp.bool_).at[0].set(True),
    "size": i32(0),
    "capacity": capacity.astype(i32),
    "in_run": jnp.bool_(False),
    "stop": jnp.bool_(False),
    "prot": i32(0),
    "filled": jnp.bool_(False),
  }
  if policy == "fifo":
    s["ring"] = jnp.full((max_capacity,), _NONE, i32)
    s["ring_head"] = i32(0)
    return s
  s["children"] = jnp.zeros((num_nodes,), i32)
  s["nxt"] = jnp.full((num_nodes,), _NONE, i32)
  s["prv"] = jnp.full((num_nodes,), _NONE, i32)
  s["key"] = jnp.zeros((num_nodes,), i32)
  s["bucket"] = jnp.full((num_keys,), _NONE, i32)
  levels = max(1, math.ceil(math.log2(num_keys)))
  s["seg"] = jnp.zeros((2 << levels,), i32)
  s["clock"] = i32(0)  # lru_leaf: ticks on every touch
  return s


def _fifo_step(t: _Tape, node, pres, warm):
  s = t.s
  cap = s["capacity"]
  want = ~pres & (cap > 0)
  full = s["size"] >= cap
  head = s["ring_head"]
  victim = t.read("ring", head)
  t.set("present", victim, False, want & full)
  t.set("ring", jnp.where(full, head, s["size"]), node, want)
  s = t.s
  s["ring_head"] = jnp.where(
    want & full, (head + 1) % jnp.maximum(cap, 1), head
  )
  s["size"] = jnp.where(want & ~full, s["size"] + 1, s["size"])
  t.set("present", node, True, want)
  t.s["filled"] = t.s["filled"] | (want & warm & (t.s["size"] >= cap))


def _leaf_step(t: _Tape, policy, node, parent_of, hit, pres, use, warm):
  lru = policy == "lru_leaf"
  # Touch a hit block (root first): new key; a leaf moves to its new bucket.
  is_leaf = t.read("children", node, 0) == 0
  t.s["clock"] = jnp.where(hit, t.s["clock"] + 1, t.s["clock"])
  new_key = t.s["clock"] if lru else use
  _leaf_remove(t, node, hit & is_leaf)
  t.set("key", node, new_key, hit)
  _leaf_add(t, node, new_key, hit & is_leaf)
  t.s["prot"] = jnp.where(hit, node, t.s["prot"])

  # Insert a missing block, evicting one leaf first when full.
  want = ~pres & ~t.s["stop"]
  need = want & (t.s["size"] >= t.s["capacity"])
  best = _seg_find(t, rightmost=not lru)
  victim = t.read("bucket", best)
  if lru:
    # The request's hit blocks are protected; only the deepest can be a
    # leaf. If it is the least recent leaf, take the next one instead.
    prot = t.s["prot"]
    skip = need & (victim == prot) & (victim != _NONE)
    prot_key = t.read("key", prot, 0)
    _leaf_remove(t, prot, skip)
    second = t.read("bucket", _seg_find(t, rightmost=False))
    _leaf_add(t, prot, prot_key, skip)
    victim = jnp.where(skip, second, victim)
    ok = victim != _NONE
  else:
    ok = (best != _NONE) & (best > use)  # else Belady bypass
  evict = need & ok
  _leaf_remove(t, victim, evict)
  vparent = t.compute([], lambda: _one(parent_of, victim, 0))
  t.set("present", victim, False, evict)
  t.s["size"] = jnp.where(evict, t.s["size"] - 1, t.s["size"])
  t.add("children", vparent, -1, evict)
  orphan = evict & (vparent != 0) & (t.read("children", vparent, 0) == 0)
  _leaf_add(t, vparent, t.read("key", vparent, 0), orphan)

  parent = t.compute([], lambda: _one(parent_of, node, 0))
  parent_present = t.read("present", parent, False)
  parent_children = t.read("children", parent, 0)
  stop = t.s["stop"] | (need & ~ok) | (want & ~parent_present)
  insert = want & ~stop
  parent_was_leaf = insert & (parent != 0) & (parent_children == 0)
  _leaf_remove(t, parent, parent_was_leaf)
  t.add("children", parent, 1, insert)
  t.set("present", node, True, insert)
  s = t.s
  s["size"] = jnp.where(insert, s["size"] + 1, s["size"])
  s["clock"] = jnp.where(insert, s["clock"] + 1, s["clock"])
  _leaf_add(t, node, t.s["clock"] if lru else use, insert)
  t.s["stop"] = stop
  t.s["filled"] = t.s["filled"] | (
    insert & warm & (t.s["size"] >= t.s["capacity"])
  )


def _replay_one(policy, events, parent_of, num_keys, max_capacity, capacity):
  num_nodes = parent_of.shape[0]
  carry = _init_carry(policy, num_nodes, num_keys, capacity, max_capacity)
  levels = max(1, math.ceil(math.log2(num_keys)))
  static = {"levels": levels, "leaf0": 1 << levels}

  def step(carry, ev):
    node, weight, use, first, warm = ev
    t = _Tape(carry, node, static)
    s = t.s
    s["in_run"] = s["in_run"] | first
    s["stop"] = s["stop"] & ~first
    s["prot"] = jnp.where(first, 0, s["prot"])
    pres = t.read("present", node, False)
    hit = s["in_run"] & pres
    s["in_run"] = hit
    if policy == "fifo":
      _fifo_step(t, node, pres, warm)
    else:
      _leaf_step(t, policy, node, parent_of, hit, pres, use, warm)
    return t.s, jnp.where(hit, weight, 0)

  carry, hits = jax.lax.scan(step, carry, events)
  return hits, carry["filled"]


def _device_events(plan: ReplayPlan):
  warm = plan.request < plan.warmup_requests
  return (
    jnp.asarray(plan.node),
    jnp.asarray(plan.weight),
    jnp.asarray(plan.next_use),
    jnp.asarray(plan.first),
    jnp.asarray(warm),
  )


def _compiled(plan: ReplayPlan, policy: str, num_configs: int):
  max_capacity = plan.unique_blocks + 1
  # belady_leaf keys are next uses (<= num_kept + 1); lru_leaf keys are clock
  # values (one tick per hit or insertion, so <= num_events).
  num_keys = (
    plan.num_kept + 2 if policy == "belady_leaf" else plan.num_events + 2
  )

  def run(events, parent_of, capacities):
    one = lambda c: _replay_one(
      policy, events, parent_of, num_keys, max_capacity, c
    )
    return jax.vmap(one)(capacities)

  args = (
    _device_events(plan),
    jnp.asarray(plan.parent),
    jnp.zeros((num_configs,), jnp.int32),
  )
  return jax.jit(run).lower(*args).compile(), args


def replay(
  plan: ReplayPlan,
  *,
  policy: str,
  capacities: Sequence[int],
  timings: dict | None = None,
) -> list[ReplayPoint]:
  """Replays ``plan`` at every capacity in one vmapped program.

  Args:
    plan: from :func:`prepare_replay`.
    policy: one of :data:`REPLAY_POLICIES`.
    capacities: cache sizes in blocks (>= 0).
    timings: if given, ``compile_s`` and ``run_s`` are added to it.

  Returns:
    One :class:`ReplayPoint` per capacity, in order.

  Example:
    >>> from prefixjax import replay as rp
    >>> plan = rp.prepare_replay([[1, 2], [1, 2, 3], [1, 4]], [20, 30, 17],
    ...                          block_size=10, warmup_fraction=0.0)
    >>> [p.per_request_hit_tokens.tolist() for p in rp.replay(
    ...     plan, policy="lru_leaf", capacities=[8])]
    [[0, 20, 10]]
  """
  if policy not in REPLAY_POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {REPLAY_POLICIES}")
  capacities = [int(c) for c in capacities]
  if not capacities:
    raise ValueError("capacities must not be empty")
  if min(capacities) < 0:
    raise ValueError(f"capacities={capacities} must be >= 0")
  # A capacity above the number of nodes behaves like the node count.
  clipped = np.minimum(np.asarray(capacities), plan.unique_blocks + 1)
  start = time.perf_counter()
  compiled, (events, parent_of, _) = _compiled(plan, policy, len(capacities))
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  hits, filled = jax.block_until_ready(
    compiled(events, parent_of, jnp.asarray(clipped, jnp.int32))
  )
  run_s = time.perf_counter() - start
  if timings is not None:
    timings["compile_s"] = timings.get("compile_s", 0.0) + compile_s
    timings["run_s"] = timings.get("run_s", 0.0) + run_s
  hits = np.asarray(hits, np.int64)
  filled = np.asarray(filled)
  return [
    _point(plan, policy, capacity, hits[i], bool(filled[i]))
    for i, capacity in enumerate(capacities)
  ]


def _point(plan, policy, capacity, event_hits, filled) -> ReplayPoint:
  per_kept = np.zeros(plan.num_kept, np.int64)
  np.add.at(per_kept, plan.request, event_hits)
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


def replay_ceiling(plan: ReplayPlan) -> ReplayPoint:
  """The unbounded cache: every block ever seen stays cached.

  Host-side numpy (no eviction, so it is a pure function of first
  appearances): a request's hit is its run of blocks seen earlier. Reported
  over the measured window, never underfilled.
  """
  seen_before = np.zeros(plan.num_events, bool)
  first_seen = np.full(plan.unique_blocks + 1, np.iinfo(np.int32).max)
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
  point = _point(plan, "ceiling", plan.unique_blocks, event_hits, True)
  measured = int(
    event_hits[plan.request >= plan.warmup_requests].astype(np.int64).sum()
  )
  return dataclasses.replace(point, hit_tokens=measured, underfilled=False)
