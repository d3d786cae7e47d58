"""Plain-Python models of the prefix cache under scoring eviction policies.

:class:`PolicyPrefixCache` is :class:`vllm_apc.VllmPrefixCache` (vLLM v1
automatic prefix caching: hash chain, ``prompt_len - 1`` cap, touch / free
symmetry, identity eviction on reuse) with the block chosen for reuse decided
by a policy instead of the free-queue head, as ``prefixjax.policies``
documents it:

- The free queue keeps vLLM >= 0.23's release order (``prepend_unhashed``),
  so free blocks without a hash sit at its head; they are used first, in
  queue order.
- When none is left, each further block is the policy's victim: among free
  blocks carrying a hash (for leaf policies: those with no cached child;
  all of them if none qualifies), the lowest score; ties to the largest
  table column the block was published at, then the lowest block id. The
  victim loses its identity at once (so its parent may become a leaf for the
  next choice). Among one allocation's new blocks the unhashed ones come
  first, then the victims in choice order, so one allocation of ``n``
  blocks hands out what ``n`` one-block allocations would.
- A request step (clock) advances once per request, at its first
  allocation; hits and publishes happen "now".
- A block's parent is the block before it in the publishing request's
  table, if that one carries a hash when the block is published.
- Scores: ``fifo`` publish step; ``lfu`` use count (1 at publish, +1 per
  hit), decayed by ``decay ** (now - last use)`` in float32 with denormals
  flushed to zero (as XLA:CPU computes it); ``lru_leaf`` step of the last
  hit or publish; ``belady`` / ``belady_leaf`` minus the stored next-use
  step (given per block by the caller at each hit and publish).

Written independently of the device code, from that description.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .vllm_apc import NULL_BLOCK, VllmPrefixCache, cdiv

NEVER = 2**31 - 1
LEAF_POLICIES = ("lru_leaf", "belady_leaf")
POLICIES = ("fifo", "lfu", "lru_leaf", "belady", "belady_leaf", "largest_id")

_TINY = np.finfo(np.float32).tiny


def _ftz(x: np.float32) -> np.float32:
  return np.float32(0.0) if abs(x) < _TINY else np.float32(x)


class PolicyPrefixCache(VllmPrefixCache):
  """vLLM APC with a scoring eviction policy (see the module docstring).

  ``policy`` is one of :data:`POLICIES` (``largest_id``: the test's
  user-defined policy, score ``-block_id``).
  """

  def __init__(
    self,
    num_blocks: int,
    block_size: int,
    policy: str,
    decay: float | None = None,
  ):
    if policy not in POLICIES:
      raise ValueError(f"unknown policy {policy!r}")
    super().__init__(num_blocks, block_size, free_order="prepend_unhashed")
    self.policy = policy
    self.leaf_only = policy in LEAF_POLICIES
    self.decay = np.float32(1.0 if decay is None else decay)
    self.clock = 0
    self.parent: list[int | None] = [None] * num_blocks
    self.children = [0] * num_blocks
    self.stamp = [0] * num_blocks  # publish / last-use step
    self.count = [np.float32(0.0)] * num_blocks
    self.next_use = [NEVER] * num_blocks
    self.depth = [0] * num_blocks
    self._hints: dict[Hashable, list[int]] = {}
    self.victims: list[int] = []  # every victim, in order (for tests)

  def set_next_use(self, request_id: Hashable, next_use: Sequence[int]):
    """Per-block next-use steps of a request (for ``belady``)."""
    self._hints[request_id] = [int(x) for x in next_use]

  def _hint(self, req, i: int) -> int:
    hints = self._hints.get(req.request_id, [])
    return hints[i] if i < len(hints) else NEVER

  # --------------------------------------------------------------- metadata
  def _decayed(self, b: int) -> np.float32:
    dt = np.float32(self.clock - self.stamp[b])
    factor = _ftz(np.float32(self.decay**dt))
    return _ftz(np.float32(self.count[b] * factor))

  def _on_touch(self, req, i: int, b: int) -> None:
    if self.policy == "lfu":
      self.count[b] = np.float32(self._decayed(b) + np.float32(1.0))
      self.stamp[b] = self.clock
    elif self.policy == "lru_leaf":
      self.stamp[b] = self.clock
    elif self.policy in ("belady", "belady_leaf"):
      self.next_use[b] = self._hint(req, i)

  def _on_publish(self, req, i: int, b: int) -> None:
    if self.policy in ("fifo", "lru_leaf"):
      self.stamp[b] = self.clock
    elif self.policy == "lfu":
      self.count[b] = np.float32(1.0)
      self.stamp[b] = self.clock
    elif self.policy in ("belady", "belady_leaf"):
      self.next_use[b] = self._hint(req, i)

  def score(self, b: int):
    if self.policy in ("fifo", "lru_leaf"):
      return self.stamp[b]
    if self.policy == "lfu":
      return float(self._decayed(b))
    if self.policy in ("belady", "belady_leaf"):
      return -self.next_use[b]
    return -b  # largest_id

  def select_victim(self) -> int:
    evictable = [
      b
      for b in range(1, self.num_blocks)
      if self._ref[b] == 0 and self._hash[b] is not None
    ]
    assert evictable, "a victim is needed but none is evictable"
    if self.leaf_only:
      leaves = [b for b in evictable if self.children[b] == 0]
      evictable = leaves or evictable
    return min(evictable, key=lambda b: (self.score(b), -self.depth[b], b))

  # ------------------------------------------------------------- overrides
  def _evict_identity(self, b: int) -> None:
    if self._hash[b] is not None:
      p = self.parent[b]
      if p is not None:
        self.children[p] -= 1
      for c in range(self.num_blocks):
        if self.parent[c] == b:
          self.parent[c] = None
      self.parent[b] = None
      self.children[b] = 0
    super()._evict_identity(b)

  def _cache_blocks(self, req, num_tokens: int) -> None:
    first = req.num_cached_blocks
    super()._cache_blocks(req, num_tokens)
    for i in range(first, req.num_cached_blocks):
      b = req.blocks[i]
      self.depth[b] = i
      prev = req.blocks[i - 1] if i > 0 else None
      if prev is not None and self._hash[prev] is not None:
        self.parent[b] = prev
        self.children[prev] += 1
      self._on_publish(req, i, b)

  def _take_new(self, num_new: int) -> list[int]:
    order = self._queue.order()
    unhashed = [b for b in order if self._hash[b] is None]
    assert order[: len(unhashed)] == unhashed, "unhashed blocks not at head"
    victims = []
    for _ in range(max(num_new - len(unhashed), 0)):
      v = self.select_victim()
      self._evict_identity(v)
      self._queue.remove(v)
      victims.append(v)
    self.victims += victims
    # The blocks without a hash first (the queue head, vLLM's order), then
    # the victims in the order chosen: as ``num_new`` one-block takes.
    return self._queue.popleft_n(num_new - len(victims)) + victims

  def allocate_slots(
    self,
    request_id: Hashable,
    num_new_tokens: int,
    new_computed_blocks: Sequence[int] = (),
  ) -> list[int] | None:
    """``VllmPrefixCache.allocate_slots`` with policy-chosen new blocks."""
    req = self._requests[request_id]
    bs = self.block_size
    first = req.num_cached_blocks is None
    hits = list(new_computed_blocks)
    computed = req.num_computed_tokens + len(hits) * bs
    need_slots = computed + num_new_tokens
    num_new = max(cdiv(need_slots, bs) - len(req.blocks) - len(hits), 0)
    evictable = sum(self._ref[b] == 0 for b in hits)
    if num_new + evictable > self.num_free:
      return None
    if first:
      self.clock += 1
    for i, b in enumerate(hits):
      self._on_touch(req, len(req.blocks) + i, b)
      if self._ref[b] == 0:
        self._queue.remove(b)
      self._ref[b] += 1
    req.blocks.extend(hits)
    if first:
      req.num_cached_blocks = len(req.blocks)
    new = self._take_new(num_new)
    for b in new:
      self._evict_identity(b)
      assert self._ref[b] == 0 and b != NULL_BLOCK
      self._ref[b] = 1
    req.blocks.extend(new)
    req.num_computed_tokens = need_slots
    self._cache_blocks(req, min(need_slots, req.num_tokens))
    return new

  def check_invariants(self) -> None:
    super().check_invariants()
    for b in range(self.num_blocks):
      kids = sum(
        1
        for c in range(self.num_blocks)
        if self.parent[c] == b and self._hash[c] is not None
      )
      assert self.children[b] == kids, (b, self.children[b], kids)
      if self.parent[b] is not None:
        assert self._hash[b] is not None
