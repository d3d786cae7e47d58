"""The Mosaic GPU port of the paged flash kernel (``set_gpu_variant``).

Runs the kernel in JAX's GPU interpret mode (simulated shared memory, TMA
copies and barriers, NaN for uninitialised memory, optional race detection)
against a float64 numpy model of the same contract, on shapes drawn fresh
per case: shared page indices, NaN-filled unused page slots, several splits,
multi-token query rows, row blocks folded into the launch. Then through the
public kernels with the variant switched, the fallback for inputs the port
does not take, and, where the CUDA plugin is installed, its lowering for
``cuda`` through Mosaic GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from test_kernels_support import nan_fill_unused

import pallas_kernels as pk
from pallas_kernels import _dispatch
from pallas_kernels.gpu_mosaic import paged_attention as mosaic

DTYPES = ("bfloat16", "float16")


@pytest.fixture
def mosaic_variant():
  previous = pk.set_gpu_variant("mosaic")
  try:
    yield
  finally:
    pk.set_gpu_variant(previous)


def launch_case(rng, dtype, *, rows_per_token=None, shared=True):
  """Random ``paged_flash_unbatched`` arguments; unused slots hold NaN."""
  page_size = int(rng.choice([8, 16, 32]))
  head_dim = int(rng.choice([16, 32, 64]))
  num_seqs = int(rng.integers(1, 4))
  num_kv_heads = int(rng.integers(1, 3))
  pages_per_seq = int(rng.integers(2, 6)) * max(1, 64 // page_size) // 2
  pages_per_seq = max(pages_per_seq, 2)
  num_pages = num_seqs * pages_per_seq + 3
  if rows_per_token is None:
    rows_per_token = int(rng.choice([1, 2, 4]))
  tokens = int(rng.integers(1, 4))
  num_rows = rows_per_token * tokens
  tables = np.stack(
    [
      rng.choice(np.arange(1, num_pages), pages_per_seq, replace=False)
      for _ in range(num_seqs)
    ]
  ).astype(np.int32)
  if shared and num_seqs > 1:
    # Every sequence reads the first sequence's first pages (a shared prefix).
    common = int(rng.integers(1, pages_per_seq))
    tables[1:, :common] = tables[0, :common]
  lengths = rng.integers(0, pages_per_seq * page_size + 1, num_seqs)
  lengths[rng.integers(num_seqs)] = pages_per_seq * page_size  # one full
  first = np.maximum(lengths - tokens, 0) - rng.integers(0, 3, num_seqs)
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  k = nan_fill_unused(rng.standard_normal(shape), tables, lengths)
  v = nan_fill_unused(rng.standard_normal(shape), tables, lengths)
  q = rng.standard_normal((num_seqs, num_kv_heads, num_rows, head_dim))
  return dict(
    q=jnp.asarray(q, dtype),
    k_pages=jnp.asarray(k, dtype),
    v_pages=jnp.asarray(v, dtype),
    block_tables=jnp.asarray(tables),
    kv_lengths=jnp.asarray(lengths, jnp.int32),
    first_pos=jnp.asarray(first, jnp.int32),
    scale=float(rng.uniform(0.05, 0.3)),
    rows_per_token=rows_per_token,
  )


def numpy_flash(case):
  """float64 model: row ``r`` of sequence ``s`` sits at position
  ``first_pos[s] + r // rows_per_token`` and sees slots ``t <= pos`` with
  ``t < kv_length``; no visible slot gives ``o = 0, lse = -inf``."""
  q = np.asarray(case["q"], np.float64)
  k = np.asarray(case["k_pages"], np.float64)
  v = np.asarray(case["v_pages"], np.float64)
  tables = np.asarray(case["block_tables"])
  num_seqs, num_kv_heads, num_rows, head_dim = q.shape
  o = np.zeros(q.shape)
  lse = np.full(q.shape[:3], -np.inf)
  for s in range(num_seqs):
    length = int(case["kv_lengths"][s])
    keys = k[:, tables[s]].reshape(num_kv_heads, -1, head_dim)[:, :length]
    vals = v[:, tables[s]].reshape(num_kv_heads, -1, head_dim)[:, :length]
    for r in range(num_rows):
      pos = int(case["first_pos"][s]) + r // case["rows_per_token"]
      seen = min(pos + 1, length)
      if seen <= 0:
        continue
      for h in range(num_kv_heads):
        logits = keys[h, :seen] @ q[s, h, r] * case["scale"]
        top = logits.max()
        weights = np.exp(logits - top)
        o[s, h, r] = weights @ vals[h, :seen] / weights.sum()
        lse[s, h, r] = top + np.log(weights.sum())
  return o, lse


def run_mosaic(case, interpret=True):
  return mosaic.paged_flash_unbatched(**case, interpret=interpret)


def assert_matches(o, lse, case):
  o64, lse64 = numpy_flash(case)
  o = np.asarray(o, np.float64)
  lse = np.asarray(lse, np.float64)[..., 0]
  assert o.shape == o64.shape and lse.shape == lse64.shape
  assert not np.isnan(o).any(), "NaN from an unused page slot reached o"
  assert np.array_equal(np.isinf(lse), np.isinf(lse64)), "empty rows differ"
  # P is cast to the 16-bit input dtype for the P V product (as in JAX's
  # Mosaic GPU flash attention); 3e-2 is the suite's bfloat16 bound.
  np.testing.assert_allclose(o, o64, atol=3e-2, rtol=0)
  finite = np.isfinite(lse64)
  np.testing.assert_allclose(lse[finite], lse64[finite], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draw", range(3))
def test_mosaic_kernel_matches_float64_model(rng, dtype, draw):
  case = launch_case(rng, dtype)
  o, lse = run_mosaic(case)
  assert_matches(o, lse, case)


def test_mosaic_kernel_folds_row_blocks(rng):
  """More query rows than one program holds (8 when interpreting): the row
  blocks are folded into the sequence axis and unfolded again."""
  case = launch_case(rng, "bfloat16", rows_per_token=int(rng.choice([1, 3])))
  extra = int(rng.integers(9, 20))
  q = jax.random.normal(
    jax.random.key(int(rng.integers(1 << 30))),
    case["q"].shape[:2] + (extra,) + case["q"].shape[3:],
  )
  case["q"] = q.astype(case["q"].dtype)
  if case["rows_per_token"] == 1:
    case["rows_per_token"] = extra  # one token: every row at one position.
  o, lse = run_mosaic(case)
  assert_matches(o, lse, case)


def test_mosaic_kernel_has_no_races(rng):
  """GPU interpret mode's race detector sees every TMA copy, barrier and
  shared-memory access of the double-buffered page pipeline."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  case = launch_case(rng, "bfloat16")
  o, lse = run_mosaic(case, InterpretGPUParams(detect_races=True))
  jax.block_until_ready(o)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches(o, lse, case)


