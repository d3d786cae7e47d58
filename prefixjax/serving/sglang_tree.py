"""The trace and the radix tree of :mod:`prefixjax.serving.sglang_engine`.

:class:`Consts` is the trace on device: every request's page path (pages are
trie nodes of whole page prefixes, page 0 the root), each page's parent and
depth, and the per-request facts the scheduler reads; :func:`prepare` builds
it on the host. :class:`Tree` is SGLang 0.5.23's paged ``RadixCache``
(``srt/mem_cache/radix_cache.py``) over those pages plus the page pool, and
the functions below are its verbs (match with splits, insert, lock, LRU
eviction of whole leaf nodes), each touching one request's path (``O(M)``)
except the eviction's choice of leaf (``O(sqrt V)`` from per-group lower
bounds, ``O(V)`` in vmapped engines; :func:`_evict`). The rules are checked
through the engine against ``tests/reference_models/sglang_scheduler.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax._masked import barrier, take

__all__ = [
  "IN_BATCH",
  "Consts",
  "Tree",
  "dfs_order_key",
  "evict_for",
  "evictable_tokens",
  "i32",
  "insert",
  "lock_path",
  "locked_path_evictable",
  "lru_groups",
  "prepare",
  "walk",
]

IN_BATCH = 32  # IN_BATCH_PREFIX_CACHING_{CHECK,DEPRIORITIZE}_THRESHOLD
_BIG = np.iinfo(np.int32).max


class Consts(NamedTuple):
  pages: jax.Array  # [R, M] int32, -1 past the request's full pages
  parent: jax.Array  # [V] int32
  depth: jax.Array  # [V] int32
  prompt: jax.Array  # [R] int32
  max_new: jax.Array  # [R] int32
  arrival: jax.Array  # [R] int32 step, _BIG for a rejected request
  arr_rank: jax.Array  # [R] int32 rank of (arrival, rid)
  g32: jax.Array  # [R] int32 group of the first 32 tokens, -1 if shorter
  arr_ms: jax.Array  # [R] int32 arrival ms (a timed clock)
  arr_frac: jax.Array  # [R] float32 its fraction
  tin: jax.Array  # [V] int32 pre-order number of the page in the whole trie
  tout: jax.Array  # [V] int32 the last pre-order number of its subtree
  client: jax.Array  # [R] int32 dense client id (``fair``), 0 by default
  pv: jax.Array  # [R] int32 priority, higher first (``priority``), 0 default


def page_trie(prompts, outputs, max_new, page_size: int) -> dict:
  """The trace's page trie on the host (what :func:`prepare` computes from
  the tokens and the page size alone, so runs over one trace at other
  arrivals can share it): ``pages`` ``[R, M]``, ``parent``, ``depth``,
  ``tin``, ``tout`` ``[V]`` and ``g32`` ``[R]``, numpy arrays.

  A page is a trie node of a whole page prefix (page 0 the root); nodes
  are numbered by first appearance, request by request and page by page
  (the eviction's ties go to the smaller number). Vectorized: every page
  occurrence gets a hash of its prefix, checked exactly (a shared hash
  must mean the same page tokens, depth and parent node), with an exact
  sort level by level in the unlikely case it is not
  (``tests/test_sglang_trie.py`` compares both with a plain dict walk)."""
  K = page_size
  R = len(prompts)
  max_new = np.asarray(max_new, np.int64).reshape(-1)
  plen = np.fromiter((len(p) for p in prompts), np.int64, count=R)
  # the committed tokens' full pages: prompt + max_new - 1 tokens
  n = np.maximum((plen + max_new - 1) // K, 0)
  off = np.zeros((R + 1,), np.int64)
  np.cumsum(n, out=off[1:])
  P = int(off[-1])
  seqs, heads, with_head = [], [], []
  for r in range(R):
    seq = np.concatenate(
      [np.asarray(prompts[r], np.int64), np.asarray(outputs[r], np.int64)]
    )[: int(plen[r] + max_new[r])]
    seqs.append(seq[: int(n[r]) * K])
    if seq.shape[0] >= IN_BATCH:
      heads.append(seq[:IN_BATCH])
      with_head.append(r)
  g32 = np.full((R,), -1, np.int32)
  if heads:
    g32[np.asarray(with_head)] = _row_ids(np.stack(heads))
  rows = np.concatenate(seqs + [np.zeros((0,), np.int64)]).reshape(P, K)
  rid = np.repeat(np.arange(R), n)
  j = np.arange(P) - off[rid]  # each occurrence's page index
  node = _hashed_nodes(rows, j, off[rid])
  if node is None:
    node = _sorted_nodes(rows, n, off)
  first = _first_of(node)
  V = first.shape[0] + 1
  parent = np.zeros((V,), np.int64)
  parent[1:] = np.where(j[first] > 0, node[np.maximum(first - 1, 0)] + 1, 0)
  depth = np.zeros((V,), np.int64)
  depth[1:] = j[first]
  pages = np.full((R, max(1, int(n.max(initial=0)))), -1, np.int32)
  pages[rid, j] = node + 1
  tin, tout = _euler(parent, depth)
  return dict(
    pages=pages,
    parent=parent.astype(np.int32),
    depth=depth.astype(np.int32),
    tin=tin,
    tout=tout,
    g32=g32,
  )


def _by_first(inv: np.ndarray, first: np.ndarray) -> np.ndarray:
  """Ids ``inv`` (of classes whose first members are ``first``) renumbered
  in the order of their first members."""
  rank = np.empty_like(first)
  rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
  return rank[inv.reshape(-1)]


def _first_of(node: np.ndarray) -> np.ndarray:
  """The first index of each id of ``node``, ids numbered by first
  appearance (so each first one is above every id before it)."""
  seen = np.maximum.accumulate(np.concatenate([[-1], node[:-1]]))
  return np.flatnonzero(node > seen)


def _row_ids(rows: np.ndarray) -> np.ndarray:
  """Ids of the distinct rows of a 2-D integer array, numbered by first
  appearance (an exact sort of the rows' bytes)."""
  rows = np.ascontiguousarray(rows)
  if rows.shape[0] == 0:
    return np.zeros((0,), np.int64)
  whole = np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))
  _, first, inv = np.unique(
    rows.view(whole)[:, 0], return_index=True, return_inverse=True
  )
  return _by_first(inv, first)


