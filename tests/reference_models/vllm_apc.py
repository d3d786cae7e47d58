"""Plain-Python model of vLLM v1 automatic prefix caching (test oracle).

One KV-cache group, full attention, ``hash_block_size == block_size``, no
speculative decoding, no KV connector, no watermark, prefix caching on. The
model is the exact ideal of the real system: block hashes are exact,
collision-free Python tuples instead of 64-bit digests.

Sources read (vLLM wheels from PyPI): ``vllm/v1/core/`` of 0.33.0 and 0.11.0
in full, and ``block_pool.py`` of 0.16.0, 0.20.0, 0.22.0, 0.23.0 and 0.25.0
for the release order. The rules hold in 0.11 and 0.33 unless a version is
named. Every rule names the file and function it models.

Checked against the real code: ``tests/test_reference_models.py::
test_vllm_model_matches_real_vllm`` (runs only where vLLM imports) drives
vLLM's own ``KVCacheManager`` one request at a time and compares hits, the
free-queue order and which blocks carry hashes after every request; it passed
with vLLM 0.33.0 (``free_order="prepend_unhashed"``) and 0.22.0
(``"append"``), and an interleaved-request variant (hit blocks, allocated
block ids, refcounts after every verb) agreed on 24,000 operations per version.

Rules
-----
- Pool. ``block_pool.py BlockPool.__init__``: ``num_blocks`` blocks with ids
  ``0..num_blocks-1``; the free queue starts in block-id order; block 0 is
  popped at init as the null block and is never handed out, freed or counted,
  so ``num_blocks - 1`` blocks are usable.
- Free queue. ``kv_cache_utils.py FreeKVCacheBlockQueue``: a doubly linked
  list; ``popleft``/``popleft_n`` take from the head, ``append``/``append_n``
  add at the tail, ``remove`` unlinks from the middle (O(1)), and (vLLM >=
  0.23) ``prepend_n(blocks)`` puts ``blocks`` at the head keeping their order
  (``blocks[0]`` becomes the new head). A block is on the queue iff its
  ``ref_cnt == 0``.
- Block hash chain. ``kv_cache_utils.py hash_block_tokens`` /
  ``get_request_block_hasher``: only full blocks are hashed;
  ``h_i = H((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))``.
  ``generate_block_hash_extra_keys`` puts the cache salt in the first block
  only (LoRA name in every block); because the chain carries it on, the
  equality relation is the same either way. Here: ``extra`` enters block 0.
  A request's hashes cover every full block of ``request.num_tokens`` tokens
  and grow as sampled tokens are appended.
- Index. ``block_pool.py BlockHashToBlockMap`` (``cached_block_hash_to_block``):
  a hash maps to one block *or several* (no de-duplication: "we want to make
  sure the allocated block IDs won't change so that block tables are
  append-only"). ``get_one_block`` returns the earliest-inserted block still
  present for that hash (dict insertion order); ``pop(hash, block_id)``
  removes just that block. Modelled as ``key -> [block ids]`` in insertion
  order.
  Duplicates are NOT only a concurrency effect: in one-request-at-a-time
  replay a prompt whose blocks are all cached gets the last one recomputed
  (the ``prompt_len - 1`` cap below) into a fresh block, which is hashed too,
  so the same hash then names two blocks; the same happens to output-filled
  blocks when a request is repeated. A hash stays findable while any of its
  blocks keeps it. Hit tokens depend only on that presence; which duplicate
  a hit touches (the earliest inserted) shows in block-level state. A
  one-block-per-hash device index must therefore, when the indexed block
  loses its identity, fall back to the earliest remaining duplicate.
- Lookup. ``kv_cache_manager.py KVCacheManager.get_computed_blocks``:
  ``max_cache_hit_length = request.num_tokens - 1`` ("we must recompute the
  last token to obtain logits"), then
  ``single_type_kv_cache_manager.py``
  ``FullAttentionManager.find_longest_cache_hit``
  scans the first ``max_length // block_size`` block hashes and stops at the
  first miss. Hit tokens = hit blocks * block_size, so a hit never covers the
  whole prompt and a prompt of exactly ``n`` cached blocks hits ``n - 1``.
- Allocation. ``kv_cache_manager.py KVCacheManager.allocate_slots`` with
  ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``: needed = new blocks
  (``cdiv(computed + new_tokens, block_size) - held``) + hit blocks whose
  ``ref_cnt == 0`` (touching takes them off the free queue); if that exceeds
  the free-queue length the call returns ``None`` and changes nothing. Else
  ``add_local_computed_blocks`` touches the hits first
  (``BlockPool.touch``: if ``ref_cnt == 0`` remove from the free queue, then
  ``ref_cnt += 1``; in hit order), then ``BlockPool.get_new_blocks`` pops the
  new blocks from the head with ``popleft_n`` and, for each, drops its old
  identity (``_maybe_evict_cached_block``: pop ``(hash, block_id)`` from the
  index, clear the block's hash) and sets ``ref_cnt = 1``.
- Publishing. ``allocate_slots`` ends with
  ``cache_blocks(request, min(computed + new_tokens, request.num_tokens))``;
  ``SingleTypeKVCacheManager.cache_blocks`` / ``BlockPool.cache_full_blocks``
  give every newly full block (from ``num_cached_block`` up to
  ``min(num_tokens, len(block_hashes) * block_size) // block_size``) its hash
  and insert it in the index, whether or not that hash is already there. Hit
  blocks count as already cached. So prompt blocks are published right after
  the prefill allocation, and each decode step publishes the block it fills.
  A request with prompt ``P`` and ``O >= 1`` output tokens ends with hashes on
  the full blocks of its first ``P + O - 1`` tokens (the last sampled token
  never gets KV) and holds ``cdiv(P + O - 1, block_size)`` blocks.
- Release. ``SingleTypeKVCacheManager.free`` passes the request's blocks in
  reverse order (tail first) to ``BlockPool.free_blocks``
  (``single_type_kv_cache_manager.py`` line 599 of 0.33.0), which decrements
  every ``ref_cnt`` and then queues the blocks that reached 0, in that
  reverse order:
    * vLLM 0.8 .. 0.22 (``free_order="append"``, ``vllm_version="0.22"``):
      all of them appended to the tail, so the deepest block of a chain is
      evicted first (``block_pool.py BlockPool.free_blocks`` of 0.8.0 appends
      each block as it reaches 0; 0.22.0 ``append_n``-s them);
    * vLLM >= 0.23 (``free_order="prepend_unhashed"``, the default,
      ``vllm_version="0.33"``): ``block_pool.py BlockPool.free_blocks``
      (lines 816-847 of 0.33.0) collects the blocks with ``block_hash is
      None`` ("LIFO reuse of non-cached blocks") and ``prepend_n``-s them to
      the head keeping their order (``kv_cache_utils.py
      FreeKVCacheBlockQueue.prepend_n``, line 438: the first becomes the
      head), then ``append_n``-s the hashed ones to the tail ("FIFO reuse of
      cached blocks for LRU eviction behavior"). Verified: 0.22.0 has no
      ``prepend_n``, 0.23.0 does. In one-request-at-a-time replay only a
      request's partly filled last block has no hash.
- Capacity failure in replay. One request at a time, every block the request
  does not hold is free, so the request runs iff
  ``cdiv(P + max(O, 1) - 1, block_size) <= num_blocks - 1``; otherwise the
  real scheduler cannot finish it. ``run_request`` raises
  :class:`OutOfBlocks` before changing any state.

Choices of this model (not vLLM rules)
--------------------------------------
- ``O == 0`` is treated as ``O == 1`` (vLLM always samples one token from the
  prefill; it gets no KV either way).
- The scheduler's bookkeeping ``num_computed_tokens += num_new_tokens`` is done
  inside :meth:`VllmPrefixCache.allocate_slots`.
- Pre-chained block ids (Mooncake ``hash_ids``): the id of block ``i`` is used
  as that block's hash key, as is (``("id", extra, hash_id)``; ``extra``
  keeps salts apart). Only the ``P // block_size`` full prompt blocks use
  trace ids: the id of a partial last prompt block describes a partial block
  and is dropped. Blocks that become full during decode get fresh ids that
  never match anything (``("fresh", n)``), unless ``all_hashes`` supplies ids
  for every full block of the ``P + O - 1`` tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

BlockKey = Hashable
FreeOrder = Literal["prepend_unhashed", "append"]
NULL_BLOCK = 0


class OutOfBlocks(RuntimeError):
  """A request cannot run: it needs more blocks than the pool has."""


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def hash_block_tokens(
  parent: BlockKey | None, tokens: Sequence[int], extra: Hashable = None
) -> tuple:
  """Exact stand-in for ``kv_cache_utils.hash_block_tokens``."""
  return (parent, tuple(int(t) for t in tokens), extra)


def block_keys_for_tokens(
  token_ids: Sequence[int], block_size: int, extra: Hashable = None
) -> list[tuple]:
  """Chained keys of every full block of ``token_ids`` (extra in block 0)."""
  keys: list[tuple] = []
  parent = None
  for i in range(len(token_ids) // block_size):
    toks = token_ids[i * block_size : (i + 1) * block_size]
    parent = hash_block_tokens(parent, toks, extra if i == 0 else None)
    keys.append(parent)
  return keys


def id_key(hash_id: Hashable, extra: Hashable = None) -> tuple:
  """Key of a block known by a pre-chained trace id (Mooncake hash_ids)."""
  return ("id", extra, hash_id)


class FreeBlockQueue:
  """``kv_cache_utils.FreeKVCacheBlockQueue``: doubly linked list of ids."""

  def __init__(self, block_ids: Sequence[int]):
    self._head = -1
    self._tail = -2
    self._next: dict[int, int] = {}
    self._prev: dict[int, int] = {}
    ids = [self._head, *block_ids, self._tail]
    for a, b in itertools.pairwise(ids):
      self._next[a] = b
      self._prev[b] = a
    self._len = len(block_ids)

  def __len__(self) -> int:
    return self._len

  def __contains__(self, b: int) -> bool:
    return b in self._prev and b not in (self._head, self._tail)

  def _unlink(self, b: int) -> None:
    p, n = self._prev.pop(b), self._next.pop(b)
    self._next[p] = n
    self._prev[n] = p
    self._len -= 1

  def _link_after(self, p: int, b: int) -> None:
    assert b not in self, f"block {b} already on the free queue"
    n = self._next[p]
    self._next[p], self._prev[b] = b, p
    self._next[b], self._prev[n] = n, b
    self._len += 1

  def popleft(self) -> int:
    b = self._next[self._head]
    if b == self._tail:
      raise ValueError("No free blocks available")
    self._unlink(b)
    return b

  def popleft_n(self, n: int) -> list[int]:
    assert n <= self._len
    return [self.popleft() for _ in range(n)]

  def remove(self, b: int) -> None:
    if b not in self:
      raise RuntimeError(f"remove() called on a block not queued: {b}")
    self._unlink(b)

  def append(self, b: int) -> None:
    self._link_after(self._prev[self._tail], b)

  def append_n(self, blocks: Sequence[int]) -> None:
    for b in blocks:
      self.append(b)

  def prepend_n(self, blocks: Sequence[int]) -> None:
    p = self._head
    for b in blocks:
      self._link_after(p, b)
      p = b

  def order(self) -> list[int]:
    out, b = [], self._next[self._head]
    while b != self._tail:
      out.append(b)
      b = self._next[b]
    return out


@dataclass
class _Request:
  request_id: Hashable
  num_prompt_tokens: int
  num_tokens: int
  extra: Hashable
  token_ids: list[int] | None  # token mode; None for pre-chained ids
  id_keys: list[BlockKey] = field(default_factory=list)  # hashed mode
  keys: list[BlockKey] = field(default_factory=list)  # block_hashes
  blocks: list[int] = field(default_factory=list)
  num_computed_tokens: int = 0
  num_cached_blocks: int | None = None  # None: never allocated


class VllmPrefixCache:
  """vLLM v1 ``KVCacheManager`` + ``BlockPool`` with prefix caching.

  ``num_blocks`` counts vLLM's ``num_gpu_blocks`` *including* the null block
  0; use :meth:`from_capacity` to give the usable count instead.
  """

  def __init__(
    self,
    num_blocks: int,
    block_size: int,
    free_order: FreeOrder = "prepend_unhashed",
  ):
    if num_blocks < 1 or block_size < 1:
      raise ValueError("num_blocks and block_size must be >= 1")
    if free_order not in ("prepend_unhashed", "append"):
      raise ValueError(f"unknown free_order {free_order!r}")
    self.num_blocks = num_blocks
    self.block_size = block_size
    self.free_order = free_order
    self._queue = FreeBlockQueue(range(num_blocks))
    # BlockPool.__init__: the null block is popped from the queue head.
    assert self._queue.popleft() == NULL_BLOCK
    self._ref = [0] * num_blocks
    self._hash: list[BlockKey | None] = [None] * num_blocks
    self._index: dict[BlockKey, list[int]] = {}
    self._requests: dict[Hashable, _Request] = {}
    self._fresh = itertools.count()
    self._auto_id = itertools.count()
    self.evictions = 0  # identities dropped by _evict_identity

  @classmethod
  def from_capacity(
    cls,
    capacity: int,
    block_size: int,
    free_order: FreeOrder = "prepend_unhashed",
  ) -> VllmPrefixCache:
    """A pool with ``capacity`` usable blocks (plus the null block)."""
    return cls(capacity + 1, block_size, free_order)

  # ----------------------------------------------------------------- state
  @property
  def num_free(self) -> int:
    return len(self._queue)

  @property
  def capacity(self) -> int:
    return self.num_blocks - 1

  def free_queue_order(self) -> list[int]:
    return self._queue.order()

  def block_hash(self, b: int) -> BlockKey | None:
    return self._hash[b]

  def refcount(self, b: int) -> int:
    return self._ref[b]

  def cached_blocks(self) -> dict[BlockKey, list[int]]:
    """The index: key -> blocks carrying it, earliest-inserted first."""
    return {k: list(v) for k, v in self._index.items()}

  def num_cached_blocks(self) -> int:
    return sum(len(v) for v in self._index.values())

  def request_blocks(self, request_id: Hashable) -> list[int]:
    return list(self._requests[request_id].blocks)

  def running_requests(self) -> list[Hashable]:
    return list(self._requests)

  def check_invariants(self) -> None:
    """Raise AssertionError if the state is inconsistent."""
    held = [0] * self.num_blocks
    for req in self._requests.values():
      assert len(set(req.blocks)) == len(req.blocks)
      for b in req.blocks:
        held[b] += 1
    assert NULL_BLOCK not in self._queue
    order = self._queue.order()
    assert len(order) == len(self._queue) == len(set(order))
    for b in range(1, self.num_blocks):
      assert self._ref[b] == held[b], (b, self._ref[b], held[b])
      assert (b in self._queue) == (self._ref[b] == 0), b
    assert self._hash[NULL_BLOCK] is None
    n = 0
    for key, blocks in self._index.items():
      assert blocks, key
      for b in blocks:
        assert self._hash[b] == key
        n += 1
    assert n == sum(h is not None for h in self._hash)

  # ----------------------------------------------------------------- index
  def lookup(self, key: BlockKey) -> int | None:
    """``BlockHashToBlockMap.get_one_block``: earliest-inserted block."""
    blocks = self._index.get(key)
    return blocks[0] if blocks else None

  def find_longest_cache_hit(
    self, keys: Sequence[BlockKey], max_length: int
  ) -> tuple[list[int], int]:
    """``FullAttentionManager.find_longest_cache_hit`` (no state change)."""
    hit: list[int] = []
    for key in keys[: max(max_length, 0) // self.block_size]:
      b = self.lookup(key)
      if b is None:
        break
      hit.append(b)
    return hit, len(hit) * self.block_size

  def peek_computed_blocks(
    self,
    token_ids: Sequence[int] | None = None,
    *,
    block_keys: Sequence[BlockKey] | None = None,
    num_tokens: int | None = None,
    extra: Hashable = None,
  ) -> tuple[list[int], int]:
    """``get_computed_blocks`` for a prompt not registered as a request.

    Give ``token_ids`` (keys derived with ``extra``) or ``block_keys`` plus
    ``num_tokens``; the hit is capped at ``num_tokens - 1``. No state change.
    """
    if block_keys is None:
      if token_ids is None:
        raise ValueError("give token_ids or block_keys")
      block_keys = block_keys_for_tokens(token_ids, self.block_size, extra)
      if num_tokens is None:
        num_tokens = len(token_ids)
    if num_tokens is None:
      raise ValueError("num_tokens is needed with block_keys")
    return self.find_longest_cache_hit(block_keys, num_tokens - 1)

  def _evict_identity(self, b: int) -> None:
    """``BlockPool._maybe_evict_cached_block``."""
    key = self._hash[b]
    if key is None:
      return
    self.evictions += 1
    blocks = self._index[key]
    blocks.remove(b)
    if not blocks:
      del self._index[key]
    self._hash[b] = None

  def _publish(self, b: int, key: BlockKey) -> None:
    """``BlockPool.cache_full_blocks`` for one block (no de-duplication)."""
    assert self._hash[b] is None
    self._hash[b] = key
    self._index.setdefault(key, []).append(b)

  # -------------------------------------------------------------- requests
  def add_request(
    self,
    request_id: Hashable,
    prompt_token_ids: Sequence[int],
    extra: Hashable = None,
  ) -> None:
    """Register a waiting request given by token ids."""
    self._add(
      _Request(
        request_id,
        len(prompt_token_ids),
        len(prompt_token_ids),
        extra,
        [int(t) for t in prompt_token_ids],
      )
    )

  def add_request_hashed(
    self,
    request_id: Hashable,
    prompt_len: int,
    block_ids: Sequence[Hashable],
    extra: Hashable = None,
  ) -> None:
    """Register a request given by pre-chained block ids.

    ``block_ids[i]`` is the hash of block ``i`` once that block is full; it
    must cover at least the ``prompt_len // block_size`` full prompt blocks.
    Blocks past ``len(block_ids)`` get fresh, never-matching keys when they
    fill.
    """
    if len(block_ids) < prompt_len // self.block_size:
      raise ValueError("block_ids must cover every full prompt block")
    req = _Request(request_id, prompt_len, prompt_len, extra, None)
    req.id_keys = [id_key(h, extra) for h in block_ids]
    self._add(req)

  def _add(self, req: _Request) -> None:
    if req.request_id in self._requests:
      raise ValueError(f"request {req.request_id!r} already exists")
    self._requests[req.request_id] = req
    self._update_keys(req)

  def _update_keys(self, req: _Request) -> None:
    """``get_request_block_hasher``: hash every newly full block."""
    bs = self.block_size
    while (len(req.keys) + 1) * bs <= req.num_tokens:
      i = len(req.keys)
      if req.token_ids is not None:
        parent = req.keys[-1] if req.keys else None
        toks = req.token_ids[i * bs : (i + 1) * bs]
        req.keys.append(
          hash_block_tokens(parent, toks, req.extra if i == 0 else None)
        )
      elif i < len(req.id_keys):
        req.keys.append(req.id_keys[i])
      else:
        req.keys.append(("fresh", next(self._fresh)))

  def append_tokens(
    self, request_id: Hashable, token_ids: Sequence[int] | int
  ) -> None:
    """Append sampled tokens (a list, or a count in hashed mode)."""
    req = self._requests[request_id]
    if isinstance(token_ids, int):
      if req.token_ids is not None:
        raise TypeError("token-mode requests need the token ids")
      req.num_tokens += token_ids
    else:
      if req.token_ids is not None:
        req.token_ids.extend(int(t) for t in token_ids)
      req.num_tokens += len(token_ids)
    self._update_keys(req)

  def block_keys(self, request_id: Hashable) -> list[BlockKey]:
    return list(self._requests[request_id].keys)

  def get_computed_blocks(self, request_id: Hashable) -> tuple[list[int], int]:
    """``KVCacheManager.get_computed_blocks``: hit capped at num_tokens - 1."""
    req = self._requests[request_id]
    if req.num_cached_blocks is not None:
      raise ValueError("get_computed_blocks is for waiting requests only")
    return self.find_longest_cache_hit(req.keys, req.num_tokens - 1)

  def allocate_slots(
    self,
    request_id: Hashable,
    num_new_tokens: int,
    new_computed_blocks: Sequence[int] = (),
  ) -> list[int] | None:
    """``KVCacheManager.allocate_slots``; ``None`` when blocks run short."""
    req = self._requests[request_id]
    bs = self.block_size
    first = req.num_cached_blocks is None
    if not first and new_computed_blocks:
      raise ValueError("a running request has no new prefix hits")
    hits = list(new_computed_blocks)
    computed = req.num_computed_tokens + len(hits) * bs
    if num_new_tokens <= 0 and not hits:
      raise ValueError("num_new_tokens must be > 0")
    need_slots = computed + num_new_tokens
    required = cdiv(need_slots, bs)
    num_new = max(required - len(req.blocks) - len(hits), 0)
    evictable = sum(self._ref[b] == 0 for b in hits)
    if num_new + evictable > self.num_free:
      return None
    # add_local_computed_blocks: touch the hits before popping new blocks.
    for b in hits:
      if self._ref[b] == 0:
        self._queue.remove(b)
      self._ref[b] += 1
    req.blocks.extend(hits)
    if first:
      req.num_cached_blocks = len(req.blocks)
    # get_new_blocks: pop from the head, drop old identities.
    new = self._queue.popleft_n(num_new)
    for b in new:
      self._evict_identity(b)
      assert self._ref[b] == 0
      self._ref[b] = 1
    req.blocks.extend(new)
    # The scheduler advances num_computed_tokens by the scheduled tokens.
    req.num_computed_tokens = need_slots
    self._cache_blocks(req, min(need_slots, req.num_tokens))
    return new

  def _cache_blocks(self, req: _Request, num_tokens: int) -> None:
    """``SingleTypeKVCacheManager.cache_blocks``."""
    assert req.num_cached_blocks is not None
    full = min(num_tokens, len(req.keys) * self.block_size) // self.block_size
    for i in range(req.num_cached_blocks, full):
      self._publish(req.blocks[i], req.keys[i])
    req.num_cached_blocks = max(req.num_cached_blocks, full)

  def free(self, request_id: Hashable) -> None:
    """``SingleTypeKVCacheManager.free`` + ``BlockPool.free_blocks``."""
    req = self._requests.pop(request_id)
    ordered = list(reversed(req.blocks))
    for b in ordered:
      self._ref[b] -= 1
    freed = [b for b in ordered if self._ref[b] == 0 and b != NULL_BLOCK]
    if self.free_order == "append":
      self._queue.append_n(freed)
    else:
      self._queue.prepend_n([b for b in freed if self._hash[b] is None])
      self._queue.append_n([b for b in freed if self._hash[b] is not None])

  # ---------------------------------------------------------------- replay
  def fits(self, prompt_len: int, output_len: int) -> bool:
    total = prompt_len + max(output_len, 1) - 1
    return cdiv(total, self.block_size) <= self.capacity

  def _run(self, rid: Hashable, prompt_len: int, outputs) -> int:
    blocks, hit = self.get_computed_blocks(rid)
    got = self.allocate_slots(rid, prompt_len - hit, blocks)
    assert got is not None, "checked by fits()"
    for k, tok in enumerate(outputs):
      self.append_tokens(rid, tok)
      if k + 1 < len(outputs):  # the last sampled token gets no KV
        assert self.allocate_slots(rid, 1) is not None
    self.free(rid)
    return hit

  def run_request(
    self,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    extra: Hashable = None,
  ) -> int:
    """Serve one request alone (prefill, decode, free); return hit tokens."""
    p, o = len(prompt_token_ids), len(output_token_ids)
    if p < 1:
      raise ValueError("empty prompt")
    if not self.fits(p, o):
      raise OutOfBlocks(f"prompt {p} + output {o} exceeds the pool")
    rid = ("replay", next(self._auto_id))
    self.add_request(rid, prompt_token_ids, extra)
    return self._run(rid, p, [[int(t)] for t in output_token_ids])

  def run_request_hashed(
    self,
    prompt_hashes: Sequence[Hashable],
    prompt_len: int,
    output_len: int,
    all_hashes: Sequence[Hashable] | None = None,
    extra: Hashable = None,
  ) -> int:
    """Like :meth:`run_request` for pre-chained ids (Mooncake hash_ids).

    ``prompt_hashes`` has one id per prompt block (the partial last one is
    ignored). ``all_hashes``, if given, names every full block of the
    ``prompt_len + output_len - 1`` tokens; otherwise output-filled blocks get
    fresh ids that never hit.
    """
    if prompt_len < 1:
      raise ValueError("empty prompt")
    if not self.fits(prompt_len, output_len):
      raise OutOfBlocks(f"prompt {prompt_len} + output {output_len}")
    bs = self.block_size
    ids = list(prompt_hashes[: prompt_len // bs])
    if len(ids) < prompt_len // bs:
      raise ValueError("prompt_hashes must cover every full prompt block")
    if all_hashes is not None:
      n_full = (prompt_len + max(output_len, 1) - 1) // bs
      if len(all_hashes) < n_full:
        raise ValueError("all_hashes must cover every full block")
      ids = list(all_hashes)
    rid = ("replay", next(self._auto_id))
    self.add_request_hashed(rid, prompt_len, ids, extra)
    return self._run(rid, prompt_len, [1] * output_len)
