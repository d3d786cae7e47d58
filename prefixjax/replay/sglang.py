"""Trace replay with SGLang ``RadixCache`` semantics, as one jitted scan.

Each request, one at a time and in order, is served the way SGLang 0.5.23's
paged ``RadixCache`` (``srt/mem_cache/radix_cache.py``) with LRU eviction
serves a request alone, under the default FCFS scheduler policy (the rules,
each with its source, are in ``tests/reference_models/sglang_radix.py``,
which this module reproduces hit for hit; paths below are in the 0.5.23
wheel's ``sglang/srt/``):

0. Waiting-prefix refresh, on by default (``environ.py
   SGLANG_ENABLE_WAITING_PREFIX_REFRESH``, true): ``managers/
   schedule_policy.py SchedulePolicy.calc_priority`` ends with
   ``_touch_waiting_prefixes``, which on its 1st, 33rd, 65th, ... call
   (``WAITING_PREFIX_REFRESH_INTERVAL = 32``) runs ``mem_cache/common.py
   touch_waiting_prefix`` -> ``RadixCache.touch_prefix`` for each waiting
   request: ``_match_prefix_helper`` of the page-aligned prompt, *not*
   capped at ``P - 1`` tokens. Modelled as one ``calc_priority`` per
   request, with the request alone in the queue: requests ``0, n, 2n, ...``
   (``n = waiting_refresh_interval``, 32 by default, ``None`` turns the
   rule off) first match their ``P // K`` full prompt pages: every node
   walked gets the match's timestamp, a node the match ends inside is split
   (its upper part gets a later timestamp); nothing is locked or counted.
   It walks further than step 1's match only when ``K`` divides ``P``, and
   it matters where that match stops at a node boundary one page short:
   the touch also refreshes the next node, so step 2 may spare it.
1. ``match_prefix`` of the prompt, capped at ``(P - 1) // K`` pages
   (``managers/schedule_batch.py Req._compute_max_prefix_len``,
   ``RadixCache._match_prefix_helper`` / ``_split_node``); every node walked
   gets the match's timestamp; a node the match ends inside is split and its
   upper part gets a fresh, later timestamp. The matched path is locked
   (``schedule_policy.py PrefillAdder._commit_prefill_admission``).
2. Prefill allocation (``mem_cache/allocation.py
   alloc_paged_token_slots_extend``, ``alloc_token_slots`` when ``K == 1``;
   ``allocator/base.py evict_to_free_tokens``; ``RadixCache.evict`` with
   ``evict_policy.py LRUStrategy``): evict whole least-recently-used
   unlocked leaf nodes until ``(P - hit) + K`` tokens are free (``K`` =
   page size; ``P - hit`` when ``K == 1``), then take ``cdiv(P, K) -
   hit_pages`` pages.
3. If the request decodes (``O >= 2``), checkpoint the full prompt pages
   (``common.py checkpoint_kv_cache`` -> ``RadixCache.checkpoint`` /
   ``_insert_cache``): insert them (walk, split, one new leaf node for the
   rest; pages that duplicate tree pages are freed), match them again, move
   the lock.
4. ``O - 1`` decode steps (``allocation.py alloc_paged_token_slots_decode``):
   each step whose start finds no free page evicts one LRU leaf node (SGLang
   asks for ``K`` tokens every step); a page is taken when a step starts a
   page.
5. Finish (``common.py release_kv_cache(checkpoint=True)``): checkpoint
   every full page of the ``P + O - 1`` tokens with KV (plus the refreshing
   re-insert of the prompt), free the partial last page (``free_kv_row``),
   unlock.

SGLang 0.5.23's default cache factory (``mem_cache/registry.py
default_radix_cache_factory`` -> ``create_unified_radix_cache``) builds a
``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``, a Rust tree
core by default), not the plain ``RadixCache`` modelled here. For a
full-attention model (the FULL component alone) the two behave alike:
driven side by side through the scheduler's own cache calls they made the
same matches, evictions, allocator free lists and request rows on 322,500
random operations (``tests/reference_models/sglang_unified_check.py``,
by hand, session 33), and neither supports fast matching, so
``calc_priority`` touches every 32nd waiting request with either. Not
modelled: the overlap scheduler (SGLang's default), batching and
concurrent requests, chunked prefill, admission reservations
(``max_new_tokens``), the hierarchical cache, speculative decoding and
eviction policies other than LRU; and SGLang counts
``calc_priority`` calls with a non-empty waiting queue, which depend on
arrival timing, where this replay counts requests.

Timestamps are a logical clock that ticks once per match, insert and node
creation, exactly as the oracle's, since eviction order depends on them.
Pages are keyed by their whole prefix: a token-id trace's page ``j`` is the
trie node of its first ``(j + 1) * K`` tokens (prompt, then output tokens; a
page holding output tokens the trace does not know gets a fresh key that
never hits); a hash-id trace (Mooncake) keys its ``P // K`` full prompt pages
by their chained ``hash_ids`` and gives every page filled during decode a
fresh key. The replay reports hit tokens per request (``K`` times the hit
pages of step 1).

Data structures (``V`` = distinct pages + 1, the root being page 0; ``R`` =
requests; ``M`` = most pages of one request; ``T`` = timestamps, at most
``18 R``):

* The radix tree is the set of cached pages, each page knowing its trie
  parent and depth (constants). A radix node is a run of pages from a page
  marked as a node start down to the next start or the leaf end; its
  metadata lives at its start page: last-access time, length in pages,
  child-node count, and ``rep``, a request whose page path holds the whole
  node, so the node's pages are ``pages[rep, depth : depth + length]`` of the
  constant ``[R, M]`` page table. So every tree verb works on one request
  path: a match or insert is a few ``[M]``-wide gathers and one masked
  scatter; a split marks one more start page and writes both parts'
  metadata; evicting a node is one ``[M]``-wide scatter.
* Lock counts are not stored: one request runs at a time and SGLang locks a
  root path, so the locked nodes are the first ``lock`` pages of the running
  request's path, and the only locked leaf can be the deepest of them.
* The leaf nodes sit in a hierarchical bitmap keyed by their last-access
  time (leaves never share one: a match or insert refreshes one root path,
  on which only the deepest node is a leaf), with a ``[T]`` table from key
  to node, so the LRU leaf is one word gather per level (3-4 levels), as in
  :mod:`prefixjax.replay`. The locked leaf leaves the bitmap for the length
  of an eviction loop.

A request costs ``O(M)`` per tree verb (six of them, seven with the touch)
plus ``O(M)`` per node it evicts; nothing scans the pool, so the rate does
not fall as ``V`` grows. Every verb reads the state once, through
:func:`prefixjax._masked.barrier`, and writes each array with one masked
scatter, so XLA:CPU updates the arrays in place. The replay of one capacity
is one jitted ``lax.scan`` over requests; :data:`ENGINE`'s ``run`` is pure
and ``jax.vmap``-s over capacities, but a vmapped eviction ``while_loop``
selects over the whole state on every iteration, so the engine declares
``PER_CAPACITY`` batching: the capacities run one after another through one
compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._checks import check_block_size
from prefixjax._host import to_device
from prefixjax._masked import NONE, barrier, gather, scatter
from prefixjax.cache import bitmap
from prefixjax.replay import frame
from prefixjax.replay.frame import (
  Batching,
  Prepared,
  ReplayEngine,
  ReplayResult,
)
from prefixjax.workloads import PrefixNumbering, Trace

__all__ = [
  "ENGINE",
  "SGLANG_POLICY",
  "WAITING_REFRESH_INTERVAL",
  "hits_and_free",
  "plan_pages",
  "replay_sglang",
]

SGLANG_POLICY = "lru_leaf"
"""Policy name of the points :func:`replay_sglang` returns."""

WAITING_REFRESH_INTERVAL = 32
"""SGLang 0.5.23's ``schedule_policy.py WAITING_PREFIX_REFRESH_INTERVAL``:
the default ``waiting_refresh_interval``."""


def _cdiv(a, b):
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class PagePlan:
  """A trace as page paths on the host.

  Attributes:
    pages: ``[R, M]`` int32 page (trie node) of position ``j`` of request
      ``r``'s KV (``j < (P + max(O, 1) - 1) // K``), ``-1`` past the end.
    depth: ``[V]`` int32 position of every page in its paths (root: 0).
    parent: ``[V]`` int32 trie parent of every page (root: 0).
    prompt_lens: ``[R]`` int32 ``P``.
    output_lens: ``[R]`` int32 ``max(O, 1)``.
  """

  pages: np.ndarray  # [R, M] int32
  depth: np.ndarray  # [V] int32
  parent: np.ndarray  # [V] int32
  prompt_lens: np.ndarray  # [R] int32
  output_lens: np.ndarray  # [R] int32

  @property
  def num_pages(self) -> int:
    """``V``: distinct pages plus the root."""
    return int(self.depth.shape[0])

  @property
  def max_pages(self) -> int:
    """``M``: columns of the page table."""
    return int(self.pages.shape[1])


def plan_pages(trace: Trace, block_size: int) -> PagePlan:
  """Numbers every page of every request's KV by its whole prefix."""
  prompt_lens = np.asarray(trace.input_lengths, np.int64)
  output_lens = np.maximum(np.asarray(trace.output_lengths, np.int64), 1)
  totals = prompt_lens + output_lens - 1
  full = totals // block_size
  max_pages = max(int(full.max()), 1)
  if len(trace) * max_pages >= 2**31 or int(full.sum()) >= 2**31 - 1:
    raise ValueError(
      f"trace too large: {len(trace)} requests x {max_pages} pages overflow "
      "int32 page ids"
    )
  pages = np.full((len(trace), max_pages), NONE, np.int32)
  numbering = PrefixNumbering()
  depth = [0]
  use_tokens = trace.has_token_ids
  for r in range(len(trace)):
    p, n = int(prompt_lens[r]), int(full[r])
    if use_tokens:
      seq = trace.input_token_ids[r]
      if trace.output_token_ids is not None:
        seq = np.concatenate([seq, trace.output_token_ids[r]])
      known = seq.shape[0] // block_size  # pages of known tokens
    else:
      known = p // block_size
      hashes = trace.hash_ids[r]
    node = 0
    for j in range(n):
      seen = len(numbering)
      if j < known:
        if use_tokens:
          key = seq[j * block_size : (j + 1) * block_size].tobytes()
        else:
          key = int(hashes[j])
        new = numbering.child(node, key)
      else:  # a page filled by tokens the trace does not know: fresh
        new = numbering.fresh(node)
      if new == seen:
        depth.append(j)
      pages[r, j] = node = new
  return PagePlan(
    pages=pages,
    depth=np.asarray(depth, np.int32),
    parent=np.asarray(numbering.parent, np.int32),
    prompt_lens=prompt_lens.astype(np.int32),
    output_lens=output_lens.astype(np.int32),
  )