def _hashed_nodes(rows, j, start):
  """Each page occurrence's node (ids by first appearance), or ``None``
  when two different prefixes share a hash. ``rows`` ``[P, K]`` the
  occurrences' tokens, request by request; ``j`` their page index;
  ``start`` the index of their request's first occurrence.

  A page's hash mixes its ``K`` tokens; a prefix's is the sum over its
  pages of page hash times ``B ** j`` (mod 2**64, a ``cumsum`` within each
  request), with the depth mixed in. The check: every occurrence has its
  class's first occurrence's tokens, depth and parent node, so, by
  induction on the depth, its whole prefix."""
  P, K = rows.shape
  if P == 0:
    return np.zeros((0,), np.int64)
  mix = np.random.default_rng(_HASH_SEED).integers(
    1, 2**63, size=(K,), dtype=np.uint64
  ) | np.uint64(1)
  powers = np.cumprod(
    np.full((int(j.max()) + 1,), _HASH_BASE, np.uint64), dtype=np.uint64
  )
  with np.errstate(over="ignore"):
    h = (rows.view(np.uint64) * mix).sum(axis=1, dtype=np.uint64)
    h = (h ^ (h >> np.uint64(31))) * np.uint64(_HASH_BASE)
    cs = np.cumsum(h * powers[j], dtype=np.uint64)
    key = cs - np.where(start > 0, cs[start - 1], np.uint64(0))
    key ^= j.astype(np.uint64) * np.uint64(_HASH_DEPTH)
  _, first, inv = np.unique(key, return_index=True, return_inverse=True)
  inv = inv.reshape(-1)
  rep = first[inv]  # each occurrence's class's first occurrence
  deep = j > 0
  same = (
    np.array_equal(j, j[rep])
    and np.array_equal(inv[np.flatnonzero(deep) - 1], inv[rep[deep] - 1])
    and np.array_equal(rows, rows[rep])
  )
  return _by_first(inv, first) if same else None


