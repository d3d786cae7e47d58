"""Prefix cache: the paging core plus an on-device index of block hashes.

A :class:`PrefixCacheState` is a :class:`prefixjax.paging.PagingState`, an
:class:`prefixjax.index.IndexState` mapping 64-bit block keys to blocks, the
key each block carries, and statistics: one frozen pytree. Every verb is a
pure jitted function that takes the state first and returns
``(new_state, result)``; a failed verb returns the state unchanged with a
status, as in the paging core. Semantics are vLLM v1's automatic prefix
caching (see ``tests/reference_models/vllm_apc.py``, the test oracle):

* Keys are chained block hashes (:mod:`prefixjax.hashing`), given to the
  verbs as ``block_keys [L, 2]`` uint32 (content keys). The state mixes its
  ``version`` word into every key at lookup and insert; :func:`invalidate`
  bumps it, so every earlier block becomes unmatchable in O(1). Old blocks
  keep their (old-version) identity until the allocator reuses them. A
  sequence publishes under the version it started with (``seq_version``),
  so KV computed before a bump never becomes matchable after it.
* :func:`match` finds the longest run of cached full blocks from the start
  of a prompt, capped at ``prompt_len - 1`` tokens rounded down to whole
  blocks (the last token is recomputed to get logits).
* :func:`allocate_with_prefix` matches, *touches* the hit blocks (a block
  with refcount 0 is first unlinked from the free queue, then counted) and
  pops fresh blocks for the rest from the free-queue head. A popped block
  that still carries a hash loses that identity first (identity eviction:
  removed from the index, ``published`` cleared, one eviction counted).
  The budget counts touched refcount-0 hits as vLLM's
  ``get_num_blocks_to_allocate`` does: ``new + evictable_hits > num_free``
  is ``OUT_OF_BLOCKS`` with the state unchanged.
* :func:`publish` gives the sequence's full blocks their keys (``published``
  set: they are read-only from then on; writes go through copy on write). A
  key may name several blocks, as in vLLM (the same prompt computed twice,
  or the recomputed last block of a fully cached prompt): the index maps the
  key to the earliest-published block still present, and the others wait in
  a per-key circular list (``dup_next`` / ``dup_prev``) in publication
  order, so when that block is evicted the next one takes its place.
  Call it when a block fills (early publishing, lets a concurrent wave
  share) or once when the request finishes (late); the verb is the same.
* :func:`append`, :func:`copy_on_write` and :func:`fork` wrap the paging
  verbs; every block they pop loses its old identity first. Call these, not
  the :mod:`prefixjax.paging` verbs, on a cache's ``paging`` field.
* :func:`release`: blocks reaching refcount 0 join the free queue in
  reverse table order (the sequence's last block first). ``free_order``
  (static, set at :func:`init`) picks vLLM's version: ``"append"`` (all at
  the tail: vLLM <= 0.22, the paging core's release) or
  ``"prepend_unhashed"`` (unhashed blocks at the head for LIFO reuse,
  hashed ones at the tail: vLLM >= 0.23). Hashed blocks stay findable on
  the free queue until reused.

Eviction policy (static, :mod:`prefixjax.policies`, set at :func:`init`).
The default ``lru`` is vLLM's: the free queue *is* the eviction order (head
= next victim), maintained incrementally, O(blocks touched). Every other
policy scores blocks from per-block metadata in ``policy_state`` (``[N]``
arrays), which the verbs update through the policy's hooks: ``on_touch``
for the hit blocks in :func:`allocate_with_prefix`, ``on_publish`` for the
blocks :func:`publish` gives a key, both at the request step ``clock`` and
with the caller's optional ``next_use`` per block (``belady``). Blocks are
then taken as follows: free blocks without a hash first, in queue order
(such policies require ``free_order="prepend_unhashed"``, which keeps them
at the queue head), and for the rest, one victim at a time, the free cached
block with the lowest score (ties: the deepest block, i.e. the largest
table column at publish, then the lowest id; found at the root of a
tournament tree or by a masked reduction, see Cost); it loses its
identity and leaves the queue (:func:`prefixjax.paging.unlink_free`)
before the ordinary pops take it.
:func:`append` and :func:`copy_on_write` take blocks the same way. For
``leaf_only`` policies (``lru_leaf``, ``belady_leaf``) the cache also keeps
each cached block's parent (the block before it in the publishing table)
and its number of cached children; only blocks without one are eligible
(all free cached blocks if none is: a child pinned by a running sequence
under a free parent).

Cost: with ``lru`` every verb is O(M) lanes plus O(1) expected index probes
per block touched, published or evicted; nothing scans the pool. ``fifo``
and ``belady`` (``static_score``, not ``leaf_only``) add ``ceil(log32 N)``
32-lane reductions per block hit, released or evicted (a tournament tree of
the free cached blocks, :mod:`prefixjax.victim_tree`; the victim is its
root); the other scoring policies add an O(N) reduction per victim.
Values read from the state pass through :func:`prefixjax.paging.settle`
before it is written (see there why).

Dimensions: ``N`` blocks (including the null block 0), ``S`` sequence
slots, ``M`` block-table columns, ``K`` block size, ``C`` index slots.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from prefixjax import hashing, paging, victim_tree
from prefixjax import index as index_lib
from prefixjax import policies as policies_lib
from prefixjax.paging import NO_BLOCK, NULL_BLOCK, Status, gather, scatter

__all__ = [
  "FREE_ORDERS",
  "CacheStats",
  "MatchResult",
  "PrefixAllocateResult",
  "PrefixCacheState",
  "PublishResult",
  "allocate_with_prefix",
  "append",
  "check_invariants",
  "copy_on_write",
  "fork",
  "init",
  "invalidate",
  "match",
  "num_pinned",
  "publish",
  "release",
  "stats_dict",
]

_INT32_MAX = 2**31 - 1

FREE_ORDERS = ("append", "prepend_unhashed")
"""Accepted ``free_order`` values."""


@struct.dataclass
class CacheStats:
  """Counters (saturating at ``2**31 - 1``); all ``[]`` int32.

  Attributes:
    requests: successful :func:`allocate_with_prefix` calls.
    hit_blocks: prompt blocks served from the cache.
    hit_tokens: ``hit_blocks * K``.
    miss_blocks: prompt blocks allocated fresh (``ceil(P / K) - hits``).
    miss_tokens: prompt tokens computed (``P - hit_tokens``).
    evictions: identities dropped when a hashed free block was reused.
    publish_dropped: blocks left unpublished because the index refused the
      key (``PROBE_LIMIT``); 0 unless the index is badly overloaded.
    num_cached: blocks carrying a hash now.
    num_cached_free: of those, blocks with refcount 0 (evictable; SGLang's
      ``evictable_size``). ``num_cached - num_cached_free`` are cached
      blocks pinned by running sequences (SGLang's ``protected_size``).
  """

  requests: jax.Array  # [] int32
  hit_blocks: jax.Array  # [] int32
  hit_tokens: jax.Array  # [] int32
  miss_blocks: jax.Array  # [] int32
  miss_tokens: jax.Array  # [] int32
  evictions: jax.Array  # [] int32
  publish_dropped: jax.Array  # [] int32
  num_cached: jax.Array  # [] int32
  num_cached_free: jax.Array  # [] int32


@struct.dataclass
class PrefixCacheState:
  """Paging state + block-hash index + per-block identity + statistics.

  Attributes:
    paging: the :class:`prefixjax.paging.PagingState` (its ``published``
      flags mark blocks that carry a hash).
    index: the :class:`prefixjax.index.IndexState`, versioned key -> the
      earliest-published present block with that key.
    block_hash: ``[N, 2]`` uint32 the index key (version mixed in) of each
      hashed block; zero for unhashed blocks.
    dup_next: ``[N]`` int32 next block in the circular list of blocks that
      share a key (itself if alone); ``NO_BLOCK`` for unhashed blocks.
    dup_prev: ``[N]`` int32 previous block in that list.
    version: ``[]`` uint32 model/cache version mixed into every key.
    seq_version: ``[S]`` uint32 the version each live sequence started
      under; its blocks are published under that version, so KV computed
      before a bump never becomes matchable after it.
    stats: :class:`CacheStats`.
    clock: ``[]`` int32 request step: :func:`allocate_with_prefix` advances
      it (the first request is step 1); the policy hooks see it as ``now``.
    block_parent: ``[N]`` int32 for ``leaf_only`` policies, the block before
      each cached block in the table that published it (``NO_BLOCK`` for a
      first block, an unhashed block, or when unused).
    num_children: ``[N]`` int32 for ``leaf_only`` policies, cached blocks
      whose ``block_parent`` is this block.
    block_depth: ``[N]`` int32 for scoring policies, the table column each
      block was published at (the first tie-break: deeper blocks first).
    policy_state: the policy's metadata pytree (``policy.init(N)``).
    victim_tree: for ``static_score`` policies that are not ``leaf_only``,
      the :mod:`prefixjax.victim_tree` of free cached blocks (its root is
      the next victim); ``()`` otherwise.
    free_order: static, where released blocks join the free queue:
      ``"append"`` (all at the tail, last block first: vLLM <= 0.22 and the
      paging core) or ``"prepend_unhashed"`` (unhashed ones at the head,
      hashed ones at the tail: vLLM >= 0.23).
    policy: static, the :class:`prefixjax.policies.EvictionPolicy`.
  """

  paging: paging.PagingState
  index: index_lib.IndexState
  block_hash: jax.Array  # [N, 2] uint32
  dup_next: jax.Array  # [N] int32
  dup_prev: jax.Array  # [N] int32
  version: jax.Array  # [] uint32
  seq_version: jax.Array  # [S] uint32
  stats: CacheStats
  clock: jax.Array  # [] int32
  block_parent: jax.Array  # [N] int32
  num_children: jax.Array  # [N] int32
  block_depth: jax.Array  # [N] int32
  policy_state: Any
  victim_tree: tuple = ()
  free_order: str = struct.field(pytree_node=False, default="append")
  policy: policies_lib.EvictionPolicy = struct.field(
    pytree_node=False, default=policies_lib.lru()
  )

  @property
  def num_blocks(self) -> int:
    """``N``: blocks in the pool, including the null block."""
    return self.paging.num_blocks

  @property
  def block_size(self) -> int:
    """``K``: token slots per block."""
    return self.paging.block_size

  @property
  def max_seqs(self) -> int:
    """``S``: sequence slots."""
    return self.paging.max_seqs

  @property
  def max_blocks_per_seq(self) -> int:
    """``M``: block-table columns."""
    return self.paging.max_blocks_per_seq


class MatchResult(NamedTuple):
  """Result of :func:`match`.

  Attributes:
    hit_blocks: ``[M]`` int32 cached blocks of the prompt's leading run,
      ``NO_BLOCK`` after ``num_hit_blocks``.
    num_hit_blocks: ``[]`` int32.
    hit_tokens: ``[]`` int32 ``num_hit_blocks * K`` (``<= P - 1``).
  """

  hit_blocks: jax.Array  # [M] int32
  num_hit_blocks: jax.Array  # [] int32
  hit_tokens: jax.Array  # [] int32


class PrefixAllocateResult(NamedTuple):
  """Result of :func:`allocate_with_prefix`.

  Attributes:
    status: ``[]`` int32 :class:`prefixjax.paging.Status`.
    hit_blocks: ``[M]`` int32 touched hit blocks (table columns
      ``0 .. num_hit_blocks - 1``), ``NO_BLOCK`` after.
    num_hit_blocks: ``[]`` int32.
    hit_tokens: ``[]`` int32.
    new_blocks: ``[M]`` int32 fresh blocks (the following columns).
    num_new_blocks: ``[]`` int32.
    num_evicted: ``[]`` int32 fresh blocks that lost a cached identity.
  """

  status: jax.Array  # [] int32
  hit_blocks: jax.Array  # [M] int32
  num_hit_blocks: jax.Array  # [] int32
  hit_tokens: jax.Array  # [] int32
  new_blocks: jax.Array  # [M] int32
  num_new_blocks: jax.Array  # [] int32
  num_evicted: jax.Array  # [] int32


class PublishResult(NamedTuple):
  """Result of :func:`publish`.

  Attributes:
    status: ``[]`` int32 :class:`prefixjax.paging.Status`.
    num_published: ``[]`` int32 blocks given a key by this call.
    num_dropped: ``[]`` int32 blocks the index refused (``PROBE_LIMIT``).
  """

  status: jax.Array  # [] int32
  num_published: jax.Array  # [] int32
  num_dropped: jax.Array  # [] int32


# ---------------------------------------------------------------------------
# Construction.


def init(
  num_blocks: int,
  block_size: int,
  max_seqs: int,
  max_blocks_per_seq: int,
  *,
  index_load: float = 0.5,
  index_capacity: int | None = None,
  max_probes: int = 128,
  free_order: str | None = None,
  policy: str | policies_lib.EvictionPolicy = "lru",
) -> PrefixCacheState:
  """Creates an empty prefix cache.

  Args:
    num_blocks: ``N``, blocks including the null block.
    block_size: ``K``.
    max_seqs: ``S``.
    max_blocks_per_seq: ``M``.
    index_load: the index's ``max_load`` (at most 0.75); the index has the
      smallest power-of-two capacity ``C`` with ``N - 1 <= C * index_load``.
    index_capacity: overrides ``C`` (validated against ``index_load``).
    max_probes: the index probe bound.
    free_order: ``"append"`` or ``"prepend_unhashed"`` (see
      :class:`PrefixCacheState`); default ``"append"`` for ``lru`` and
      ``"prepend_unhashed"`` (required) for every other policy, which keeps
      the free blocks without a hash at the queue head.
    policy: a registered policy name (:func:`prefixjax.policies.get_policy`
      with default hyperparameters) or an
      :class:`prefixjax.policies.EvictionPolicy`.

  Returns:
    A :class:`PrefixCacheState`.

  Raises:
    TypeError, ValueError: bad sizes (messages name the values).

  Example:
    >>> from prefixjax import prefix_cache
    >>> s = prefix_cache.init(64, 4, max_seqs=2, max_blocks_per_seq=8)
    >>> s.index.capacity, int(s.paging.num_free)
    (128, 63)
  """
  if isinstance(policy, str):
    policy = policies_lib.get_policy(policy)
  if not isinstance(policy, policies_lib.EvictionPolicy):
    raise TypeError(
      f"policy must be a name or an EvictionPolicy, got {type(policy)}"
    )
  queue_order = policy.score is None
  if free_order is None:
    free_order = "append" if queue_order else "prepend_unhashed"
  if free_order not in FREE_ORDERS:
    raise ValueError(f"{free_order=} must be one of {FREE_ORDERS}")
  if not queue_order and free_order != "prepend_unhashed":
    raise ValueError(
      f"{free_order=}: a scoring policy needs free_order='prepend_unhashed' "
      "(free blocks without a hash must stay at the queue head)"
    )
  pstate = paging.init(
    num_blocks=num_blocks,
    block_size=block_size,
    max_seqs=max_seqs,
    max_blocks_per_seq=max_blocks_per_seq,
  )
  idx = index_lib.init(
    num_keys=max(num_blocks - 1, 1),
    max_load=index_load,
    capacity=index_capacity,
    max_probes=max_probes,
  )
  zero = jnp.zeros((), jnp.int32)
  return PrefixCacheState(
    paging=pstate,
    index=idx,
    block_hash=jnp.zeros((num_blocks, 2), jnp.uint32),
    dup_next=jnp.full((num_blocks,), NO_BLOCK, jnp.int32),
    dup_prev=jnp.full((num_blocks,), NO_BLOCK, jnp.int32),
    version=jnp.zeros((), jnp.uint32),
    seq_version=jnp.zeros((max_seqs,), jnp.uint32),
    stats=CacheStats(*([zero] * len(CacheStats.__dataclass_fields__))),
    clock=zero,
    block_parent=jnp.full((num_blocks,), NO_BLOCK, jnp.int32),
    num_children=jnp.zeros((num_blocks,), jnp.int32),
    block_depth=jnp.zeros((num_blocks,), jnp.int32),
    policy_state=policy.init(num_blocks),
    victim_tree=victim_tree.init(num_blocks) if _uses_tree(policy) else (),
    free_order=free_order,
    policy=policy,
  )


# ---------------------------------------------------------------------------
# Internal pieces (traceable; the caller jits).


def _sat_add(a: jax.Array, b: jax.Array) -> jax.Array:
  b = b.astype(jnp.int32)
  return a + jnp.minimum(b, _INT32_MAX - a)


def _add_stats(stats: CacheStats, **deltas) -> CacheStats:
  return stats.replace(
    **{k: _sat_add(getattr(stats, k), v) for k, v in deltas.items()}
  )


def _settle(state: PrefixCacheState, *values):
  return paging.settle(state.paging, *values)


def _uses_tree(policy: policies_lib.EvictionPolicy) -> bool:
  return (
    policy.score is not None and policy.static_score and not policy.leaf_only
  )


def _rank(state: PrefixCacheState):
  """``ids -> (evictable, score, depth)`` for :mod:`prefixjax.victim_tree`
  (the policy's score on the ``[N]`` metadata entries of ``ids``)."""
  n = state.num_blocks

  def rank(ids):
    valid = (
      (ids > NULL_BLOCK)
      & (ids < n)
      & (gather(state.paging.refcounts, ids, 1) == 0)
      & (gather(state.dup_next, ids, NO_BLOCK) != NO_BLOCK)
    )
    meta = jax.tree.map(
      lambda x: gather(x, ids) if x.ndim and x.shape[0] == n else x,
      state.policy_state,
    )
    score = state.policy.score(meta, state.clock)
    return valid, score, gather(state.block_depth, ids, -1)

  return rank


def _refresh_tree(state: PrefixCacheState, blocks: jax.Array, lanes):
  """Re-ranks ``blocks[lanes]`` in the victim tree (if the policy has
  one) after their eligibility may have changed. The state rides through
  the loop so later writes are ordered after its reads."""
  if not _uses_tree(state.policy):
    return state
  todo, count = paging._compact(blocks, lanes)

  def body(c):
    i, state = c
    tree = victim_tree.refresh(
      state.victim_tree, todo[i], jnp.bool_(True), _rank(state)
    )
    return i + 1, state.replace(victim_tree=tree)

  _, state = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state)
  )
  return state