# ---------------------------------------------------------------------------
# Device side. Dimension letters: V pages (page 0 = the root), M columns of
# the page table, W bitmap words, T timestamps (keys).
#
# State of one capacity, a dict of:
#   info  [V * 5] int32  per page, interleaved: _STATE (-1 not cached, 0
#         cached, 1 cached and the start of a radix node), then, meaningful
#         at node starts: _TIME (last access), _LENGTH (pages), _REP (a
#         request whose path holds the node), _KIDS (child nodes)
#   bm    [W] uint32     hierarchical bitmap of the timestamps of the leaf
#         nodes (the root excluded)
#   owner [T] int32      start page of the leaf node holding each set key
#   clock, free          [] int32
#
# Leaves never share a timestamp, so a key names one leaf and the smallest
# set key is the LRU leaf. Locks are not stored (see the module docstring):
# around each eviction loop the deepest locked node, if a leaf, leaves the
# bitmap and comes back after, and a parent it exposes as a leaf during the
# loop is not added.
#
# Every verb reads what it needs from the state, passes all of it through one
# ``barrier`` and writes each array with one masked scatter derived from the
# barrier's outputs, so XLA:CPU updates the arrays in place (see
# ``prefixjax._masked.barrier``) and no verb costs O(V).

_FIELDS = 5
_STATE, _TIME, _LENGTH, _REP, _KIDS = range(_FIELDS)
_TICKS_PER_REQUEST = 18  # the seven tree verbs of a request tick <= 17 times

