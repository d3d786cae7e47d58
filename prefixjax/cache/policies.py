"""Eviction policies for the prefix cache: small pure rules, registered by name.

A policy decides which *free, cached* block (refcount 0, carrying a hash)
loses its identity when the allocator needs a block and no free block without
a hash is left. It is an :class:`EvictionPolicy`: a ``NamedTuple`` of pure
functions built by a factory with keyword-only hyperparameters (optax's
style), with its per-block metadata in a small pytree of ``[N]`` arrays that
lives in the cache state (``PrefixCacheState.policy_state``), so it is
jittable and ``jax.vmap``-able over configurations (e.g. an ``lfu`` decay or a
``belady`` trace per configuration).

The protocol:

* ``init(num_blocks) -> policy_state``: the metadata, a pytree of arrays
  (``[N]`` per-block arrays and scalar hyperparameters).
* ``on_touch(policy_state, blocks, lanes, now, next_use) -> policy_state``:
  ``blocks [M]`` int32 were hit by a request at step ``now`` (``[]`` int32,
  the cache's request clock); only ``lanes [M]`` bool are real, and the real
  blocks are distinct. ``next_use [M]`` int32 is whatever the caller passed
  per block-table column (by convention the step of the next request that
  will use the block's key, :data:`NEVER` if none: see
  :func:`next_use_from_keys`).
* ``on_publish(policy_state, blocks, lanes, now, next_use) -> policy_state``:
  the same for blocks that just got their hash (entered the cache).
* ``score(policy_state, now) -> [N]`` int32 or float32: the victim is the
  *eligible* block with the lowest score. Ties go to the deepest block (the
  largest table column at publish: a chain loses its tail first, as in
  vLLM's tail-first release, and a parent never goes before a child with
  the same score), then to the lowest block id. Scores must not be NaN.
  ``score=None`` means "free-queue order" (``lru``): no scan, the queue head
  is the victim.
* ``leaf_only``: only blocks with no cached child are eligible (radix-tree
  order). A block's parent is the block before it in the table of the
  sequence that published it (set at publish); the cache keeps a cached-child
  count per block. If every free cached block has a cached child (possible
  only when a child is pinned by a running sequence while its parent is
  free), the rule falls back to all free cached blocks.

Eligible blocks are ``refcount == 0``, published, not the null block (and a
leaf, for ``leaf_only``). Selection runs only after the free blocks without
a hash are used up. For a ``static_score`` policy that is not ``leaf_only``
(``fifo``, ``belady``) the cache keeps the eligible blocks in a 32-way
tournament tree (:mod:`prefixjax.cache.victim_tree`): the victim is its root,
and each block that becomes or stops being eligible (hit, release, eviction)
costs ``ceil(log32 N)`` small reductions, so these policies cost O(blocks
touched * log32 N) per verb and never scan the pool. Otherwise (``lfu``,
the leaf policies, user-defined policies by default) selection is one
masked reduction over ``[N]`` per victim.

Built-in policies (see each factory): ``lru``, ``fifo``, ``lfu``,
``lru_leaf``, ``belady``, ``belady_leaf``. A user-defined policy is any
:class:`EvictionPolicy`; register it with :func:`register_policy` to name it
in configs.

Example (a user-defined policy: evict the largest block id first):

  >>> import jax.numpy as jnp
  >>> from prefixjax.cache import policies, prefix_cache as pc
  >>> largest_id = policies.EvictionPolicy(
  ...     init=lambda n: jnp.arange(n, dtype=jnp.int32),
  ...     score=lambda ids, now: -ids)
  >>> s = pc.init(8, 4, max_seqs=1, max_blocks_per_seq=4, policy=largest_id)
  >>> policies.register_policy(
  ...     "largest_id", lambda policy=largest_id: policy, overwrite=True)
  >>> "largest_id" in policies.policy_names()
  True

Dimensions: ``N`` blocks (including the null block 0), ``M`` block-table
columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
  "NEVER",
  "EvictionPolicy",
  "belady",
  "belady_leaf",
  "fifo",
  "get_policy",
  "lfu",
  "lru",
  "lru_leaf",
  "next_use_from_keys",
  "policy_names",
  "register_policy",
  "select_victim",
]

NEVER = 2**31 - 1
"""``next_use`` of a block whose key is never used again."""

PolicyState = Any
Hook = Callable[
  [PolicyState, jax.Array, jax.Array, jax.Array, jax.Array], PolicyState
]


def _keep(policy_state, blocks, lanes, now, next_use):
  del blocks, lanes, now, next_use
  return policy_state


class EvictionPolicy(NamedTuple):
  """An eviction rule (see the module docstring for the protocol).

  Attributes:
    init: ``num_blocks -> policy_state``.
    score: ``(policy_state, now) -> [N]`` scores, lowest evicted first (ties:
      deepest, then lowest block id); ``None`` for free-queue order
      (``lru``).
    on_touch: hook for blocks hit by a request.
    on_publish: hook for blocks that just entered the cache.
    leaf_only: only blocks without a cached child are eligible.
    static_score: a promise that a block's score changes only through the
      hooks on that block (never with ``now``, never while the block is
      free) and that ``score`` is elementwise: block ``b``'s score reads
      only entry ``b`` of the ``[N]`` arrays in ``policy_state`` (other
      leaves are scalars). The cache then keeps its free cached blocks in
      a tournament tree (:mod:`prefixjax.cache.victim_tree`) instead of scanning
      ``[N]`` per victim. Ignored for ``leaf_only`` policies.
  """

  init: Callable[[int], PolicyState]
  score: Callable[[PolicyState, jax.Array], jax.Array] | None = None
  on_touch: Hook = _keep
  on_publish: Hook = _keep
  leaf_only: bool = False
  static_score: bool = False


def _set(x, blocks, lanes, values):
  n = x.shape[0]
  safe = jnp.where(lanes & (blocks >= 0) & (blocks < n), blocks, n)
  return x.at[safe].set(values, mode="drop")


def _stamp(policy_state, blocks, lanes, now, next_use):
  """Sets ``[N]`` int32 ``policy_state`` to ``now`` on ``blocks[lanes]``."""
  del next_use
  return _set(policy_state, blocks, lanes, now)


def _store_next_use(policy_state, blocks, lanes, now, next_use):
  del now
  return _set(policy_state, blocks, lanes, next_use)


def _zeros(num_blocks: int) -> jax.Array:
  return jnp.zeros((num_blocks,), jnp.int32)


@functools.cache
def lru() -> EvictionPolicy:
  """vLLM's order: the free queue *is* the eviction order (head first).

  A released sequence's blocks join the queue tail last block first, so the
  least recently released blocks go first and, within a sequence, its deepest
  blocks first. O(blocks touched): no scan, no metadata.
  """
  return EvictionPolicy(init=lambda num_blocks: ())


@functools.cache
def fifo() -> EvictionPolicy:
  """First in, first out: the block published at the earliest step.

  Metadata: ``[N]`` int32 publish step. Hits do not refresh it. Blocks
  published by the same request share a step: deepest first (the general
  tie-break), so a request's chain leaves from its tail.
  """
  return EvictionPolicy(
    init=_zeros,
    score=lambda inserted, now: inserted,
    on_publish=_stamp,
    static_score=True,
  )


class LfuState(NamedTuple):
  """``lfu`` metadata.

  Attributes:
    count: ``[N]`` float32 (decayed) use count as of step ``stamp``.
    stamp: ``[N]`` int32 step of the last use.
    decay: ``[]`` float32 factor per step (1 = no decay); an array so a
      sweep can vmap over it.
  """

  count: jax.Array  # [N] float32
  stamp: jax.Array  # [N] int32
  decay: jax.Array  # [] float32


def _decayed(state: LfuState, blocks, now):
  dt = (now - state.stamp[blocks]).astype(jnp.float32)
  return state.count[blocks] * jnp.power(state.decay, dt)


def lfu(*, decay: float | None = None) -> EvictionPolicy:
  """Least frequently used, with optional exponential decay.

  A publish sets the count to 1; each hit adds 1. With ``decay`` the count
  is multiplied by ``decay`` per request step (``count * decay ** (now -
  last_use)``, kept lazily, float32), so old popularity fades. Ties (equal
  counts, e.g. a parent and the child hit with it): deepest first.

  Args:
    decay: factor in ``(0, 1]`` per step, or ``None`` (no decay).

  Raises:
    ValueError: ``decay`` outside ``(0, 1]``.
  """
  if isinstance(decay, bool | str | bytes):  # float() would take "0.5"
    raise ValueError(f"{decay=} must be a number in (0, 1]")
  if decay is not None and not 0.0 < decay <= 1.0:
    raise ValueError(f"{decay=} must be in (0, 1]")
  return _lfu(1.0 if decay is None else float(decay))


@functools.cache
def _lfu(factor: float) -> EvictionPolicy:
  def init(num_blocks):
    return LfuState(
      count=jnp.zeros((num_blocks,), jnp.float32),
      stamp=jnp.zeros((num_blocks,), jnp.int32),
      decay=jnp.float32(factor),
    )

  def on_touch(state: LfuState, blocks, lanes, now, next_use):
    del next_use
    count = _decayed(state, blocks, now) + jnp.float32(1)
    return state._replace(
      count=_set(state.count, blocks, lanes, count),
      stamp=_set(state.stamp, blocks, lanes, now),
    )

  def on_publish(state: LfuState, blocks, lanes, now, next_use):
    del next_use
    return state._replace(
      count=_set(state.count, blocks, lanes, jnp.float32(1)),
      stamp=_set(state.stamp, blocks, lanes, now),
    )

  def score(state: LfuState, now):
    dt = (now - state.stamp).astype(jnp.float32)
    return state.count * jnp.power(state.decay, dt)

  return EvictionPolicy(
    init=init,
    score=score,
    on_touch=on_touch,
    on_publish=on_publish,
    # Not static_score even without decay: ``decay`` is an array in the
    # state (a sweep may vmap it), and decayed counts change with ``now``.
  )


@functools.cache
def lru_leaf() -> EvictionPolicy:
  """SGLang's radix order: the least recently used block with no cached child.

  Metadata: ``[N]`` int32 step of the last hit or publish. All blocks of one
  request share a step; on one chain only the deepest is a leaf; ties
  between leaves go to the deeper one, then the lowest block id.
  """
  return EvictionPolicy(
    init=_zeros,
    score=lambda last, now: last,
    on_touch=_stamp,
    on_publish=_stamp,
    leaf_only=True,
    static_score=True,
  )


def _belady(leaf_only: bool) -> EvictionPolicy:
  return EvictionPolicy(
    init=lambda num_blocks: jnp.full((num_blocks,), NEVER, jnp.int32),
    score=lambda next_use, now: -next_use,
    on_touch=_store_next_use,
    on_publish=_store_next_use,
    leaf_only=leaf_only,
    static_score=True,
  )


@functools.cache
def belady() -> EvictionPolicy:
  """Offline optimal: evict the block whose key is next used furthest ahead.

  The next-use times come from the trace: pass ``next_use`` ``[L]`` int32
  per block to :func:`prefixjax.cache.prefix_cache.allocate_with_prefix` and
  :func:`~prefixjax.cache.prefix_cache.publish` (the request step at which the
  block's key is next wanted, :data:`NEVER` if never; see
  :func:`next_use_from_keys`). Each hit or publish stores it. Blocks never
  used again tie at :data:`NEVER`: deepest first.

  Not optimal for a prefix cache: a block is usable only while its whole
  prefix is cached, which block-level next-use times ignore (evicting a
  parent strands its children); :func:`belady_leaf` respects the chains.
  """
  return _belady(leaf_only=False)


@functools.cache
def belady_leaf() -> EvictionPolicy:
  """:func:`belady` restricted to blocks with no cached child (radix leaves)."""
  return _belady(leaf_only=True)


# ---------------------------------------------------------------------------
# Registry.

_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {
  "belady": belady,
  "belady_leaf": belady_leaf,
  "fifo": fifo,
  "lfu": lfu,
  "lru": lru,
  "lru_leaf": lru_leaf,
}


def register_policy(
  name: str, factory: Callable[..., EvictionPolicy], *, overwrite=False
) -> None:
  """Registers ``factory`` (keyword hyperparameters -> policy) as ``name``.

  Return the same policy object for equal hyperparameters (e.g. decorate the
  factory with ``functools.cache``): the policy is a static part of the
  cache state, and a new object means a new compilation.

  Raises:
    ValueError: ``name`` is taken and not ``overwrite``.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"policy name must be a non-empty string, got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"policy {name!r} is already registered")
  _REGISTRY[name] = factory