_HASH_SEED = 20261207
_HASH_BASE = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_HASH_DEPTH = 0xD6E8FEB86659FD93


def _sorted_nodes(rows, n, off):
  """:func:`_hashed_nodes` by exact sorts: the pages' tokens to ids, then
  one level of pages at a time, ``(parent node, page tokens)`` to ids."""
  R, P = n.shape[0], rows.shape[0]
  content = _row_ids(rows)
  C = int(content.max(initial=-1)) + 1
  node = np.zeros((R,), np.int64)  # each request's node, dense per level
  where = np.empty((P,), np.int64)
  for level in range(int(n.max(initial=0))):
    act = np.flatnonzero(n > level)
    at = off[act] + level
    _, inv = np.unique(node[act] * C + content[at], return_inverse=True)
    node[act] = inv.reshape(-1)
    where[at] = level * P + node[act]  # distinct across levels
  _, first, inv = np.unique(where, return_index=True, return_inverse=True)
  return _by_first(inv, first)


def prepare(
  prompts,
  outputs,
  max_new,
  arrival_steps,
  rejected,
  page_size: int,
  arrival_ms=None,
  arrival_frac=None,
  sort_by=None,
  client=None,
  pv=None,
  trie=None,
) -> Consts:
  """Host side: page paths, first-32-token groups and arrival ranks.

  Args:
    prompts: ``R`` prompt token sequences.
    outputs: ``R`` output token sequences (at least ``max_new`` long).
    max_new: ``[R]`` outputs each request samples (>= 1).
    arrival_steps: ``[R]`` arrival step.
    rejected: ``[R]`` bool, requests refused at arrival.
    page_size: ``K``.
    arrival_ms, arrival_frac: ``[R]`` a timed clock's arrival times (ms
      and its fraction); zeros by default.
    sort_by: ``[R]`` the arrival order's key (default ``arrival_steps``);
      ties go by rid.
    client: ``[R]`` dense client ids in ``0 .. R - 1`` (the ``fair``
      policy's clients); all 0 by default.
    pv: ``[R]`` the ``priority`` policy's priorities, signed so that
      higher values go first (``|pv| < 2**30``); all 0 by default.
    trie: :func:`page_trie` of these tokens and page size, when the
      caller keeps it (default: computed here).
  """
  R = len(prompts)
  if trie is None:
    trie = page_trie(prompts, outputs, max_new, page_size)
  arrival = np.where(
    np.asarray(rejected, bool), _BIG, np.asarray(arrival_steps, np.int64)
  ).astype(np.int32)
  key = arrival if sort_by is None else np.asarray(sort_by)
  order = np.lexsort((np.arange(R), key))
  rank = np.empty((R,), np.int32)
  rank[order] = np.arange(R, dtype=np.int32)
  return Consts(
    pages=to_device(trie["pages"]),
    parent=to_device(trie["parent"]),
    depth=to_device(trie["depth"]),
    prompt=to_device(np.asarray([len(p) for p in prompts], np.int32)),
    max_new=to_device(np.asarray(max_new, np.int32)),
    arrival=to_device(arrival),
    arr_rank=to_device(rank),
    g32=to_device(trie["g32"]),
    arr_ms=to_device(
      np.zeros((R,), np.int32) if arrival_ms is None else arrival_ms, jnp.int32
    ),
    arr_frac=to_device(
      np.zeros((R,), np.float32) if arrival_frac is None else arrival_frac,
      jnp.float32,
    ),
    tin=to_device(trie["tin"]),
    tout=to_device(trie["tout"]),
    client=to_device(
      np.zeros((R,), np.int32) if client is None else client, jnp.int32
    ),
    pv=to_device(np.zeros((R,), np.int32) if pv is None else pv, jnp.int32),
  )


