"""GPU (Triton-style) variant of the page copy."""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels.gpu.paged_attention import compiler_params


def copy_blocks_kernel(
  src_ref,  # [1] int32
  dst_ref,  # [1] int32
  k_pages_ref,  # [N, K, D] (one KV head; aliased with k_out_ref)
  v_pages_ref,  # [N, K, D]
  k_out_ref,  # [N, K, D]
  v_out_ref,  # [N, K, D]
):
  src, dst = src_ref[0], dst_ref[0]

  @pl.when((src >= 0) & (dst >= 0) & (src != dst))
  def _copy():
    k_out_ref[dst] = k_pages_ref[src]
    v_out_ref[dst] = v_pages_ref[src]


def copy_blocks_unbatched(
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  src: jax.Array,  # [C] int32
  dst: jax.Array,  # [C] int32
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """GPU grid setup: one program per (pair, KV head), pools aliased."""
  num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
  pool_spec = pl.BlockSpec(
    (None, num_pages, page_size, head_dim), lambda c, h: (h, 0, 0, 0)
  )
  id_spec = pl.BlockSpec((1,), lambda c, h: (c,))
  return pl.pallas_call(
    copy_blocks_kernel,
    grid=(src.shape[0], num_kv_heads),
    in_specs=[id_spec, id_spec, pool_spec, pool_spec],
    out_specs=[pool_spec, pool_spec],
    out_shape=_common.shape_structs(k_pages, v_pages),
    input_output_aliases={2: 0, 3: 1},
    compiler_params=compiler_params(interpret, num_warps=1, num_stages=1),
    interpret=interpret,
    name="copy_blocks_gpu",
  )(src, dst, k_pages, v_pages)
