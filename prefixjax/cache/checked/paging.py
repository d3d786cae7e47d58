"""Host-checked paging verbs: concrete arguments validated, clear errors.

Each function has the name and arguments of the traceable verb in
:mod:`prefixjax.cache.paging` and calls it after checking, on the host, that
the state is a :class:`~prefixjax.cache.paging.PagingState` and that ids and
counts are integer scalars in range (``TypeError`` / ``ValueError`` naming
the argument and its value). Use these at a program's boundary; inside
``jit`` / ``vmap`` / ``scan`` call the traceable verbs, whose failures are
status values.

Example:
  >>> from prefixjax.cache import paging
  >>> from prefixjax.cache.checked import paging as checked
  >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
  ...                 max_blocks_per_seq=3)
  >>> s, r = checked.allocate(s, 0, 6)
  >>> s.block_tables[0].tolist(), int(r.status)
  ([1, 2, 0], 0)
  >>> checked.allocate(s, 1, -1)
  Traceback (most recent call last):
  ...
  ValueError: num_tokens=-1 must be >= 0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.cache import paging
from prefixjax.cache.paging import BatchView, PagingState, check_state
from prefixjax.cache.paging_state import DEFAULT_VLLM_VERSION

__all__ = [
  "allocate",
  "append",
  "as_index",
  "as_int32_array",
  "as_sequence",
  "batch_view",
  "check_state",
  "copy_on_write",
  "fork",
  "host_array",
  "host_int",
  "release",
  "slot_mapping",
]


def as_index(name: str, value) -> jax.Array:
  """Converts a scalar id or count to an int32 array, checking its type.

  Concrete negative values are reported here; traced values are checked by
  the verb, which returns a status.
  """
  return _index(name, value)[0]


def _index(name: str, value) -> tuple[jax.Array, int | None]:
  """:func:`as_index`'s array, and its value on the host (None if traced)."""
  if isinstance(value, bool):
    raise TypeError(f"{name}={value!r} must be an integer, not a bool")
  if isinstance(value, (int, np.integer)):
    return _in_int32(name, int(value)), int(value)
  if value is None or isinstance(value, (str, bytes, float)):
    raise TypeError(f"{name}={value!r} must be an integer scalar")
  host = _concrete(value)
  arr = jnp.asarray(value) if host is None else host
  if arr.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
  if arr.dtype == bool or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
  if host is not None:  # concrete: its value checked before the cast
    return _in_int32(name, int(host)), int(host)
  return arr.astype(jnp.int32), None


def host_int(name: str, value) -> int | None:
  """A scalar id or count on the host (checked as :func:`as_index`
  checks it), or None when it is traced."""
  return _index(name, value)[1]


def host_array(value) -> np.ndarray | None:
  """``value`` on the host, or None when it is traced."""
  return _concrete(value)


def _concrete(value) -> np.ndarray | None:
  """``value`` on the host, or None when it is traced."""
  try:
    return np.asarray(value)
  except (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
  ):
    return None


def _in_int32(name: str, value: int) -> jax.Array:
  if value < 0:
    raise ValueError(f"{name}={value} must be >= 0")
  if value >= 2**31:
    raise ValueError(f"{name}={value} does not fit in int32")
  return jnp.asarray(value, jnp.int32)


def as_sequence(state, name: str, value) -> jax.Array:
  """:func:`as_index` for a sequence id, also checked against the state's
  ``max_seqs`` when concrete."""
  index, host = _index(name, value)  # the value read on the host once
  if host is not None and host >= state.max_seqs:
    raise ValueError(
      f"{name}={host} is outside [0, {state.max_seqs}) "
      f"(max_seqs={state.max_seqs})"
    )
  return index


def allocate(state: PagingState, seq_id, num_tokens):
  """Checked :func:`prefixjax.cache.paging.allocate`."""
  check_state(state)
  return paging.allocate(
    state,
    as_sequence(state, "seq_id", seq_id),
    as_index("num_tokens", num_tokens),
  )


def copy_on_write(state: PagingState, seq_id):
  """Checked :func:`prefixjax.cache.paging.copy_on_write`."""
  check_state(state)
  return paging.copy_on_write(state, as_sequence(state, "seq_id", seq_id))


def append(state: PagingState, seq_id, num_new_tokens):
  """Checked :func:`prefixjax.cache.paging.append`."""
  check_state(state)
  return paging.append(
    state,
    as_sequence(state, "seq_id", seq_id),
    as_index("num_new_tokens", num_new_tokens),
  )


def fork(state: PagingState, parent_id, child_id):
  """Checked :func:`prefixjax.cache.paging.fork`."""
  check_state(state)
  return paging.fork(
    state,
    as_sequence(state, "parent_id", parent_id),
    as_sequence(state, "child_id", child_id),
  )


def release(
  state: PagingState, seq_id, *, vllm_version: str = DEFAULT_VLLM_VERSION
):
  """Checked :func:`prefixjax.cache.paging.release` (``vllm_version`` a
  release name, static: checked before any work)."""
  check_state(state)
  paging.vllm_free_order(vllm_version)  # raises naming the accepted ones
  return paging.release(
    state, as_sequence(state, "seq_id", seq_id), vllm_version=vllm_version
  )


def as_int32_array(name: str, value) -> jax.Array:
  """A 1-D integer array as int32; concrete values are checked to fit
  int32 on the host before the cast (an int64 ``2**32 + 1`` would wrap to
  1). Negative values stay: the verbs read them as padding."""
  host = _concrete(value)
  arr = jnp.asarray(value) if host is None else host
  if arr.ndim != 1:
    raise ValueError(f"{name} must be 1-D [T], got shape {arr.shape}")
  if arr.dtype == bool or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"{name} must be integer, got dtype {arr.dtype}")
  if host is not None and host.size:
    bad = (host < -(2**31)) | (host >= 2**31)
    if bad.any():
      i = int(np.flatnonzero(bad)[0])
      raise ValueError(f"{name}[{i}]={int(host[i])} does not fit in int32")
  return jnp.asarray(arr, jnp.int32)


def slot_mapping(state: PagingState, seq_ids, positions) -> jax.Array:
  """Checked :func:`prefixjax.cache.paging.slot_mapping`."""
  check_state(state)
  seq_ids = as_int32_array("seq_ids", seq_ids)
  positions = as_int32_array("positions", positions)
  if seq_ids.shape != positions.shape:
    raise ValueError(
      f"seq_ids shape {seq_ids.shape} != positions shape {positions.shape}"
    )
  return paging.slot_mapping(
    state, seq_ids.astype(jnp.int32), positions.astype(jnp.int32)
  )


def batch_view(state: PagingState, seq_ids) -> BatchView:
  """Checked :func:`prefixjax.cache.paging.batch_view`."""
  check_state(state)
  host = _concrete(seq_ids)
  arr = jnp.asarray(seq_ids) if host is None else host
  if arr.ndim != 1 or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(
      f"seq_ids must be a 1-D integer array, got {arr.shape} {arr.dtype}"
    )
  if host is not None:
    bad = (host < 0) | (host >= state.max_seqs)
    if bad.any():
      raise ValueError(
        f"seq_ids[{int(np.argmax(bad))}]={int(host[bad][0])} is outside "
        f"[0, {state.max_seqs}) (max_seqs={state.max_seqs})"
      )
  return paging.batch_view(state, jnp.asarray(arr, jnp.int32))
