"""Small traceable helpers of the serving engine's loop.

Scalar reads and masked writes of ``[R]`` / ``[S]`` arrays, and the cache
verbs under ``lax.cond``: the verbs do ``O(M)`` work even when they change
nothing (a masked release, a publish with no new full block, an append
inside the last block), so the engine calls them only when they can act;
each skipped call is exactly the identity (or, for an append inside the
last block, the token count it would set). Their operand is the cache
alone: a ``lax.cond`` over the whole engine state would copy every
``[R]`` array each time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._masked import NONE, gather, scatter
from prefixjax.cache import Status, paging
from prefixjax.cache import prefix_cache as pc

__all__ = [
  "OK",
  "append_tokens",
  "at",
  "cap",
  "i32",
  "publish_if",
  "put",
  "release_if",
  "remove_at",
]


def i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32)


def at(x: jax.Array, i) -> jax.Array:
  return gather(x, i32(i)[None])[0]


def put(x: jax.Array, i, value, mask=True) -> jax.Array:
  return scatter(x, i32(i)[None], value, mask)


def cap(n, threshold):
  return jnp.where((threshold > 0) & (threshold < n), threshold, n)


def remove_at(x: jax.Array, k, length, mask) -> jax.Array:
  """``del x[k]`` of the first ``length`` entries (where ``mask``), -1 pad."""
  idx = jnp.arange(x.shape[0])
  moved = gather(x, jnp.where(idx >= k, idx + 1, idx), NONE)
  moved = jnp.where(idx < length - 1, moved, NONE)
  return jnp.where(mask, moved, x)


OK = np.int32(Status.OK)  # a constant: no program compiled at import


def release_if(pred, cache, slot):
  """``pc.release(cache, slot)`` where ``pred``; ``(cache, status)``."""

  def go(cache):
    cache, r = pc.release(cache, slot)
    return cache, r.status

  return jax.lax.cond(pred, go, lambda cache: (cache, OK), cache)


def publish_if(pred, cache, slot, keys, num_tokens):
  """``pc.publish`` where ``pred`` (new full blocks); ``(cache, status)``."""

  def go(cache):
    cache, r = pc.publish(cache, slot, keys, num_tokens)
    return cache, r.status

  return jax.lax.cond(pred, go, lambda cache: (cache, OK), cache)


def append_tokens(cache, slot, n, skip):
  """``pc.append(cache, slot, n)``; ``(cache, status)`` (``skip``: none).

  Inside the last block (no new block, no copy: the partly filled last
  block is neither published nor shared) only the token count moves,
  which is all ``paging.append`` would change.
  """
  pstate = cache.paging
  safe = jnp.where(skip, 0, slot)
  k = cache.block_size
  tokens = at(pstate.num_tokens, safe)
  *_, copy = paging.last_block(pstate, safe)
  grow = paging.blocks_for(tokens + n, k) > paging.blocks_for(tokens, k)
  full = (~skip) & (grow | copy)

  def go(cache):
    cache, r = pc.append(cache, jnp.where(skip, NONE, slot), n)
    return cache, r.status

  def bump(cache):
    counts = put(cache.paging.num_tokens, safe, tokens + n, ~skip)
    return cache.replace(paging=cache.paging.replace(num_tokens=counts)), OK

  return jax.lax.cond(full, go, bump, cache)