def get_policy(name: str, **params) -> EvictionPolicy:
  """The policy registered as ``name``, built with ``params``.

  Example:
    >>> from prefixjax.cache import policies
    >>> policies.get_policy("lfu", decay=0.9) is policies.lfu(decay=0.9)
    True
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown policy {name!r}; known: {policy_names()}")
  policy = _REGISTRY[name](**params)
  if not isinstance(policy, EvictionPolicy):
    raise TypeError(
      f"factory of {name!r} returned {type(policy).__name__}, "
      "not an EvictionPolicy"
    )
  return policy


def policy_names() -> tuple[str, ...]:
  """Registered policy names, sorted."""
  return tuple(sorted(_REGISTRY))


# ---------------------------------------------------------------------------
# Selection (used by the prefix cache).


def select_victim(
  policy: EvictionPolicy,
  policy_state: PolicyState,
  now: jax.Array,
  evictable: jax.Array,
  leaf: jax.Array | None,
  depth: jax.Array | None = None,
) -> jax.Array:
  """The block to evict: the eligible block with the lowest score; ties go
  to the deepest block (largest ``depth``), then to the lowest block id.

  Args:
    policy: a policy with a ``score``.
    policy_state: its metadata.
    now: ``[]`` int32 request step.
    evictable: ``[N]`` bool free cached blocks.
    leaf: ``[N]`` bool blocks without a cached child (used when
      ``policy.leaf_only``; if no evictable block is a leaf, every evictable
      block is eligible).
    depth: ``[N]`` int32 table column each block was published at, or
      ``None`` (no depth tie-break).

  Returns:
    ``[]`` int32 block id, or ``-1`` when nothing is evictable.
  """
  eligible = evictable
  if policy.leaf_only:
    leaves = evictable & leaf
    eligible = jnp.where(jnp.any(leaves), leaves, evictable)
  score = policy.score(policy_state, now)
  high = (
    jnp.finfo(score.dtype).max
    if jnp.issubdtype(score.dtype, jnp.floating)
    else jnp.iinfo(score.dtype).max
  )
  best = jnp.min(jnp.where(eligible, score, high))
  candidates = eligible & (score == best)
  if depth is not None:
    deepest = jnp.max(jnp.where(candidates, depth, -1))
    candidates = candidates & (depth == deepest)
  victim = jnp.argmax(candidates).astype(jnp.int32)
  return jnp.where(jnp.any(candidates), victim, jnp.int32(-1))


# ---------------------------------------------------------------------------
# Host-side helper.


def next_use_from_keys(
  keys: Sequence[Sequence[Hashable]], num_usable: Sequence[int] | None = None
) -> list[list[int]]:
  """Next-use steps for :func:`belady` from a trace's block keys.

  Args:
    keys: per request (step ``i + 1`` for request ``i``, the cache's clock),
      the hashable keys of its full blocks in order.
    num_usable: per request, how many leading keys a lookup may hit (e.g.
      ``(P - 1) // K``); default all.

  Returns:
    Per request, per block, the step of the next later request whose first
    ``num_usable`` keys contain that key, or :data:`NEVER`.

  Example:
    >>> from prefixjax.cache import policies
    >>> policies.next_use_from_keys([["a", "b"], ["a"], ["b"]])
    [[2, 3], [2147483647], [2147483647]]
  """
  if num_usable is None:
    num_usable = [len(k) for k in keys]
  upcoming: dict[Hashable, int] = {}
  out: list[list[int]] = [[] for _ in keys]
  for i in range(len(keys) - 1, -1, -1):
    row = [int(upcoming.get(k, NEVER)) for k in keys[i]]
    out[i] = row
    for k in keys[i][: int(num_usable[i])]:
      upcoming[k] = i + 1
  return out


def as_next_use(next_use, length: int) -> jax.Array:
  """``[L]`` int32 -> ``[length]`` (padded with :data:`NEVER`, truncated)."""
  if next_use is None:
    return jnp.full((length,), NEVER, jnp.int32)
  arr = jnp.asarray(next_use)
  if arr.ndim != 1 or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(
      f"next_use must be an integer array of shape [L], got {arr.shape} "
      f"{arr.dtype}"
    )
  arr = arr.astype(jnp.int32)
  if arr.shape[0] < length:
    arr = jnp.concatenate(
      [arr, jnp.full((length - arr.shape[0],), NEVER, jnp.int32)]
    )
  return arr[:length]
