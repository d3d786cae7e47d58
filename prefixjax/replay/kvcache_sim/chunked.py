"""kvcache-simulator replay, a request (or a chunk of one) per scan step.

A faster engine than :mod:`.event` (same
:class:`~prefixjax.replay.plan.ReplayPlan` in, hits equal request for
request): where that engine spends one scan step per block event, this one
serves ``W`` blocks of a request per step in a few ``[W]``-wide vectorised
operations, after the design of :mod:`prefixjax.replay.vllm_engine` (a
request longer than ``W`` blocks takes several consecutive steps). One step
serves every capacity: ``fifo`` keeps them as columns of its arrays, the
leaf policies' scan is ``vmap``-ed over them. :func:`prefixjax.replay.replay`
uses this engine for ``fifo``, and
for ``lru_leaf`` capacities below the longest request; the leaf policies
otherwise go to :mod:`.stack`, which needs no trie.

``fifo`` (kvcache-simulator's ``fifo``): a flat set plus an insertion
queue; every block of the request not cached (in order) is inserted,
evicting the oldest insertion when full. Insertions get consecutive queue
keys ``tail, tail + 1, ...`` and evictions always take the oldest, so the
cached set is exactly the nodes whose *latest* queue key is at least
``head``: the state is a key per node and two counters per capacity, and an
eviction is ``head += 1`` with no write at all. A request's blocks are
distinct nodes, so a block's key is the same at the request's start and
just before its turn; it is cached at the start iff its key is at least the
start's ``head`` (the hit run), and just before its turn iff its key is at
least ``head + max(0, i_j - f)``, where ``f`` is the free room when the step
starts and ``i_j`` the insertions of the step before column ``j``. That is
the sequential subtlety: a block cached at the start can be evicted by an
earlier insertion of the same request and is then inserted again, shifting
every later eviction. Marking such blocks as insertions only adds
insertions, so iterating "mark, recount" from the blocks missing at the
start reaches the exact (least) fixed point; a step loops only when such an
eviction happens.

Most blocks are new (73% of the Mooncake trace's): a trie node's parent is
seen with it, so a request is a prefix of seen blocks and then new blocks,
which are inserted at every capacity with keys ``b, b + 1, ...`` in order
(``b`` the ``tail`` before them). So the steps walk only the seen prefixes
(``W`` blocks a step), and the new blocks cost ``O(C)`` a request: one
*base* row per request holds ``b``, and each of its new blocks takes ``b``
as its key. That is exact for every test ``key >= head`` the replay makes.
The keys differ only for a request's new block ``j`` that was not inserted
again since, when ``b < head <= b + j`` (a full cache; let
``p = head - b``). Each insertion evicts the block at ``head``, so whenever
one of these blocks is inserted again, ``head`` passes it by two: those
inserted again are below ``p - 1``, and block ``p - 1`` keeps key
``b + p - 1 < head``. A request reaching block ``j >= p`` passes through
its ancestor ``p - 1``: the hit run stops there, and inserting it evicts
block ``p``, inserting that evicts ``p + 1``, and so on, so block ``j`` is
inserted under either key. A node gets a key row of its own only if it is
used again; its key is the larger of that row (set when it is inserted
again) and its request's base. Per step: one gather of the chunk's
``[2 W, C]`` key and base rows of the capacity-minor key array (through
:func:`prefixjax._masked.barrier`), prefix sums along ``W``, one scatter of
the key rows and one base row written; nothing depends on the number of
nodes. (FIFO is not a stack algorithm, so no pass serves several
capacities; on the first 1,500 Mooncake requests 256 capacities take
0.015 s against 0.0025 s for one.)

``lru_leaf`` and ``belady_leaf`` (kvcache-simulator's ``lru`` and
``optimal``): the state of :mod:`prefixjax.replay` (per node its
cached-children count and its key; the leaves as a hierarchical bitmap of
keys, a key naming its node through the event arrays), without its
``held`` leaf or never-used stack. A step touches the chunk's hit run (one
scatter of keys; only the deepest hit can be a leaf, so one bitmap move),
evicts, then inserts its missing blocks as a chain (one scatter).

The victims are taken by chain walks in a ``while_loop``, one
gather-barrier-scatter round per walk: the best leaf key ``k1`` names an
event of its node, whose ancestors are the earlier events of that request
(``k1 - 1, k1 - 2, ...``, one gather), and the walk goes up while the next
ancestor is left childless and would be the sequential process's next
victim too: up to ``W`` victims per walk. ``lru_leaf`` asks its key to be
below ``k1`` (so below every leaf's), ``belady_leaf`` above ``k2``, an
upper bound on the runner-up leaf key read off ``k1``'s bitmap path
(:func:`_below_bound`). Both tests can stop a walk early, never late, so
a walk evicts a prefix of the sequential victims; the next walk goes on.

* ``lru_leaf`` keys a node by the event that last touched it; the victim
  is the smallest key. The request's own keys (its hits and insertions)
  are at least its first event index and all others are below it, so
  while an older leaf exists none of its blocks is a victim, and the
  victims are the first ``max(0, misses - free)`` of the process "evict
  the smallest leaf; its parent may become a leaf" over the older leaves,
  whatever their interleaving with the insertions (about 3.5 walks per
  request on the Mooncake trace). When the older leaves run out (tiny
  capacities) the next insertion that needs room evicts the request's
  last inserted block, the parent of the block being inserted, and the
  request stops (without an eviction when the only leaf is its protected
  hit).
* ``belady_leaf`` keys a node by the event of its next use, or, if it is
  never used again, by ``E +`` the event that last touched it (at or
  above ``E``, so above every finite key, and still naming the node's
  path; never-used leaves
  tie, and any of them is a valid victim); the victim is the largest key.
  Victim ``i`` of a chunk makes room for its insertion ``free + i``, and
  the walk stops at the first victim whose next-use request is not after
  that block's (the Belady bypass, which stops the request). The
  request's own blocks always fail that test (a block's next use is no
  later than its descendants'), so they are never evicted.

Dimensions: ``S`` steps (request chunks), ``W`` blocks per step, ``C``
capacities, ``V`` trie nodes + 1 (the root), ``E`` block events.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax._masked import NONE, barrier, gather, scatter
from prefixjax.cache import bitmap
from prefixjax.replay import frame
from prefixjax.replay.frame import Batching, Prepared, ReplayEngine
from prefixjax.replay.kvcache_sim import POLICIES
from prefixjax.replay.plan import ReplayPlan, clip_capacities, points_of_events

__all__ = ["ENGINE", "chunk_points", "chunks", "column", "request_lengths"]

_CAPACITIES = "capacities"  # the vmap axis (eviction loops sync across it)
_WIDTH = 32  # blocks per scan step (16 to 64 measure alike on Mooncake)
# A fifo base row for capacity 0, whose base keys must stay below head = 0.
_NO_BASE = -(2**30)


def request_lengths(plan: ReplayPlan):
  """``[R_kept]`` blocks of each request and ``[E]`` each event's column
  in its request."""
  starts = np.flatnonzero(plan.first)
  lengths = np.diff(np.r_[starts, plan.num_events])
  return lengths, np.arange(plan.num_events) - np.repeat(starts, lengths)


def chunks(plan: ReplayPlan, width: int):
  """Requests cut into ``[S, W]`` chunks of event indices (-1 padded).

  Returns the rows, ``[S]`` whether each chunk starts its request, ``[S]``
  each chunk's kept request and ``[S]`` its first column in the request.
  """
  lengths, cols = request_lengths(plan)
  per_request = -(-lengths // width)
  first_chunk = np.cumsum(per_request) - per_request
  chunk = first_chunk[plan.request] + cols // width
  num_chunks = int(per_request.sum())
  rows = np.full((num_chunks, width), NONE, np.int32)
  rows[chunk, cols % width] = np.arange(plan.num_events)
  request = np.repeat(np.arange(plan.num_kept), per_request)
  offset = (np.arange(num_chunks) - first_chunk[request]) * width
  return rows, offset == 0, request.astype(np.int32), offset.astype(np.int32)


def column(rows: np.ndarray, per_event: np.ndarray) -> np.ndarray:
  """``[S, W]`` int32: ``per_event`` at each chunk cell (-1 padded)."""
  out = np.full(rows.shape, NONE, np.int32)
  out[rows >= 0] = per_event[rows[rows >= 0]]
  return out


def chunk_points(plan, policy, capacities, request, hits, filled):
  """Points from ``[C, S]`` hit blocks per chunk (a request's hits are its
  first blocks) and ``[C]`` filled flags."""
  lengths, cols = request_lengths(plan)
  hits = np.asarray(hits, np.int64)
  filled = np.asarray(filled)
  points = []
  for i, capacity in enumerate(capacities):
    per_kept = np.rint(
      np.bincount(
        request,
        weights=hits[i].astype(np.float64),
        minlength=plan.num_kept,
      )
    ).astype(np.int64)
    event_hits = np.where(cols < per_kept[plan.request], plan.weight, 0)
    points.append(
      points_of_events(plan, policy, capacity, event_hits, bool(filled[i]))
    )
  return points


def _exclusive_cumsum(x):
  """Exclusive prefix sums of ``[W, C]`` along ``W``, by log2(W) shifted
  adds (XLA:CPU lowers ``jnp.cumsum`` along the major axis to a
  reduce-window plus transposes, about 2x slower for the whole scan)."""
  y, shift = x, 1
  while shift < x.shape[0]:
    y = y + jnp.concatenate([jnp.zeros_like(y[:shift]), y[:-shift]])
    shift *= 2
  return y - x


def _fifo_width(num_capacities: int) -> int:
  """Default ``fifo`` blocks per step: narrower steps pad less of the
  ``[W, C]`` work as ``C`` grows (first 1,500 Mooncake requests: best at
  32 for one capacity, 16 up to 8, 8 from 16 on)."""
  if num_capacities == 1:
    return 32
  return 16 if num_capacities <= 8 else 8


def _fifo_chunks(plan: ReplayPlan, width: int, bucketed: bool = True):
  """The ``fifo`` scan's inputs: every request's seen prefix cut into
  ``[S, W]`` chunks (at least one chunk per request).

  Returns ``xs`` (``[S_pad, W]`` key rows to read and write, ``[S_pad, W]``
  base rows to read, and ``[S_pad]``: starts its request, in warm-up, new
  blocks appended after the chunk, base row to write; ``S`` real chunks
  padded to ``S_pad``, with ``bucketed`` a power of two), ``[S]`` each
  chunk's kept request and the key array's row count (its last row the
  spare row, ``bucketed`` a power of two).
  """
  num_events, num_kept = plan.num_events, plan.num_kept
  lengths, cols = request_lengths(plan)
  nodes, first_event, uses = np.unique(
    plan.node, return_index=True, return_counts=True
  )
  first_of = np.zeros(plan.unique_blocks + 1, np.int64)
  first_of[nodes] = first_event
  seen = first_of[plan.node] != np.arange(num_events)
  prefix = np.bincount(plan.request, seen, num_kept).astype(np.int64)
  if not np.array_equal(seen, cols < prefix[plan.request]):
    # Impossible for trie nodes: a seen node's parent was seen with it.
    raise RuntimeError("a request's already-seen blocks are not its prefix")
  # Rows: a key row per node used again, a base row per request, unused
  # rows up to the bucket, and the spare row (padding lanes) last, so the
  # compiled program depends on the row count alone.
  again = np.zeros(plan.unique_blocks + 1, bool)
  again[nodes[uses > 1]] = True
  num_again = int(again.sum())
  num_rows = frame.padded(num_again + num_kept + 1, bucketed)
  spare = num_rows - 1
  key_row = np.full(plan.unique_blocks + 1, spare, np.int64)
  key_row[again] = np.arange(num_again)
  per_request = np.maximum(1, -(-prefix // width))
  num_chunks = int(per_request.sum())
  first_chunk = np.cumsum(per_request) - per_request
  events = np.flatnonzero(seen)
  at = (first_chunk[plan.request[events]] + cols[events] // width,)
  at += (cols[events] % width,)
  origin = plan.request[first_of[plan.node[events]]]  # added it as new
  reads = []
  for row in (key_row[plan.node[events]], num_again + origin):
    out = np.full((num_chunks, width), spare, np.int32)
    out[at] = row
    reads.append(out)
  request = np.repeat(np.arange(num_kept), per_request)
  index = np.arange(num_chunks)
  last = index == first_chunk[request] + per_request[request] - 1
  xs = (
    *reads,
    index == first_chunk[request],
    request < plan.warmup_requests,
    np.where(last, lengths[request] - prefix[request], 0).astype(np.int32),
    (num_again + request).astype(np.int32),
  )
  # Padded chunks (never run): no block, no warm-up, no new blocks.
  steps = frame.padded(num_chunks, bucketed)
  fills = (spare, spare, False, False, 0, spare)
  xs = tuple(
    frame.pad_rows(x, steps, f) for x, f in zip(xs, fills, strict=True)
  )
  return xs, request.astype(np.int32), num_rows


def _fifo_step(s, x, *, capacities, spare):
  """Serves one chunk of a request's seen prefix, then (in its last chunk)
  appends the request's new blocks, at every capacity; returns ``[C]`` the
  chunk's hit blocks.

  ``key_of`` is ``[rows, C]``, capacity-minor: a chunk reads its nodes' key
  rows and base rows in one gather and writes the key rows back in one
  scatter (padding goes to the spare row). A node's key is the larger of
  its key row (set when it is inserted again) and the base row of the
  request that added it (see the module notes). A block is cached when its
  request starts iff its key is at least the request's starting ``head``
  (the request has not touched it yet), and just before its turn iff its
  key is at least the ``head`` of that moment.
  """
  key_idx, base_idx, first, warm, new, base_row = x
  i32 = jnp.int32
  width = key_idx.shape[0]
  idx = jnp.concatenate([key_idx, base_idx])
  got, idx, base_row = barrier(idx[0], s["key_of"][idx], idx, base_row)
  own = got[:width]
  rows = jnp.maximum(own, got[width:])
  valid = (key_idx != spare)[:, None]  # [W, 1]
  on = (capacities > 0)[None, :]  # [1, C]
  head, tail = s["head"][None, :], s["tail"][None, :]
  head0 = jnp.where(first, s["head"], s["head0"])
  cached0 = valid & (rows >= head0[None, :])
  stop = jnp.zeros((1, capacities.shape[0]), bool)
  run = jnp.argmin(jnp.concatenate([cached0, stop]), axis=0).astype(i32)
  in_run = s["in_run"] | first
  hits = jnp.where(in_run, run, 0)
  free = jnp.maximum(capacities - (s["tail"] - s["head"]), 0)[None, :]

  def marks(insert):
    """The insertions before each column, and the blocks to insert given
    them (missing at the start, or evicted by those insertions)."""
    before = _exclusive_cumsum(insert.astype(i32))
    return before, valid & on & (rows < head + jnp.maximum(before - free, 0))

  # Iterate insert -> marks(insert) from the blocks missing at the start;
  # at the fixed point `before` is the insertions' ranks.
  insert0 = valid & on & (rows < head)
  insert, rank, _ = jax.lax.while_loop(
    lambda carry: jnp.any(carry[0] != carry[2]),
    lambda carry: (carry[2], *marks(carry[2])),
    (insert0, *marks(insert0)),
  )
  count = jnp.sum(insert.astype(i32), axis=0)
  key_of = s["key_of"].at[idx[:width]].set(jnp.where(insert, tail + rank, own))
  head = s["head"] + jnp.maximum(count - free[0], 0)
  tail = s["tail"] + count
  # The new blocks (none cached) all take their base, tail, as their key.
  new = jnp.where(on[0], new, 0)
  base = jnp.where(on[0], tail, _NO_BASE)[None, :]
  free = jnp.maximum(capacities - (tail - head), 0)
  s = dict(s)
  s["key_of"] = jax.lax.dynamic_update_slice_in_dim(key_of, base, base_row, 0)
  s["head"] = head + jnp.maximum(new - free, 0)
  s["tail"] = tail + new
  s["head0"] = head0
  s["in_run"] = in_run & (run == jnp.sum(valid.astype(i32)))
  size = s["tail"] - s["head"]
  s["filled"] = s["filled"] | (warm & (count + new > 0) & (size >= capacities))
  return s, hits


@functools.partial(jax.jit, static_argnames=("num_rows",))
def _fifo_all(xs, num_steps, capacities, *, num_rows):
  """``[C, S]`` hit blocks per chunk and ``[C]`` filled flags (``fifo``;
  the first ``num_steps`` chunks of ``xs`` run, the spare row is the
  last).

  Not ``vmap``: ``vmap`` would give every capacity its own keys and gather
  from each; capacity-minor rows are one gather of ``2 W`` rows. The fix-up
  loop runs while any capacity needs it (it rarely does).
  """
  i32 = jnp.int32
  n = capacities.shape[0]
  s = {
    "key_of": jnp.full((num_rows, n), NONE, i32),
    "head": jnp.zeros((n,), i32),
    "tail": jnp.zeros((n,), i32),
    "head0": jnp.zeros((n,), i32),
    "in_run": jnp.zeros((n,), bool),
    "filled": jnp.zeros((n,), bool),
  }
  step = functools.partial(
    _fifo_step, capacities=capacities, spare=num_rows - 1
  )
  like = jax.ShapeDtypeStruct((n,), i32)
  s, hits = frame.scan_prefix(step, s, xs, num_steps, like)
  return hits.T, s["filled"]


def _below_bound(bm, offsets, key):
  """An upper bound on the nearest set key below ``key`` (a set key), or -1.

  One gather: the path words of ``key`` say at which level the neighbour
  branches off, and which sibling subtree holds it; the bound is that
  subtree's last key (exact when the neighbour shares ``key``'s word).
  """
  u32 = jnp.uint32
  path = bitmap.words(bm, offsets, key[None])[0]  # [L]
  bound = jnp.int32(-1)
  for lv in reversed(range(len(offsets))):
    bit = jnp.left_shift(u32(1), ((key >> (5 * lv)) & 31).astype(u32))
    below = path[lv] & (bit - 1)
    top = (
      (key >> (5 * (lv + 1))) * 32 + 31 - jax.lax.clz(below).astype(jnp.int32)
    )
    bound = jnp.where(below != 0, ((top + 1) << (5 * lv)) - 1, bound)
  return jnp.where(key >= 0, bound, -1)


class _Chunk(NamedTuple):
  """What the phases of one :func:`_leaf_step` share (read-only)."""

  lru: bool
  offsets: tuple[int, ...]  # the leaf bitmap's level offsets
  never: jax.Array  # belady_leaf: the next-use event of an unused node
  # [E] ev_node, [E] ev_start, [E + 1] ev_req, [V] parent_of, [] never
  consts: tuple
  nodes: jax.Array  # [W] the chunk's nodes (-1 padded)
  valid: jax.Array  # [W] which columns hold a block
  col: jax.Array  # [W] column indices
  use_req: jax.Array  # [W] the request of each block's next use
  new_keys: jax.Array  # [W] the key of a touch at each column
  anchor: jax.Array  # the barriers' anchor (the chunk's first event)
  req_start: jax.Array  # the request's first event


def _origin(c: _Chunk, key):
  """The event a key names (its node's, on the node's path)."""
  return key if c.lru else jnp.where(key >= c.never, key - c.never, key)


def _info_of(info, ns, fill=0):
  """``[..., 2]`` rows (cached children, key) of nodes ``ns``: one gather."""
  idx = jnp.stack([2 * ns, 2 * ns + 1], axis=-1)
  out = gather(info, idx.reshape(-1), fill)
  return out.reshape(idx.shape)


def _leaf_hits(s, c: _Chunk, in_run, prev, prev_hit):
  """The hit phase: reads the chunk's node rows and the deepest hit's bitmap
  words (one barrier), then writes the hits' keys to ``s["info"]`` (one
  scatter) and moves the deepest hit in ``s["bm"]`` if it is a leaf (only
  it can be).

  Returns the new state, the chunk's cached run, ``hit_n`` (its hit
  blocks) and the updated ``prev`` and ``prev_hit``.
  """
  i32 = jnp.int32

  def hit_reads():
    # [W, 2]: cached children (-1: not cached), key.
    rows = _info_of(s["info"], c.nodes, NONE)
    cached = c.valid & (rows[:, 0] >= 0)
    run = jnp.argmin(jnp.append(cached, False)).astype(i32)
    hit_n = jnp.where(in_run, run, 0)
    d_col = jnp.maximum(hit_n - 1, 0)
    keys = jnp.stack([rows[d_col, 1], c.new_keys[d_col]])
    return rows, run, hit_n, bitmap.words(s["bm"], c.offsets, keys)

  (rows, run, hit_n, d_words) = barrier(c.anchor, *hit_reads())
  d_col = jnp.maximum(hit_n - 1, 0)
  d_leaf = (hit_n > 0) & (rows[d_col, 0] == 0)
  hits = c.col < hit_n
  s = dict(s)
  s["info"] = scatter(s["info"], 2 * c.nodes + 1, c.new_keys, hits)
  s["bm"] = bitmap.update(
    s["bm"],
    c.offsets,
    jnp.stack([rows[d_col, 1], c.new_keys[d_col]]),
    d_words,
    jnp.asarray([False, True]),
    jnp.stack([d_leaf, d_leaf]),
  )
  prev = jnp.where(hit_n > 0, c.nodes[d_col], prev)
  prev_hit = prev_hit | (hit_n > 0)
  return s, run, hit_n, prev, prev_hit


def _walk_reads(c: _Chunk, info, bm, chain, hit_n, free, need, done, go):
  """One eviction walk's reads (of the state after ``done`` victims): the
  best leaf ``k1``, the rows of its chain of ancestors (the earlier events
  of its request), the victims to take (``taken``), whether their parent
  is exposed as a leaf, and the bitmap words to update."""
  ev_node, ev_start, ev_req, _, _ = c.consts
  i32 = jnp.int32
  width = c.nodes.shape[0]
  k1 = bitmap.find(bm, c.offsets, rightmost=not c.lru)
  start = gather(ev_start, _origin(c, k1)[None], 0)[0]
  chain_ev = _origin(c, k1) - chain
  in_req = (k1 >= 0) & (chain_ev >= start)
  chain_nodes = jnp.where(in_req, gather(ev_node, chain_ev, 0), NONE)
  rows = _info_of(info, chain_nodes)
  ch, key = rows[:, 0], rows[:, 1]
  if c.lru:
    # The request's own keys are the newest: never a victim while an
    # older leaf is left. Ancestor i follows victim i - 1 while it is
    # left childless, old and older than k1, so older than every leaf
    # (a parent usually shares its child's request, so its key is
    # smaller; stopping at a newer one only ends the walk early).
    ok = (key < c.req_start) & (key <= k1)
  else:
    k2 = _below_bound(bm, c.offsets, k1)
    # Victim i makes room for insertion free + done + i, whose next
    # use must come before the victim's (else the Belady bypass).
    key_req = gather(ev_req, jnp.minimum(key, c.never), 0)
    incoming = c.use_req[jnp.clip(hit_n + free + done + chain, 0, width - 1)]
    ok = (key_req > incoming) & (key > k2)
  ok = in_req & ok & ((chain == 0) | (ch == 1))
  lead = jnp.argmin(jnp.append(ok, False)).astype(i32)
  go_now = go & (done < need)
  taken = jnp.minimum(jnp.minimum(lead, need - done), width)
  taken = jnp.where(go_now, taken, 0)
  exposed = (taken > 0) & in_req[taken]
  keys = jnp.stack([k1, key[taken]])
  return (
    chain_nodes,
    ch,
    taken,
    exposed,
    ch[taken] == 1,
    keys,
    bitmap.words(bm, c.offsets, keys),
  )


def _leaf_evict(s, c: _Chunk, hit_n, free, need):
  """The eviction phase: chain walks in a ``while_loop`` until ``need``
  victims are taken or none is left. Each walk reads through one barrier
  (:func:`_walk_reads`), then writes ``info`` (victims uncached, the
  exposed parent's children count) and ``bm`` with one scatter each.

  Returns the new ``s["info"]`` and ``s["bm"]``, and the victims' count.
  """
  i32 = jnp.int32
  chain = jnp.arange(c.nodes.shape[0] + 1, dtype=i32)

  def evict_walk(carry):
    info, bm, done, go = carry
    chain_nodes, ch, taken, exposed, leaf, keys, words = barrier(
      c.anchor + done,
      *_walk_reads(c, info, bm, chain, hit_n, free, need, done, go),
    )
    victim = chain < taken
    info = scatter(
      info,
      2 * chain_nodes,
      jnp.where(victim, NONE, ch - 1),
      victim | (exposed & (chain == taken)),
    )
    bm = bitmap.update(
      bm,
      c.offsets,
      keys,
      words,
      jnp.asarray([False, True]),
      jnp.stack([taken > 0, exposed & leaf]),
    )
    return info, bm, done + taken, taken > 0

  def walking(carry):
    go = carry[3] & (carry[2] < need)
    return jax.lax.pmax(go.astype(i32), _CAPACITIES) > 0

  info, bm, evicted, _ = jax.lax.while_loop(
    walking, evict_walk, (s["info"], s["bm"], i32(0), need > 0)
  )
  return info, bm, evicted


def _leaf_insert(s, c: _Chunk, hit_n, evicted, inserted, short, prev, prev_hit):
  """The insertion phase: the chunk's missing blocks that fit (``kept``)
  join the cached path below ``prev`` as a chain, or ``lru_leaf`` evicts
  ``prev`` itself when nothing else is left. Reads the rows and bitmap
  words of ``prev``, its parent and the last insertion (one barrier), then
  writes ``s["info"]`` and ``s["bm"]`` with one scatter each.

  Returns the new state, ``kept``, ``evict_prev`` and ``prev``'s parent.
  """
  i32 = jnp.int32
  width = c.nodes.shape[0]
  nodes, new_keys, col = c.nodes, c.new_keys, c.col
  # lru_leaf: the next insertion evicts the request's last one. A
  # belady_leaf victim of the request's own is always bypassed instead
  # (its next use is no later than the incoming block's).
  own = short & (inserted > 0) & c.lru
  kept = inserted - own.astype(i32)
  evict_prev = short & (inserted == 0) & ~prev_hit & c.lru
  prev_parent = gather(c.consts[3], prev[None], 0)[0]

  def end_reads():
    ends = _info_of(s["info"], jnp.stack([prev, prev_parent]))  # [2, 2]
    last = new_keys[jnp.clip(hit_n + kept - 1, 0, width - 1)]
    keys = jnp.stack([ends[0, 1], last, ends[1, 1]])
    return ends, last, bitmap.words(s["bm"], c.offsets, keys)

  ends, last, end_words = barrier(c.anchor + evicted + 1, *end_reads())
  new_col = (col >= hit_n) & (col < hit_n + kept)
  chained = col < hit_n + kept - 1
  prev_real = prev != 0
  grow = (kept > 0) & prev_real
  pp_real = evict_prev & (prev_parent != 0)
  s = dict(s)
  s["info"] = scatter(
    s["info"],
    jnp.concatenate(
      [2 * nodes, 2 * nodes + 1, jnp.stack([2 * prev, 2 * prev_parent])]
    ),
    jnp.concatenate(
      [
        chained.astype(i32),
        new_keys,
        jnp.stack(
          [jnp.where(evict_prev, NONE, ends[0, 0] + 1), ends[1, 0] - 1]
        ),
      ]
    ),
    jnp.concatenate(
      [new_col, new_col, jnp.stack([grow | evict_prev, pp_real])]
    ),
  )
  clear_prev = (grow & (ends[0, 0] == 0)) | evict_prev
  s["bm"] = bitmap.update(
    s["bm"],
    c.offsets,
    jnp.stack([ends[0, 1], last, ends[1, 1]]),
    end_words,
    jnp.asarray([False, True, True]),
    jnp.stack([clear_prev, kept > 0, pp_real & (ends[1, 0] == 1)]),
  )
  return s, kept, evict_prev, prev_parent


def _leaf_step(s, x, *, policy, capacity, consts, num_events):
  """Serves one chunk of a request under a leaf policy; returns its hits.

  See the module docstring. ``prev`` is the end of the request's cached
  path so far (the root, its deepest hit or its last insertion) and
  ``prev_hit`` whether it is protected (the root or a hit); reads pass
  through one barrier per phase (hits, each walk, insertions) and every
  array gets one masked scatter per phase: :func:`_leaf_hits`,
  :func:`_leaf_evict`, :func:`_leaf_insert`, then this step updates the
  request's scalars.
  """
  nodes, evs, use, use_req, first, warm = x
  lru = policy == "lru_leaf"
  # belady_leaf: the next-use event of an unused node, the trace's event
  # count (data, not the padded num_events: the keys then lie as on the
  # unpadded trace, 0 .. 2 E - 1 with no gap, and the walks stop where
  # they would there; a gap up to the padded count made them 1.4x slower
  # on the Mooncake trace).
  never = consts[4]
  width = nodes.shape[0]
  i32 = jnp.int32
  col = jnp.arange(width, dtype=i32)
  valid = nodes >= 0
  count = jnp.sum(valid.astype(i32))
  anchor = evs[0]  # a chunk has at least one block, so never -7
  in_run = s["in_run"] | first
  stop = s["stop"] & ~first
  req_start = jnp.where(first, evs[0], s["req_start"])
  prev = jnp.where(first, 0, s["prev"])  # the request's cached path end
  prev_hit = s["prev_hit"] | first  # the root and hits are protected
  # The key of a touch at each column (see the module docstring).
  if lru:
    new_keys = evs
  else:
    new_keys = jnp.where(use < never, use, never + evs)
  c = _Chunk(
    lru=lru,
    offsets=bitmap.layout(_num_keys(policy, num_events))[0],
    never=never,
    consts=consts,
    nodes=nodes,
    valid=valid,
    col=col,
    use_req=use_req,
    new_keys=new_keys,
    anchor=anchor,
    req_start=req_start,
  )
  s, run, hit_n, prev, prev_hit = _leaf_hits(s, c, in_run, prev, prev_hit)
  misses = jnp.where(stop, 0, count - hit_n)
  size = s["size"]
  free = jnp.maximum(capacity - size, 0)
  need = jnp.maximum(misses - free, 0)
  s["info"], s["bm"], evicted = _leaf_evict(s, c, hit_n, free, need)
  inserted = jnp.minimum(misses, free + evicted)
  short = inserted < misses  # no victim left (or the Belady bypass)
  s, kept, evict_prev, prev_parent = _leaf_insert(
    s, c, hit_n, evicted, inserted, short, prev, prev_hit
  )
  last_node = nodes[jnp.clip(hit_n + kept - 1, 0, width - 1)]
  s["prev"] = jnp.where(
    kept > 0, last_node, jnp.where(evict_prev, prev_parent, prev)
  )
  s["prev_hit"] = prev_hit & (kept == 0)
  s["size"] = size - evicted + kept - evict_prev.astype(i32)
  s["req_start"] = req_start
  s["stop"] = stop | short
  s["in_run"] = in_run & (run == count)
  reached = size + inserted - evicted >= capacity
  s["filled"] = s["filled"] | (warm & (inserted > 0) & reached)
  return s, hit_n


def _num_keys(policy, num_events):
  """Leaf keys: event indices below ``E``; ``belady_leaf`` adds a
  never-used range ``E .. 2 E - 1``. No slack on top: a padded ``E`` is a
  power of two, and one key more would add a bitmap level at every power
  of 32 (2**20 + 2 keys take 5 levels, 2**20 take 4), a word read more on
  every search and update."""
  return num_events if policy == "lru_leaf" else 2 * num_events


def _init_leaf(policy, num_nodes, num_events):
  """The empty cache of one capacity (the leaf policies)."""
  i32 = jnp.int32
  # Per node, interleaved: [2n] cached children (-1: not cached), [2n + 1]
  # its key. The root is always cached and never a leaf.
  info = jnp.zeros((num_nodes, 2), i32).at[1:, 0].set(NONE)
  num_words = bitmap.layout(_num_keys(policy, num_events))[1]
  return {
    "in_run": jnp.bool_(False),
    "filled": jnp.bool_(False),
    "info": info.reshape(-1),  # [2V]
    "bm": jnp.zeros((num_words,), jnp.uint32),  # [~E/31] or [~2E/31]
    "size": i32(0),
    "stop": jnp.bool_(False),
    "req_start": i32(0),
    "prev": i32(0),
    "prev_hit": jnp.bool_(True),
  }


@functools.partial(
  jax.jit, static_argnames=("policy", "num_nodes", "num_events")
)
def _run_all(
  xs, consts, num_steps, capacities, *, policy, num_nodes, num_events
):
  """``[C, S]`` hit blocks per chunk and ``[C]`` filled flags (the leaf
  policies; the first ``num_steps`` chunks run).

  ``vmap`` over capacities: one step serves every capacity, which amortises
  XLA:CPU's per-op cost. The eviction loop takes its trip
  count from every capacity at once (a ``pmax`` over the vmapped axis):
  with a per-capacity trip count ``vmap`` would select over the whole
  state on every iteration; here a capacity with nothing left to evict
  runs the body as a no-op. The step is vmapped, not the loop over steps
  (the same program; a vmapped loop is traced twice to find its batched
  carry).
  """
  nodes, first, warm, evs, use, use_req = xs
  num = capacities.shape[0]
  init = _init_leaf(policy, num_nodes, num_events)
  s = jax.tree.map(lambda x: jnp.broadcast_to(x, (num, *x.shape)), init)

  def one(s, x, capacity):
    return _leaf_step(
      s,
      x,
      policy=policy,
      capacity=capacity,
      consts=consts,
      num_events=num_events,
    )

  step = jax.vmap(one, in_axes=(0, None, 0), axis_name=_CAPACITIES)
  xs = (nodes, evs, use, use_req, first, warm)
  like = jax.ShapeDtypeStruct((num,), jnp.int32)
  s, hits = frame.scan_prefix(
    lambda s, x: step(s, x, capacities), s, xs, num_steps, like
  )
  return hits.T, s["filled"]


def check_width(width) -> int:
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ValueError(f"width={width!r} must be an int >= 1")
  return width


def _prepare(
  plan: ReplayPlan, capacities, *, policy: str, width=None, bucketed=False
):
  """Scan inputs for ``policy``; ``width`` blocks per scan step (a longer
  request takes several steps; ``fifo`` steps walk only the blocks seen
  before): by default 32, and for ``fifo`` 32, 16 or 8 as the capacities
  grow (see :func:`_fifo_width`). ``bucketed``: steps, rows, events and
  nodes padded to powers of two (the padded steps are never run, and no
  real step reaches a padded row)."""
  if width is None:
    width = _fifo_width(len(capacities)) if policy == "fifo" else _WIDTH
  check_width(width)
  clipped = clip_capacities(plan, capacities)
  if policy == "fifo":
    xs, request, num_rows = _fifo_chunks(plan, width, bucketed)
    return Prepared(
      arrays=(
        tuple(to_device(a) for a in xs),
        to_device(np.int32(request.shape[0])),
      ),
      capacities=clipped,
      static=dict(policy=policy, num_rows=num_rows),
      context=(plan, request),
    )
  rows, first, request, _ = chunks(plan, width)
  nodes = column(rows, plan.node)
  warm = request < plan.warmup_requests
  num_events = frame.padded(plan.num_events, bucketed)
  num_nodes = frame.padded(plan.unique_blocks + 1, bucketed)
  # Per column: its event index, the event and the request of its node's
  # next use (never: E, the trace's event count, and num_kept + 1; -1
  # padded). Per event: its node, its request's first event and its
  # request (never_req from index E on, so at never); then never itself.
  never = plan.num_events
  starts = np.flatnonzero(plan.first)
  ev_start = np.repeat(starts, np.diff(np.r_[starts, never]))
  use_ev = np.full(never, never, np.int32)
  order = np.lexsort((np.arange(never), plan.node))
  same = plan.node[order][1:] == plan.node[order][:-1]
  use_ev[order[:-1]] = np.where(same, order[1:], never)
  columns = [
    column(rows, per_event)
    for per_event in (np.arange(plan.num_events), use_ev, plan.next_use)
  ]
  # Padded chunks (never run): no block, no warm-up.
  steps = frame.padded(rows.shape[0], bucketed)
  xs = (nodes, first, warm, *columns)
  fills = (NONE, False, False, NONE, NONE, NONE)
  xs = tuple(
    to_device(frame.pad_rows(x, steps, f))
    for x, f in zip(xs, fills, strict=True)
  )
  never_req = plan.num_kept + 1
  consts = (
    frame.pad_rows(plan.node, num_events, 0),
    frame.pad_rows(ev_start, num_events, 0),
    frame.pad_rows(plan.request, num_events + 1, never_req),
    frame.pad_rows(plan.parent, num_nodes, 0),
    np.int32(never),
  )
  return Prepared(
    arrays=(
      xs,
      tuple(to_device(a, np.int32) for a in consts),
      to_device(np.int32(rows.shape[0])),
    ),
    capacities=clipped,
    static=dict(policy=policy, num_nodes=num_nodes, num_events=num_events),
    context=(plan, request),
  )


def _engine_run(arrays, capacities, *, policy, **static):
  """``[C, S]`` hit blocks per chunk and ``[C]`` filled flags."""
  if policy == "fifo":
    xs, num_steps = arrays
    return _fifo_all(xs, num_steps, capacities, **static)
  xs, consts, num_steps = arrays
  return _run_all(xs, consts, num_steps, capacities, policy=policy, **static)


def _points(prepared: Prepared, capacities, outputs):
  plan, request = prepared.context
  hits, filled = outputs
  hits = np.asarray(hits)[:, : request.shape[0]]
  policy = prepared.static["policy"]
  return chunk_points(plan, policy, capacities, request, hits, filled)


ENGINE = ReplayEngine(
  name="kvcache_sim.chunked",
  semantics="kvcache-sim",
  policies=POLICIES,
  batching=Batching.COLUMNS,
  prepare=_prepare,
  run=_engine_run,
  points=_points,
)
"""A request's blocks (``W`` at a time) per scan step, every capacity a
column (``fifo``) or a vmapped lane (the leaf policies)."""
