"""The compiled (non-interpret) Pallas variants lower for their hardware.

No accelerator is needed: ``jax.export`` lowers for another platform, so the
TPU variants go through Pallas's Mosaic lowering (under an abstract TPU v5e
device, which Mosaic needs for its tiling rules) and the GPU variants through
the Triton-style lowering to Triton IR. This catches block shapes, DMA shapes
and primitives that interpret mode accepts but the real compilers reject. It
does not run the kernels or compile to machine code.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels import _dispatch


def lowering_cases(backend):
  """(name, jitted fn, abstract args) at realistic-ish small sizes."""
  dtype = jnp.bfloat16
  batch, num_q_heads, num_kv_heads, head_dim = 4, 16, 4, 128
  num_pages, page_size, pages_per_seq = 33, 16, 8

  def spec(shape, dt=dtype):
    return jax.ShapeDtypeStruct(shape, dt)

  q = spec((batch, num_q_heads, head_dim))
  pages = spec((num_kv_heads, num_pages, page_size, head_dim))
  tables = spec((batch, pages_per_seq), jnp.int32)
  lengths = spec((batch,), jnp.int32)
  lse = spec((batch, num_q_heads), jnp.float32)
  rows = spec((batch, num_kv_heads, head_dim))

  def impl(module, name, **static):
    fn = getattr(importlib.import_module(f"pallas_kernels.{module}"), name)
    return functools.partial(fn, backend=backend, interpret=False, **static)

  return {
    "paged_attention": (
      impl("paged_attention", "_paged_attention", scale=0.1, return_lse=True),
      (q, pages, pages, tables, lengths),
    ),
    "shared_prefix_attention": (
      impl(
        "shared_prefix_attention",
        "_shared_prefix_attention",
        scale=0.1,
        return_lse=True,
        max_group_size=32,  # 128 rows: the GPU row-blocking path.
      ),
      (
        q,
        pages,
        pages,
        spec((2, pages_per_seq), jnp.int32),
        spec((2,), jnp.int32),
        lengths,
        tables,
        lengths,
      ),
    ),
    "prefill_attention": (
      impl("prefill_attention", "_prefill_attention", scale=0.1, block_q=16),
      (
        spec((32, num_q_heads, head_dim)),
        pages,
        pages,
        tables,
        lengths,
        spec((batch + 1,), jnp.int32),
      ),
    ),
    "merge_attention_states": (
      impl("merge_attention_states", "_merge"),
      (q, lse, q, lse),
    ),
    "write_kv": (
      impl("write_kv", "_write_kv"),
      (pages, pages, rows, rows, lengths),
    ),
    "copy_blocks": (
      impl("copy_blocks", "_copy_blocks"),
      (pages, pages, lengths, lengths),
    ),
  }


def abstract_tpu():
  try:
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    device = AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu"
    )
    mesh = AbstractMesh((1,), ("x",), abstract_device=device)
  except (ImportError, TypeError) as error:
    pytest.skip(f"no abstract TPU device on this jax: {error}")
  return use_abstract_mesh(mesh)


KERNELS = list(lowering_cases("pallas_tpu"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_tpu_variant_lowers_through_mosaic(kernel):
  fn, args = lowering_cases("pallas_tpu")[kernel]
  with abstract_tpu():
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
  assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_variant_lowers_to_triton(kernel):
  if not _dispatch.triton_available():
    pytest.skip("the Triton-style Pallas GPU lowering is unavailable here")
  fn, args = lowering_cases("pallas_gpu")[kernel]
  triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = export.export(
    jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call]
  )(*args)
  assert "xla.gpu.triton" in exported.mlir_module()
