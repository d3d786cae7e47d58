"""Plain-Python model of SGLang's paged ``RadixCache`` (test oracle).

Page size = block size, LRU eviction (SGLang's default
``--radix-eviction-policy lru``), one request at a time, no chunked prefill,
no speculative decoding, no hierarchical cache, the non-overlap scheduler.
Pages are anonymous: the model tracks how many pages the tree, the running
request and the free list hold, which is all that decides hits.

Sources read (SGLang wheel 0.5.23 from PyPI): ``srt/mem_cache/radix_cache.py``,
``evict_policy.py``, ``common.py``, ``allocation.py``, ``allocator/base.py``,
``base_prefix_cache.py``; ``srt/managers/schedule_batch.py``,
``schedule_policy.py``, ``scheduler_components/batch_result_processor.py``.
(``cache_unfinished_req`` / ``cache_finished_req`` of older releases are
``checkpoint`` / ``release_kv_cache`` there.) Every rule names its source.

Checked against the real code: ``tests/test_reference_models.py::
test_sglang_model_matches_real_sglang`` (runs only where SGLang imports)
drives SGLang 0.5.23's own ``RadixCache``, ``PagedTokenToKVPoolAllocator``,
``alloc_paged_token_slots_extend`` / ``_decode``, ``alloc_token_slots``,
``checkpoint`` and ``free_kv_row`` the way the scheduler does and compares
hits, free pages and evictable size after every request. Longer runs of the
same driver (about 17,000 requests with heavy eviction) also agreed on tree
shapes and lock counts; a separate run of random ``match_prefix`` /
``insert`` / lock / ``evict`` calls agreed on tree shape, sizes and evicted
tokens over 54,000 operations, so the logical clock orders eviction as
``time.monotonic()`` does.

Rules
-----
- Keys. ``radix_cache.py RadixKey.child_key`` / ``match``: nodes are keyed by
  their first page, namespaced by ``extra_key`` (and ``cache_salt``), so equal
  tokens with different extra keys never share a node; matches are rounded
  down to whole pages (``page_aligned``). Here a page key is
  ``(extra, tuple(page tokens))`` and the tree works on page-key sequences.
- Hit cap. ``schedule_batch.py Req.init_next_round_input`` /
  ``_compute_max_prefix_len``: the match key is limited to
  ``input_len - 1`` tokens ("at most 1 less than the input length"), then
  ``RadixCache.match_prefix`` page-aligns it: hit <=
  ``(P - 1) // page_size * page_size``.
- Match. ``RadixCache._match_prefix_helper``: one timestamp ``t``; the root
  and every child walked get ``last_access_time = t`` -- including a child the
  key ends inside, which is then split (``_split_node``): the new upper part
  is a fresh ``TreeNode`` (its own, later, timestamp; it copies ``lock_ref``)
  and the lower part keeps ``t``.
- Insert. ``RadixCache._insert_helper``: same walk and split; the remainder
  becomes one new leaf node (later timestamp) whose size is added to
  ``evictable_size_``; returns the length that was already in the tree.
- Locks. ``inc_lock_ref`` / ``dec_lock_ref``: walk from a node to the root
  (exclusive); a node going 0 -> 1 moves its size from evictable to
  protected, 1 -> 0 back. The root is locked forever.
- Eviction. ``RadixCache.evict``: heap of the unlocked leaves keyed by
  ``evict_policy.py LRUStrategy.get_priority`` = ``last_access_time``; pop,
  free the whole node (every page of it), delete it; if its parent now has
  no children and ``lock_ref == 0`` push the parent. Stop once the evicted
  token count reaches the request (whole nodes: it may overshoot).
  Timestamps come from ``time.monotonic()`` per match / insert / node
  creation; this model uses a logical clock ticking once per such call, so
  times are distinct across calls. Leaves that share a tick cannot occur
  (one match or insert refreshes one root path, on which only the deepest
  node is a leaf). Ties would fall back to the node id (creation order).
- Pool. ``allocator/base.py evict_to_free_tokens`` evicts
  ``shortfall = demand - available_size()`` tokens before an allocation:
    * prefill (``allocation.py alloc_paged_token_slots_extend``): demand =
      ``extend_num_tokens + page_size`` per request, i.e.
      ``(P - hit) + page_size`` tokens, then ``cdiv(P, page) - hit_pages``
      pages are taken; with ``page_size == 1`` ``alloc_for_extend`` calls
      ``alloc_token_slots(extend_num_tokens)`` instead: demand ``P - hit``;
    * each decode step (``alloc_paged_token_slots_decode``): demand =
      ``page_size`` per request *every step*, so whenever no page is free a
      decode step evicts at least one node even if it needs no new page;
      a new page is taken when position ``P + k - 1`` starts a page.
  ``capacity`` counts usable pages (SGLang's padding page is extra).
- The hit prefix is locked at admission (``schedule_policy.py
  PrefillAdder._commit_prefill_admission``: ``tree_cache.lock(last_node)``)
  before the prefill allocation, so it is never evicted by it.
- Publishing. After the prefill of an unfinished request
  (``batch_result_processor.py`` -> ``common.py checkpoint_kv_cache`` ->
  ``RadixCache.checkpoint(req, up_to=P)``) and on finish
  (``release_kv_cache(checkpoint=True)`` -> ``checkpoint(req,
  up_to=owned_kv_len = P + O - 1)``): ``_insert_cache`` inserts the
  page-aligned key; the request's own pages for positions
  ``[cache_protected_len, prefix_len)`` duplicate tree pages and are freed,
  pages past ``prefix_len`` become the new node; with ``split_prompt`` it
  re-inserts the prompt key when ``0 < P//page*page < key_len`` (here only a
  timestamp refresh, the prompt boundary already being a node boundary);
  then ``match_prefix`` of the key (refresh), unlock the old node, lock the
  new last node, ``cache_protected_len = key_len``. On finish
  ``release_kv_cache`` then frees the request's partial last page
  (``free_kv_row`` of ``[cache_protected_len, owned_kv_len)``) and unlocks.
  A request with ``O == 1`` finishes at its prefill: only the final
  checkpoint runs.

Choices of this model (not SGLang rules)
----------------------------------------
- ``O == 0`` is treated as ``O == 1``.
- A request runs iff ``cdiv(P + max(O, 1) - 1, page) <= capacity`` (then the
  allocations above always succeed because everything unlocked can be
  evicted); otherwise :class:`OutOfPages` is raised before any state change.
  SGLang's admission estimates (``max_new_tokens`` reservations) are not
  modelled: a request that physically fits is assumed admitted.
- ``conservative_evict=False`` is a variant, not SGLang: evict only the
  pages an allocation actually needs (prefill ``cdiv(P, page) - hit``
  pages; decode only on steps that start a page).
- ``waiting_refresh_interval=32`` mimics SGLang's default FCFS
  ``schedule_policy.py SchedulePolicy._touch_waiting_prefixes``
  (``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``, on by default): every 32nd
  admission first matches the *uncapped* page-aligned prompt (refresh and
  split), assuming one ``calc_priority`` call per request. Off by default
  because it depends on scheduler-iteration counts.
- The overlap scheduler (SGLang's default) is not modelled: it prepares
  decode step ``k + 1`` (and its eviction) before processing step ``k``'s
  result, e.g. before the post-prefill checkpoint frees duplicate pages.
- ``granularity="page"`` is a variant, not SGLang: every node holds exactly
  one page, so eviction is leaf-LRU per page (for a block-level device
  policy); the default ``"node"`` is SGLang's whole-node eviction.
- Pre-chained ids (Mooncake ``hash_ids``): page ``i`` of the prompt is keyed
  ``("id", extra, hash_id)`` for the ``P // page`` full prompt pages; pages
  that fill during decode get fresh keys ``("fresh", n)`` that never match,
  unless ``all_hashes`` names every full page of the ``P + O - 1`` tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import Literal

PageKey = Hashable
Granularity = Literal["node", "page"]


class OutOfPages(RuntimeError):
  """A request cannot run: it needs more pages than the pool has."""


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def page_keys_for_tokens(
  token_ids: Sequence[int], page_size: int, extra: Hashable = None
) -> list[tuple]:
  """Key of every full page of ``token_ids`` (``RadixKey.child_key``)."""
  return [
    (
      extra,
      tuple(int(t) for t in token_ids[i * page_size : (i + 1) * page_size]),
    )
    for i in range(len(token_ids) // page_size)
  ]


class Node:
  """``radix_cache.py TreeNode`` holding a run of whole pages."""

  __slots__ = ("pages", "children", "parent", "lock_ref", "last_access", "id")

  def __init__(self, node_id: int, tick: int, pages: tuple = ()):
    self.pages: tuple = pages
    self.children: dict[PageKey, Node] = {}
    self.parent: Node | None = None
    self.lock_ref = 0
    self.last_access = tick
    self.id = node_id

  def __repr__(self) -> str:
    return (
      f"Node(id={self.id}, pages={len(self.pages)}, lock={self.lock_ref}, "
      f"t={self.last_access})"
    )


class SglangRadixCache:
  """SGLang ``RadixCache`` + paged allocator, one request at a time."""

  def __init__(
    self,
    capacity_pages: int,
    page_size: int,
    granularity: Granularity = "node",
    conservative_evict: bool = True,
    waiting_refresh_interval: int | None = None,
  ):
    if capacity_pages < 1 or page_size < 1:
      raise ValueError("capacity_pages and page_size must be >= 1")
    if granularity not in ("node", "page"):
      raise ValueError(f"unknown granularity {granularity!r}")
    self.capacity = capacity_pages
    self.page_size = page_size
    self.granularity = granularity
    self.conservative_evict = conservative_evict
    self.waiting_refresh_interval = waiting_refresh_interval
    self._num_requests = 0
    self._clock = 0
    self._ids = itertools.count()
    self.root = self._new_node(())
    self.root.lock_ref = 1  # RadixCache.reset
    self._evictable = 0  # pages (SGLang counts tokens)
    self._protected = 0
    self._private = 0  # pages held by the running request only
    self.num_free_pages = capacity_pages
    self._fresh = itertools.count()
    self.stats = {"evicted_pages": 0, "evicted_nodes": 0}

  # ----------------------------------------------------------------- state
  def _tick(self) -> int:
    self._clock += 1
    return self._clock

  def _new_node(self, pages: tuple) -> Node:
    return Node(next(self._ids), self._tick(), pages)

  def evictable_size(self) -> int:
    """Tokens in unlocked tree nodes (``RadixCache.evictable_size``)."""
    return self._evictable * self.page_size

  def protected_size(self) -> int:
    """Tokens in locked tree nodes (``RadixCache.protected_size``)."""
    return self._protected * self.page_size

  def evictable_pages(self) -> int:
    return self._evictable

  def protected_pages(self) -> int:
    return self._protected

  def cached_pages(self) -> int:
    return self._evictable + self._protected

  def private_pages(self) -> int:
    return self._private

  def nodes(self) -> list[Node]:
    """Every node but the root, parents before children."""
    out, stack = [], list(self.root.children.values())
    while stack:
      n = stack.pop()
      out.append(n)
      stack.extend(n.children.values())
    return out

  def cached_sequences(self) -> list[tuple]:
    """Page-key sequence of every root-to-leaf path (for debugging)."""
    out = []

    def walk(node: Node, prefix: tuple) -> None:
      path = prefix + node.pages
      if not node.children and node is not self.root:
        out.append(path)
      for c in node.children.values():
        walk(c, path)

    walk(self.root, ())
    return out

  def check_invariants(self) -> None:
    ev = pr = 0
    for n in self.nodes():
      assert n.pages and n.parent is not None
      assert n.parent.children[n.pages[0]] is n
      assert n.lock_ref >= 0
      if self.granularity == "page":
        assert len(n.pages) == 1
      for c in n.children.values():
        assert c.lock_ref <= n.lock_ref  # locks cover root paths
      if n.lock_ref:
        pr += len(n.pages)
      else:
        ev += len(n.pages)
    assert (ev, pr) == (self._evictable, self._protected)
    assert self._private >= 0 and self.num_free_pages >= 0
    total = self.cached_pages() + self._private + self.num_free_pages
    assert total == self.capacity, (total, self.capacity)

  # ------------------------------------------------------------ tree verbs
  def _split(self, child: Node, n: int) -> Node:
    """``RadixCache._split_node``: ``child`` keeps its tail and its time."""
    new = self._new_node(child.pages[:n])
    new.lock_ref = child.lock_ref
    new.parent = child.parent
    child.pages = child.pages[n:]
    new.children = {child.pages[0]: child}
    child.parent = new
    new.parent.children[new.pages[0]] = new
    return new

  @staticmethod
  def _common(a: tuple, b: Sequence, start: int) -> int:
    n = 0
    while n < len(a) and start + n < len(b) and a[n] == b[start + n]:
      n += 1
    return n

  def match_prefix(self, keys: Sequence[PageKey]) -> tuple[int, Node]:
    """``_match_prefix_helper``: (matched pages, last node)."""
    t = self._tick()
    node = self.root
    node.last_access = t
    i = 0
    while i < len(keys) and keys[i] in node.children:
      child = node.children[keys[i]]
      child.last_access = t
      n = self._common(child.pages, keys, i)
      i += n
      if n < len(child.pages):
        node = self._split(child, n)
        break
      node = child
    return i, node

  def _insert(self, keys: Sequence[PageKey]) -> tuple[int, Node, int]:
    """``_insert_helper``: (pages already present, last node, new pages)."""
    t = self._tick()
    node = self.root
    node.last_access = t
    i = 0
    while i < len(keys) and keys[i] in node.children:
      node = node.children[keys[i]]
      node.last_access = t
      n = self._common(node.pages, keys, i)
      i += n
      if n < len(node.pages):
        node = self._split(node, n)
    prefix = i
    rest = tuple(keys[i:])
    chunks = [rest] if self.granularity == "node" else [(k,) for k in rest]
    for chunk in chunks if rest else []:
      new = self._new_node(chunk)
      new.parent = node
      node.children[chunk[0]] = new
      self._evictable += len(chunk)
      node = new
    return prefix, node, len(rest)

  def insert(self, keys: Sequence[PageKey]) -> int:
    """Insert pages taken from the free list; return pages already present.

    A test helper (SGLang's ``insert`` takes pages the caller owns): it
    raises ``OutOfPages`` rather than evict.
    """
    new = len(keys) - self._present(keys)
    if new > self.num_free_pages:
      raise OutOfPages(f"{new} new pages, {self.num_free_pages} free")
    prefix, _, n = self._insert(keys)
    self.num_free_pages -= n
    return prefix

  def _present(self, keys: Sequence[PageKey]) -> int:
    node, i = self.root, 0
    while i < len(keys) and keys[i] in node.children:
      node = node.children[keys[i]]
      n = self._common(node.pages, keys, i)
      i += n
      if n < len(node.pages):
        break
    return i

  def inc_lock_ref(self, node: Node) -> None:
    while node is not self.root:
      if node.lock_ref == 0:
        self._evictable -= len(node.pages)
        self._protected += len(node.pages)
      node.lock_ref += 1
      node = node.parent

  def dec_lock_ref(self, node: Node) -> None:
    while node is not self.root:
      assert node.lock_ref > 0
      if node.lock_ref == 1:
        self._evictable += len(node.pages)
        self._protected -= len(node.pages)
      node.lock_ref -= 1
      node = node.parent

  def _evict_tokens(self, num_tokens: int) -> int:
    """``RadixCache.evict``: whole LRU leaves; returns pages evicted."""
    heap = [
      (n.last_access, n.id, n)
      for n in self.nodes()
      if not n.children and n.lock_ref == 0
    ]
    heapq.heapify(heap)
    evicted = 0
    while evicted * self.page_size < num_tokens and heap:
      _, _, x = heapq.heappop(heap)
      parent = x.parent
      del parent.children[x.pages[0]]
      x.parent = None
      self._evictable -= len(x.pages)
      self.num_free_pages += len(x.pages)
      evicted += len(x.pages)
      self.stats["evicted_nodes"] += 1
      if not parent.children and parent.lock_ref == 0:
        heapq.heappush(heap, (parent.last_access, parent.id, parent))
    self.stats["evicted_pages"] += evicted
    return evicted

  def evict(self, num_pages: int) -> int:
    """Evict at least ``num_pages`` pages if possible; return pages freed."""
    return self._evict_tokens(num_pages * self.page_size)

  def _evict_for(self, demand_tokens: int) -> None:
    """``allocator/base.py evict_to_free_tokens``."""
    shortfall = demand_tokens - self.num_free_pages * self.page_size
    if shortfall > 0:
      self._evict_tokens(shortfall)

  def _take(self, n: int) -> None:
    if n > self.num_free_pages:
      raise AssertionError("allocation failed: checked by fits()")
    self.num_free_pages -= n
    self._private += n

  # ---------------------------------------------------------------- replay
  def fits(self, prompt_len: int, output_len: int) -> bool:
    total = prompt_len + max(output_len, 1) - 1
    return cdiv(total, self.page_size) <= self.capacity

  def _checkpoint(self, keys, n_pages, prompt_pages, protected, lock):
    """``RadixCache.checkpoint`` / ``_insert_cache``; returns (pages, lock)."""
    prefix, _, new = self._insert(keys[:n_pages])
    dup = prefix - protected
    assert dup >= 0, "the locked prefix is in the tree"
    self._private -= dup + new  # duplicates freed, the rest moves to the tree
    self.num_free_pages += dup
    if 0 < prompt_pages < n_pages:  # split_prompt: a refreshing re-insert
      self._insert(keys[:prompt_pages])
    _, last = self.match_prefix(keys[:n_pages])
    self.dec_lock_ref(lock)
    self.inc_lock_ref(last)
    return n_pages, last

  def _run(self, keys: Sequence[PageKey], p: int, o: int) -> int:
    ps = self.page_size
    o = max(o, 1)
    n = self.waiting_refresh_interval
    if n and self._num_requests % n == 0:
      self.match_prefix(keys[: p // ps])  # touch_waiting_prefix, uncapped
    self._num_requests += 1
    h, last = self.match_prefix(keys[: (p - 1) // ps])
    self.inc_lock_ref(last)  # PrefillAdder._commit_prefill_admission
    need = cdiv(p, ps) - h
    if self.conservative_evict and ps > 1:  # alloc_paged_token_slots_extend
      self._evict_for((p - h * ps) + ps)
    else:  # page_size 1: alloc_token_slots(extend_num_tokens), exact
      self._evict_for(need * ps)
    self._take(need)
    protected, lock = h, last
    if o >= 2:  # checkpoint_kv_cache after the prefill
      protected, lock = self._checkpoint(
        keys, p // ps, p // ps, protected, lock
      )
    for k in range(1, o):
      new_page = (p + k - 1) % ps == 0
      if self.conservative_evict:  # alloc_paged_token_slots_decode
        self._evict_for(ps)  # bs * page_size, every step
      elif new_page:
        self._evict_for(ps)
      if new_page:
        self._take(1)
    total = p + o - 1
    protected, lock = self._checkpoint(
      keys, total // ps, p // ps, protected, lock
    )
    # release_kv_cache: free the partial last page, unlock.
    assert self._private == (1 if total % ps else 0)
    self.num_free_pages += self._private
    self._private = 0
    self.dec_lock_ref(lock)
    return h * ps

  def run_request(
    self,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    extra: Hashable = None,
  ) -> int:
    """Serve one request alone (prefill, decode, finish); return hit tokens."""
    p, o = len(prompt_token_ids), len(output_token_ids)
    if p < 1:
      raise ValueError("empty prompt")
    if not self.fits(p, o):
      raise OutOfPages(f"prompt {p} + output {o} exceeds the pool")
    seq = list(prompt_token_ids) + list(output_token_ids)
    keys = page_keys_for_tokens(seq, self.page_size, extra)
    return self._run(keys, p, o)

  def run_request_hashed(
    self,
    prompt_hashes: Sequence[Hashable],
    prompt_len: int,
    output_len: int,
    all_hashes: Sequence[Hashable] | None = None,
    extra: Hashable = None,
  ) -> int:
    """Like :meth:`run_request` for pre-chained ids (Mooncake hash_ids)."""
    ps = self.page_size
    if prompt_len < 1:
      raise ValueError("empty prompt")
    if not self.fits(prompt_len, output_len):
      raise OutOfPages(f"prompt {prompt_len} + output {output_len}")
    n_full = (prompt_len + max(output_len, 1) - 1) // ps
    if all_hashes is not None:
      if len(all_hashes) < n_full:
        raise ValueError("all_hashes must cover every full page")
      ids = list(all_hashes[:n_full])
    else:
      ids = list(prompt_hashes[: prompt_len // ps])
      if len(ids) < prompt_len // ps:
        raise ValueError("prompt_hashes must cover every full prompt page")
    keys = [("id", extra, h) for h in ids]
    keys += [("fresh", next(self._fresh)) for _ in range(n_full - len(keys))]
    return self._run(keys, prompt_len, output_len)
