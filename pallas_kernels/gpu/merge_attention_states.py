"""GPU (Triton-style) variant of the log-sum-exp merge.

The kernel body and the launch are the TPU variant's
(:func:`pallas_kernels.merge_attention_states.merge_attention_states_call`,
plain ``pl.BlockSpec``s); only the compiler params and the name differ.
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.gpu.paged_attention import compiler_params
from pallas_kernels.merge_attention_states import merge_attention_states_call


def merge_attention_states_unbatched(
  o_a: jax.Array,  # [B, H, D]
  lse_a: jax.Array,  # [B, H, 1]
  o_b: jax.Array,  # [B, H, D]
  lse_b: jax.Array,  # [B, H, 1]
  *,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """GPU grid setup: one program per request."""
  return merge_attention_states_call(
    o_a,
    lse_a,
    o_b,
    lse_b,
    compiler_params=compiler_params(interpret, num_warps=4, num_stages=1),
    interpret=interpret,
    name="merge_attention_states_gpu",
  )