# Request verbs (one inner scan step each): kind, then what follows it.
_ADMIT, _CKPT_INSERT, _CKPT_MATCH, _REFRESH, _TOUCH = range(5)


def _one(x, i, fill=NONE):
  return gather(x, jnp.asarray(i)[None], fill)[0]


def _fields(info, page, fields):
  """``[len(fields)]`` fields of one page (0s for page -1)."""
  idx = page * _FIELDS + jnp.asarray(fields, jnp.int32)
  return gather(info, jnp.where(page >= 0, idx, NONE), 0)


def _init(num_pages: int, num_keys: int, capacity):
  info = np.zeros((num_pages, _FIELDS), np.int32)
  info[:, _STATE] = -1
  info[0, _STATE] = 1  # the root: cached, a node of its own
  return {
    "info": jnp.asarray(info.reshape(-1)),
    "bm": jnp.zeros((bitmap.layout(num_keys)[1],), jnp.uint32),
    "owner": jnp.full((num_keys,), NONE, jnp.int32),
    "clock": jnp.int32(0),
    "free": capacity.astype(jnp.int32),
  }


def _tree_op(s, c, path, request, n, do, insert):
  """``match_prefix`` (``_insert`` if ``insert``) of ``path[:n]`` where do.

  Returns the new state and the number of leading pages already cached.
  Nothing changes (not even the clock) where ``do`` is false.
  """
  i32 = jnp.int32
  width = path.shape[0]
  pos = jnp.arange(width, dtype=i32)
  offsets = c["bm_offsets"]
  tick = s["clock"] + 1

  def reads():
    state = gather(s["info"], path * _FIELDS + _STATE, NONE)  # -1 pads
    hit = jnp.argmin(jnp.append((state >= 0) & (pos < n), False).astype(i32))
    hit = hit.astype(i32)
    first = jnp.max(jnp.where((state == 1) & (pos < hit), pos, NONE))
    node = jnp.where(first >= 0, _one(path, first), 0)  # root if no hit
    time_, length, rep, kids = _fields(
      s["info"], node, [_TIME, _LENGTH, _REP, _KIDS]
    )
    split = do & (hit > 0) & (first + length > hit)
    new = do & insert & (n > hit)
    new_tick = tick + 1 + split.astype(i32)
    keys = jnp.stack([time_, tick, new_tick])
    r = dict(state=state, hit=hit, first=first, node=node, time=time_)
    r.update(length=length, rep=rep, kids=kids, split=split, new=new)
    r["lower"] = _one(c["table"], rep * width + hit)  # split's lower part
    r["words"] = bitmap.words(s["bm"], offsets, keys)
    r["keys"] = keys
    return r

  (r,) = barrier(request, reads())
  hit, first, node, kids, split, new = (
    r[k] for k in ("hit", "first", "node", "kids", "split", "new")
  )
  lower, length, rep = r["lower"], r["length"], r["rep"]
  head = _one(path, hit)  # first page of the new leaf node
  new_tick = r["keys"][2]
  upper = hit - first  # pages of the split's upper part
  s = dict(s)
  ticks = 1 + split.astype(i32) + new.astype(i32)
  s["clock"] = s["clock"] + jnp.where(do, ticks, 0)
  # Every node walked gets ``tick``, a split's upper part ``tick + 1``.
  walked = (r["state"] == 1) & (pos < hit) & do & ~(split & (pos == first))
  fresh = new & (pos >= hit) & (pos < n)
  lanes = [  # (page, field, value, mask)
    (node, _TIME, tick + 1, split),
    (node, _LENGTH, upper, split),
    (node, _KIDS, jnp.where(split, 1, kids) + new.astype(i32), split | new),
    (lower, _STATE, 1, split),
    (lower, _TIME, tick, split),
    (lower, _LENGTH, length - upper, split),
    (lower, _REP, rep, split),
    (lower, _KIDS, kids, split),
    (head, _TIME, new_tick, new),
    (head, _LENGTH, n - hit, new),
    (head, _REP, request, new),
    (head, _KIDS, 0, new),
  ]
  idx = jnp.stack([p * _FIELDS + f for p, f, _, _ in lanes])
  values = jnp.stack([jnp.asarray(v, i32) for _, _, v, _ in lanes])
  masks = jnp.stack([m for _, _, _, m in lanes])
  s["info"] = scatter(
    s["info"],
    jnp.concatenate([path * _FIELDS + _TIME, path * _FIELDS + _STATE, idx]),
    jnp.concatenate(
      [
        jnp.full((width,), tick, i32),
        jnp.where(pos == hit, 1, 0).astype(i32),
        values,
      ]
    ),
    jnp.concatenate([walked, fresh, masks]),
  )
  # Leaves: the deepest walked node leaves the bitmap under its old time;
  # it (or a split's lower part) comes back under ``tick`` unless the new
  # node hangs below it; the new node is a leaf.
  was_leaf = (node != 0) & (kids == 0)
  stays = do & was_leaf & (split | ~new)
  s["bm"] = bitmap.update(
    s["bm"],
    offsets,
    r["keys"],
    r["words"],
    jnp.asarray([False, True, True]),
    jnp.stack([do & was_leaf, stays, new]),
  )
  s["owner"] = scatter(
    s["owner"],
    r["keys"][1:],
    jnp.stack([jnp.where(split, lower, node), head]),
    jnp.stack([stays, new]),
  )
  return s, hit