def test_public_kernels_use_the_mosaic_variant(rng, mosaic_variant):
  """Decode, prefill and shared-prefix attention all reach the port."""
  assert _dispatch.gpu_variant("paged_attention") is mosaic
  write_kv = _dispatch.gpu_variant("write_kv")
  assert write_kv.__name__ == "pallas_kernels.gpu.write_kv"
  num_q_heads, num_kv_heads, head_dim, page_size = 4, 2, 32, 16
  num_pages, pages_per_seq, batch = 24, 4, 3
  dtype = jnp.bfloat16
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
  k = jax.random.normal(keys[0], (num_kv_heads, num_pages, page_size, head_dim))
  v = jax.random.normal(keys[1], k.shape)
  k, v = k.astype(dtype), v.astype(dtype)
  tables = jnp.asarray(
    rng.choice(np.arange(1, num_pages), (batch, pages_per_seq), replace=False),
    jnp.int32,
  )
  lengths = jnp.asarray(rng.integers(1, pages_per_seq * page_size, batch))
  lengths = lengths.astype(jnp.int32)
  q = jax.random.normal(keys[2], (batch, num_q_heads, head_dim)).astype(dtype)
  kw = dict(backend="pallas_gpu", interpret=True)

  o, lse = pk.paged_attention(q, k, v, tables, lengths, return_lse=True, **kw)
  o_ref, lse_ref = pk.paged_attention_reference(
    q, k, v, tables, lengths, return_lse=True
  )
  np.testing.assert_allclose(
    np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=3e-2
  )
  np.testing.assert_allclose(lse, lse_ref, atol=1e-4)

  new = jnp.asarray(rng.integers(1, 4, batch), jnp.int32)
  ctx = jnp.maximum(lengths, new)
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(new)]).astype(
    jnp.int32
  )
  qp = jax.random.normal(keys[3], (int(cu[-1]), num_q_heads, head_dim))
  qp = qp.astype(dtype)
  o = pk.prefill_attention(qp, k, v, tables, ctx, cu, **kw)
  o_ref = pk.prefill_attention_reference(qp, k, v, tables, ctx, cu)
  np.testing.assert_allclose(
    np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=3e-2
  )

  prefix_tables = tables[:1, :2]
  prefix_lengths = jnp.asarray([2 * page_size], jnp.int32)
  group_of = jnp.zeros(batch, jnp.int32)
  suffix_lengths = jnp.asarray(rng.integers(0, 2 * page_size, batch), jnp.int32)
  suffix_tables = tables[:, 2:]
  args = (
    q, k, v, prefix_tables, prefix_lengths, group_of, suffix_tables,
    suffix_lengths,
  )  # fmt: skip
  o = pk.shared_prefix_attention(*args, **kw)
  o_ref = pk.shared_prefix_attention_reference(*args)
  np.testing.assert_allclose(
    np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=3e-2
  )


