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

Three engines give equal hits (``replay(engine=...)``): this module's,
one scan step per block event, which models the cache itself and is the
reference the others are tested against; :mod:`prefixjax.replay_fast`, a
request's blocks per step (the default for ``fifo``); and
:mod:`prefixjax.replay_keys`, which keeps only the keys that order the
nodes (the default for ``lru_leaf``, as stack distances good for every
capacity at once, and ``belady_leaf``, as counts per next-use key).

This module's data structures (``V`` = trie nodes + 1, ``E`` = block
events, ``C`` = capacity):

* Both leaf policies keep, per node, its cached-children count (-1 when
  not cached) and its key, and the set of evictable leaves as a
  hierarchical bitmap over keys (32-bit words, one word per level, 3-4
  levels), so the victim is found with one word gather per level and every
  update is one gather and one scatter of a few words, whatever the cache
  size. Keys are event indices, so a key names its node through the event
  arrays (no key-to-node table to maintain): ``lru_leaf`` keys a node by the
  event that last touched it (a clock; the smallest key is the least recent
  leaf); ``belady_leaf`` by the event of its next use after that touch (the
  largest key is the furthest next use; two leaves never share it, since
  both would lie on one request's path). ``belady_leaf`` leaves never used
  again sit on a stack instead (any of them is a valid victim: they tie,
  and a tie cannot change a hit). A linked list in recency order is not
  enough for ``lru_leaf``: a parent touched by another request's path is
  more recent than its children, so when it becomes a leaf it belongs
  somewhere in the middle.
* ``fifo`` keeps a ring buffer of ``C`` node ids.

All updates are masked gathers and scatters, with reads materialised by
:func:`prefixjax.paging.barrier` before in-place writes, so the per-event
cost does not grow with the number of nodes. A leaf-policy event has one
read phase and one barrier, then one scatter per array (see
:func:`_leaf_step`): on XLA:CPU each op of the step is a separate kernel
call, so the number of ops per event is its cost.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import bitmap
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
_ENGINES = ("auto", "event", "request", "keys")


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
# reads of that array since its last write. (``fifo`` uses it; the leaf
# policies follow the same rules with a single barrier: ``_leaf_step`` reads
# everything it needs from the state before the event, passes all of it
# through one barrier, and derives every write from the barrier's outputs.)


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


def _init_carry(policy, num_nodes, num_keys, capacity, max_capacity):
  i32 = jnp.int32
  s = {
    "size": i32(0),
    "capacity": capacity.astype(i32),
    "in_run": jnp.bool_(False),
    "stop": jnp.bool_(False),
    "filled": jnp.bool_(False),
  }
  if policy == "fifo":
    s["present"] = jnp.zeros((num_nodes,), jnp.bool_).at[0].set(True)
    s["ring"] = jnp.full((max_capacity,), _NONE, i32)
    s["ring_head"] = i32(0)
    return s
  # Per node, interleaved: [2n] cached children if cached, else -1;
  # [2n + 1] its key (see _leaf_step). The root is always cached.
  info = jnp.zeros((num_nodes, 2), i32).at[1:, 0].set(-1)
  s["info"] = info.reshape(-1)
  s["bm"] = jnp.zeros((bitmap.layout(num_keys)[1],), jnp.uint32)
  if policy == "lru_leaf":
    s["held"] = i32(_NONE)  # the leaf kept out of the bitmap (see _leaf_step)
    s["held_key"] = i32(0)
    s["held_parent"] = i32(0)
    s["held_prot"] = jnp.bool_(False)
  else:
    s["stack"] = jnp.full((num_nodes,), _NONE, i32)  # never-used leaves
    s["top"] = i32(0)
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


def _leaf_step(s, policy, static, consts, ev):
  """One block event of ``lru_leaf`` / ``belady_leaf``.

  Keys are event indices, so a key names its node (and its parent) through
  the constant event table: ``lru_leaf`` keys a node by the event that last
  touched it (a clock); ``belady_leaf`` by the event of its next use after
  that touch (ordered like the next-use request; two leaves never share one), or
  ``never`` (not used again). Evictable leaves are a hierarchical bitmap of
  keys (the victim is one word gather per level), except ``belady_leaf``'s
  never-used leaves, which sit on a stack (any of them is a valid victim;
  such a leaf leaves the leaf set only by eviction or, at the top of the
  stack, by the insertion of a child right after it was touched).

  ``lru_leaf`` keeps the request's protected leaf (its deepest hit, when that
  is a leaf) out of the bitmap, as the ``held`` leaf: a victim candidate
  unless protected, moved into the bitmap when another hit leaf replaces
  it. So the victim is one search and one compare.

  Every event is a hit (touch), or a miss that may evict one leaf and
  insert the block, never both; all reads are of the state before the
  event, through one barrier, and each array gets one masked scatter (node
  state as additions, so colliding lanes need no care).
  """
  (node, weight, use, use_ev, first, warm, par, index) = ev
  parent_of, event_table = consts
  lru = policy == "lru_leaf"
  i32 = jnp.int32
  never = static["never"]
  never_req = static["never_req"]
  stop = s["stop"] & ~first
  in_run = s["in_run"] | first
  new_key = index if lru else use_ev
  held_key = s["held_key"] if lru else None

  def info_of(nodes):
    nodes = jnp.stack(nodes)
    idx = jnp.stack([2 * nodes, 2 * nodes + 1], axis=1).reshape(-1)
    return gather(s["info"], idx, 0)  # a node -1 reads 0s

  def lane_keys(r):
    if lru:
      ks = [r["key_n"], held_key, r["k1"], r["key_vp1"], r["key_vp2"]]
    else:
      ks = [r["key_n"], r["k1"], r["key_vp1"], r["key_vp2"]]
    return jnp.stack(ks + [r["key_p"], new_key])

  def reads():
    st_n, key_n, st_p, key_p = info_of([node, par])
    r = {"st_n": st_n, "key_n": key_n, "st_p": st_p, "key_p": key_p}
    k1 = bitmap.find(s["bm"], static["bm_offsets"], rightmost=not lru)
    r["k1"] = k1
    # Each read costs an op per event (the barrier keeps unused ones).
    cols = 2 if lru else 3
    row = gather(event_table, 3 * k1 + jnp.arange(cols), 0)
    r["v1"] = jnp.where(k1 >= 0, row[0], _NONE)
    r["vp1"] = row[1]
    if lru:
      r["v2"], r["vp2"] = s["held"], s["held_parent"]
    else:
      r["k1_req"] = row[2]
      r["v2"] = _one(s["stack"], s["top"] - 1)
      r["vp2"] = _one(parent_of, r["v2"], 0)
    (r["st_vp1"], r["key_vp1"], r["st_vp2"], r["key_vp2"]) = info_of(
      [r["vp1"], r["vp2"]]
    )
    r["words"] = bitmap.words(s["bm"], static["bm_offsets"], lane_keys(r))
    return r

  (r,) = barrier(node, reads())
  keys = lane_keys(r)
  pres = r["st_n"] >= 0
  hit = in_run & pres
  want = ~pres & ~stop
  need = want & (s["size"] >= s["capacity"])
  k1 = r["k1"]
  tree_ok = k1 != _NONE
  leaf_n = hit & (r["st_n"] == 0)

  if lru:
    held = s["held"]
    held_prot = s["held_prot"] & ~first
    held_ok = (held != _NONE) & ~held_prot
    use_2 = held_ok & (~tree_ok | (held_key < k1))
    ok = tree_ok | held_ok
  else:
    use_2 = s["top"] > 0
    best = jnp.where(use_2, never_req, jnp.where(tree_ok, r["k1_req"], -1))
    ok = (use_2 | tree_ok) & (best > use)  # else Belady bypass
  pick = lambda a: jnp.where(use_2, r[a + "2"], r[a + "1"])
  victim, vp, ch_vp, key_vp = (
    pick("v"),
    pick("vp"),
    pick("st_vp"),
    pick("key_vp"),
  )
  evict = need & ok
  evict_tree = evict & ~use_2
  parent_present = (r["st_p"] >= 0) & ~(evict & (victim == par))
  stop = stop | (need & ~ok) | (want & ~parent_present)
  insert = want & ~stop
  ch_p = r["st_p"]
  ch_p_after = ch_p - (evict & (vp == par)).astype(i32)
  # The parent stops being a leaf: it was one before this event (in the
  # bitmap, the held leaf, or the top of the never stack).
  p_leaf = insert & (par != 0) & (ch_p_after == 0) & (ch_p == 0)
  orphan = evict & (vp != 0) & (ch_vp == 1) & ~(insert & (vp == par))
  touched = hit | insert
  from_1 = orphan & ~use_2
  from_2 = orphan & use_2

  if lru:
    n_held = node == held
    hit_clear = leaf_n & ~n_held
    # Lanes as in lane_keys: (set the bit, do).
    p_held = p_leaf & (par == held)
    lanes = [
      (False, hit_clear),
      (True, hit_clear & (held != _NONE)),
      (False, evict_tree),
      (True, from_1),
      (True, from_2),
      (False, p_leaf & ~p_held),
      (True, insert),
    ]
    s["held"] = jnp.where(
      leaf_n, node, jnp.where((evict & use_2) | p_held, _NONE, held)
    )
    s["held_key"] = jnp.where(leaf_n, new_key, held_key)
    s["held_parent"] = jnp.where(leaf_n, par, s["held_parent"])
    s["held_prot"] = held_prot | leaf_n
  else:
    add_n = leaf_n | insert
    lanes = [
      (False, leaf_n),
      (False, evict_tree),
      (True, from_1 & (r["key_vp1"] != never)),
      (True, from_2 & (r["key_vp2"] != never)),
      (False, p_leaf & (r["key_p"] != never)),
      (True, add_n & (use_ev != never)),
    ]
    pop = (evict & use_2) | (p_leaf & (r["key_p"] == never))
    push_vp = orphan & (key_vp == never)
    push_n = add_n & (use_ev == never)
    base = s["top"] - pop.astype(i32)
    s["stack"] = scatter(
      s["stack"],
      jnp.stack([base, base + push_vp.astype(i32)]),
      jnp.stack([vp, node]),
      jnp.stack([push_vp, push_n]),
    )
    s["top"] = base + push_vp.astype(i32) + push_n.astype(i32)

  sets = jnp.asarray([b for b, _ in lanes])
  dos = jnp.stack([d for _, d in lanes])
  s["bm"] = bitmap.update(
    s["bm"], static["bm_offsets"], keys, r["words"], sets, dos
  )
  # Node state: inserted -1 -> 0 children, evicted leaf 0 -> -1, the
  # parents' child counts, and the touched node's key.
  s["info"] = scatter_add(
    s["info"],
    jnp.stack([2 * node, 2 * victim, 2 * par, 2 * vp, 2 * node + 1]),
    jnp.stack([i32(1), i32(-1), i32(1), i32(-1), new_key - r["key_n"]]),
    jnp.stack([insert, evict, insert, evict, touched]),
  )
  size = s["size"] + insert.astype(i32) - evict.astype(i32)
  s["size"] = size
  s["stop"] = stop
  s["in_run"] = hit
  s["filled"] = s["filled"] | (insert & warm & (size >= s["capacity"]))
  return s, jnp.where(hit, weight, 0)


def _replay_one(
  policy, events, consts, num_keys, never_req, max_capacity, capacity
):
  num_nodes = consts[0].shape[0]
  carry = _init_carry(policy, num_nodes, num_keys, capacity, max_capacity)
  static = {
    "bm_offsets": bitmap.layout(num_keys)[0],
    "never": num_keys - 1,
    "never_req": never_req,
  }

  def step(carry, ev):
    if policy != "fifo":
      return _leaf_step(dict(carry), policy, static, consts, ev)
    node, weight, _, _, first, warm, _, _ = ev
    t = _Tape(carry, node, static)
    s = t.s
    s["in_run"] = s["in_run"] | first
    s["stop"] = s["stop"] & ~first
    pres = t.read("present", node, False)
    hit = s["in_run"] & pres
    s["in_run"] = hit
    _fifo_step(t, node, pres, warm)
    return t.s, jnp.where(hit, weight, 0)

  carry, hits = jax.lax.scan(step, carry, events)
  return hits, carry["filled"]


def _device_events(plan: ReplayPlan):
  """Per-event arrays for the scan, and constant arrays beside it."""
  num_events = plan.num_events
  warm = plan.request < plan.warmup_requests
  # The next event touching the same node (num_events if none).
  use_ev = np.full(num_events, num_events, np.int32)
  order = np.lexsort((np.arange(num_events), plan.node))
  same = plan.node[order][1:] == plan.node[order][:-1]
  use_ev[order[:-1]] = np.where(same, order[1:], num_events)
  events = (
    jnp.asarray(plan.node),
    jnp.asarray(plan.weight),
    jnp.asarray(plan.next_use),
    jnp.asarray(use_ev),
    jnp.asarray(plan.first),
    jnp.asarray(warm),
    jnp.asarray(plan.parent[plan.node]),
    jnp.arange(num_events, dtype=jnp.int32),
  )
  # Per event: its node, the node's parent and its request (one gather
  # names a key's node and parent, and its request for the Belady bypass).
  table = np.stack([plan.node, plan.parent[plan.node], plan.request], axis=1)
  consts = (jnp.asarray(plan.parent), jnp.asarray(table.reshape(-1)))
  return events, consts


def _compiled(plan: ReplayPlan, policy: str, num_configs: int):
  max_capacity = plan.unique_blocks + 1
  # Leaf keys are event indices; the last key, num_events, is "never".
  num_keys = plan.num_events + 1
  never_req = plan.num_kept + 1

  def run(events, consts, capacities):
    one = lambda c: _replay_one(
      policy, events, consts, num_keys, never_req, max_capacity, c
    )
    return jax.vmap(one)(capacities)

  events, consts = _device_events(plan)
  args = (events, consts, jnp.zeros((num_configs,), jnp.int32))
  return jax.jit(run).lower(*args).compile(), args


def replay(
  plan: ReplayPlan,
  *,
  policy: str,
  capacities: Sequence[int],
  timings: dict | None = None,
  engine: str = "auto",
) -> list[ReplayPoint]:
  """Replays ``plan`` at every capacity in one compiled program.

  Args:
    plan: from :func:`prepare_replay`.
    policy: one of :data:`REPLAY_POLICIES`.
    capacities: cache sizes in blocks (>= 0).
    timings: if given, ``compile_s`` and ``run_s`` are added to it.
    engine: ``"event"`` (this module: one scan step per block event),
      ``"request"`` (:mod:`prefixjax.replay_fast`: a request's blocks per
      step, for the policies in its ``FAST_POLICIES``), ``"keys"``
      (:mod:`prefixjax.replay_keys`: ``lru_leaf`` as stack distances, every
      capacity in one pass, and ``belady_leaf`` as counts per next-use
      key, every capacity a column of one array) or ``"auto"``
      (``"keys"`` for the leaf policies, ``"request"`` for ``fifo``). All
      give equal hits.

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
  if engine not in _ENGINES:
    raise ValueError(f"engine={engine!r} is not one of {_ENGINES}")
  from prefixjax import replay_fast, replay_keys  # they import this module

  if engine == "keys" and policy not in replay_keys.KEY_POLICIES:
    raise ValueError(
      f"engine='keys' serves {replay_keys.KEY_POLICIES}, not {policy!r}"
    )
  if engine == "keys" or (
    engine == "auto" and policy in replay_keys.KEY_POLICIES
  ):
    return replay_keys.replay_keys(
      plan, policy=policy, capacities=capacities, timings=timings
    )
  if engine == "request" or (
    engine == "auto" and policy in replay_fast.FAST_POLICIES
  ):
    return replay_fast.replay_fast(
      plan, policy=policy, capacities=capacities, timings=timings
    )
  capacities, clipped = _capacities(plan, capacities)
  start = time.perf_counter()
  compiled, (events, consts, _) = _compiled(plan, policy, len(capacities))
  hits, filled = _timed_run(
    compiled,
    (events, consts, jnp.asarray(clipped, jnp.int32)),
    time.perf_counter() - start,
    timings,
  )
  hits = np.asarray(hits, np.int64)
  filled = np.asarray(filled)
  return [
    _point(plan, policy, capacity, hits[i], bool(filled[i]))
    for i, capacity in enumerate(capacities)
  ]


def _capacities(plan: ReplayPlan, capacities) -> tuple[list[int], np.ndarray]:
  """Validated capacities, and the same clipped to the number of nodes (a
  larger capacity behaves like it)."""
  capacities = [int(c) for c in capacities]
  if not capacities:
    raise ValueError("capacities must not be empty")
  if min(capacities) < 0:
    raise ValueError(f"capacities={capacities} must be >= 0")
  return capacities, np.minimum(np.asarray(capacities), plan.unique_blocks + 1)


def _timed_run(compiled, args, compile_s: float, timings: dict | None):
  """Runs ``compiled(*args)`` to completion; adds ``compile_s`` and the run
  time to ``timings`` (if given). Returns the outputs."""
  start = time.perf_counter()
  out = jax.block_until_ready(compiled(*args))
  if timings is not None:
    timings["compile_s"] = timings.get("compile_s", 0.0) + compile_s
    timings["run_s"] = timings.get("run_s", 0.0) + time.perf_counter() - start
  return out


def _point(plan, policy, capacity, event_hits, filled) -> ReplayPoint:
  """The point of ``[E]`` hit tokens per block event."""
  per_kept = np.zeros(plan.num_kept, np.int64)
  np.add.at(per_kept, plan.request, event_hits)
  return _point_kept(plan, policy, capacity, per_kept, filled)


def _point_kept(plan, policy, capacity, per_kept, filled) -> ReplayPoint:
  """The point of ``[R_kept]`` hit tokens per kept request."""
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
