"""Prefix-cache state: the pytree, its result types and :func:`init`.

The ground floor of the prefix cache (:mod:`prefixjax.cache.prefix_cache`,
whose docstring describes the semantics): :class:`PrefixCacheState` and
:class:`CacheStats`, the verbs' result types, the constructor, and the small
traceable helpers every layer above shares (saturating counters, the
settle barrier, versioned keys).

Dimensions: ``N`` blocks (including the null block 0), ``S`` sequence
slots, ``M`` block-table columns, ``K`` block size, ``C`` index slots.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from prefixjax import _struct as struct
from prefixjax._masked import NO_BLOCK
from prefixjax.cache import hashing, paging, victim_tree
from prefixjax.cache import index as index_lib
from prefixjax.cache import policies as policies_lib
from prefixjax.cache.paging_state import (
  DEFAULT_VLLM_VERSION,
  FREE_ORDERS,
  VLLM_FREE_ORDERS,
  vllm_free_order,
)

__all__ = [
  "DEFAULT_VLLM_VERSION",
  "FREE_ORDERS",
  "VLLM_FREE_ORDERS",
  "CacheStats",
  "MatchResult",
  "PrefixAllocateResult",
  "PrefixCacheState",
  "PublishResult",
  "add_stats",
  "check_state",
  "identity_of",
  "init",
  "settle",
  "uses_tree",
  "versioned",
  "vllm_free_order",
  "with_identity",
]

_INT32_MAX = 2**31 - 1


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
    paging: the :class:`prefixjax.cache.paging.PagingState` (its ``published``
      flags mark blocks that carry a hash).
    index: the :class:`prefixjax.cache.index.IndexState`, versioned key -> the
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
      the :mod:`prefixjax.cache.victim_tree` of free cached blocks (its root is
      the next victim); ``()`` otherwise.
    free_order: static, where released blocks join the free queue:
      ``"append"`` (all at the tail, last block first: vLLM <= 0.22 and the
      paging core's default) or ``"prepend_unhashed"`` (unhashed ones at the
      head, hashed ones at the tail, each last block first: vLLM >= 0.23;
      see :data:`VLLM_FREE_ORDERS`).
    policy: static, the :class:`prefixjax.cache.policies.EvictionPolicy`.
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
  free_order: str = struct.field(pytree_node=False, default="prepend_unhashed")
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
    status: ``[]`` int32 :class:`prefixjax.cache.paging.Status`.
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
    status: ``[]`` int32 :class:`prefixjax.cache.paging.Status`.
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
  vllm_version: str | None = None,
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
      :class:`PrefixCacheState`); by default the order of ``vllm_version``,
      which is ``"prepend_unhashed"`` (vLLM 0.33's) unless an older release
      is named. Every policy but ``lru`` requires ``"prepend_unhashed"``,
      which keeps the free blocks without a hash at the queue head.
    vllm_version: a vLLM release (:func:`vllm_free_order`: ``"0.33"``,
      ``"0.22"``, ``"latest"``, ...) whose release order to use; default
      :data:`DEFAULT_VLLM_VERSION`. Giving both it and a ``free_order`` that
      differs from its order is an error.
    policy: a registered policy name
      (:func:`prefixjax.cache.policies.get_policy` with default
      hyperparameters) or an :class:`prefixjax.cache.policies.EvictionPolicy`.

  Returns:
    A :class:`PrefixCacheState`.

  Raises:
    TypeError, ValueError: bad sizes (messages name the values).

  Example:
    >>> from prefixjax.cache import prefix_cache
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
  if free_order is not None and free_order not in FREE_ORDERS:
    raise ValueError(f"{free_order=} must be one of {FREE_ORDERS}")
  if vllm_version is not None:
    order = vllm_free_order(vllm_version)
    if free_order is not None and free_order != order:
      raise ValueError(
        f"{free_order=} contradicts {vllm_version=}, whose release order is "
        f"{order!r}: give one of them"
      )
    free_order = order
  if free_order is None:
    free_order = vllm_free_order(DEFAULT_VLLM_VERSION)
  if not queue_order and free_order != "prepend_unhashed":
    raise ValueError(
      f"{free_order=}: a scoring policy needs free_order='prepend_unhashed' "
      "(free blocks without a hash must stay at the queue head; vLLM >= 0.23)"
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
  try:
    hash(policy)
  except TypeError:  # unhashable parameters: built op by op
    return _empty(pstate, idx, num_blocks, max_seqs, free_order, policy)
  return _empty_jit(pstate, idx, num_blocks, max_seqs, free_order, policy)


def _empty(pstate, idx, num_blocks, max_seqs, free_order, policy):
  """The rest of :func:`init`'s empty cache around ``pstate`` and ``idx``."""
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
    victim_tree=victim_tree.init(num_blocks) if uses_tree(policy) else (),
    free_order=free_order,
    policy=policy,
  )


# One compiled program: outside ``jit`` each array constructor would
# compile one of its own.
_empty_jit = jax.jit(_empty, static_argnums=(2, 3, 4, 5))


def check_state(state) -> None:
  """Raises ``TypeError`` unless ``state`` is a ``PrefixCacheState``."""
  if not isinstance(state, PrefixCacheState):
    raise TypeError(
      f"state must be a PrefixCacheState, got {type(state).__name__}"
    )


# ---------------------------------------------------------------------------
# Shared pieces (traceable; the caller jits).


def _sat_add(a: jax.Array, b: jax.Array) -> jax.Array:
  b = b.astype(jnp.int32)
  return a + jnp.minimum(b, _INT32_MAX - a)


def add_stats(stats: CacheStats, **deltas) -> CacheStats:
  """``stats`` with each named counter raised by its delta (saturating)."""
  return stats.replace(
    **{k: _sat_add(getattr(stats, k), v) for k, v in deltas.items()}
  )


def identity_of(state: PrefixCacheState) -> tuple:
  """The fields that hold the blocks' identities, ``(dup_next, dup_prev,
  block_hash, published, stats)``: the carry of a kernel
  (:func:`prefixjax._masked.kernel`) that publishes or forgets a block;
  :func:`with_identity` puts them back."""
  return (
    state.dup_next,
    state.dup_prev,
    state.block_hash,
    state.paging.published,
    state.stats,
  )


def with_identity(
  state: PrefixCacheState, identity: tuple, index: index_lib.IndexState
) -> PrefixCacheState:
  """``state`` with the fields of :func:`identity_of` and ``index``."""
  dup_next, dup_prev, block_hash, published, stats = identity
  return state.replace(
    paging=state.paging.replace(published=published),
    index=index,
    block_hash=block_hash,
    dup_next=dup_next,
    dup_prev=dup_prev,
    stats=stats,
  )


def settle(state: PrefixCacheState, *values):
  """:func:`prefixjax.cache.paging.settle` on the cache's paging state."""
  return paging.settle(state.paging, *values)


def uses_tree(policy: policies_lib.EvictionPolicy) -> bool:
  """Whether ``policy`` keeps a :mod:`prefixjax.cache.victim_tree`: a
  scoring policy with a ``static_score`` that is not ``leaf_only``."""
  return (
    policy.score is not None and policy.static_score and not policy.leaf_only
  )


def versioned(state: PrefixCacheState, keys: jax.Array, version=None):
  """Index keys: ``keys`` with ``version`` (default the state's) mixed in."""
  version = state.version if version is None else version
  version = jnp.broadcast_to(version, keys.shape[:-1])
  return hashing.hash_words(
    jnp.concatenate([keys, version[..., None]], axis=-1), hashing.SEED_VERSION
  )
