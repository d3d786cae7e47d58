"""The compiled (non-interpret) Pallas variants lower for their hardware.

No accelerator is needed: ``jax.export`` lowers for another platform, so the
TPU variants go through Pallas's Mosaic lowering (under an abstract TPU v5e
device, which Mosaic needs for its tiling rules) and the GPU variants through
the Triton-style lowering to Triton IR. This catches block shapes, DMA shapes
and primitives that interpret mode accepts but the real compilers reject. It
does not run the kernels or compile to machine code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
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


def abstract_gpu():
  """An abstract H200 for lowering the Triton variants on a machine without
  a GPU. jax 0.11.2 and 0.12.0.1 read the target's compute capability from
  the device (``jax/_src/pallas/triton/gpu_info.py``) and ask for an
  abstract device when there is none; jax 0.10.2 lowers without one."""
  if _dispatch.triton_deprecation() is None:
    return contextlib.nullcontext()
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

  device = AbstractDevice(
    device_kind="NVIDIA H200", num_cores=1, platform="gpu"
  )
  return use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def lower_gpu(kernel):
  """Lowers ``kernel``'s GPU variant for CUDA: ``(mlir text, the Triton
  deprecation warnings seen)``; any other warning fails the test, as the
  suite's ``filterwarnings = error`` would."""
  fn, args = lowering_cases("pallas_gpu")[kernel]
  triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with warnings.catch_warnings(record=True) as caught, abstract_gpu():
    warnings.simplefilter("always")
    exported = export.export(
      jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call]
    )(*args)
  # jax 0.11.2 and 0.12.0.1 deprecate the Pallas Triton backend with a
  # DeprecationWarning at lowering (jax/_src/pallas/triton/
  # pallas_call_registration.py); the lowering still works.
  deprecation = [
    w
    for w in caught
    if issubclass(w.category, DeprecationWarning)
    and _dispatch.TRITON_DEPRECATION.search(str(w.message))
  ]
  others = [w for w in caught if w not in deprecation]
  assert not others, [str(w.message) for w in others]
  return exported.mlir_module(), deprecation


@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_variant_lowers_to_triton(kernel):
  if not _dispatch.triton_available():
    pytest.skip("the Triton-style Pallas GPU lowering is unavailable here")
  mlir, _ = lower_gpu(kernel)
  assert "xla.gpu.triton" in mlir


def test_triton_deprecation_is_read_from_this_jax():
  """``triton_deprecation()`` says "warns" exactly when lowering warns."""
  if not _dispatch.triton_available():
    pytest.skip("the Triton-style Pallas GPU lowering is unavailable here")
  kernel = KERNELS[np.random.default_rng().integers(len(KERNELS))]
  _, seen = lower_gpu(kernel)
  assert bool(seen) == (_dispatch.triton_deprecation() == "warns"), (
    kernel,
    jax.__version__,
  )


def test_accelerated_triton_deprecation_falls_back_on_gpu(monkeypatch, caplog):
  """When JAX turns the deprecation into an error, lowering really fails,
  and ``backend=None`` on a GPU picks the reference with a logged reason
  instead of a kernel that cannot compile."""
  try:
    from jax._src import deprecations
  except ImportError:
    pytest.skip("no jax._src.deprecations on this jax")
  registry = getattr(deprecations, "_registered_deprecations", {})
  if "jax-pallas-triton" not in registry:
    pytest.skip(f"jax {jax.__version__} does not deprecate Pallas Triton")
  monkeypatch.setattr(registry["jax-pallas-triton"], "accelerated", True)
  _dispatch.triton_available.cache_clear()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  _dispatch._log_once.cache_clear()
  try:
    assert _dispatch.triton_deprecation() == "error"
    with pytest.raises(Exception, match="Triton backend is deprecated"):
      lower_gpu("write_kv")
    with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
      got = _dispatch.resolve_backend(None, False, kernel="paged_attention")
    assert got == ("reference", None)
    assert "falling back to the jnp reference" in caplog.text
  finally:
    _dispatch.triton_available.cache_clear()
    _dispatch._log_once.cache_clear()


def test_compiled_gpu_variant_logs_the_deprecation(monkeypatch, caplog):
  """On a GPU, choosing the compiled Triton variant says once that JAX
  deprecates it, on the jax versions that do (and only there)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  _dispatch._log_once.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
      got = _dispatch.resolve_backend("pallas_gpu", False, kernel="write_kv")
    assert got == ("pallas_gpu", False)
    said = "deprecates" in caplog.text
    assert said == (_dispatch.triton_deprecation() is not None)
  finally:
    _dispatch._log_once.cache_clear()
