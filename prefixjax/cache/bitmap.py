"""Hierarchical bitmaps over integer keys, for device-side replays.

Level 0 has one bit per key; a bit of level ``l + 1`` says whether the word
of level ``l`` under it is nonzero; the top level is one word. All levels
live in one flat uint32 array; ``offsets`` (from :func:`layout`, a static
tuple) says where each level starts. Finding the smallest or largest set
key is one word gather per level (3-4 levels); updating a batch of keys is
one gather (:func:`words`) and one scatter (:func:`update`), so callers can
route the gathered words through :func:`prefixjax._masked.barrier`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._masked import gather, scatter

__all__ = ["find", "index", "layout", "update", "words"]


def layout(num_keys: int) -> tuple[tuple[int, ...], int]:
  """``(offsets, total_words)`` of a bitmap over ``num_keys`` keys."""
  sizes = []
  n = num_keys
  while True:
    n = -(-n // 32)
    sizes.append(n)
    if n == 1:
      break
  offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
  return tuple(int(o) for o in offsets[:-1]), int(offsets[-1])


def _word(bm, i):
  return gather(bm, jnp.asarray(i)[None], 0)[0]


def find(bm: jax.Array, offsets, *, rightmost: bool = False) -> jax.Array:
  """The smallest (largest if ``rightmost``) set key, or -1."""
  i = jnp.int32(0)
  for off in reversed(offsets):
    w = _word(bm, off + i)
    if rightmost:
      b = 31 - jax.lax.clz(w).astype(jnp.int32)
    else:
      b = jax.lax.population_count((w & (~w + 1)) - 1).astype(jnp.int32)
    i = i * 32 + b
  found = _word(bm, jnp.int32(offsets[-1])) != 0
  return jnp.where(found, i, jnp.int32(-1))


def index(offsets, keys: jax.Array) -> jax.Array:
  """``[U, L]`` word indices of ``keys`` (``[U]``) at every level; -1 for
  negative keys."""
  shifts = 5 * jnp.arange(1, len(offsets) + 1, dtype=jnp.int32)
  base = jnp.asarray(offsets, jnp.int32)
  word = keys[:, None] >> shifts[None, :]
  return jnp.where(keys[:, None] >= 0, base[None, :] + word, -1)


def words(bm: jax.Array, offsets, keys: jax.Array) -> jax.Array:
  """``[U, L]`` the words on the paths of ``keys``, one gather."""
  idx = index(offsets, keys)
  return gather(bm, idx.reshape(-1), 0).reshape(idx.shape)


def update(bm, offsets, keys, old_words, sets, dos) -> jax.Array:
  """Sets (``sets``) or clears the bits of distinct ``keys`` where ``dos``.

  ``old_words`` are the words on the keys' paths from :func:`words`, read
  before any write. A key both cleared and set stays set. Lanes sharing a
  word get the same merged value, so one scatter writes every level.
  """
  u32 = jnp.uint32
  idx = index(offsets, keys)
  new = []
  value = sets  # the bit each active lane writes at this level
  for lv in range(len(offsets)):
    same = (idx[:, lv][:, None] == idx[:, lv][None, :]) & dos[None, :]
    bit = jnp.left_shift(u32(1), ((keys >> (5 * lv)) & 31).astype(u32))
    on = jnp.where(same & value[None, :], bit[None, :], u32(0))
    off = jnp.where(same & ~value[None, :], bit[None, :], u32(0))
    or_all = lambda m: jax.lax.reduce(m, u32(0), jax.lax.bitwise_or, (1,))
    w = (old_words[:, lv] & ~or_all(off)) | or_all(on)
    new.append(w)
    value = w != 0
  new = jnp.stack(new, axis=1)
  mask = jnp.broadcast_to(dos[:, None], idx.shape)
  return scatter(bm, idx.reshape(-1), new.reshape(-1), mask.reshape(-1))