def _lock_node(s, path, lock):
  """Start page of the deepest locked node (0, the root, if none)."""
  pos = jnp.arange(path.shape[0], dtype=jnp.int32)
  state = gather(s["info"], path * _FIELDS + _STATE, NONE)
  first = jnp.max(jnp.where((state == 1) & (pos < lock), pos, NONE))
  return jnp.where(first >= 0, _one(path, first), 0)


def _hold(s, c, locked, anchor, put_back):
  """Takes the locked node out of the bitmap if it is a leaf, or back."""
  time_, kids = _fields(s["info"], locked, [_TIME, _KIDS])
  leaf = (locked != 0) & (kids == 0)
  words = bitmap.words(s["bm"], c["bm_offsets"], time_[None])
  (time_, leaf, words) = barrier(anchor, time_, leaf, words)
  s = dict(s)
  s["bm"] = bitmap.update(
    s["bm"],
    c["bm_offsets"],
    time_[None],
    words,
    jnp.asarray([put_back]),
    leaf[None],
  )
  if put_back:
    s["owner"] = scatter(s["owner"], time_[None], locked[None], leaf[None])
  return s


def _evict_one(s, c, locked, anchor):
  """Evicts the LRU unlocked leaf node; returns the state and pages freed."""
  i32 = jnp.int32
  table = c["table"]
  width = c["width"]
  offsets = c["bm_offsets"]
  pos = jnp.arange(width, dtype=i32)

  def reads():
    key = bitmap.find(s["bm"], offsets)
    victim = _one(s["owner"], key)
    length, rep = _fields(s["info"], victim, [_LENGTH, _REP])
    top = _one(c["depth"], victim, 0)
    rep_path = gather(table, rep * width + pos)
    above = gather(s["info"], rep_path * _FIELDS + _STATE, NONE)
    first = jnp.max(jnp.where((above == 1) & (pos < top), pos, NONE))
    parent = jnp.where(first >= 0, _one(rep_path, first), 0)
    p_time, p_kids = _fields(s["info"], parent, [_TIME, _KIDS])
    keys = jnp.stack([key, p_time])
    r = dict(key=key, victim=victim, length=length, top=top, parent=parent)
    r.update(p_kids=p_kids, keys=keys, rep_row=rep * width)
    r["words"] = bitmap.words(s["bm"], offsets, keys)
    return r

  (r,) = barrier(anchor, reads())
  ok = r["key"] >= 0
  parent = r["parent"]
  pages = gather(table, r["rep_row"] + r["top"] + pos)
  exposed = ok & (parent != 0) & (parent != locked) & (r["p_kids"] == 1)
  s = dict(s)
  s["info"] = scatter(
    s["info"],
    jnp.concatenate(
      [pages * _FIELDS + _STATE, (parent * _FIELDS + _KIDS)[None]]
    ),
    jnp.concatenate([jnp.full((width,), NONE, i32), (r["p_kids"] - 1)[None]]),
    jnp.concatenate([ok & (pos < r["length"]), ok[None]]),
  )
  s["bm"] = bitmap.update(
    s["bm"],
    offsets,
    r["keys"],
    r["words"],
    jnp.asarray([False, True]),
    jnp.stack([ok, exposed]),
  )
  s["owner"] = scatter(s["owner"], r["keys"][1:], parent[None], exposed[None])
  freed = jnp.where(ok, r["length"], 0)
  s["free"] = s["free"] + freed
  return s, freed, ok


