"""Host-checked index verbs (see :mod:`prefixjax.cache.index`).

Each checks that keys are ``uint32`` of shape ``[2]`` (or ``[L, 2]``) and
then calls the traceable verb of the same name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixjax.cache import index as index_lib
from prefixjax.cache.index import IndexState

__all__ = ["check_key", "delete", "insert", "lookup", "update"]


def check_key(key, shape_name: str, batch: bool) -> jax.Array:
  """``key`` as an array, if uint32 of shape ``[L, 2]`` (batch) or ``[2]``."""
  key = jnp.asarray(key)
  want = 2 if batch else 1
  if key.ndim != want or key.shape[-1] != 2 or key.dtype != jnp.uint32:
    raise ValueError(
      f"{shape_name} must be uint32 of shape {'[L, 2]' if batch else '[2]'}, "
      f"got {key.shape} {key.dtype}"
    )
  return key


def lookup(index: IndexState, keys) -> jax.Array:
  """Checked :func:`prefixjax.cache.index.lookup`."""
  return index_lib.lookup(index, check_key(keys, "keys", True))


def insert(index: IndexState, key, value, ok=True):
  """Checked :func:`prefixjax.cache.index.insert`."""
  key = check_key(key, "key", False)
  return index_lib.insert(
    index, key, jnp.asarray(value, jnp.int32), jnp.asarray(ok, jnp.bool_)
  )


def update(index: IndexState, key, value, ok=True):
  """Checked :func:`prefixjax.cache.index.update`."""
  key = check_key(key, "key", False)
  return index_lib.update(
    index, key, jnp.asarray(value, jnp.int32), jnp.asarray(ok, jnp.bool_)
  )


def delete(index: IndexState, key, ok=True):
  """Checked :func:`prefixjax.cache.index.delete`."""
  key = check_key(key, "key", False)
  return index_lib.delete(index, key, jnp.asarray(ok, jnp.bool_))