def _euler(parent: np.ndarray, depth: np.ndarray):
  """Pre-order numbers of a trie (page 0 the root, its children at depth
  0; siblings in id order): ``(tin, tout)``, a page's subtree is
  ``tin[v] .. tout[v]``. One pass per level, bottom up for the subtree
  sizes, top down for the numbers."""
  V = parent.shape[0]
  level = depth + 1
  level[0] = 0
  by = np.argsort(level, kind="stable")  # ids increasing within a level
  cuts = np.searchsorted(level[by], np.arange(int(level.max()) + 2))
  size = np.ones((V,), np.int64)
  for d in range(cuts.shape[0] - 2, 0, -1):
    vs = by[cuts[d] : cuts[d + 1]]
    np.add.at(size, parent[vs], size[vs])
  tin = np.zeros((V,), np.int64)
  for d in range(1, cuts.shape[0] - 1):
    vs = by[cuts[d] : cuts[d + 1]]
    vs = vs[np.lexsort((vs, parent[vs]))]  # by parent, then id
    p = parent[vs]
    total = np.cumsum(size[vs])
    head = np.r_[True, p[1:] != p[:-1]]
    # the sizes of the earlier siblings: the running total since the
    # parent's first child
    at = np.maximum.accumulate(np.where(head, np.arange(vs.shape[0]), 0))
    before = total - size[vs] - np.where(at > 0, total[at - 1], 0)
    tin[vs] = tin[p] + 1 + before
  return tin.astype(np.int32), (tin + size - 1).astype(np.int32)


# ----------------------------------------------------------------- the tree
class Tree(NamedTuple):
  """The radix tree and the page pool. Node fields live at a node's first
  page: ``ts`` last access, ``lock`` lock count, ``nend`` the depth its
  pages end at (exclusive), ``rep`` a request whose path holds all its
  pages, ``kids`` its child nodes. ``born`` (every page) orders a node's
  children as SGLang's ``children`` dict does, by insertion: a split puts
  the upper part in the lower part's place, so a child's place is the time
  its first page was inserted."""

  cached: jax.Array  # [V] bool
  nstart: jax.Array  # [V] int32 first page of the node holding each page
  ts: jax.Array  # [V] int32
  lock: jax.Array  # [V] int32
  nend: jax.Array  # [V] int32
  rep: jax.Array  # [V] int32
  kids: jax.Array  # [V] int32
  born: jax.Array  # [V] int32 the time each cached page joined the tree
  evictable: jax.Array  # pages in unlocked nodes
  clock: jax.Array
  free: jax.Array  # free pages
  private: jax.Array  # pages held by requests only
  evicted: jax.Array  # pages evicted so far (the evictions metric)
  gmin: jax.Array  # [G] int32 a lower bound of each page group's LRU key


def lru_groups(v_len: int) -> tuple[int, int]:
  """``(B, G)``: the eviction index splits the ``V`` pages into ``G``
  groups of ``B`` consecutive pages, ``B`` the power of two at most
  ``sqrt(V)`` (16 at least), so a victim costs ``O(sqrt V)``."""
  b = 1 << max(4, math.isqrt(max(v_len, 1)).bit_length() - 1)
  return b, -(-v_len // b)


def _one(t: Tree) -> bool:
  """Whether ``t`` is one engine's tree, which keeps the LRU index
  (``gmin``), not a vmapped engine's (see :func:`_evict`). Only then do
  :func:`_evict` use the index, :func:`dfs_order_key` sort the weighing
  pages apart and :func:`prefixjax._masked.take` read a path by its loop."""
  return t.gmin.shape[0] > 0


def _lower(t: Tree, pages, keys, ok):
  """``gmin[page // B] = min(gmin, key)`` where ``ok``: a page that may have
  become an eviction candidate (a new or unlocked leaf, a node whose last
  child left) lowers its group's bound to its time. A bound may stay below
  its group's true minimum (a candidate since touched, locked or evicted);
  :func:`_evict` raises it when it picks that group."""
  if not _one(t):  # no index (see :func:`_evict`)
    return t
  b, g = lru_groups(t.cached.shape[0])
  return t._replace(
    gmin=t.gmin.at[jnp.where(ok, pages // b, g)].min(keys, mode="drop")
  )


def i32(x):
  return jnp.asarray(x, jnp.int32)


def _path(c: Consts, r):
  p = c.pages[r]
  return p, jnp.maximum(p, 0)


def _put(a, idx, v, ok):
  """``a[idx] = v`` where ``ok`` (a masked scatter, no select over ``a``)."""
  return a.at[jnp.where(ok, idx, a.shape[0])].set(v, mode="drop")


def _leading(t: Tree, c: Consts, r, n):
  """Pages of ``r``'s path among its first ``n`` that the tree holds."""
  p, pv = _path(c, r)
  j = jnp.arange(p.shape[0])
  ok = (j < n) & (p >= 0) & t.cached[pv]
  return i32(jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)])))


