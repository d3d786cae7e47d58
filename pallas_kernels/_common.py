"""Helpers shared by the kernels: argument checks and the online softmax.

Dimension letters used across the package:

* ``B``: requests (decode batch), ``G``: prefix groups, ``S``: sequences in a
  prefill batch, ``T``: tokens (ragged, flattened), ``C``: page copies.
* ``Hq``: query heads, ``Hkv``: key/value heads, ``g = Hq // Hkv`` (GQA).
* ``N``: pages in the pool, ``K``: page size (tokens per page), ``D``: head
  dim, ``P``: block-table width (pages per sequence).
* ``R``: query rows that share one KV head in a kernel block.

Masking never multiplies a masked value by zero: scores of masked slots are
replaced with ``-inf`` by ``jnp.where`` before the exponential, probabilities
of masked slots are replaced with ``0`` by ``jnp.where``, and V rows at
positions past the sequence length are replaced with ``0`` before ``p @ v``
(``0 * NaN`` is NaN, so garbage in unused slots would otherwise leak).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def is_concrete(x: Any) -> bool:
  """True when ``x`` holds values we can read on the host (not a tracer)."""
  return not isinstance(x, jax.core.Tracer)


def host(x: Any) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def check_rank(name: str, x: Any, rank: int, layout: str) -> None:
  if getattr(x, "ndim", None) != rank:
    raise ValueError(
      f"{name} must have rank {rank} ({layout}); got shape "
      f"{getattr(x, 'shape', None)}."
    )


def check_dtype(name: str, x: Any, dtypes: tuple[Any, ...]) -> None:
  allowed = tuple(jnp.dtype(d) for d in dtypes)
  if jnp.dtype(x.dtype) not in allowed:
    names = ", ".join(str(d) for d in allowed)
    raise ValueError(f"{name}.dtype={x.dtype} must be one of ({names}).")


def check_shape(name: str, x: Any, expected: tuple[int, ...], rule: str):
  if tuple(x.shape) != tuple(expected):
    raise ValueError(
      f"{name}.shape={tuple(x.shape)} must be {tuple(expected)} ({rule})."
    )


def check_pages(
  q: Any, k_pages: Any, v_pages: Any, *, q_name: str = "q"
) -> tuple[int, int, int, int, int]:
  """Checks q/k/v layouts; returns ``(Hq, Hkv, N, K, D)``."""
  check_rank("k_pages", k_pages, 4, "[Hkv, N, K, D]")
  check_rank("v_pages", v_pages, 4, "[Hkv, N, K, D]")
  check_dtype("k_pages", k_pages, FLOAT_DTYPES)
  if v_pages.shape != k_pages.shape:
    raise ValueError(
      f"v_pages.shape={tuple(v_pages.shape)} must equal "
      f"k_pages.shape={tuple(k_pages.shape)}."
    )
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"v_pages.dtype={v_pages.dtype} must equal k_pages.dtype={k_pages.dtype}."
    )
  num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
  if min(k_pages.shape) <= 0:
    raise ValueError(f"k_pages.shape={tuple(k_pages.shape)} has an empty dim.")
  check_dtype(q_name, q, FLOAT_DTYPES)
  if q.dtype != k_pages.dtype:
    raise ValueError(
      f"{q_name}.dtype={q.dtype} must equal k_pages.dtype={k_pages.dtype}."
    )
  num_q_heads = q.shape[-2]
  if q.shape[-1] != head_dim:
    raise ValueError(
      f"{q_name} head_dim={q.shape[-1]} must equal k_pages head_dim={head_dim}."
    )
  if num_q_heads % num_kv_heads != 0 or num_q_heads == 0:
    raise ValueError(
      f"{q_name} num_q_heads={num_q_heads} must be a positive multiple of "
      f"num_kv_heads={num_kv_heads}."
    )
  return num_q_heads, num_kv_heads, num_pages, page_size, head_dim


def check_int_array(name: str, x: Any, shape: tuple[int, ...], rule: str):
  if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
    raise ValueError(
      f"{name}.dtype={getattr(x, 'dtype', type(x))} must be int32."
    )
  check_shape(name, x, shape, rule)


def check_range(
  name: str, x: Any, low: int, high: int, *, allow_negative: bool = False
) -> None:
  """Checks ``low <= x < high`` when ``x`` is concrete (negatives optional)."""
  if not is_concrete(x) or x.size == 0:
    return
  values = host(x)
  checked = values[values >= 0] if allow_negative else values
  bad = checked[(checked < low) | (checked >= high)]
  if bad.size:
    raise ValueError(
      f"{name} has out-of-range values {np.unique(bad)[:8].tolist()}; "
      f"must lie in [{low}, {high})"
      + (" or be negative (skipped)." if allow_negative else ".")
    )


def shape_structs(*arrays: Any) -> list[jax.ShapeDtypeStruct]:
  """``out_shape`` for outputs shaped like ``arrays`` (e.g. aliased pools)."""
  return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]


def start_then_wait(copies: list[Any]) -> None:
  """Starts every async copy (DMA descriptor), then waits for all of them."""
  for copy in copies:
    copy.start()
  for copy in copies:
    copy.wait()


def default_scale(scale: float | None, head_dim: int) -> float:
  """``1 / sqrt(D)``, or ``scale`` checked to be a finite number."""
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)):
    raise TypeError(f"scale={scale!r} must be a number or None.")
  if not math.isfinite(scale):
    raise ValueError(f"scale={scale!r} must be finite.")
  return float(scale)


def check_page_size(page_size: Any) -> int:
  """``page_size`` as a positive int; a bool, float or non-positive value
  is refused."""
  if isinstance(page_size, (bool, np.bool_)) or not isinstance(
    page_size, (int, np.integer)
  ):
    raise TypeError(f"page_size={page_size!r} must be an int.")
  if page_size < 1:
    raise ValueError(f"page_size={page_size} must be >= 1.")
  return int(page_size)


def check_whole_pages(name: str, lengths: Any, page_size: int) -> None:
  """Concrete ``lengths`` must be multiples of ``page_size``."""
  if is_concrete(lengths) and (host(lengths) % page_size).any():
    raise ValueError(
      f"{name}={host(lengths).tolist()} must be whole pages (multiples of "
      f"page_size={page_size})."
    )


def unreadable_rows(
  tables: jax.Array, lengths: jax.Array, num_pages: int, page_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Rows a jitted kernel cannot read, and tables and lengths safe to read.

  Under a caller's ``jit`` the values of ``tables [R, P]`` and ``lengths
  [R]`` cannot be checked before the call. A row is unreadable when its
  length lies outside ``[0, P * K]`` or a page column it uses (``c <
  ceil(length / K)``) holds an id outside ``[0, num_pages)``: read as
  given, such an id would be clamped (or, negative, wrap) to another
  sequence's page, silently. The callers set those rows' outputs to NaN,
  a visible failure, and give the kernel the safe tables (bad ids replaced
  by page 0) and lengths (clipped), so no DMA leaves the pool.

  Returns:
    ``(bad [R] bool, safe_tables [R, P] int32, safe_lengths [R] int32)``.
  """
  width = tables.shape[1]
  safe_lengths = jnp.clip(lengths, 0, width * page_size).astype(jnp.int32)
  pages = (safe_lengths + page_size - 1) // page_size
  used = jnp.arange(width, dtype=jnp.int32)[None, :] < pages[:, None]
  bad_id = (tables < 0) | (tables >= num_pages)
  bad = jnp.any(used & bad_id, axis=1) | (safe_lengths != lengths)
  safe_tables = jnp.where(bad_id, 0, tables).astype(jnp.int32)
  return bad, safe_tables, safe_lengths


