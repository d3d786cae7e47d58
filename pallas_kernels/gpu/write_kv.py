"""GPU (Triton-style) variant of the KV scatter."""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels.gpu.paged_attention import compiler_params


def write_kv_kernel(
  k_new_ref,  # [Hkv, D]
  v_new_ref,  # [Hkv, D]
  slot_ref,  # [1] int32
  k_pages_ref,  # [Hkv, N, K, D] (aliased with k_out_ref)
  v_pages_ref,  # [Hkv, N, K, D] (aliased with v_out_ref)
  k_out_ref,  # [Hkv, N, K, D]
  v_out_ref,  # [Hkv, N, K, D]
):
  del k_pages_ref, v_pages_ref
  page_size = k_out_ref.shape[2]
  slot = slot_ref[0]

  @pl.when(slot >= 0)
  def _write():
    page, offset = slot // page_size, slot % page_size
    k_out_ref[:, page, offset, :] = k_new_ref[...]
    v_out_ref[:, page, offset, :] = v_new_ref[...]


def write_kv_unbatched(
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  k_new: jax.Array,  # [T, Hkv, D]
  v_new: jax.Array,  # [T, Hkv, D]
  slot_mapping: jax.Array,  # [T] int32
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """GPU grid setup: one program per token, pools aliased in place."""
  num_tokens, num_kv_heads, head_dim = k_new.shape
  new_spec = pl.BlockSpec((None, num_kv_heads, head_dim), lambda t: (t, 0, 0))
  pool_spec = pl.BlockSpec(k_pages.shape, lambda t: (0, 0, 0, 0))
  return pl.pallas_call(
    write_kv_kernel,
    grid=(num_tokens,),
    in_specs=[
      new_spec,
      new_spec,
      pl.BlockSpec((1,), lambda t: (t,)),
      pool_spec,
      pool_spec,
    ],
    out_specs=[pool_spec, pool_spec],
    out_shape=_common.shape_structs(k_pages, v_pages),
    input_output_aliases={3: 0, 4: 1},
    compiler_params=compiler_params(interpret, num_warps=1, num_stages=1),
    interpret=interpret,
    name="write_kv_gpu",
  )(k_new, v_new, slot_mapping, k_pages, v_pages)