def walk(t: Tree, c: Consts, r, n, do=True):
  """``_match_prefix_helper`` over ``r``'s first ``n`` pages (when ``do``):
  every node walked gets a new time; a node the walk ends inside is split,
  its upper part a new node with a later time. Returns (pages, tree).

  Every read passes :func:`prefixjax._masked.barrier` before the writes,
  one masked scatter per array, so XLA:CPU updates the arrays in place."""
  do = jnp.asarray(do)
  p, pv = _path(c, r)
  V = t.cached.shape[0]
  M = p.shape[0]
  j = jnp.arange(M)
  h = jnp.where(do, _leading(t, c, r, n), 0)
  (ns_path,) = take(pv, t.nstart, loop=_one(t))
  x = jnp.where(h > 0, ns_path[jnp.maximum(h - 1, 0)], 0)
  h, ns_path, x, nend_x, rep_x, lock_x, kids_x = barrier(
    h, h, ns_path, x, t.nend[x], t.rep[x], t.lock[x], t.kids[x]
  )
  now = t.clock + 1
  split = do & (h > 0) & (nend_x > h)
  row = c.pages[rep_x]
  low = row[jnp.minimum(h, M - 1)]
  clock = now - 1 + do.astype(jnp.int32) + split.astype(jnp.int32)
  start = do & (j < h) & (ns_path == pv) & ~(split & (pv == x))
  ts_idx = jnp.concatenate([jnp.where(start, pv, V), jnp.stack([x, low])])
  ts_val = jnp.concatenate(
    [jnp.full((M,), now, jnp.int32), jnp.stack([clock, now])]
  )
  ts_ok = jnp.concatenate([start, jnp.stack([split, split])])
  lower = split & (j >= h) & (j < nend_x)
  two = jnp.stack([low, x])
  t = t._replace(
    nstart=t.nstart.at[jnp.where(lower, jnp.maximum(row, 0), V)].set(
      low, mode="drop"
    ),
    ts=t.ts.at[jnp.where(ts_ok, ts_idx, V)].set(ts_val, mode="drop"),
    lock=_put(t.lock, low, lock_x, split),
    nend=t.nend.at[jnp.where(split, two, V)].set(
      jnp.stack([nend_x, h]), mode="drop"
    ),
    rep=_put(t.rep, low, rep_x, split),
    kids=t.kids.at[jnp.where(split, two, V)].set(
      jnp.stack([kids_x, jnp.int32(1)]), mode="drop"
    ),
    clock=clock,
  )
  return h, _lower(t, low, now, split)