def test_unsupported_inputs_fall_back_to_triton(rng, caplog):
  """float32 (no WGMMA path from registers) runs the Triton-style variant,
  says so once, and still matches the model."""
  case = launch_case(rng, "float32")
  _dispatch._log_once.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
      o, lse = run_mosaic(case)
    assert "does not support dtype float32" in caplog.text
  finally:
    _dispatch._log_once.cache_clear()
  o64, lse64 = numpy_flash(case)
  np.testing.assert_allclose(np.asarray(o), o64, atol=1e-4)


@pytest.mark.parametrize(
  ("dtype", "head_dim", "page_size", "pages", "needle"),
  [
    ("float32", 64, 16, 8, "dtype float32"),
    ("bfloat16", 64, 24, 8, "page size 24"),
    ("bfloat16", 40, 16, 8, "head dim 40"),
    ("bfloat16", 96, 16, 8, "head dim 96"),
    ("bfloat16", 256, 128, 8, "bytes of shared memory"),
    ("bfloat16", 256, 64, 64, "bytes of shared memory"),
    ("bfloat16", 128, 16, 16500, "16500 pages per sequence"),
    ("float16", 128, 16, 4096, None),
    ("bfloat16", 192, 64, 64, None),
  ],
)
def test_unsupported_reason(dtype, head_dim, page_size, pages, needle):
  reason = mosaic.unsupported_reason(dtype, head_dim, page_size, pages)
  if needle is None:
    assert reason is None
  else:
    assert needle in reason


class FakeGpu:
  platform = "gpu"

  def __init__(self, kind, capability):
    self.device_kind, self.compute_capability = kind, capability


@pytest.mark.parametrize(
  ("kind", "capability", "needle"),
  [
    ("NVIDIA A100-SXM4-80GB", "8.0", "compute capability 8.0"),
    ("NVIDIA L4", "8.9", "compute capability 8.9"),
    ("NVIDIA B200", "10.0", "compute capability 10.0"),
    ("NVIDIA H100 80GB HBM3", "9.0", None),
    ("NVIDIA H200", "9.0", None),
  ],
)
def test_only_hopper_runs_the_compiled_port(
  monkeypatch, kind, capability, needle
):
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu(kind, capability)])
  reason = mosaic.device_reason(False)
  if needle is None:
    assert reason is None
  else:
    assert needle in reason and kind in reason
  assert mosaic.device_reason(True) is None  # interpret mode: any machine