def nan_rows(outputs: Any, bad: jax.Array) -> Any:
  """Every array of ``outputs`` (leading axis ``R``) NaN in the ``bad``
  rows."""

  def one(x):
    mask = bad.reshape(bad.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, jnp.nan, x).astype(x.dtype)

  return jax.tree.map(one, outputs)


def check_flag(name: str, value) -> bool:
  """``value`` as a bool; anything but a bool (``"no"`` is truthy) is a
  TypeError."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}={value!r} must be True or False.")
  return bool(value)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b.T`` in float32: ``[R, D] x [C, D] -> [R, C]``."""
  return lax.dot_general(
    a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` in float32: ``[R, C] x [C, D] -> [R, D]``."""
  return lax.dot_general(
    a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )


def online_softmax_step(
  m_prev: jax.Array,  # [R, 1] f32
  l_prev: jax.Array,  # [R, 1] f32
  acc_prev: jax.Array,  # [R, D] f32
  q: jax.Array,  # [R, D] f32, already scaled
  k: jax.Array,  # [C, D]
  v: jax.Array,  # [C, D]
  valid: jax.Array,  # [R, C] bool
  v_valid: jax.Array,  # [C, 1] bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One flash-attention update over a block of ``C`` key/value slots.

  Rows whose slots are all masked keep ``m = -inf, l = 0, acc = 0``; no NaN
  from masked slots (or from garbage in unused pages) can reach the state.
  """
  k = k.astype(jnp.float32)
  v = jnp.where(v_valid, v.astype(jnp.float32), 0.0)
  s = jnp.where(valid, dot_nt(q, k), -jnp.inf)  # [R, C]
  m_cur = jnp.max(s, axis=1, keepdims=True)  # [R, 1]
  m_next = jnp.maximum(m_prev, m_cur)
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  alpha = jnp.exp(m_prev - m_safe)  # 0 where m_prev == -inf.
  p = jnp.where(valid, jnp.exp(s - m_safe), 0.0)  # [R, C]
  l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
  acc_next = alpha * acc_prev + dot_nn(p, v)
  return m_next, l_next, acc_next


def finalize(
  m: jax.Array, denom: jax.Array, acc: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``(o [R, D], lse [R, 1])``; empty rows give ``o = 0, lse = -inf``."""
  nonempty = denom > 0.0
  l_safe = jnp.where(nonempty, denom, 1.0)
  o = jnp.where(nonempty, acc / l_safe, 0.0)
  lse = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)
  return o, lse


def merge_states(
  o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Exact log-sum-exp merge in float32; ``lse`` has ``o``'s rank minus one
  trailing axis broadcast as ``[..., 1]``. Empty states (``lse = -inf``) are
  neutral."""
  m = jnp.maximum(lse_a, lse_b)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w_a = jnp.where(lse_a == -jnp.inf, 0.0, jnp.exp(lse_a - m_safe))
  w_b = jnp.where(lse_b == -jnp.inf, 0.0, jnp.exp(lse_b - m_safe))
  total = w_a + w_b
  nonempty = total > 0.0
  total_safe = jnp.where(nonempty, total, 1.0)
  o_a = jnp.where(w_a > 0.0, o_a.astype(jnp.float32), 0.0)
  o_b = jnp.where(w_b > 0.0, o_b.astype(jnp.float32), 0.0)
  o = (w_a * o_a + w_b * o_b) / total_safe
  lse = jnp.where(nonempty, m_safe + jnp.log(total_safe), -jnp.inf)
  # A NaN or +inf lse is no state at all: NaN out, never "empty" (-inf),
  # which a later merge would treat as neutral and so hide.
  bad = jnp.isnan(lse_a) | jnp.isnan(lse_b) | (lse_a == jnp.inf)
  bad = bad | (lse_b == jnp.inf)
  return jnp.where(bad, jnp.nan, o), jnp.where(bad, jnp.nan, lse)
