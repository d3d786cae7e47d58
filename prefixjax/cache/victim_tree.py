"""A 32-way tournament tree that keeps the best eviction candidate on top.

Used by the prefix cache for scoring policies whose block scores never
change while a block is free (``EvictionPolicy.static_score``: ``fifo``,
``belady``). Leaves are block ids ``0 .. N - 1``;
each internal node holds the id of the best *eligible* block below it (or
:data:`prefixjax._masked.NO_BLOCK`), so the victim is the root, read in O(1),
and a block whose eligibility changes costs one refresh of its path: ``L =
ceil(log32 N)`` levels (3 for 32,768 blocks, 4 for a million), each a
32-lane gather and reduction. No step scans the pool.

"Best" is the order of :func:`prefixjax.cache.policies.select_victim`: the
lowest score, then the largest depth, then the lowest block id. The caller
supplies ``rank(ids) -> (valid, score, depth)`` for a ``[32]`` vector of ids
(which may hold ``NO_BLOCK`` or ids ``>= N``; those must come back invalid).

The tree is a tuple of int32 arrays, bottom level first: level ``l`` has
``ceil(N / 32**(l + 1))`` entries, padded with ``NO_BLOCK`` to a multiple
of 32 (so every group slices in bounds) except the top, which has one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from prefixjax._masked import NO_BLOCK, scatter

__all__ = ["WIDTH", "best", "build", "init", "refresh", "victim"]

WIDTH = 32
"""Children per node."""

_INT32_MAX = 2**31 - 1

Rank = Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def _sizes(num_leaves: int) -> list[int]:
  sizes, n = [], num_leaves
  while True:
    n = -(-n // WIDTH)
    sizes.append(n)
    if n == 1:
      return sizes


def init(num_leaves: int) -> tuple[jax.Array, ...]:
  """An empty tree (no eligible leaf) over ``num_leaves >= 1`` leaves."""
  if num_leaves < 1:
    raise ValueError(f"{num_leaves=} must be >= 1")
  sizes = _sizes(num_leaves)
  lengths = [above * WIDTH for above in sizes[1:]] + [1]
  return tuple(jnp.full((n,), NO_BLOCK, jnp.int32) for n in lengths)


def best(
  ids: jax.Array, valid: jax.Array, score: jax.Array, depth: jax.Array
) -> jax.Array:
  """The best id along the last axis (lowest score, deepest, lowest id), or
  ``NO_BLOCK`` where none is valid."""
  high = (
    jnp.finfo(score.dtype).max
    if jnp.issubdtype(score.dtype, jnp.floating)
    else jnp.iinfo(score.dtype).max
  )
  low = jnp.min(jnp.where(valid, score, high), axis=-1, keepdims=True)
  cand = valid & (score == low)
  deep = jnp.max(jnp.where(cand, depth, -1), axis=-1, keepdims=True)
  cand = cand & (depth == deep)
  out = jnp.min(jnp.where(cand, ids, _INT32_MAX), axis=-1)
  return jnp.where(jnp.any(cand, axis=-1), out, NO_BLOCK).astype(jnp.int32)


def _group(level: jax.Array, g: jax.Array) -> jax.Array:
  return jax.lax.dynamic_slice(level, (g * WIDTH,), (WIDTH,))


def refresh(
  tree: tuple[jax.Array, ...], leaf: jax.Array, ok: jax.Array, rank: Rank
) -> tuple[jax.Array, ...]:
  """Recomputes the path above ``leaf`` (``[]`` int32) if ``ok``.

  Call it after anything that may change the leaf's eligibility or rank.
  """
  g = jnp.clip(leaf, 0, None) // WIDTH
  ids = g * WIDTH + jnp.arange(WIDTH, dtype=jnp.int32)
  value = best(ids, *rank(ids))
  out = []
  for level, arr in enumerate(tree):
    if level:
      children = _group(out[-1], g)
      value = best(children, *rank(children))
    out.append(scatter(arr, g[None], value, ok))
    g = g // WIDTH
  return tuple(out)


def build(num_leaves: int, rank: Rank) -> tuple[jax.Array, ...]:
  """The tree from scratch, O(N): for checks and for rebuilding."""
  sizes = _sizes(num_leaves)
  ids = jnp.arange(sizes[0] * WIDTH, dtype=jnp.int32).reshape(-1, WIDTH)
  out = []
  for level in range(len(sizes)):
    if level:
      ids = out[-1][: sizes[level] * WIDTH].reshape(-1, WIDTH)
    values = best(ids, *jax.vmap(rank)(ids))
    if level + 1 < len(sizes):
      pad = sizes[level + 1] * WIDTH - values.shape[0]
      values = jnp.concatenate([values, jnp.full((pad,), NO_BLOCK, jnp.int32)])
    out.append(values)
  return tuple(out)


def victim(tree: tuple[jax.Array, ...]) -> jax.Array:
  """``[]`` int32 the best eligible leaf, ``NO_BLOCK`` if none."""
  return tree[-1][0]