def _versioned(state: PrefixCacheState, keys: jax.Array, version=None):
  """Index keys: ``keys`` with ``version`` (default the state's) mixed in."""
  version = state.version if version is None else version
  version = jnp.broadcast_to(version, keys.shape[:-1])
  return hashing.hash_words(
    jnp.concatenate([keys, version[..., None]], axis=-1), hashing.SEED_VERSION
  )


def _match(state: PrefixCacheState, vkeys: jax.Array, num_prompt_tokens):
  k, m = state.block_size, state.max_blocks_per_seq
  max_hits = jnp.clip((num_prompt_tokens - 1) // k, 0, m)
  lanes = jnp.arange(m) < max_hits
  values = index_lib._lookup(state.index, vkeys, lanes)
  run = jnp.cumprod((lanes & (values >= 0)).astype(jnp.int32)) > 0
  num_hits = jnp.sum(run.astype(jnp.int32))
  hits = jnp.where(run, values, NO_BLOCK)
  return MatchResult(hits, num_hits, num_hits * k)


def _evict_one(state: PrefixCacheState, block, ok):
  """Drops ``block``'s identity if it has one (``ok`` masks the call)."""
  nxt = gather(state.dup_next, block[None], NO_BLOCK)[0]
  prv = gather(state.dup_prev, block[None], NO_BLOCK)[0]
  key = state.block_hash.at[jnp.clip(block, 0, state.num_blocks - 1)].get()
  has = ok & (nxt != NO_BLOCK)
  sole = nxt == block
  head = index_lib._lookup(state.index, key[None], has[None])[0]
  nxt, prv, key, has, sole, head = _settle(
    state, nxt, prv, key, has, sole, head
  )
  idx, _ = index_lib._delete(state.index, key, has & sole)
  idx, _ = index_lib._update(idx, key, nxt, has & ~sole & (head == block))
  relink = has & ~sole
  dup_next = scatter(state.dup_next, prv[None], nxt, relink)
  dup_prev = scatter(state.dup_prev, nxt[None], prv, relink)
  dup_next = scatter(dup_next, block[None], NO_BLOCK, has)
  dup_prev = scatter(dup_prev, block[None], NO_BLOCK, has)
  block_hash = state.block_hash.at[jnp.where(has, block, state.num_blocks)].set(
    jnp.zeros((2,), jnp.uint32), mode="drop"
  )
  pstate = state.paging.replace(
    published=scatter(state.paging.published, block[None], False, has)
  )
  one = has.astype(jnp.int32)
  stats = _add_stats(state.stats, evictions=one)
  stats = stats.replace(
    num_cached=stats.num_cached - one,
    num_cached_free=stats.num_cached_free - one,
  )
  state = state.replace(
    paging=pstate,
    index=idx,
    block_hash=block_hash,
    dup_next=dup_next,
    dup_prev=dup_prev,
    stats=stats,
  )
  if state.policy.leaf_only:
    state = _unlink_parent(state, block, has)
  state = _refresh_tree(state, block[None], has[None])
  return state, one


def _unlink_parent(state: PrefixCacheState, block, has):
  """Leaf bookkeeping when ``block`` (``has``) loses its identity."""
  parent = gather(state.block_parent, block[None], NO_BLOCK)[0]
  parent = _settle(state, parent)[0]
  num_children = paging.scatter_add(
    state.num_children, parent[None], -1, has & (parent != NO_BLOCK)
  )
  num_children = scatter(num_children, block[None], 0, has)
  # Only the fallback rule evicts a block with cached children: they become
  # first blocks of their chains (O(N), as the scan that chose the block).
  block_parent = jnp.where(
    has & (state.block_parent == block), NO_BLOCK, state.block_parent
  )
  block_parent = scatter(block_parent, block[None], NO_BLOCK, has)
  return state.replace(block_parent=block_parent, num_children=num_children)


def _link_parents(state: PrefixCacheState, row, published_now):
  """Leaf bookkeeping for blocks ``row[published_now]`` just published: the
  parent of column ``i`` is column ``i - 1`` when that block is cached."""
  prev = jnp.concatenate([jnp.full((1,), NO_BLOCK, jnp.int32), row[:-1]])
  prev_cached = gather(state.paging.published, prev, False)
  parent = jnp.where(prev_cached, prev, NO_BLOCK)
  parent = _settle(state, parent)[0]
  return state.replace(
    block_parent=scatter(state.block_parent, row, parent, published_now),
    num_children=paging.scatter_add(
      state.num_children, parent, 1, published_now & (parent != NO_BLOCK)
    ),
  )


def _promote_victims(state: PrefixCacheState, need, ok):
  """Scoring policies: makes the next ``need`` queue pops policy-correct.

  Free blocks without a hash sit at the queue head (``prepend_unhashed``)
  and are used first. For the shortfall, the policy's victims are chosen one
  at a time (each a masked reduction over ``[N]``; an eviction may turn its
  parent into a leaf), lose their identity, and are moved to the queue head
  in that order, where the caller's pops take them.

  Returns:
    ``(state, num_victims)``.
  """
  m = state.max_blocks_per_seq
  unhashed = state.paging.num_free - state.stats.num_cached_free
  count = jnp.where(ok, jnp.clip(need - unhashed, 0, m), 0)

  def body(c):
    i, state, victims = c
    if _uses_tree(state.policy):
      victim = victim_tree.victim(state.victim_tree)
    else:
      evictable = (state.paging.refcounts == 0) & (state.dup_next != NO_BLOCK)
      victim = policies_lib.select_victim(
        state.policy,
        state.policy_state,
        state.clock,
        evictable,
        state.num_children == 0,
        state.block_depth,
      )
    victim = _settle(state, victim)[0]
    found = victim != NO_BLOCK
    state, _ = _evict_one(state, victim, found)
    pstate = paging.unlink_free(state.paging, victim, found)
    return i + 1, state.replace(paging=pstate), victims.at[i].set(victim)

  _, state, victims = jax.lax.while_loop(
    lambda c: c[0] < count,
    body,
    (jnp.int32(0), state, jnp.full((m,), NO_BLOCK, jnp.int32)),
  )
  num = jnp.sum((victims != NO_BLOCK).astype(jnp.int32))
  pstate = _push_free_head(state.paging, victims, num)
  return state.replace(paging=pstate), num


def _evict_popped(state: PrefixCacheState, blocks: jax.Array, count):
  """Identity eviction for freshly popped ``blocks[:count]``, in order."""

  def body(c):
    i, state, n = c
    state, one = _evict_one(state, blocks[i], jnp.bool_(True))
    return i + 1, state, n + one

  _, state, n = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state, jnp.int32(0))
  )
  return state, n