def insert(t: Tree, c: Consts, r, n, do=True):
  """``_insert_helper`` (when ``do``): (pages already there, tree); the rest
  of ``r``'s first ``n`` pages become one new, unlocked leaf."""
  do = jnp.asarray(do)
  h, t = walk(t, c, r, n, do)
  p, pv = _path(c, r)
  V = t.cached.shape[0]
  j = jnp.arange(p.shape[0])
  parent = jnp.where(h > 0, t.nstart[pv[jnp.maximum(h - 1, 0)]], 0)
  # h through the barrier too: the writes below then come after the nstart
  # and kids reads (else XLA:CPU copies the V-sized nstart to keep them)
  h, parent, kids_parent = barrier(h, h, parent, t.kids[parent])
  grow = do & (h < n)
  new = grow & (j >= h) & (j < n)
  first = pv[jnp.minimum(h, p.shape[0] - 1)]
  clock = t.clock + grow.astype(jnp.int32)
  idx = jnp.where(new, pv, V)
  size = jnp.where(grow, n - h, 0)
  two = jnp.stack([first, parent])
  t = t._replace(
    cached=t.cached.at[idx].set(True, mode="drop"),
    nstart=t.nstart.at[idx].set(first, mode="drop"),
    born=t.born.at[idx].set(clock, mode="drop"),
    ts=_put(t.ts, first, clock, grow),
    lock=_put(t.lock, first, 0, grow),
    nend=_put(t.nend, first, n, grow),
    rep=_put(t.rep, first, r, grow),
    kids=t.kids.at[jnp.where(grow, two, V)].set(
      jnp.stack([jnp.int32(0), kids_parent + 1]), mode="drop"
    ),
    evictable=t.evictable + size,
    clock=clock,
  )
  return jnp.where(do, h, 0), _lower(t, first, clock, grow)


def lock_path(t: Tree, c: Consts, r, n, delta):
  """Adds ``delta`` to the lock count of every node on ``r``'s first ``n``
  pages (SGLang's ``inc_lock_ref`` / ``dec_lock_ref`` of its last node)."""
  p, pv = _path(c, r)
  V = t.cached.shape[0]
  j = jnp.arange(p.shape[0])
  unlock = (t.ts,) if delta < 0 else ()  # times, for the LRU bounds
  nstart, before, nend, depth, *ts = take(
    pv, t.nstart, t.lock, t.nend, c.depth, *unlock, loop=_one(t)
  )
  start = (j < n) & (nstart == pv)
  size = nend - depth
  start, before, size, *ts = barrier(n, start, before, size, *ts)
  flip = start & (before == (0 if delta > 0 else 1))
  moved = jnp.sum(jnp.where(flip, size, 0), dtype=jnp.int32)
  t = t._replace(
    lock=t.lock.at[jnp.where(start, pv, V)].add(delta, mode="drop"),
    evictable=t.evictable - moved if delta > 0 else t.evictable + moved,
  )
  return _lower(t, pv, ts[0], flip) if delta < 0 else t


def locked_path_evictable(t: Tree, c: Consts, r, n):
  """Evictable pages if ``r``'s first ``n`` pages were locked too."""
  p, pv = _path(c, r)
  j = jnp.arange(p.shape[0])
  nstart, lock, nend, depth = take(
    pv, t.nstart, t.lock, t.nend, c.depth, loop=_one(t)
  )
  start = (j < n) & (nstart == pv) & (lock == 0)
  size = nend - depth
  return t.evictable - jnp.sum(jnp.where(start, size, 0), dtype=jnp.int32)


def evictable_tokens(t: Tree, K):
  return K * t.evictable