def replay_one(
  consts,
  xs,
  capacity,
  *,
  block_size: int,
  waiting_refresh_interval: int | None = WAITING_REFRESH_INTERVAL,
  num_keys: int | None = None,
):
  """Hit tokens, free pages after, broken invariant: ``[R]`` each.

  ``xs`` is the per-request arrays and the number of real requests: only
  those run (the rows after them, and the table's, are padding).
  ``waiting_refresh_interval`` (static): requests ``0, n, 2n, ...`` first
  touch their whole page-aligned prompt (a match, uncapped); ``None``: none
  does. ``num_keys`` (static): the timestamps the leaf bitmap holds, at
  least ``_TICKS_PER_REQUEST`` per real request plus 2 (default: that many
  for every row of ``xs``).
  """
  table, depth = consts
  xs, num_real = xs
  num_requests = xs[0].shape[0]
  width = table.shape[0] // num_requests
  if num_keys is None:
    num_keys = _key_count(num_requests)
  c = {
    "table": table,
    "depth": depth,
    "width": width,
    "bm_offsets": bitmap.layout(num_keys)[0],
  }
  ps = block_size
  i32 = jnp.int32
  pos = jnp.arange(width, dtype=i32)

  def evict(s, path, lock, anchor, go):
    """Evicts LRU leaves while ``go(pages freed so far)``."""
    locked = _lock_node(s, path, lock)
    s = _hold(s, c, locked, anchor, put_back=False)

    def body(carry):
      s, count, _ = carry
      s, freed, ok = _evict_one(s, c, locked, anchor + count)
      return s, count + freed, ok

    s, _, _ = jax.lax.while_loop(
      lambda carry: carry[2] & go(carry[1]), body, (s, i32(0), jnp.bool_(True))
    )
    return _hold(s, c, locked, anchor, put_back=True)

  def step(s, x):
    r, p, o = x
    total = p + o - 1
    prompt_pages = p // ps
    full_pages = total // ps
    path = gather(table, r * width + pos)
    takes = _cdiv(total, ps) - _cdiv(p, ps)  # pages taken while decoding
    first_take = _cdiv(p, ps) * ps - p + 1  # the decode step of take 1
    decodes = o >= 2
    refresh = (prompt_pages > 0) & (prompt_pages < full_pages)
    verbs = [  # (kind, pages, do); decode runs after the first _CKPT_MATCH
      (_ADMIT, (p - 1) // ps, True),
      (_CKPT_INSERT, prompt_pages, decodes),
      (_CKPT_MATCH, prompt_pages, decodes),
      (_CKPT_INSERT, full_pages, True),
      (_REFRESH, prompt_pages, refresh),
      (_CKPT_MATCH, full_pages, True),
    ]
    if waiting_refresh_interval is not None:  # touch_waiting_prefix first
      touch = r % waiting_refresh_interval == 0
      verbs.insert(0, (_TOUCH, prompt_pages, touch))
    decode_at = [k for k, _, _ in verbs].index(_CKPT_MATCH)
    kinds = jnp.asarray([k for k, _, _ in verbs], jnp.int32)
    ns = jnp.stack([jnp.asarray(n, i32) for _, n, _ in verbs])
    dos = jnp.stack([jnp.asarray(d) for _, _, d in verbs])

    def op(carry, args):
      s, lock, private, hit, bad = carry
      kind, n, do, index = args
      insert = (kind == _CKPT_INSERT) | (kind == _REFRESH)
      s, got = _tree_op(s, c, path, r, n, do, insert)
      admit = kind == _ADMIT
      hit = jnp.where(admit, got, hit)
      # Checkpoint (``_insert_cache``): pages duplicating tree pages are
      # freed, the rest move from the request to the tree.
      ckpt = do & (kind == _CKPT_INSERT)
      dup = got - lock
      private = private - jnp.where(ckpt, dup + jnp.maximum(n - got, 0), 0)
      s["free"] = s["free"] + jnp.where(ckpt, dup, 0)
      bad = bad | (ckpt & (dup < 0))
      rematch = do & (kind == _CKPT_MATCH)
      bad = bad | (rematch & (got != n))
      lock = jnp.where(admit, got, jnp.where(rematch, n, lock))
      # Prefill: free ``(P - hit) + K`` tokens (``P - hit`` if K = 1).
      need = _cdiv(p, ps) - hit
      demand = (p - hit * ps) + ps if ps > 1 else need
      target = _cdiv(jnp.maximum(demand - s["free"] * ps, 0), ps)
      # Decode: a step that starts with no free page evicts one leaf; with
      # ``f`` = free pages before decode plus pages evicted since, the
      # next such step follows take number ``f`` (take 0: step 0).
      free0 = s["free"]
      decode = index == decode_at

      def go(count):
        f = free0 + count
        step_f = jnp.where(f == 0, 0, first_take + (f - 1) * ps)
        more = (f <= takes) & (step_f + 1 <= o - 1)
        return jnp.where(admit, count < target, decode & more)

      s = evict(s, path, lock, r * 8 + index, go)
      taken = jnp.where(admit, need, jnp.where(decode, takes, 0))
      s["free"] = s["free"] - taken
      private = private + taken
      bad = bad | (s["free"] < 0)
      return (s, lock, private, hit, bad), None

    zero = i32(0)
    carry = (s, zero, zero, zero, jnp.bool_(False))
    (s, _, private, hit, bad), _ = jax.lax.scan(
      op, carry, (kinds, ns, dos, jnp.arange(len(verbs), dtype=i32))
    )
    # Finish: free the partial last page, unlock.
    bad = bad | (private != (total % ps != 0).astype(i32))
    s["free"] = s["free"] + private
    return s, (hit * ps, s["free"], bad)

  s = _init(depth.shape[0], num_keys, capacity)
  like = (
    jax.ShapeDtypeStruct((), i32),
    jax.ShapeDtypeStruct((), i32),
    jax.ShapeDtypeStruct((), jnp.bool_),
  )
  _, out = frame.scan_prefix(step, s, xs, num_real, like)
  return out


def _run(arrays, capacity, *, block_size, waiting_refresh_interval, num_keys):
  consts, xs = arrays
  return replay_one(
    consts,
    xs,
    capacity,
    block_size=block_size,
    waiting_refresh_interval=waiting_refresh_interval,
    num_keys=num_keys,
  )


def _key_count(num_requests: int) -> int:
  """Timestamps ``num_requests`` requests can take (keys of the bitmap)."""
  return _TICKS_PER_REQUEST * num_requests + 2


def _padded_key_count(num_requests: int, rows: int) -> int:
  """The key count of ``rows`` requests, but at most the power of 32 at or
  above the ``num_requests`` real ones' (their timestamps all fit below
  it): padding then never adds a bitmap level (a word read per level, on
  every search and update). Two traces of one bucket compile apart only
  when their key counts straddle a power of 32 (``R`` from 57 to 64,
  1,821 to 2,048, 58,255 to 65,536)."""
  real = _key_count(num_requests)
  levels = len(bitmap.layout(real)[0])
  return min(_key_count(rows), 32**levels)


def _check_interval(waiting_refresh_interval) -> int | None:
  """``waiting_refresh_interval`` as ``None`` or a Python int >= 1."""
  value = waiting_refresh_interval
  if value is None:
    return None
  if (
    isinstance(value, bool)
    or not isinstance(value, int | np.integer)
    or not 1 <= value < 2**31
  ):
    raise ValueError(
      f"waiting_refresh_interval={value!r} must be None (no waiting-prefix "
      "refresh) or an int from 1 to 2**31 - 1"
    )
  return int(value)


def _prepare(
  trace: Trace,
  capacities,
  *,
  block_size: int,
  warmup_fraction: float = 0.5,
  waiting_refresh_interval: int | None = WAITING_REFRESH_INTERVAL,
  bucketed: bool = False,
) -> Prepared:
  """Scan inputs; ``bucketed``: requests, table columns and pages padded
  to powers of two (:func:`prefixjax.replay.frame.padded`: padded requests
  never run, padded columns are ``-1`` as past any request's end, and no
  real request names a padded page; timestamps count from 0 whatever the
  key space's size)."""
  interval = _check_interval(waiting_refresh_interval)
  plan = plan_pages(trace, block_size)
  num_requests = len(trace)
  rows = frame.padded(num_requests, bucketed)
  pages = np.full((rows, frame.padded(plan.max_pages, bucketed)), NONE)
  pages[:num_requests, : plan.max_pages] = plan.pages
  consts = (
    pages.astype(np.int32).reshape(-1),
    frame.pad_rows(plan.depth, frame.padded(plan.num_pages, bucketed), 0),
  )
  # Padded requests (never run): an empty prompt and no output.
  xs = (
    np.arange(rows, dtype=np.int32),
    frame.pad_rows(plan.prompt_lens, rows, 0),
    frame.pad_rows(plan.output_lens, rows, 1),
  )
  return Prepared(
    arrays=(
      tuple(map(to_device, consts)),
      (tuple(map(to_device, xs)), to_device(np.int32(num_requests))),
    ),
    capacities=np.asarray(capacities, np.int32),
    static=dict(
      block_size=block_size,
      waiting_refresh_interval=interval,
      num_keys=_padded_key_count(num_requests, rows),
    ),
    context=(trace, warmup_fraction),
  )


def _checked_outputs(capacities, outputs, num_requests):
  """``[C, R]`` int64 hit tokens and free pages of the ``R =
  num_requests`` real requests, after checking their invariant flags."""
  hits, free, bad = (np.asarray(x)[:, :num_requests] for x in outputs)
  if bad.any():
    c, r = (int(i[0]) for i in np.nonzero(bad))
    raise RuntimeError(
      f"internal error: request {r} broke a pool invariant at capacity "
      f"{capacities[c]}"
    )
  return np.asarray(hits, np.int64), np.asarray(free, np.int64)


def _points(prepared: Prepared, capacities, outputs):
  trace, warmup_fraction = prepared.context
  hits, _ = _checked_outputs(capacities, outputs, len(trace))
  return frame.points_of_requests(
    SGLANG_POLICY,
    capacities,
    prepared.static["block_size"],
    hits,
    trace.input_lengths,
    warmup_fraction,
  )


def _check(trace: Trace, block_size, capacities, warmup_fraction):
  if not isinstance(trace, Trace):
    raise TypeError(f"trace must be a Trace, got {type(trace).__name__}")
  check_block_size(block_size)
  frame.check_warmup_fraction(warmup_fraction)
  if len(trace) == 0:
    raise ValueError(f"trace {trace.name!r} has no requests")
  if not trace.has_token_ids:
    if not trace.has_hash_ids:
      raise ValueError(
        f"trace {trace.name!r} has neither token ids nor hash ids: "
        "SGLang-semantics replay needs page identities"
      )
    if trace.hash_block_size != block_size:
      raise ValueError(
        f"block_size={block_size} differs from the trace's hash block size "
        f"{trace.hash_block_size}: hash ids name pages of that size only"
      )
  if (trace.input_lengths < 1).any():
    bad = int(np.argmin(trace.input_lengths))
    raise ValueError(
      f"request {bad} has input_length={int(trace.input_lengths[bad])}; "
      "SGLang needs a non-empty prompt"
    )
  capacities = frame.check_capacities(capacities)
  totals = trace.kv_tokens
  need, biggest = frame.largest_request_blocks(trace, block_size)
  for capacity in capacities:
    if capacity < need:
      raise ValueError(
        f"capacity={capacity} pages cannot hold the largest request "
        f"(request {biggest}: {int(totals[biggest])} tokens with KV need "
        f"{need} pages of {block_size} tokens)"
      )
  return capacities


def hits_and_free(
  trace: Trace,
  block_size: int,
  capacities,
  *,
  waiting_refresh_interval: int | None = WAITING_REFRESH_INTERVAL,
  bucketed: bool = True,
):
  """``[C, R]`` hit tokens and free pages after each request, for
  arguments :func:`replay_sglang` accepts (``waiting_refresh_interval``
  as there; ``bucketed`` as :data:`ENGINE`'s ``prepare``)."""
  capacities = _check(trace, block_size, capacities, 0.0)
  prepared = ENGINE.prepare(
    trace,
    capacities,
    block_size=int(block_size),
    waiting_refresh_interval=waiting_refresh_interval,
    bucketed=bucketed,
  )
  outputs, _ = frame.compile_and_run(ENGINE, prepared)
  return _checked_outputs(capacities, outputs, len(trace))


def replay_sglang(
  trace: Trace,
  *,
  block_size: int,
  capacities: Sequence[int],
  warmup_fraction: float = 0.5,
  waiting_refresh_interval: int | None = WAITING_REFRESH_INTERVAL,
  devices=None,
) -> ReplayResult:
  """Replays a trace with SGLang 0.5.23 ``RadixCache`` semantics.

  Requests run one at a time, in order, through a pool of ``capacity``
  pages of ``block_size`` tokens holding the radix tree, the running
  request's own pages and free pages (see the module docstring for every
  rule and the SGLang file it follows). By default SGLang's FCFS
  scheduler refreshes waiting prefixes (``schedule_policy.py
  _touch_waiting_prefixes``, ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH`` on):
  requests ``0, 32, 64, ...`` first match their whole page-aligned prompt,
  which can change which leaves LRU evicts. Hits equal those of
  ``tests/reference_models/sglang_radix.py``'s ``SglangRadixCache(
  capacity, page_size=block_size, waiting_refresh_interval=...)`` with the
  same interval, request for request.

  SGLang 0.5.23's default ``UnifiedRadixCache`` behaves as the plain
  ``RadixCache`` this replays for a full-attention model (see the module
  docstring). Not modelled: the overlap scheduler, batching, chunked
  prefill or admission reservations.

  Args:
    trace: a token-id trace (generated workloads, token-id JSONL; output
      token ids, when known, fill pages a later prompt can hit) or a
      hash-id trace (Mooncake; ``block_size`` must be its hash block size).
      Token ids are used when a trace has both.
    block_size: tokens per page (SGLang's ``page_size``).
    capacities: usable pages in the pool; each must hold the largest
      request (``ceil((P + max(O, 1) - 1) / block_size)`` pages).
    warmup_fraction: share of requests before hits are counted.
    waiting_refresh_interval: every how many requests (from request 0) the
      waiting-prefix refresh runs: SGLang 0.5.23's 32 by default
      (:data:`WAITING_REFRESH_INTERVAL`); ``None`` turns it off (SGLang
      with ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH=0``). Static: each value
      compiles its own program.

  Returns:
    A :class:`~prefixjax.replay.frame.ReplayResult`: one point per
    capacity, in order, with policy ``"lru_leaf"`` (never underfilled),
    and the timing.

  Raises:
    ValueError: no page identities, a hash block size other than
      ``block_size``, an empty prompt, a bad size or fraction, a capacity
      too small for the largest request, or a ``waiting_refresh_interval``
      that is neither ``None`` nor an int >= 1.
    TypeError: a size that is not an int.

  Example:
    >>> import numpy as np
    >>> from prefixjax.workloads import Trace
    >>> trace = Trace([0.0, 1.0], [8, 9], [1, 1],
    ...               hash_ids=[np.array([1, 2]), np.array([1, 2, 3])],
    ...               hash_block_size=4)
    >>> [p.per_request_hit_tokens.tolist() for p in replay_sglang(
    ...     trace, block_size=4, capacities=[3, 8], warmup_fraction=0.0)]
    [[0, 8], [0, 8]]
  """
  capacities = _check(trace, block_size, capacities, warmup_fraction)
  prepared = ENGINE.prepare(
    trace,
    capacities,
    block_size=int(block_size),
    warmup_fraction=warmup_fraction,
    waiting_refresh_interval=waiting_refresh_interval,
    bucketed=True,
  )
  return frame.execute(ENGINE, prepared, capacities, devices)


ENGINE = ReplayEngine(
  name="sglang",
  semantics="sglang",
  policies=(SGLANG_POLICY,),
  batching=Batching.PER_CAPACITY,
  prepare=_prepare,
  run=_run,
  points=_points,
)
"""SGLang 0.5.23 ``RadixCache`` semantics, one capacity per run
(``prepare`` takes ``waiting_refresh_interval`` as :func:`replay_sglang`)."""
