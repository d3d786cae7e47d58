"""Exact log-sum-exp merge of two partial attention results.

If ``(o_a, lse_a)`` is attention over key set ``A`` and ``(o_b, lse_b)`` over a
disjoint set ``B`` (same queries, same scale), the merge is attention over
``A + B``: ``lse = logaddexp(lse_a, lse_b)`` and
``o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b``. A state with
``lse = -inf`` (no keys) is neutral and its ``o`` is ignored, even if NaN.

Layouts: ``o_*`` ``[B, H, D]`` (any float dtype, both the same), ``lse_*``
``[B, H]`` float32. Output ``o`` in ``o_a.dtype``, ``lse`` float32. The
arithmetic is float32; bytes model: read ``2 * (o + lse)``, write ``o + lse``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels._dispatch import (
  gpu_variant,
  reference_when_empty,
  resolve_backend,
)


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
  """TPU grid setup: one request per step, all heads in one block."""
  return merge_attention_states_call(
    o_a,
    lse_a,
    o_b,
    lse_b,
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    interpret=interpret,
    name="merge_attention_states",
  )


def merge_attention_states_call(
  o_a: jax.Array,  # [B, H, D]
  lse_a: jax.Array,  # [B, H, 1]
  o_b: jax.Array,  # [B, H, D]
  lse_b: jax.Array,  # [B, H, 1]
  *,
  compiler_params: Any,
  interpret: Any,
  name: str,
) -> tuple[jax.Array, jax.Array]:
  """The launch of both variants: grid ``(B,)``, all heads in one block.

  Only plain ``pl.BlockSpec``s, so it serves the TPU variant and the GPU
  variant (:mod:`pallas_kernels.gpu.merge_attention_states`) alike; each
  passes its own ``compiler_params`` and ``name``.
  """
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
    compiler_params=compiler_params,
    interpret=interpret,
    name=name,
  )(o_a, lse_a, o_b, lse_b)


def merge_attention_states_reference(
  o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Plain-``jnp`` merge (same contract as the kernel)."""
  o, lse = _common.merge_states(o_a, lse_a[..., None], o_b, lse_b[..., None])
  return o.astype(o_a.dtype), lse[..., 0]


@functools.partial(jax.jit, static_argnames=("backend", "interpret"))
def _merge(o_a, lse_a, o_b, lse_b, *, backend, interpret):
  if backend == "reference":
    return merge_attention_states_reference(o_a, lse_a, o_b, lse_b)
  impl = (
    merge_attention_states_unbatched
    if backend == "pallas_tpu"
    else gpu_variant("merge_attention_states").merge_attention_states_unbatched
  )
  o, lse = impl(
    o_a, lse_a[..., None], o_b, lse_b[..., None], interpret=interpret
  )
  return o, lse[..., 0]


def merge_attention_states(
  o_a: jax.Array,
  lse_a: jax.Array,
  o_b: jax.Array,
  lse_b: jax.Array,
  *,
  backend: str | None = None,
  interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention states exactly.

  Args:
    o_a: ``[B, H, D]`` output of attention over the first key set.
    lse_a: ``[B, H]`` float32 log-sum-exp of the first key set.
    o_b: ``[B, H, D]`` output over the second (disjoint) key set.
    lse_b: ``[B, H]`` float32 log-sum-exp of the second key set.
    backend: see :mod:`pallas_kernels._dispatch`.
    interpret: run the Pallas variant in interpret mode.

  Returns:
    ``(o [B, H, D] in o_a.dtype, lse [B, H] float32)``.

  Raises:
    ValueError: mismatched shapes or dtypes.

  Example:
    >>> import jax.numpy as jnp
    >>> o = jnp.ones((1, 2, 4))
    >>> lse = jnp.zeros((1, 2))
    >>> o2, lse2 = merge_attention_states(o, lse, o, lse, backend="reference")
    >>> float(lse2[0, 0])  # log(2)
    0.6931...
  """
  _common.check_rank("o_a", o_a, 3, "[B, H, D]")
  _common.check_dtype("o_a", o_a, _common.FLOAT_DTYPES)
  _common.check_shape("o_b", o_b, o_a.shape, "same as o_a")
  if o_b.dtype != o_a.dtype:
    raise ValueError(f"o_b.dtype={o_b.dtype} must equal o_a.dtype={o_a.dtype}.")
  for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
    _common.check_shape(name, lse, o_a.shape[:2], "o_a.shape[:2]")
    _common.check_dtype(name, lse, (jnp.float32,))
  backend, interpret = reference_when_empty(
    resolve_backend(backend, interpret, kernel="merge_attention_states"), o_a
  )
  return _merge(o_a, lse_a, o_b, lse_b, backend=backend, interpret=interpret)