def _evict(t: Tree, c: Consts, K, need):
  """``RadixCache.evict``: whole LRU unlocked leaves until ``need`` tokens.

  The victim is the candidate (a cached, unlocked, childless node start,
  not the root) of smallest time, the first such page on ties, as an
  ``argmin`` over all ``V`` pages would pick it. ``gmin`` bounds each
  group's smallest candidate time from below: a trip takes the group of
  smallest bound (the first on ties) and that group's true minimum; if it
  equals the bound, no other group can hold a smaller time (nor an equal
  one at a smaller page), so its first minimum is the victim; else the
  trip raises the bound and looks again. ``O(G + B)`` a trip instead of
  ``O(V)``. A tree with no bounds (``G = 0``: vmapped engines, where every
  trip costs a select of the whole tree per lane, so the repair trips
  would cost more than the scans) takes the ``argmin`` over all pages."""
  V = t.cached.shape[0]
  B, _ = lru_groups(V)
  W = min(B, V)  # the window read (B, but for a trie of under 16 pages)
  b = jnp.arange(W)
  M = c.pages.shape[1]
  j = jnp.arange(M)

  def indexed(t):
    # the group and its bound read before the bound's write (barrier)
    g = i32(jnp.argmin(t.gmin))
    g, bound_g = barrier(g, g, t.gmin[g])
    # the group's pages as one window of B (the last group's shifted back
    # to end at V, its lanes before the group masked): dynamic slices, not
    # gathers, which XLA:CPU splits over threads from large arrays (see
    # prefixjax._masked.take)
    at = jnp.minimum(g * B, V - W)
    v = at + b
    cached, nstart, kids, lock, ts = (
      jax.lax.dynamic_slice_in_dim(a, at, W)
      for a in (t.cached, t.nstart, t.kids, t.lock, t.ts)
    )
    cand = (
      (v >= g * B) & cached & (nstart == v) & (v != 0) & (kids == 0)
      & (lock == 0)
    )  # fmt: skip
    key = jnp.where(cand, ts, _BIG)
    k = i32(jnp.argmin(key))
    low = key[k]
    exact = low == bound_g
    ok = exact & (low < _BIG)
    # the group's bound: its true minimum, without the victim if one goes
    bound = jnp.where(ok, jnp.min(jnp.where(b == k, _BIG, key)), low)
    return v[k], ok, ok | ~exact, t._replace(gmin=t.gmin.at[g].set(bound))

  def scan(t):
    v = jnp.arange(V)
    cand = t.cached & (t.nstart == v) & (v != 0) & (t.kids == 0) & (t.lock == 0)
    x = i32(jnp.argmin(jnp.where(cand, t.ts, _BIG)))
    return x, cand[x], cand[x], t

  def cond(s):
    t, ev, more = s
    return (ev * K < need) & more

  def body(s):
    t, ev, _ = s
    x, ok, more, t = indexed(t) if _one(t) else scan(t)
    parent = t.nstart[c.parent[x]]
    x, ok, rep_x, nend_x, parent, kids_parent, ts_parent = barrier(
      x, x, ok, t.rep[x], t.nend[x], parent, t.kids[parent], t.ts[parent]
    )
    row = c.pages[rep_x]
    mine = ok & (j >= c.depth[x]) & (j < nend_x)
    cnt = jnp.where(ok, nend_x - c.depth[x], 0)
    t = t._replace(
      cached=t.cached.at[jnp.where(mine, jnp.maximum(row, 0), V)].set(
        False, mode="drop"
      ),
      kids=_put(t.kids, parent, kids_parent - 1, ok),
      evictable=t.evictable - cnt,
      free=t.free + cnt,
      evicted=t.evicted + cnt,
    )
    # the parent may be a leaf now
    t = _lower(t, parent, ts_parent, ok & (kids_parent == 1))
    return t, ev + cnt, more

  t, _, _ = jax.lax.while_loop(cond, body, (t, i32(0), jnp.bool_(True)))
  return t


def evict_for(t: Tree, c: Consts, K, demand):
  """``evict_to_free_tokens``: evict the shortfall of ``demand`` tokens."""
  return _evict(t, c, K, demand - t.free * K)