def _touch(state: PrefixCacheState, blocks: jax.Array, count):
  """Refcount up on ``blocks[:count]``; refcount-0 ones leave the queue."""
  lanes = jnp.arange(blocks.shape[0]) < count
  zero = lanes & (gather(state.paging.refcounts, blocks) == 0)
  # ``lanes`` passes through the same barrier so the refcount scatter below
  # is ordered after the read (else XLA copies ``refcounts``).
  zero, lanes = _settle(state, zero, lanes)

  # Remove, then count (never the other way round).
  def body(c):
    i, pstate = c
    pstate = paging.unlink_free(pstate, blocks[i], zero[i])
    return i + 1, pstate

  _, pstate = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state.paging)
  )
  pstate = pstate.replace(
    refcounts=paging.scatter_add(pstate.refcounts, blocks, 1, lanes)
  )
  stats = state.stats
  stats = stats.replace(
    num_cached_free=stats.num_cached_free - jnp.sum(zero.astype(jnp.int32))
  )
  state = state.replace(paging=pstate, stats=stats)
  return _refresh_tree(state, blocks, zero)


def _seq_checks(state: PrefixCacheState, seq_id, want_active: bool):
  return paging._seq_status(state.paging, seq_id, want_active)


@jax.jit
def _match_jit(state, block_keys, num_prompt_tokens):
  return _match(state, _versioned(state, block_keys), num_prompt_tokens)


