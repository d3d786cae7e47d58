"""GPU (Triton-style) variant of the log-sum-exp merge."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels.gpu.paged_attention import compiler_params


def merge_attention_states_kernel(
  o_a_ref,  # [H, D]
  lse_a_ref,  # [H, 1] f32
  o_b_ref,  # [H, D]
  lse_b_ref,  # [H, 1] f32
  o_ref,  # [H, D]
  lse_ref,  # [H, 1] f32
):
  o, lse = _common.merge_states(
    o_a_ref[...], lse_a_ref[...], o_b_ref[...], lse_b_ref[...]
  )
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def merge_attention_states_unbatched(
  o_a: jax.Array,  # [B, H, D]
  lse_a: jax.Array,  # [B, H, 1]
  o_b: jax.Array,  # [B, H, D]
  lse_b: jax.Array,  # [B, H, 1]
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """GPU grid setup: one program per request."""
  batch, num_heads, head_dim = o_a.shape
  o_spec = pl.BlockSpec((None, num_heads, head_dim), lambda b: (b, 0, 0))
  lse_spec = pl.BlockSpec((None, num_heads, 1), lambda b: (b, 0, 0))
  return pl.pallas_call(
    merge_attention_states_kernel,
    grid=(batch,),
    in_specs=[o_spec, lse_spec, o_spec, lse_spec],
    out_specs=[o_spec, lse_spec],
    out_shape=[
      jax.ShapeDtypeStruct(o_a.shape, o_a.dtype),
      jax.ShapeDtypeStruct(lse_a.shape, jnp.float32),
    ],
    compiler_params=compiler_params(interpret, num_warps=4, num_stages=1),
    interpret=interpret,
    name="merge_attention_states_gpu",
  )(o_a, lse_a, o_b, lse_b)