def dfs_order_key(t: Tree, c: Consts, waiting, node):
  """``mem_cache/base_prefix_cache.py _dfs_weight_order`` (SGLang 0.5.23)
  as a sort key: the position of each waiting request (``waiting [R]``,
  its match ending at page ``node [R]``, 0 the root) in the DFS-weight
  order, before ties (requests ending at the same page keep queue order).

  A page's weight ``w`` is the waiting requests ending in its subtree
  (prefix sums over the static pre-order ``tin``); a node's children go by
  decreasing weight, ties by ``born``; the requests ending at a node come
  after its whole subtree. So a subtree takes the positions ``start ..
  start + w`` with ``start(v) = start(parent) + w`` of the siblings before
  ``v``; its own requests the last of them. Pages inside a node have one
  cached child and uncached pages weigh 0, so working on pages gives the
  nodes' order.

  Only the pages that weigh (a waiting request's match ends in their
  subtree) matter: a weighing page's start counts its siblings that weigh
  as much or more, and every ancestor of a weighing page weighs. When at most
  :data:`DFS_PAGES` pages weigh (a run's usual case: waiting requests'
  matches share a few prefixes), they are gathered first and sorted alone,
  ``O(V)`` plus ``O(D log D)`` for ``D`` of them; else (and in vmapped
  engines) all ``V`` pages are sorted, ``O(V log V)``.
  """
  v_len = c.parent.shape[0]
  node = jnp.where(waiting, node, 0)
  own = (
    jnp.zeros((v_len,), jnp.int32)
    .at[jnp.where(waiting, node, v_len)]
    .add(1, mode="drop")
  )
  csum = jnp.cumsum(jnp.zeros((v_len,), jnp.int32).at[c.tin].set(own))
  w = csum[c.tout] - jnp.where(c.tin > 0, csum[jnp.maximum(c.tin - 1, 0)], 0)

  def key(pages):
    start, at = _dfs_starts(t, c, w, pages)
    return start[at[node]] + w[node] - own[node]

  if DFS_PAGES >= v_len or not _one(t):
    # (no LRU index: a vmapped engine, where a batched cond runs both ways)
    return key(None)
  few = jnp.sum(w > 0, dtype=jnp.int32) <= DFS_PAGES
  pages = jnp.nonzero(w > 0, size=DFS_PAGES, fill_value=v_len)[0]
  return jax.lax.cond(few, lambda: key(i32(pages)), lambda: key(None))


DFS_PAGES = 4096
"""Most weighing pages :func:`dfs_order_key` sorts apart from the rest."""


def _dfs_starts(t: Tree, c: Consts, w, pages):
  """:func:`dfs_order_key`'s start positions of ``pages`` (``[D]`` ids, ``V``
  for none; ``None``: every page): ``(start [D], at [V] each page's lane)``.
  A page's gap is the weight of its siblings before it in ``(-w, born,
  id)`` order; its start the sum of the gaps of it and its ancestors
  (pointer jumping, ``log2`` of the depth rounds)."""
  v_len = c.parent.shape[0]
  rounds = max(c.pages.shape[1], 1).bit_length()  # 2^rounds > the deepest
  every = pages is None
  if every:
    pages = jnp.arange(v_len, dtype=jnp.int32)
    valid = jnp.ones((v_len,), bool)
  else:
    valid = pages < v_len
  d = pages.shape[0]
  lane = jnp.arange(d, dtype=jnp.int32)
  safe = jnp.minimum(pages, v_len - 1)
  root = valid & (safe == 0)
  ws = jnp.where(valid, w[safe], 0)
  par = jnp.where(valid, jnp.where(root, -1, c.parent[safe]), v_len)
  order = jnp.lexsort((pages, jnp.where(valid, t.born[safe], 0), -ws, par))
  ws, ps = ws[order], par[order]
  before = jnp.cumsum(ws) - ws
  head = jnp.concatenate([jnp.ones((1,), bool), ps[1:] != ps[:-1]])
  first = jax.lax.cummax(jnp.where(head, lane, 0))
  gap = jnp.zeros((d,), jnp.int32).at[order].set(before - before[first])
  start = jnp.where(root, 0, gap)
  if every:
    at, up = lane, c.parent
  else:
    at = (
      jnp.zeros((v_len,), jnp.int32)
      .at[jnp.where(valid, pages, v_len)]
      .set(lane, mode="drop")
    )
    up = jnp.where(valid, at[c.parent[safe]], lane)
  for _ in range(rounds):
    start = start + start[up]
    up = up[up]
  return start, at