@jax.jit
def _allocate_with_prefix(
  state, seq_id, block_keys, num_prompt_tokens, next_use=None
):
  k, m = state.block_size, state.max_blocks_per_seq
  policy = state.policy
  if next_use is None:
    next_use = jnp.full((m,), policies_lib.NEVER, jnp.int32)
  pstate = state.paging
  hit = _match(state, _versioned(state, block_keys), num_prompt_tokens)
  total = paging._blocks_for(num_prompt_tokens, k)
  num_new = jnp.maximum(total - hit.num_hit_blocks, 0)
  lanes = jnp.arange(m)
  evictable = jnp.sum(
    (
      (lanes < hit.num_hit_blocks)
      & (gather(pstate.refcounts, hit.hit_blocks) == 0)
    ).astype(jnp.int32)
  )
  status = paging._first_error(
    *_seq_checks(state, seq_id, want_active=False),
    (num_prompt_tokens < 0, Status.BAD_COUNT),
    (total > m, Status.TABLE_OVERFLOW),
    (num_new + evictable > pstate.num_free, Status.OUT_OF_BLOCKS),
  )
  status, hit, num_new = _settle(state, status, hit, num_new)
  ok = status == Status.OK
  num_hits = jnp.where(ok, hit.num_hit_blocks, 0)
  now = state.clock + ok.astype(jnp.int32)
  policy_state = policy.on_touch(
    state.policy_state, hit.hit_blocks, lanes < num_hits, now, next_use
  )
  state = state.replace(clock=now, policy_state=policy_state)
  state = _touch(state, hit.hit_blocks, num_hits)
  num_victims = jnp.int32(0)
  if policy.score is not None:
    state, num_victims = _promote_victims(state, num_new, ok)
  pstate, new = paging.pop_free(state.paging, num_new, ok)
  state = state.replace(paging=pstate)
  state, num_evicted = _evict_popped(state, new, jnp.where(ok, num_new, 0))
  num_evicted = num_evicted + num_victims
  row = jnp.where(
    lanes < num_hits, hit.hit_blocks, gather(new, lanes - num_hits, NO_BLOCK)
  )
  row = jnp.where(row == NO_BLOCK, NULL_BLOCK, row)
  pstate = state.paging
  pstate = pstate.replace(
    block_tables=paging._set_row(pstate.block_tables, seq_id, row, ok),
    num_tokens=scatter(pstate.num_tokens, seq_id[None], num_prompt_tokens, ok),
    active=scatter(pstate.active, seq_id[None], True, ok),
  )
  state = state.replace(
    seq_version=scatter(state.seq_version, seq_id[None], state.version, ok)
  )
  hit_tokens = num_hits * k
  zero = jnp.int32(0)
  stats = _add_stats(
    state.stats,
    requests=ok.astype(jnp.int32),
    hit_blocks=num_hits,
    hit_tokens=hit_tokens,
    miss_blocks=jnp.where(ok, num_new, zero),
    miss_tokens=jnp.where(ok, num_prompt_tokens - hit_tokens, zero),
  )
  state = state.replace(paging=pstate, stats=stats)
  hit_blocks = jnp.where(lanes < num_hits, hit.hit_blocks, NO_BLOCK)
  return state, PrefixAllocateResult(
    status,
    hit_blocks,
    num_hits,
    hit_tokens,
    new,
    jnp.where(ok, num_new, 0),
    num_evicted,
  )


