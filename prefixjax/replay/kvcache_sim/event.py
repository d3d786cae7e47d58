"""Cache replay with kvcache-simulator semantics, as one jitted scan.

A hit-rate study replays a trace, one request at a time, through a cache of
``capacity`` blocks under an eviction policy. This module does it on the
device: the trace becomes flat arrays of block events, every policy is a
fixed set of O(1) array updates per event, and one ``lax.scan`` over the
events is ``vmap``-ed over capacities, so many points cost one compiled
program.

Semantics: kvcache-simulator 0.1.3's (see :mod:`prefixjax.replay.kvcache_sim`).
This engine models the cache itself, one scan step per block event; it is
the reference the other engines are tested against.

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
:func:`prefixjax._masked.barrier` before in-place writes, so the per-event
cost does not grow with the number of nodes. A leaf-policy event has one
read phase and one barrier, then one scatter per array (see
:func:`_leaf_step`): on XLA:CPU each op of the step is a separate kernel
call, so the number of ops per event is its cost.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax._masked import NONE, barrier, gather, scatter, scatter_add
from prefixjax.cache import bitmap
from prefixjax.replay import frame
from prefixjax.replay.frame import Batching, Prepared, ReplayEngine
from prefixjax.replay.kvcache_sim import POLICIES
from prefixjax.replay.plan import ReplayPlan, clip_capacities, points_of_events

__all__ = ["ENGINE"]

# ---------------------------------------------------------------------------
# Device-side building blocks.
#
# XLA:CPU copies a whole array inside the scan when a write to it is not
# ordered after every read of its previous value, or when a cheap read is
# duplicated into a consumer scheduled after the write (see
# ``prefixjax._masked.barrier``). ``_Tape`` enforces the discipline that
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

  def read(self, name: str, idx, fill=NONE):
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


def _one(x, i, fill=NONE):
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
    s["ring"] = jnp.full((max_capacity,), NONE, i32)
    s["ring_head"] = i32(0)
    return s
  # Per node, interleaved: [2n] cached children if cached, else -1;
  # [2n + 1] its key (see _leaf_step). The root is always cached.
  info = jnp.zeros((num_nodes, 2), i32).at[1:, 0].set(-1)
  s["info"] = info.reshape(-1)
  s["bm"] = jnp.zeros((bitmap.layout(num_keys)[1],), jnp.uint32)
  if policy == "lru_leaf":
    s["held"] = i32(NONE)  # the leaf kept out of the bitmap (see _leaf_step)
    s["held_key"] = i32(0)
    s["held_parent"] = i32(0)
    s["held_prot"] = jnp.bool_(False)
  else:
    s["stack"] = jnp.full((num_nodes,), NONE, i32)  # never-used leaves
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


def _info_of(info, nodes):
  """``[2 L]`` (state, key) of each of ``nodes``, interleaved: one gather."""
  nodes = jnp.stack(nodes)
  idx = jnp.stack([2 * nodes, 2 * nodes + 1], axis=1).reshape(-1)
  return gather(info, idx, 0)  # a node -1 reads 0s


def _lane_keys(r, lru, held_key, new_key):
  """The bitmap update lanes' keys (see :func:`_lru_lanes` and
  :func:`_belady_lanes` for what each lane does)."""
  if lru:
    ks = [r["key_n"], held_key, r["k1"], r["key_vp1"], r["key_vp2"]]
  else:
    ks = [r["key_n"], r["k1"], r["key_vp1"], r["key_vp2"]]
  return jnp.stack(ks + [r["key_p"], new_key])


def _leaf_reads(s, lru, static, consts, node, par, new_key):
  """The event's read phase, all of the state before the event, through one
  barrier: the rows of the node and its parent, both victim candidates
  (``1``: the bitmap's best leaf; ``2``: the held leaf or the top of the
  never stack) with their parents' rows, and every lane's bitmap words."""
  parent_of, event_table = consts
  held_key = s["held_key"] if lru else None

  def reads():
    st_n, key_n, st_p, key_p = _info_of(s["info"], [node, par])
    r = {"st_n": st_n, "key_n": key_n, "st_p": st_p, "key_p": key_p}
    k1 = bitmap.find(s["bm"], static["bm_offsets"], rightmost=not lru)
    r["k1"] = k1
    # Each read costs an op per event (the barrier keeps unused ones).
    cols = 2 if lru else 3
    row = gather(event_table, 3 * k1 + jnp.arange(cols), 0)
    r["v1"] = jnp.where(k1 >= 0, row[0], NONE)
    r["vp1"] = row[1]
    if lru:
      r["v2"], r["vp2"] = s["held"], s["held_parent"]
    else:
      r["k1_req"] = row[2]
      r["v2"] = _one(s["stack"], s["top"] - 1)
      r["vp2"] = _one(parent_of, r["v2"], 0)
    (r["st_vp1"], r["key_vp1"], r["st_vp2"], r["key_vp2"]) = _info_of(
      s["info"], [r["vp1"], r["vp2"]]
    )
    r["words"] = bitmap.words(
      s["bm"], static["bm_offsets"], _lane_keys(r, lru, held_key, new_key)
    )
    return r

  (r,) = barrier(node, reads())
  return r


class _Outcome(NamedTuple):
  """What a leaf event does, decided from its reads (see
  :func:`_leaf_outcome`)."""

  hit: jax.Array  # a hit (touch) of the node
  leaf_n: jax.Array  # a hit of a leaf
  use_2: jax.Array  # the victim candidate is 2 (else 1)
  held_prot: jax.Array | None  # lru_leaf: the held leaf is protected
  victim: jax.Array  # the victim candidate
  vp: jax.Array  # its parent
  key_vp: jax.Array  # its parent's key
  evict: jax.Array  # the victim is evicted
  evict_tree: jax.Array  # ... out of the bitmap
  stop: jax.Array  # the request stops (after this event)
  insert: jax.Array  # the node is inserted
  p_leaf: jax.Array  # the parent stops being a leaf
  orphan: jax.Array  # the victim's parent becomes a leaf
  touched: jax.Array  # the node's key changes
  from_1: jax.Array  # orphan, of the bitmap's victim
  from_2: jax.Array  # orphan, of candidate 2


def _leaf_outcome(s, r, lru, never_req, ev, stop, in_run):
  """The event's decisions, from its reads ``r`` and the state's scalars
  (``size``, ``capacity``, the held leaf or the stack's ``top``): a hit, or
  a miss that may evict one leaf and insert the block, and which leaves
  leave or join the leaf set. Writes nothing."""
  (_, _, use, _, first, _, par, _) = ev
  i32 = jnp.int32
  pres = r["st_n"] >= 0
  hit = in_run & pres
  want = ~pres & ~stop
  need = want & (s["size"] >= s["capacity"])
  k1 = r["k1"]
  tree_ok = k1 != NONE
  leaf_n = hit & (r["st_n"] == 0)

  held_prot = None
  if lru:
    held = s["held"]
    held_prot = s["held_prot"] & ~first
    held_ok = (held != NONE) & ~held_prot
    use_2 = held_ok & (~tree_ok | (s["held_key"] < k1))
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
  return _Outcome(
    hit=hit,
    leaf_n=leaf_n,
    use_2=use_2,
    held_prot=held_prot,
    victim=victim,
    vp=vp,
    key_vp=key_vp,
    evict=evict,
    evict_tree=evict_tree,
    stop=stop,
    insert=insert,
    p_leaf=p_leaf,
    orphan=orphan,
    touched=touched,
    from_1=from_1,
    from_2=from_2,
  )


def _lru_lanes(s, o: _Outcome, node, par, new_key):
  """``lru_leaf``: the bitmap lanes ``(set the bit, do)``, in the order of
  :func:`_lane_keys`; writes the held leaf (``s["held"]``, ``"held_key"``,
  ``"held_parent"``, ``"held_prot"``)."""
  held = s["held"]
  n_held = node == held
  hit_clear = o.leaf_n & ~n_held
  # Lanes as in lane_keys: (set the bit, do).
  p_held = o.p_leaf & (par == held)
  lanes = [
    (False, hit_clear),
    (True, hit_clear & (held != NONE)),
    (False, o.evict_tree),
    (True, o.from_1),
    (True, o.from_2),
    (False, o.p_leaf & ~p_held),
    (True, o.insert),
  ]
  s["held"] = jnp.where(
    o.leaf_n, node, jnp.where((o.evict & o.use_2) | p_held, NONE, held)
  )
  s["held_key"] = jnp.where(o.leaf_n, new_key, s["held_key"])
  s["held_parent"] = jnp.where(o.leaf_n, par, s["held_parent"])
  s["held_prot"] = o.held_prot | o.leaf_n
  return lanes


def _belady_lanes(s, o: _Outcome, r, node, use_ev, never):
  """``belady_leaf``: the bitmap lanes ``(set the bit, do)``, in the order
  of :func:`_lane_keys` (never-used leaves go to the stack instead); writes
  the never stack (``s["stack"]``, ``s["top"]``, one scatter)."""
  add_n = o.leaf_n | o.insert
  lanes = [
    (False, o.leaf_n),
    (False, o.evict_tree),
    (True, o.from_1 & (r["key_vp1"] != never)),
    (True, o.from_2 & (r["key_vp2"] != never)),
    (False, o.p_leaf & (r["key_p"] != never)),
    (True, add_n & (use_ev != never)),
  ]
  pop = (o.evict & o.use_2) | (o.p_leaf & (r["key_p"] == never))
  push_vp = o.orphan & (o.key_vp == never)
  push_n = add_n & (use_ev == never)
  base = s["top"] - pop.astype(jnp.int32)
  s["stack"] = scatter(
    s["stack"],
    jnp.stack([base, base + push_vp.astype(jnp.int32)]),
    jnp.stack([o.vp, node]),
    jnp.stack([push_vp, push_n]),
  )
  s["top"] = base + push_vp.astype(jnp.int32) + push_n.astype(jnp.int32)
  return lanes


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
  state as additions, so colliding lanes need no care). Phases:
  :func:`_leaf_reads`, :func:`_leaf_outcome`, the policy's lanes
  (:func:`_lru_lanes` or :func:`_belady_lanes`), then the writes here.
  """
  (node, weight, use, use_ev, first, warm, par, index) = ev
  lru = policy == "lru_leaf"
  i32 = jnp.int32
  stop = s["stop"] & ~first
  in_run = s["in_run"] | first
  new_key = index if lru else use_ev
  held_key = s["held_key"] if lru else None
  r = _leaf_reads(s, lru, static, consts, node, par, new_key)
  keys = _lane_keys(r, lru, held_key, new_key)
  o = _leaf_outcome(s, r, lru, static["never_req"], ev, stop, in_run)
  if lru:
    lanes = _lru_lanes(s, o, node, par, new_key)
  else:
    lanes = _belady_lanes(s, o, r, node, use_ev, static["never"])

  sets = jnp.asarray([b for b, _ in lanes])
  dos = jnp.stack([d for _, d in lanes])
  s["bm"] = bitmap.update(
    s["bm"], static["bm_offsets"], keys, r["words"], sets, dos
  )
  # Node state: inserted -1 -> 0 children, evicted leaf 0 -> -1, the
  # parents' child counts, and the touched node's key.
  s["info"] = scatter_add(
    s["info"],
    jnp.stack([2 * node, 2 * o.victim, 2 * par, 2 * o.vp, 2 * node + 1]),
    jnp.stack([i32(1), i32(-1), i32(1), i32(-1), new_key - r["key_n"]]),
    jnp.stack([o.insert, o.evict, o.insert, o.evict, o.touched]),
  )
  size = s["size"] + o.insert.astype(i32) - o.evict.astype(i32)
  s["size"] = size
  s["stop"] = o.stop
  s["in_run"] = o.hit
  s["filled"] = s["filled"] | (o.insert & warm & (size >= s["capacity"]))
  return s, jnp.where(o.hit, weight, 0)


def _replay_one(
  policy, events, consts, num_steps, num_keys, max_capacity, capacity
):
  num_nodes = consts[0].shape[0]
  carry = _init_carry(policy, num_nodes, num_keys, capacity, max_capacity)
  static = {
    "bm_offsets": bitmap.layout(num_keys)[0],
    "never": num_keys - 1,
    "never_req": _NEVER_REQ,
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

  like = jax.ShapeDtypeStruct((), events[1].dtype)
  carry, hits = frame.scan_prefix(step, carry, events, num_steps, like)
  return hits, carry["filled"]


# The next-use request of a block never used again (the plan's
# ``num_kept + 1``, remapped): above every real request, and the same for
# every trace, so the compiled program does not depend on the trace's.
_NEVER_REQ = np.iinfo(np.int32).max


def _device_events(plan: ReplayPlan, num_events: int, num_nodes: int):
  """Per-event arrays for the scan, and constant arrays beside it, padded
  to ``num_events`` events and ``num_nodes`` nodes (padded events are
  never run; no real event names a padded node)."""
  real = plan.num_events
  warm = plan.request < plan.warmup_requests
  # The next event touching the same node (num_events, never, if none).
  use_ev = np.full(real, num_events, np.int32)
  order = np.lexsort((np.arange(real), plan.node))
  same = plan.node[order][1:] == plan.node[order][:-1]
  use_ev[order[:-1]] = np.where(same, order[1:], num_events)
  next_use = np.where(plan.next_use > plan.num_kept, _NEVER_REQ, plan.next_use)
  events = (
    (plan.node, NONE),
    (plan.weight, 0),
    (next_use.astype(np.int32), _NEVER_REQ),
    (use_ev, num_events),
    (plan.first, False),
    (warm, False),
    (plan.parent[plan.node], NONE),
    (np.arange(real, dtype=np.int32), NONE),
  )
  events = tuple(
    to_device(frame.pad_rows(x, num_events, fill)) for x, fill in events
  )
  # Per event: its node, the node's parent and its request (one gather
  # names a key's node and parent, and its request for the Belady bypass).
  table = np.stack([plan.node, plan.parent[plan.node], plan.request], axis=1)
  table = frame.pad_rows(table, num_events, 0)
  consts = (
    to_device(frame.pad_rows(plan.parent, num_nodes, 0)),
    to_device(table.reshape(-1)),
  )
  return events, consts, to_device(np.int32(real))


def _prepare(
  plan: ReplayPlan, capacities, *, policy: str, bucketed: bool = False
) -> Prepared:
  """Scan inputs; ``bucketed``: events and nodes padded to powers of
  two."""
  num_events = frame.padded(plan.num_events, bucketed)
  num_nodes = frame.padded(plan.unique_blocks + 1, bucketed)
  return Prepared(
    arrays=_device_events(plan, num_events, num_nodes),
    capacities=clip_capacities(plan, capacities),
    # Leaf keys are event indices; the last key, num_events, is "never".
    static=dict(policy=policy, num_keys=num_events + 1, max_capacity=num_nodes),
    context=plan,
  )


def _run(arrays, capacities, *, policy, num_keys, max_capacity):
  """``[C, E]`` hit tokens per event and ``[C]`` filled flags."""
  events, consts, num_steps = arrays

  def one(capacity):
    return _replay_one(
      policy, events, consts, num_steps, num_keys, max_capacity, capacity
    )

  return jax.vmap(one)(capacities)


def _points(prepared: Prepared, capacities, outputs):
  hits, filled = outputs
  plan, policy = prepared.context, prepared.static["policy"]
  hits = np.asarray(hits)[:, : plan.num_events]
  return [
    points_of_events(plan, policy, c, hits[i].astype(np.int64), bool(filled[i]))
    for i, c in enumerate(capacities)
  ]


ENGINE = ReplayEngine(
  name="kvcache_sim.event",
  semantics="kvcache-sim",
  policies=POLICIES,
  batching=Batching.COLUMNS,
  prepare=_prepare,
  run=_run,
  points=_points,
)
"""One scan step per block event, every capacity a vmapped lane."""
