"""paged_attention and merge_attention_states: every variant, interpret mode.

Each case draws fresh random inputs (the ``rng`` fixture) and checks the
variant against the plain-jnp reference and an independent float64 numpy
computation. One batch covers lengths 0, 1, not a multiple of the page size
and exactly full, with two sequences sharing prefix pages, and NaN in every
slot no sequence reads.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_kernels_support import (
  ALL_BACKENDS,
  PALLAS_BACKENDS,
  TOLERANCES,
  assert_close,
  kwargs_for,
  nan_fill_unused,
  np_attention,
  pad_tables,
  random_pool,
)

import pallas_kernels as pk

# (num_q_heads, num_kv_heads, page_size, head_dim): GQA ratios 1, 4, 8;
# page sizes 8..64; head dims 32..128.
CONFIGS = {
  "gqa1-k8-d32": (2, 2, 8, 32),
  "gqa4-k16-d64": (4, 1, 16, 64),
  "gqa8-k32-d128": (8, 1, 32, 128),
  "gqa4-k64-d32": (8, 2, 64, 32),
}

# Every config in float32, two of them in bfloat16 as well.
CASES = [(c, "float32") for c in CONFIGS.values()] + [
  (CONFIGS["gqa4-k16-d64"], "bfloat16"),
  (CONFIGS["gqa8-k32-d128"], "bfloat16"),
]
CASE_IDS = [f"{name}-float32" for name in CONFIGS] + [
  "gqa4-k16-d64-bfloat16",
  "gqa8-k32-d128-bfloat16",
]


def make_decode_case(rng, config, dtype, *, nan=True):
  """A 5-request batch over a shuffled pool; returns jnp arrays + numpy."""
  num_q_heads, num_kv_heads, page_size, head_dim = config
  pages_per_seq = 3
  num_pages = 10
  ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  shared = list(ids[:2])
  rows = [
    [ids[2]],  # length 1
    [*shared, ids[3]],  # shares 2 pages, not a multiple of the page size
    [*shared, ids[4]],  # shares 2 pages, exactly full
    [],  # length 0
    [ids[5], ids[6]],  # partial second page
  ]
  lengths = np.array(
    [
      1,
      2 * page_size + int(rng.integers(1, page_size)),
      3 * page_size,
      0,
      page_size + int(rng.integers(1, page_size)),
    ],
    np.int32,
  )
  tables = pad_tables(rows, pages_per_seq)
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  if nan:
    k, v = (
      nan_fill_unused(k, tables, lengths),
      nan_fill_unused(v, tables, lengths),
    )
  q = rng.standard_normal((len(rows), num_q_heads, head_dim)).astype(np.float32)
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(k, dtype),
    jnp.asarray(v, dtype),
    jnp.asarray(tables),
    jnp.asarray(lengths),
  )


@pytest.mark.parametrize(("config", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_paged_attention_matches_reference_and_float64(
  rng, backend, config, dtype
):
  q, k, v, tables, lengths = make_decode_case(rng, config, dtype)
  tol = TOLERANCES[dtype]
  o, lse = pk.paged_attention(
    q, k, v, tables, lengths, return_lse=True, **kwargs_for(backend)
  )
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  o_ref, lse_ref = pk.paged_attention_reference(
    q, k, v, tables, lengths, return_lse=True
  )
  assert_close(o, o_ref, tol["ref"], name="o vs reference")
  assert_close(lse, lse_ref, tol["lse"], name="lse vs reference")
  o64, lse64 = np_attention(q, k, v, np.asarray(tables), np.asarray(lengths))
  assert_close(o, o64, tol["f64"], name="o vs float64")
  assert_close(lse, lse64, tol["lse"], name="lse vs float64")
  # Length 0 is the merge-neutral state.
  np.testing.assert_array_equal(np.asarray(o[3], np.float32), 0.0)
  assert np.all(np.asarray(lse[3]) == -np.inf)


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_paged_attention_custom_scale_without_lse(rng, backend):
  q, k, v, tables, lengths = make_decode_case(rng, (4, 2, 8, 32), "float32")
  o = pk.paged_attention(
    q, k, v, tables, lengths, scale=0.3, **kwargs_for(backend)
  )
  o64, _ = np_attention(q, k, v, np.asarray(tables), np.asarray(lengths), 0.3)
  assert_close(o, o64, 1e-4)


def test_paged_attention_matches_jax_paged_attention(rng):
  """Against JAX's own Pallas TPU paged attention in TPU interpret mode.

  JAX's kernel adds a large negative mask value to masked scores, so NaN in
  unused slots would leak into its output: this case uses finite pools and
  positive lengths (its documented contract). Its kernel also casts loaded
  K/V pages to bfloat16, so the pools hold bfloat16-representable float32
  values, which makes that cast exact. It applies no score scale (callers
  pre-scale q), so ours runs with ``scale=1.0``.
  """
  from jax.experimental.pallas.ops.tpu.paged_attention import (
    paged_attention as jax_paged_attention,
  )

  q, k, v, tables, lengths = make_decode_case(
    rng, (8, 2, 16, 64), "float32", nan=False
  )
  k = k.astype(jnp.bfloat16).astype(jnp.float32)
  v = v.astype(jnp.bfloat16).astype(jnp.float32)
  lengths = jnp.maximum(lengths, 1)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    # JAX's kernel body mixes bfloat16 and float32 in an einsum, which strict
    # dtype promotion (tests/conftest.py) rejects; the relaxation covers only
    # JAX's own kernel, not ours.
    with jax.numpy_dtype_promotion("standard"):
      expected = jax_paged_attention(
        q, k, v, lengths, tables, pages_per_compute_block=1
      )
    # Inside the context manager pallas_tpu also runs with interpret=False.
    ours = pk.paged_attention(
      q, k, v, tables, lengths, scale=1.0, backend="pallas_tpu"
    )
  assert_close(ours, expected, 2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_of_split_attention_is_exact(rng, backend, dtype):
  """Attention over pages A then B == merge(attention A, attention B)."""
  q, k, v, tables, lengths = make_decode_case(rng, (4, 1, 8, 32), dtype)
  # Split each table after its first page: part A = page 0, part B = rest.
  page_size = k.shape[2]
  len_a = jnp.minimum(lengths, page_size)
  len_b = lengths - len_a
  tables_b = jnp.concatenate([tables[:, 1:], tables[:, :1]], axis=1)
  o_a, lse_a = pk.paged_attention(
    q, k, v, tables, len_a, return_lse=True, backend="reference"
  )
  o_b, lse_b = pk.paged_attention(
    q, k, v, tables_b, len_b, return_lse=True, backend="reference"
  )
  o, lse = pk.merge_attention_states(
    o_a, lse_a, o_b, lse_b, **kwargs_for(backend)
  )
  assert o.dtype == q.dtype and lse.dtype == jnp.float32
  o64, lse64 = np_attention(q, k, v, np.asarray(tables), np.asarray(lengths))
  tol = TOLERANCES[dtype]
  assert_close(o, o64, 2 * tol["f64"], name="merged o")
  assert_close(lse, lse64, tol["lse"], name="merged lse")
  o_ref, lse_ref = pk.merge_attention_states_reference(o_a, lse_a, o_b, lse_b)
  assert_close(o, o_ref, tol["ref"], name="merge vs reference")
  assert_close(lse, lse_ref, 1e-6, name="merge lse vs reference")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_ignores_empty_states_even_if_nan(rng, backend):
  o_a = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.float32)
  lse_a = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  o_nan = jnp.full((3, 4, 32), jnp.nan, jnp.float32)
  empty = jnp.full((3, 4), -jnp.inf, jnp.float32)
  o, lse = pk.merge_attention_states(
    o_a, lse_a, o_nan, empty, **kwargs_for(backend)
  )
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_a), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_a), rtol=1e-6)
  o, lse = pk.merge_attention_states(
    o_nan, empty, o_nan, empty, **kwargs_for(backend)
  )
  np.testing.assert_array_equal(np.asarray(o), 0.0)
  assert np.all(np.asarray(lse) == -np.inf)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_merge_keeps_a_bad_lse_visible(rng, backend, bad):
  """A NaN or +inf lse used to come out as -inf, the "empty" marker, so a
  later merge dropped the NaN as neutral."""
  o_a = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.float32)
  lse_a = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  row = int(rng.integers(3))
  lse_bad = lse_a.at[row].set(bad)
  o, lse = pk.merge_attention_states(
    o_a, lse_bad, o_a, lse_a, **kwargs_for(backend)
  )
  assert np.isnan(np.asarray(lse)[row]).all()
  assert np.isnan(np.asarray(o)[row]).all()
  rest = np.arange(3) != row
  assert np.isfinite(np.asarray(lse)[rest]).all()
  o2, lse2 = pk.merge_attention_states(
    o, lse, o_a, lse_a, **kwargs_for(backend)
  )
  assert np.isnan(np.asarray(o2)[row]).all()


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_paged_attention_traces_once_per_shape(rng, backend):
  """New values with the same shapes reuse the compiled kernel."""
  module = importlib.import_module("pallas_kernels.paged_attention")

  q, k, v, tables, lengths = make_decode_case(rng, (2, 1, 8, 32), "float32")
  pk.paged_attention(q, k, v, tables, lengths, **kwargs_for(backend))
  before = module._paged_attention._cache_size()
  pk.paged_attention(
    q + 1.0, k, v, tables[::-1], lengths[::-1], **kwargs_for(backend)
  )
  assert module._paged_attention._cache_size() == before


def test_paged_attention_inside_user_jit(rng):
  """Traced tables skip the concrete checks and still compute correctly."""
  q, k, v, tables, lengths = make_decode_case(rng, (4, 2, 8, 32), "float32")

  @jax.jit
  def step(q, k, v, tables, lengths):
    return pk.paged_attention(
      q, k, v, tables, lengths, backend="pallas_gpu", interpret=True
    )

  o64, _ = np_attention(q, k, v, np.asarray(tables), np.asarray(lengths))
  assert_close(step(q, k, v, tables, lengths), o64, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_paged_attention_larger_batch_bfloat16(rng, backend):
  """A bigger pool and batch (8 requests, up to 6 pages of 16, D=128)."""
  num_q_heads, num_kv_heads, page_size, head_dim = 8, 2, 16, 128
  batch, pages_per_seq, num_pages = 8, 6, 40
  ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  tables = ids[: batch * pages_per_seq // 2].reshape(batch, -1)
  tables = np.concatenate([tables[:1].repeat(batch, 0), tables], axis=1)
  lengths = rng.integers(1, pages_per_seq * page_size + 1, batch)
  lengths = lengths.astype(np.int32)
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  k = nan_fill_unused(k, tables, lengths)
  v = nan_fill_unused(v, tables, lengths)
  q = rng.standard_normal((batch, num_q_heads, head_dim))
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  o, lse = pk.paged_attention(
    *args,
    jnp.asarray(tables),
    jnp.asarray(lengths),
    return_lse=True,
    **kwargs_for(backend),
  )
  o64, lse64 = np_attention(*args, tables, lengths)
  assert_close(o, o64, TOLERANCES["bfloat16"]["f64"], name="o")
  assert_close(lse, lse64, TOLERANCES["bfloat16"]["lse"], name="lse")
