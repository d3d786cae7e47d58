"""Host-checked prefix-cache verbs (see :mod:`prefixjax.cache.prefix_cache`).

Each checks the state type, ids and counts (as
:mod:`prefixjax.cache.checked.paging` does), key arrays (``uint32``
``[L, 2]``) and ``next_use`` on the host, then calls the traceable verb of
the same name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.cache import policies as policies_lib
from prefixjax.cache import prefix_cache
from prefixjax.cache.checked.paging import (
  as_index,
  as_sequence,
  host_array,
  host_int,
)
from prefixjax.cache.prefix_cache import PrefixCacheState, check_state

__all__ = [
  "allocate_with_prefix",
  "append",
  "check_state",
  "copy_on_write",
  "fork",
  "invalidate",
  "keys_arg",
  "match",
  "next_use_arg",
  "publish",
  "release",
]


def keys_arg(
  state: PrefixCacheState, block_keys, num_tokens=None, what="num_tokens"
) -> jax.Array:
  """``[L, 2]`` uint32 -> ``[M, 2]`` (padded or cut to the table width).

  ``block_keys`` must hold a key for every full block of ``num_tokens``
  that fits the table (``min(num_tokens // K, M)`` rows): a missing key is
  refused here, never padded into a key that could hit or be published.
  """
  host = host_array(block_keys)  # its dtype before any cast (uint64 wraps)
  keys = jnp.asarray(block_keys) if host is None else host
  if keys.ndim != 2 or keys.shape[-1] != 2 or keys.dtype != np.uint32:
    raise ValueError(
      f"block_keys must be uint32 of shape [L, 2], got {keys.shape} "
      f"{keys.dtype}"
    )
  keys = jnp.asarray(keys)
  m = state.max_blocks_per_seq
  tokens = None if num_tokens is None else host_int(what, num_tokens)
  if tokens is not None:  # concrete (a Python, numpy or jax scalar)
    need = min(tokens // state.block_size, m)
    if keys.shape[0] < need:
      raise ValueError(
        f"block_keys has {keys.shape[0]} rows but {what}={tokens} "
        f"has {need} full blocks of {state.block_size} tokens: every full "
        "block needs its key"
      )
  if keys.shape[0] < m:
    keys = jnp.concatenate(
      [keys, jnp.zeros((m - keys.shape[0], 2), jnp.uint32)]
    )
  return keys[:m]


def next_use_arg(state: PrefixCacheState, next_use):
  """``None`` or ``[L]`` int -> ``None`` or ``[M]`` int32."""
  if next_use is None:
    return None
  return policies_lib.as_next_use(next_use, state.max_blocks_per_seq)


def match(state: PrefixCacheState, block_keys, num_prompt_tokens):
  """Checked :func:`prefixjax.cache.prefix_cache.match`."""
  check_state(state)
  return prefix_cache.match(
    state,
    keys_arg(state, block_keys, num_prompt_tokens, "num_prompt_tokens"),
    as_index("num_prompt_tokens", num_prompt_tokens),
  )


def allocate_with_prefix(
  state: PrefixCacheState,
  seq_id,
  block_keys,
  num_prompt_tokens,
  *,
  next_use=None,
):
  """Checked :func:`prefixjax.cache.prefix_cache.allocate_with_prefix`."""
  check_state(state)
  return prefix_cache.allocate_with_prefix(
    state,
    as_sequence(state, "seq_id", seq_id),
    keys_arg(state, block_keys, num_prompt_tokens, "num_prompt_tokens"),
    as_index("num_prompt_tokens", num_prompt_tokens),
    next_use_arg(state, next_use),
  )


def append(state: PrefixCacheState, seq_id, num_new_tokens):
  """Checked :func:`prefixjax.cache.prefix_cache.append`."""
  check_state(state)
  return prefix_cache.append(
    state,
    as_sequence(state, "seq_id", seq_id),
    as_index("num_new_tokens", num_new_tokens),
  )


def copy_on_write(state: PrefixCacheState, seq_id):
  """Checked :func:`prefixjax.cache.prefix_cache.copy_on_write`."""
  check_state(state)
  return prefix_cache.copy_on_write(state, as_sequence(state, "seq_id", seq_id))


def fork(state: PrefixCacheState, parent_id, child_id):
  """Checked :func:`prefixjax.cache.prefix_cache.fork`."""
  check_state(state)
  return prefix_cache.fork(
    state,
    as_sequence(state, "parent_id", parent_id),
    as_sequence(state, "child_id", child_id),
  )


def publish(
  state: PrefixCacheState, seq_id, block_keys, num_tokens, *, next_use=None
):
  """Checked :func:`prefixjax.cache.prefix_cache.publish`.

  Also refuses ``num_tokens`` beyond what the sequence holds (a concrete
  state is read on the host).
  """
  check_state(state)
  seq = as_sequence(state, "seq_id", seq_id)
  seq_host = host_int("seq_id", seq_id)
  tokens = host_int("num_tokens", num_tokens)
  if tokens is not None and seq_host is not None:  # both concrete
    held = host_array(state.paging.num_tokens)
    if held is not None and tokens > int(held[seq_host]):
      raise ValueError(
        f"num_tokens={tokens} but sequence {seq_host} holds "
        f"{int(held[seq_host])} tokens: only blocks it holds can be published"
      )
  return prefix_cache.publish(
    state,
    seq,
    keys_arg(state, block_keys, num_tokens),
    as_index("num_tokens", num_tokens),
    next_use_arg(state, next_use),
  )


def release(state: PrefixCacheState, seq_id):
  """Checked :func:`prefixjax.cache.prefix_cache.release`."""
  check_state(state)
  return prefix_cache.release(state, as_sequence(state, "seq_id", seq_id))


def invalidate(state: PrefixCacheState):
  """Checked :func:`prefixjax.cache.prefix_cache.invalidate`."""
  check_state(state)
  return prefix_cache.invalidate(state)
