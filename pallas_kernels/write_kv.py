"""Scatter new tokens' K/V into the page pool.

Layouts: ``k_pages``, ``v_pages`` ``[Hkv, N, K, D]``; ``k_new``, ``v_new``
``[T, Hkv, D]`` in the pages' dtype; ``slot_mapping`` int32 ``[T]`` with
``slot = page * K + offset``. A negative slot marks a padding token and is
skipped. Non-negative slots must be distinct (checked when concrete; under
``jit`` a duplicate gives an unspecified winner).

Returns the updated ``(k_pages, v_pages)``. The Pallas variants alias the
pages (``input_output_aliases``), so inside a caller's ``jit`` whose pool is
donated or carried through a loop the update is in place; called eagerly,
XLA copies the pool first (the pool arrays passed in stay valid).

TPU kernel: grid ``(T,)``; the slot mapping is scalar-prefetched and one
strided HBM-to-HBM DMA per pool writes a token's rows (all heads) to
``pages[:, page, offset]``. Bytes model: read and write
``2 * T * Hkv * D * itemsize`` (the pool is not streamed). Exact (a copy).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels._dispatch import (
  gpu_variant,
  reference_when_empty,
  resolve_backend,
)


def write_kv_kernel(
  slots_ref,  # [T] int32, SMEM
  k_new_ref,  # [Hkv, T, 1, D] HBM
  v_new_ref,  # [Hkv, T, 1, D] HBM
  k_pages_ref,  # [Hkv, N, K, D] HBM (aliased with k_out_ref)
  v_pages_ref,  # [Hkv, N, K, D] HBM (aliased with v_out_ref)
  k_out_ref,  # [Hkv, N, K, D] HBM
  v_out_ref,  # [Hkv, N, K, D] HBM
  sems,  # DMA semaphores [2]
):
  del k_pages_ref, v_pages_ref
  page_size = k_out_ref.shape[2]
  token = pl.program_id(0)
  slot = slots_ref[token]

  @pl.when(slot >= 0)
  def _write():
    page, offset = slot // page_size, slot % page_size
    copies = [
      pltpu.make_async_copy(
        new_ref.at[:, pl.ds(token, 1)],  # [Hkv, 1, 1, D]
        out_ref.at[:, pl.ds(page, 1), pl.ds(offset, 1)],  # [Hkv, 1, 1, D]
        sems.at[i],
      )
      for i, (new_ref, out_ref) in enumerate(
        ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref))
      )
    ]
    _common.start_then_wait(copies)


def write_kv_unbatched(
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  k_new: jax.Array,  # [T, Hkv, D]
  v_new: jax.Array,  # [T, Hkv, D]
  slot_mapping: jax.Array,  # [T] int32
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """TPU grid setup: one token per step, pools aliased in place.

  The new rows are handed over head-major (``[Hkv, T, 1, D]``) so that one
  strided HBM-to-HBM DMA per pool moves a token's rows for all heads.
  """
  num_tokens = k_new.shape[0]
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
    write_kv_kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(num_tokens,),
      in_specs=[any_spec] * 4,
      out_specs=[any_spec, any_spec],
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    ),
    out_shape=_common.shape_structs(k_pages, v_pages),
    input_output_aliases={3: 0, 4: 1},
    compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    interpret=interpret,
    name="write_kv",
  )(
    slot_mapping,
    jnp.swapaxes(k_new, 0, 1)[:, :, None, :],
    jnp.swapaxes(v_new, 0, 1)[:, :, None, :],
    k_pages,
    v_pages,
  )


def write_kv_reference(
  k_pages: jax.Array,
  v_pages: jax.Array,
  k_new: jax.Array,
  v_new: jax.Array,
  slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Plain-``jnp`` scatter (same contract as the kernel)."""
  num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
  num_slots = num_pages * page_size
  slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)

  def scatter(pages, new):
    flat = pages.reshape(num_kv_heads, num_slots, head_dim)
    flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1), mode="drop")
    return flat.reshape(pages.shape)

  return scatter(k_pages, k_new), scatter(v_pages, v_new)


@functools.partial(jax.jit, static_argnames=("backend", "interpret"))
def _write_kv(
  k_pages, v_pages, k_new, v_new, slot_mapping, *, backend, interpret
):
  # Under a caller's jit the slots cannot be checked first: a slot past the
  # pool is skipped like a negative one (the kernel's DMA wrote past it).
  slots = k_pages.shape[1] * k_pages.shape[2]
  slot_mapping = jnp.where(slot_mapping >= slots, -1, slot_mapping)
  if backend == "reference":
    return write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping)
  impl = (
    write_kv_unbatched
    if backend == "pallas_tpu"
    else gpu_variant("write_kv").write_kv_unbatched
  )
  return impl(k_pages, v_pages, k_new, v_new, slot_mapping, interpret=interpret)


def write_kv(
  k_pages: jax.Array,
  v_pages: jax.Array,
  k_new: jax.Array,
  v_new: jax.Array,
  slot_mapping: jax.Array,
  *,
  backend: str | None = None,
  interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
  """Writes new tokens' keys and values into their slots.

  Args:
    k_pages: ``[Hkv, N, K, D]`` key pages.
    v_pages: ``[Hkv, N, K, D]`` value pages.
    k_new: ``[T, Hkv, D]`` new keys, same dtype as the pages.
    v_new: ``[T, Hkv, D]`` new values.
    slot_mapping: int32 ``[T]`` target slots ``page * K + offset``, negative
      to skip a token.
    backend: see :mod:`pallas_kernels._dispatch`.
    interpret: run the Pallas variant in interpret mode.

  Returns:
    ``(k_pages, v_pages)`` with the new rows written.

  Raises:
    ValueError: bad shapes or dtypes, or (concrete) slots out of range or
      repeated.

  Example:
    >>> import jax.numpy as jnp
    >>> pages = jnp.zeros((1, 4, 8, 32))
    >>> new = jnp.ones((2, 1, 32))
    >>> k, v = write_kv(pages, pages, new, new, jnp.array([9, -1], jnp.int32),
    ...                 backend="reference")
    >>> float(k[0, 1, 1, 0])
    1.0
  """
  _common.check_rank("k_new", k_new, 3, "[T, Hkv, D]")
  _common.check_pages(k_new, k_pages, v_pages, q_name="k_new")
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  if k_new.shape[1] != num_kv_heads:
    raise ValueError(
      f"k_new.shape={tuple(k_new.shape)} must have num_kv_heads="
      f"{num_kv_heads} in axis 1."
    )
  _common.check_shape("v_new", v_new, k_new.shape, "same as k_new")
  if v_new.dtype != k_new.dtype:
    raise ValueError(
      f"v_new.dtype={v_new.dtype} must equal k_new.dtype={k_new.dtype}."
    )
  _common.check_int_array(
    "slot_mapping", slot_mapping, (k_new.shape[0],), "one per token"
  )
  _common.check_range(
    "slot_mapping", slot_mapping, 0, num_pages * page_size, allow_negative=True
  )
  if _common.is_concrete(slot_mapping):
    slots = _common.host(slot_mapping)
    slots = slots[slots >= 0]
    if np.unique(slots).size != slots.size:
      raise ValueError(
        f"slot_mapping={_common.host(slot_mapping).tolist()} repeats a slot."
      )
  backend, interpret = reference_when_empty(
    resolve_backend(backend, interpret, kernel="write_kv"), k_new
  )
  return _write_kv(
    k_pages,
    v_pages,
    k_new,
    v_new,
    slot_mapping,
    backend=backend,
    interpret=interpret,
  )
