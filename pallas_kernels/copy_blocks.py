"""Copy whole pages inside the pool (copy-on-write).

Layouts: ``k_pages``, ``v_pages`` ``[Hkv, N, K, D]``; ``src``, ``dst`` int32
``[C]``: page ``src[c]`` is copied to page ``dst[c]`` in both pools, all KV
heads. A pair with a negative id is padding and is skipped. All copies read
the pool as it was before the call; for that to be well defined the
(non-padding) ``dst`` ids must be distinct and disjoint from the ``src`` ids
(checked when concrete). A pair with ``src == dst`` is a no-op.

Returns the updated ``(k_pages, v_pages)``; the Pallas variants alias the
pools (see :mod:`pallas_kernels.write_kv` about in-place updates).

TPU kernel: grid ``(C,)``, ``src``/``dst`` scalar-prefetched, one HBM-to-HBM
DMA per pool and pair (``[Hkv, K, D]`` each, strided over heads). Bytes
model: read and write ``2 * C * Hkv * K * D * itemsize``. Exact (a copy).
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
from pallas_kernels._dispatch import gpu_variant, resolve_backend


def copy_blocks_kernel(
  src_ref,  # [C] int32, SMEM
  dst_ref,  # [C] int32, SMEM
  k_pages_ref,  # [Hkv, N, K, D] HBM (aliased with k_out_ref)
  v_pages_ref,  # [Hkv, N, K, D] HBM (aliased with v_out_ref)
  k_out_ref,  # [Hkv, N, K, D] HBM
  v_out_ref,  # [Hkv, N, K, D] HBM
  sems,  # DMA semaphores [2]
):
  pair = pl.program_id(0)
  src, dst = src_ref[pair], dst_ref[pair]

  @pl.when((src >= 0) & (dst >= 0) & (src != dst))
  def _copy():
    copies = [
      pltpu.make_async_copy(in_ref.at[:, src], out_ref.at[:, dst], sems.at[i])
      for i, (in_ref, out_ref) in enumerate(
        ((k_pages_ref, k_out_ref), (v_pages_ref, v_out_ref))
      )
    ]
    _common.start_then_wait(copies)


def copy_blocks_unbatched(
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  src: jax.Array,  # [C] int32
  dst: jax.Array,  # [C] int32
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """TPU grid setup: one pair per step, pools aliased in place."""
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
    copy_blocks_kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(src.shape[0],),
      in_specs=[any_spec, any_spec],
      out_specs=[any_spec, any_spec],
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    ),
    out_shape=_common.shape_structs(k_pages, v_pages),
    input_output_aliases={2: 0, 3: 1},
    compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    interpret=interpret,
    name="copy_blocks",
  )(src, dst, k_pages, v_pages)


def copy_blocks_reference(
  k_pages: jax.Array, v_pages: jax.Array, src: jax.Array, dst: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Plain-``jnp`` page copy (same contract as the kernel)."""
  num_pages = k_pages.shape[1]
  # A pair src == dst is a no-op (the contract); dropping it keeps one
  # write per destination, so the result does not depend on pair order.
  keep = (src >= 0) & (dst >= 0) & (src != dst)
  dst = jnp.where(keep, dst, num_pages)  # Out of range: dropped.
  src = jnp.where(keep, src, 0)

  def copy(pages):
    return pages.at[:, dst].set(pages[:, src], mode="drop")

  return copy(k_pages), copy(v_pages)


@functools.partial(jax.jit, static_argnames=("backend", "interpret"))
def _copy_blocks(k_pages, v_pages, src, dst, *, backend, interpret):
  # Under a caller's jit the ids cannot be checked first. A pair naming a
  # page past the pool is not copied (a source read there was clamped to
  # the last page, or left the pool in the kernel's DMA); a destination in
  # the pool whose source is past it is filled with NaN, so attention that
  # reads it shows the fault instead of the page's stale contents.
  num_pages = k_pages.shape[1]
  past = (src >= num_pages) | (dst >= num_pages)
  poisoned = jnp.where((src >= num_pages) & (dst >= 0), dst, num_pages)
  src = jnp.where(past, -1, src)
  dst = jnp.where(past, -1, dst)
  if backend == "reference":
    k_pages, v_pages = copy_blocks_reference(k_pages, v_pages, src, dst)
  else:
    impl = (
      copy_blocks_unbatched
      if backend == "pallas_tpu"
      else gpu_variant("copy_blocks").copy_blocks_unbatched
    )
    k_pages, v_pages = impl(k_pages, v_pages, src, dst, interpret=interpret)
  return tuple(
    pages.at[:, poisoned].set(jnp.nan, mode="drop")
    for pages in (k_pages, v_pages)
  )


def copy_blocks(
  k_pages: jax.Array,
  v_pages: jax.Array,
  src: jax.Array,
  dst: jax.Array,
  *,
  backend: str | None = None,
  interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
  """Copies pages ``src[c] -> dst[c]`` in both pools.

  Args:
    k_pages: ``[Hkv, N, K, D]`` key pages.
    v_pages: ``[Hkv, N, K, D]`` value pages.
    src: int32 ``[C]`` source page ids (negative: padding pair).
    dst: int32 ``[C]`` destination page ids (negative: padding pair).
    backend: see :mod:`pallas_kernels._dispatch`.
    interpret: run the Pallas variant in interpret mode.

  Returns:
    ``(k_pages, v_pages)`` with the pages copied.

  Raises:
    ValueError: bad shapes or dtypes, or (concrete) ids out of range,
      repeated destinations, or a destination that is also a source.

  Example:
    >>> import jax.numpy as jnp
    >>> pages = jnp.arange(4.0).reshape(1, 4, 1, 1)
    >>> k, _ = copy_blocks(pages, pages, jnp.array([1], jnp.int32),
    ...                    jnp.array([3], jnp.int32), backend="reference")
    >>> k[0, :, 0, 0].tolist()
    [0.0, 1.0, 2.0, 1.0]
  """
  _common.check_rank("k_pages", k_pages, 4, "[Hkv, N, K, D]")
  _common.check_rank("v_pages", v_pages, 4, "[Hkv, N, K, D]")
  if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"v_pages ({v_pages.shape}, {v_pages.dtype}) must match k_pages "
      f"({k_pages.shape}, {k_pages.dtype})."
    )
  num_pages = k_pages.shape[1]
  _common.check_rank("src", src, 1, "[C]")
  _common.check_int_array("src", src, src.shape, "[C]")
  _common.check_int_array("dst", dst, src.shape, "same as src")
  _common.check_range("src", src, 0, num_pages, allow_negative=True)
  _common.check_range("dst", dst, 0, num_pages, allow_negative=True)
  if _common.is_concrete(src) and _common.is_concrete(dst):
    s, d = _common.host(src), _common.host(dst)
    real = (s >= 0) & (d >= 0) & (s != d)
    s, d = s[real], d[real]
    if np.unique(d).size != d.size or np.intersect1d(s, d).size:
      raise ValueError(
        f"dst={d.tolist()} must be distinct and disjoint from src={s.tolist()}."
      )
  if src.shape[0] == 0:  # nothing to copy (and no Pallas grid to launch)
    return k_pages, v_pages
  backend, interpret = resolve_backend(backend, interpret, kernel="copy_blocks")
  return _copy_blocks(
    k_pages, v_pages, src, dst, backend=backend, interpret=interpret
  )