def _append_need(state: PrefixCacheState, seq_id, num_new_tokens):
  """Blocks :func:`prefixjax.paging.append` will pop, and whether it will
  succeed (its checks, repeated)."""
  k, pstate = state.block_size, state.paging
  tokens = gather(pstate.num_tokens, seq_id[None])[0]
  total = tokens + num_new_tokens
  count = paging._blocks_for(total, k) - paging._blocks_for(tokens, k)
  copy = paging._last_block(pstate, seq_id)[-1] & (num_new_tokens > 0)
  need = count + copy.astype(jnp.int32)
  status = paging._first_error(
    *_seq_checks(state, seq_id, want_active=True),
    (num_new_tokens < 0, Status.BAD_COUNT),
    (
      paging._blocks_for(total, k) > state.max_blocks_per_seq,
      Status.TABLE_OVERFLOW,
    ),
    (need > pstate.num_free, Status.OUT_OF_BLOCKS),
  )
  return _settle(state, need, status == Status.OK)


@jax.jit
def _append(state, seq_id, num_new_tokens):
  if state.policy.score is not None:
    need, ok = _append_need(state, seq_id, num_new_tokens)
    state, _ = _promote_victims(state, need, ok)
  pstate, r = paging._append(state.paging, seq_id, num_new_tokens)
  state = state.replace(paging=pstate)
  state, _ = _evict_popped(state, r.dst, r.num_copies)
  state, _ = _evict_popped(state, r.new_blocks, r.num_new_blocks)
  return state, r


@jax.jit
def _copy_on_write(state, seq_id):
  if state.policy.score is not None:
    needed = paging._last_block(state.paging, seq_id)[-1]
    status = paging._first_error(
      *_seq_checks(state, seq_id, want_active=True),
      (needed & (state.paging.num_free < 1), Status.OUT_OF_BLOCKS),
    )
    needed, ok = _settle(state, needed, status == Status.OK)
    state, _ = _promote_victims(state, needed.astype(jnp.int32), ok)
  pstate, r = paging._copy_on_write(state.paging, seq_id)
  state, _ = _evict_popped(state.replace(paging=pstate), r.dst, r.num_copies)
  return state, r


@jax.jit
def _fork(state, parent_id, child_id):
  pstate, status = paging._fork(state.paging, parent_id, child_id)
  parent_version = gather(state.seq_version, parent_id[None], 0)[0]
  seq_version = scatter(
    state.seq_version, child_id[None], parent_version, status == Status.OK
  )
  return state.replace(paging=pstate, seq_version=seq_version), status