def test_gpu_variant_choice_is_validated(monkeypatch):
  with pytest.raises(ValueError, match="set_gpu_variant.*'cutlass'"):
    pk.set_gpu_variant("cutlass")
  monkeypatch.setenv(_dispatch.GPU_VARIANT_ENV, "tritonn")
  monkeypatch.setattr(_dispatch, "_gpu_variant_choice", None)
  with pytest.raises(ValueError, match="PALLAS_KERNELS_GPU_VARIANT='tritonn'"):
    pk.current_gpu_variant()
  monkeypatch.setenv(_dispatch.GPU_VARIANT_ENV, "mosaic")
  assert pk.current_gpu_variant() == "mosaic"
  assert _dispatch.gpu_variant("paged_attention") is mosaic


def test_switching_variant_retraces_jitted_callers(rng):
  """A function jitted under one variant is traced again after a switch."""
  traced = []

  @jax.jit
  def which(x):
    traced.append(_dispatch.gpu_variant("paged_attention").__name__)
    return x + 1

  previous = pk.set_gpu_variant("triton")
  try:
    which(jnp.zeros(()))
    which(jnp.zeros(()))
    pk.set_gpu_variant("mosaic")
    which(jnp.zeros(()))
  finally:
    pk.set_gpu_variant(previous)
  assert traced == [
    "pallas_kernels.gpu.paged_attention",
    "pallas_kernels.gpu_mosaic.paged_attention",
  ]


def cuda_plugin() -> str | None:
  for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
    if importlib.util.find_spec(name) is not None:
      return name
  return None


@pytest.mark.parametrize(
  "kernel", ["paged_attention", "prefill_attention", "shared_prefix_attention"]
)
def test_mosaic_variant_lowers_for_cuda(kernel, mosaic_variant):
  """Lowers through Mosaic GPU (layouts, TMA tile shapes, WGMMA operand
  shapes, shared-memory budget). Mosaic GPU's lowering lives in the CUDA
  plugin, so this runs only where one is installed (the GPU machines; on a
  CPU machine ``pip install --no-deps jax-cuda12-plugin==<jax version>``
  plus ``absl-py`` is enough)."""
  plugin = cuda_plugin()
  if plugin is None:
    pytest.skip("Mosaic GPU lowers only with a jax CUDA plugin installed")
  from test_kernels_lowering import abstract_gpu, lowering_cases

  fn, args = lowering_cases("pallas_gpu")[kernel]
  with abstract_gpu():
    exported = export.export(jax.jit(fn), platforms=["cuda"])(*args)
  assert "mosaic_gpu" in exported.mlir_module(), plugin


# Supported shapes at the edges of unsupported_reason: head dims 16 / 192,
# pages 8 / 128, a 16,000-page table, a 6-token GQA group.
EDGE_SHAPES = [
  # (head_dim, page_size, pages_per_seq, rows, dtype)
  (16, 8, 4096, 1, "bfloat16"),
  (192, 64, 64, 6, "bfloat16"),
  (128, 128, 512, 8, "float16"),
  (128, 16, 16000 - 4096, 4, "bfloat16"),
  (64, 32, 33, 64, "float16"),
]


@pytest.mark.parametrize(
  ("head_dim", "page", "pages", "rows", "dtype"), EDGE_SHAPES
)
def test_supported_edge_shapes_lower_for_cuda(
  head_dim, page, pages, rows, dtype
):
  """Whatever unsupported_reason accepts lowers through Mosaic GPU, not the
  Triton fallback: the shapes at the edges of its rules (lowering found
  the rules: a 48-token tile, a 96-wide head, a 544-entry table row and
  an over-full shared memory all failed before they were written)."""
  if cuda_plugin() is None:
    pytest.skip("Mosaic GPU lowers only with a jax CUDA plugin installed")
  assert mosaic.unsupported_reason(dtype, head_dim, page, pages) is None

  def spec(shape, dt=dtype):
    return jax.ShapeDtypeStruct(shape, dt)

  pool = spec((2, pages + 1, page, head_dim))
  fn = functools.partial(
    mosaic.paged_flash_unbatched, scale=0.1, rows_per_token=1, interpret=False
  )
  exported = export.export(jax.jit(fn), platforms=["cuda"])(
    spec((3, 2, rows, head_dim)),
    pool,
    pool,
    spec((3, pages), jnp.int32),
    spec((3,), jnp.int32),
    spec((3,), jnp.int32),
  )
  assert "mosaic_gpu" in exported.mlir_module()