@jax.jit
def _publish(state, seq_id, block_keys, num_tokens, next_use=None):
  k, m = state.block_size, state.max_blocks_per_seq
  if next_use is None:
    next_use = jnp.full((m,), policies_lib.NEVER, jnp.int32)
  version = gather(state.seq_version, seq_id[None], 0)[0]
  vkeys = _versioned(state, block_keys, version)
  pstate = state.paging
  held = gather(pstate.num_tokens, seq_id[None])[0]
  row = paging._row(pstate.block_tables, seq_id)
  status = paging._first_error(
    *_seq_checks(state, seq_id, want_active=True),
    (num_tokens < 0, Status.BAD_COUNT),
  )
  full = jnp.clip(jnp.minimum(num_tokens, held) // k, 0, m)
  full = jnp.where(status == Status.OK, full, 0)
  done = gather(pstate.published, row, False)
  # Published blocks form a prefix of the table unless the index refused
  # one; start at the first unpublished column and skip published ones.
  blocked = done | (jnp.arange(m) >= full)
  first = jnp.argmin(blocked.astype(jnp.int32)).astype(jnp.int32)
  first = jnp.where(blocked[first], full, first)
  status, row, full, first = _settle(state, status, row, full, first)

  def body(c):
    i, state, n_pub, n_drop, fresh = c
    block = row[i]
    key = vkeys[i]
    skip = gather(state.paging.published, block[None], False)[0]
    skip = _settle(state, skip)[0]
    idx, r = index_lib._insert(state.index, key, block, ~skip)
    inserted = r.status == index_lib.IndexStatus.OK
    present = r.status == index_lib.IndexStatus.PRESENT
    dropped = r.status == index_lib.IndexStatus.PROBE_LIMIT
    head = r.value
    tail = gather(state.dup_prev, head[None], NO_BLOCK)[0]
    tail = _settle(state, tail)[0]
    # Append to the key's circular list (present) or start one (inserted).
    dup_next = scatter(
      state.dup_next,
      jnp.stack([tail, block]),
      jnp.stack([block, head]),
      present,
    )
    dup_prev = scatter(
      state.dup_prev,
      jnp.stack([block, head]),
      jnp.stack([tail, block]),
      present,
    )
    dup_next = scatter(dup_next, block[None], block, inserted)
    dup_prev = scatter(dup_prev, block[None], block, inserted)
    got = inserted | present
    block_hash = state.block_hash.at[
      jnp.where(got, block, state.num_blocks)
    ].set(key, mode="drop")
    pst = state.paging.replace(
      published=scatter(state.paging.published, block[None], True, got)
    )
    one = got.astype(jnp.int32)
    stats = state.stats.replace(num_cached=state.stats.num_cached + one)
    stats = _add_stats(stats, publish_dropped=dropped.astype(jnp.int32))
    state = state.replace(
      paging=pst,
      index=idx,
      block_hash=block_hash,
      dup_next=dup_next,
      dup_prev=dup_prev,
      stats=stats,
    )
    return (
      i + 1,
      state,
      n_pub + one,
      n_drop + dropped.astype(jnp.int32),
      fresh.at[i].set(got),
    )

  _, state, n_pub, n_drop, fresh = jax.lax.while_loop(
    lambda c: c[0] < full,
    body,
    (first, state, jnp.int32(0), jnp.int32(0), jnp.zeros((m,), jnp.bool_)),
  )
  if state.policy.leaf_only:
    state = _link_parents(state, row, fresh)
  if state.policy.score is not None:
    state = state.replace(
      block_depth=scatter(
        state.block_depth, row, jnp.arange(m, dtype=jnp.int32), fresh
      )
    )
  policy_state = state.policy.on_publish(
    state.policy_state, row, fresh, state.clock, next_use
  )
  state = state.replace(policy_state=policy_state)
  return state, PublishResult(status, n_pub, n_drop)


def _push_free_head(pstate: paging.PagingState, blocks, count):
  """Puts ``blocks[:count]`` at the queue head, keeping their order."""
  n = blocks.shape[0]
  lanes = jnp.arange(n) < count
  old_head, old_tail = pstate.free_head, pstate.free_tail
  next_of = jnp.concatenate([blocks[1:], jnp.full((1,), NO_BLOCK, jnp.int32)])
  next_of = jnp.where(jnp.arange(n) + 1 < count, next_of, old_head)
  prev_of = jnp.concatenate([jnp.full((1,), NO_BLOCK, jnp.int32), blocks[:-1]])
  any_new = count > 0
  first = blocks[0]
  last = gather(blocks, (count - 1)[None], NO_BLOCK)[0]
  free_prev = scatter(pstate.free_prev, blocks, prev_of, lanes)
  return pstate.replace(
    free_next=scatter(pstate.free_next, blocks, next_of, lanes),
    free_prev=scatter(free_prev, old_head[None], last, any_new),
    free_head=jnp.where(any_new, first, old_head),
    free_tail=jnp.where(any_new & (old_tail == NO_BLOCK), last, old_tail),
    num_free=pstate.num_free + count,
  )


def _release_prepend_unhashed(state: PrefixCacheState, seq_id):
  """Release with vLLM >= 0.23's order: in reverse table order, unhashed
  freed blocks go to the queue head (``prepend_n``), hashed ones to the
  tail (``append_n``)."""
  pstate = state.paging
  status = paging._first_error(*_seq_checks(state, seq_id, want_active=True))
  ok = status == Status.OK
  row = paging._row(pstate.block_tables, seq_id)
  tokens = gather(pstate.num_tokens, seq_id[None])[0]
  m = state.max_blocks_per_seq
  lanes = ok & (jnp.arange(m) < paging._blocks_for(tokens, state.block_size))
  rev, rev_lanes = row[::-1], lanes[::-1]
  new_counts = gather(pstate.refcounts, rev) - 1
  hashed = gather(state.dup_next, rev, NO_BLOCK) != NO_BLOCK
  status, ok, row, rev, rev_lanes, new_counts, hashed = _settle(
    state, status, ok, row, rev, rev_lanes, new_counts, hashed
  )
  freed = rev_lanes & (new_counts == 0)
  pstate = pstate.replace(
    refcounts=scatter(pstate.refcounts, rev, new_counts, rev_lanes)
  )
  to_tail, n_tail = paging._compact(rev, freed & hashed)
  to_head, n_head = paging._compact(rev, freed & ~hashed)
  pstate = paging.push_free_tail(pstate, to_tail, n_tail)
  pstate = _push_free_head(pstate, to_head, n_head)
  pstate = pstate.replace(
    block_tables=paging._set_row(
      pstate.block_tables, seq_id, jnp.zeros_like(row), ok
    ),
    num_tokens=scatter(pstate.num_tokens, seq_id[None], 0, ok),
    active=scatter(pstate.active, seq_id[None], False, ok),
  )
  all_freed, num_freed = paging._compact(rev, freed)
  stats = state.stats.replace(
    num_cached_free=state.stats.num_cached_free + n_tail
  )
  result = paging.ReleaseResult(status, all_freed, num_freed)
  state = state.replace(paging=pstate, stats=stats)
  return _refresh_tree(state, to_tail, jnp.arange(m) < n_tail), result


@jax.jit
def _release(state, seq_id):
  if state.free_order == "prepend_unhashed":
    return _release_prepend_unhashed(state, seq_id)
  pstate, r = paging._release(state.paging, seq_id)
  lanes = jnp.arange(r.freed_blocks.shape[0]) < r.num_freed
  hashed = lanes & (gather(state.dup_next, r.freed_blocks, NO_BLOCK) >= 0)
  stats = state.stats.replace(
    num_cached_free=state.stats.num_cached_free
    + jnp.sum(hashed.astype(jnp.int32))
  )
  state = state.replace(paging=pstate, stats=stats)
  return _refresh_tree(state, r.freed_blocks, hashed), r


@jax.jit
def _invalidate(state):
  version = state.version + jnp.uint32(1)
  return state.replace(version=version), version


# ---------------------------------------------------------------------------
# Public verbs.


def _check_state(state) -> None:
  if not isinstance(state, PrefixCacheState):
    raise TypeError(
      f"state must be a PrefixCacheState, got {type(state).__name__}"
    )


def _keys_arg(state: PrefixCacheState, block_keys) -> jax.Array:
  """``[L, 2]`` uint32 -> ``[M, 2]`` (zero-padded or truncated)."""
  keys = jnp.asarray(block_keys)
  if keys.ndim != 2 or keys.shape[-1] != 2 or keys.dtype != jnp.uint32:
    raise ValueError(
      f"block_keys must be uint32 of shape [L, 2], got {keys.shape} "
      f"{keys.dtype}"
    )
  m = state.max_blocks_per_seq
  if keys.shape[0] < m:
    keys = jnp.concatenate(
      [keys, jnp.zeros((m - keys.shape[0], 2), jnp.uint32)]
    )
  return keys[:m]


def _next_use_arg(state: PrefixCacheState, next_use):
  """``None`` or ``[L]`` int -> ``None`` or ``[M]`` int32."""
  if next_use is None:
    return None
  return policies_lib.as_next_use(next_use, state.max_blocks_per_seq)


def match(state: PrefixCacheState, block_keys, num_prompt_tokens):
  """The longest run of cached full blocks from the start of a prompt.

  Read only. The hit is capped at ``num_prompt_tokens - 1`` tokens rounded
  down to whole blocks, so it never covers the whole prompt.

  Args:
    state: the cache.
    block_keys: ``[L, 2]`` uint32 content keys of the prompt's blocks (from
      :func:`prefixjax.hashing.block_hashes`); only the first ``M`` matter.
    num_prompt_tokens: int32 scalar ``P``.

  Returns:
    A :class:`MatchResult`.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax import hashing, prefix_cache as pc
    >>> s = pc.init(16, 4, max_seqs=2, max_blocks_per_seq=4)
    >>> tokens = jnp.arange(16, dtype=jnp.int32)
    >>> keys, _ = hashing.block_hashes(tokens, 16, block_size=4)
    >>> s, _ = pc.allocate_with_prefix(s, 0, keys, 16)
    >>> s, _ = pc.publish(s, 0, keys, 16)
    >>> int(pc.match(s, keys, 16).hit_tokens)  # capped at 15 -> 3 blocks
    12
  """
  _check_state(state)
  return _match_jit(
    state,
    _keys_arg(state, block_keys),
    paging.as_index("num_prompt_tokens", num_prompt_tokens),
  )


def allocate_with_prefix(
  state: PrefixCacheState,
  seq_id,
  block_keys,
  num_prompt_tokens,
  *,
  next_use=None,
):
  """Starts ``seq_id`` on a prompt, reusing its cached prefix.

  Matches (as :func:`match`), touches the hit blocks, then pops fresh blocks
  for the remaining ``ceil(P / K) - hits`` blocks, evicting the identity of
  any popped block that carries one. The sequence then holds ``P`` tokens.
  Advances the request clock (``state.clock``) and runs the policy's
  ``on_touch`` hook on the hit blocks. With a scoring policy (not ``lru``)
  free blocks without a hash are used first and the rest are the policy's
  victims (see :mod:`prefixjax.policies`).

  Args:
    state: the cache.
    seq_id: int32 scalar, a free sequence slot.
    block_keys: ``[L, 2]`` uint32 content keys of the prompt's full blocks.
    num_prompt_tokens: int32 scalar ``P >= 0``.
    next_use: optional ``[L]`` int32 per block, passed to the policy hook
      (``belady``: the step the block's key is next used; default
      :data:`prefixjax.policies.NEVER`).

  Returns:
    ``(new_state, PrefixAllocateResult)``. ``OUT_OF_BLOCKS`` when the fresh
    blocks plus the refcount-0 hits exceed the free queue; on any non-OK
    status the state is unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax import hashing, prefix_cache as pc
    >>> s = pc.init(16, 4, max_seqs=2, max_blocks_per_seq=4)
    >>> keys, _ = hashing.block_hashes(
    ...     jnp.arange(16, dtype=jnp.int32), 16, block_size=4)
    >>> s, r = pc.allocate_with_prefix(s, 0, keys, 14)
    >>> r.new_blocks.tolist(), int(r.num_hit_blocks)
    ([1, 2, 3, 4], 0)
  """
  _check_state(state)
  return _allocate_with_prefix(
    state,
    paging.as_index("seq_id", seq_id),
    _keys_arg(state, block_keys),
    paging.as_index("num_prompt_tokens", num_prompt_tokens),
    _next_use_arg(state, next_use),
  )


def append(state: PrefixCacheState, seq_id, num_new_tokens):
  """:func:`prefixjax.paging.append` with identity eviction of new blocks.

  Returns:
    ``(new_state, prefixjax.paging.AppendResult)``.
  """
  _check_state(state)
  return _append(
    state,
    paging.as_index("seq_id", seq_id),
    paging.as_index("num_new_tokens", num_new_tokens),
  )


def copy_on_write(state: PrefixCacheState, seq_id):
  """:func:`prefixjax.paging.copy_on_write` with identity eviction.

  Returns:
    ``(new_state, prefixjax.paging.CopyResult)``.
  """
  _check_state(state)
  return _copy_on_write(state, paging.as_index("seq_id", seq_id))


def fork(state: PrefixCacheState, parent_id, child_id):
  """:func:`prefixjax.paging.fork`; the child inherits the parent's version.

  Returns:
    ``(new_state, status)``.
  """
  _check_state(state)
  return _fork(
    state,
    paging.as_index("parent_id", parent_id),
    paging.as_index("child_id", child_id),
  )


def num_pinned(state: PrefixCacheState) -> jax.Array:
  """``[]`` int32 blocks held by running sequences (refcount > 0), O(1).

  Jittable and vmappable; with ``stats.num_cached`` and
  ``stats.num_cached_free`` it gives SGLang's protected / evictable sizes.
  """
  return jnp.int32(state.num_blocks - 1) - state.paging.num_free


def publish(
  state: PrefixCacheState, seq_id, block_keys, num_tokens, *, next_use=None
):
  """Gives the sequence's full blocks their keys and indexes them.

  Blocks of columns ``0 .. min(num_tokens, held) // K - 1`` that are not
  yet published get ``block_keys[i]`` (with the version the sequence
  started under mixed in). A key
  already in the index keeps pointing at its earliest-published block; the
  new block joins that key's list behind it (as vLLM's
  ``BlockHashToBlockMap``, no de-duplication).

  Args:
    state: the cache.
    seq_id: int32 scalar, a live sequence.
    block_keys: ``[L, 2]`` uint32 content keys of the sequence's blocks.
    num_tokens: int32 scalar, tokens whose full blocks to publish.
    next_use: optional ``[L]`` int32 per block, passed to the policy's
      ``on_publish`` hook with the newly published blocks (see
      :func:`allocate_with_prefix`).

  Returns:
    ``(new_state, PublishResult)``.
  """
  _check_state(state)
  return _publish(
    state,
    paging.as_index("seq_id", seq_id),
    _keys_arg(state, block_keys),
    paging.as_index("num_tokens", num_tokens),
    _next_use_arg(state, next_use),
  )


def release(state: PrefixCacheState, seq_id):
  """Ends a sequence; blocks reaching refcount 0 join the free queue.

  With ``free_order="append"`` this is :func:`prefixjax.paging.release`
  (all at the tail, last block first); with ``"prepend_unhashed"`` the
  unhashed ones go to the head instead. Hashed blocks stay findable until
  reused.

  Returns:
    ``(new_state, prefixjax.paging.ReleaseResult)``.
  """
  _check_state(state)
  return _release(state, paging.as_index("seq_id", seq_id))


def invalidate(state: PrefixCacheState):
  """Bumps the version word: every earlier block becomes unmatchable, O(1).

  Old blocks keep their old-version identity (and their place in the free
  queue) until the allocator reuses them.

  Returns:
    ``(new_state, version)`` with ``version`` the new ``[]`` uint32.
  """
  _check_state(state)
  return _invalidate(state)


# ---------------------------------------------------------------------------
# Host-side helpers.


def stats_dict(state: PrefixCacheState) -> dict[str, int]:
  """The counters as Python ints, plus ``pinned_blocks`` (refcount > 0) and
  ``cached_pinned`` (cached blocks held by running sequences)."""
  out = {
    k: int(getattr(state.stats, k)) for k in CacheStats.__dataclass_fields__
  }
  out["pinned_blocks"] = state.num_blocks - 1 - int(state.paging.num_free)
  out["cached_pinned"] = out["num_cached"] - out["num_cached_free"]
  return out


def _check_policy_invariants(state, hashed) -> list[str]:
  """Scoring policies: free blocks without a hash lead the queue; leaf
  policies: parent links only on cached blocks, child counts exact."""
  errors = []
  if state.policy.score is None:
    return errors
  order = paging.free_queue_order(state.paging)
  flags = [bool(hashed[b]) for b in order]
  if flags != sorted(flags):
    errors.append("a free block without a hash follows a hashed one")
  if _uses_tree(state.policy):
    want = victim_tree.build(state.num_blocks, _rank(state))
    for level, (got, exp) in enumerate(
      zip(state.victim_tree, want, strict=True)
    ):
      if not np.array_equal(np.asarray(got), np.asarray(exp)):
        errors.append(f"victim tree level {level} is stale")
  if state.policy.leaf_only:
    parent = np.asarray(state.block_parent)
    children = np.asarray(state.num_children)
    if (parent[~hashed] != NO_BLOCK).any():
      errors.append("an unhashed block has a parent link")
    linked = parent[hashed & (parent != NO_BLOCK)]
    want = np.bincount(linked, minlength=state.num_blocks)
    if (want != children).any():
      errors.append(f"num_children {children.tolist()} != {want.tolist()}")
  return errors


def check_invariants(state: PrefixCacheState) -> list[str]:
  """Host-side checks of the whole cache; returns violations (or ``[]``).

  Paging and index invariants, plus: a block is hashed iff ``published``
  iff it is on a key list; lists are consistent circular lists of blocks
  with equal ``block_hash``; the index holds exactly one entry per distinct
  key, pointing into its list; no live sequence's partially filled last
  block is published (it would be written); counters match; for scoring
  policies, free blocks without a hash lead the free queue, and for leaf
  policies the parent links and child counts agree, and a victim tree
  equals one rebuilt from scratch.
  """
  _check_state(state)
  errors = list(paging.check_invariants(state.paging))
  errors += [f"index: {e}" for e in index_lib.check_invariants(state.index)]
  published = np.asarray(state.paging.published)
  nxt = np.asarray(state.dup_next)
  prv = np.asarray(state.dup_prev)
  hashes = np.asarray(state.block_hash)
  refcounts = np.asarray(state.paging.refcounts)
  hashed = nxt != NO_BLOCK
  if (hashed != published).any():
    errors.append(
      f"hashed != published at blocks {np.nonzero(hashed != published)[0]}"
    )
  if hashed[NULL_BLOCK]:
    errors.append("null block is hashed")
  if (hashes[~hashed] != 0).any():
    errors.append("an unhashed block has a nonzero block_hash")
  groups: dict[tuple[int, int], list[int]] = {}
  for b in np.nonzero(hashed)[0].tolist():
    groups.setdefault((int(hashes[b, 0]), int(hashes[b, 1])), []).append(b)
    if prv[nxt[b]] != b:
      errors.append(f"dup list broken at block {b}")
  keys = np.asarray(list(groups), np.uint32).reshape(-1, 2)
  heads = (
    np.asarray(index_lib._lookup_jit(state.index, jnp.asarray(keys)))
    if len(keys)
    else np.zeros(0, np.int32)
  )
  for (key, blocks), head in zip(groups.items(), heads.tolist(), strict=True):
    if head not in blocks:
      errors.append(f"index maps {key} to {head}, not one of {blocks}")
      continue
    ring, cur = [], head
    while len(ring) <= len(blocks):
      ring.append(cur)
      cur = int(nxt[cur])
      if cur == head:
        break
    if sorted(ring) != sorted(blocks):
      errors.append(f"key {key}: list {ring} != blocks {blocks}")
  if int(state.index.count) != len(groups):
    errors.append(f"index count {int(state.index.count)} != {len(groups)}")
  tables = np.asarray(state.paging.block_tables)
  tokens = np.asarray(state.paging.num_tokens)
  k = state.block_size
  for s in np.nonzero(np.asarray(state.paging.active))[0].tolist():
    if tokens[s] % k:
      last = tables[s, tokens[s] // k]
      if published[last]:
        errors.append(f"sequence {s} partial last block {last} is published")
  errors += _check_policy_invariants(state, hashed)
  stats = state.stats
  if int(stats.num_cached) != int(hashed.sum()):
    errors.append(f"num_cached {int(stats.num_cached)} != {hashed.sum()}")
  free_cached = int((hashed & (refcounts == 0)).sum())
  if int(stats.num_cached_free) != free_cached:
    errors.append(
      f"num_cached_free {int(stats.num_cached_free)} != {free_cached}"
    )
  return errors
