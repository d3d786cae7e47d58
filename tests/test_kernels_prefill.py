"""prefill_attention: every variant, interpret mode.

One ragged batch covers a fresh prompt (``q_len == kv_len``), a chunk after
cached pages (``q_len < kv_len``, a page boundary inside the chunk), a single
token, a sequence with no new tokens and padding rows after the last
sequence; unused slots hold NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_support import (
  ALL_BACKENDS,
  TOLERANCES,
  assert_close,
  kwargs_for,
  nan_fill_unused,
  np_prefill,
  pad_tables,
  random_pool,
)

import pallas_kernels as pk

CONFIGS = {
  "gqa1-k8-d32-bq4": (2, 2, 8, 32, 4),
  "gqa4-k16-d64-bq8": (4, 1, 16, 64, 8),
  "gqa8-k8-d128-bq16": (8, 1, 8, 128, 16),
}

CASES = [(c, "float32") for c in CONFIGS.values()] + [
  (CONFIGS["gqa4-k16-d64-bq8"], "bfloat16")
]
CASE_IDS = [f"{name}-float32" for name in CONFIGS] + [
  "gqa4-k16-d64-bq8-bfloat16"
]


def make_prefill_case(rng, config, dtype):
  num_q_heads, num_kv_heads, page_size, head_dim, _ = config
  num_pages = 12
  ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())
  fresh = page_size + int(rng.integers(1, page_size))
  cached = 2 * page_size + int(rng.integers(1, page_size))
  kv_lengths = np.array([fresh, cached, 3 * page_size, page_size], np.int32)
  q_lengths = np.array([fresh, page_size + 2, 1, 0], np.int32)
  rows = [
    [next(ids) for _ in range(-(-int(n) // page_size))] for n in kv_lengths
  ]
  rows[3] = rows[2][:1]  # Shares its only page with sequence 2.
  tables = pad_tables(rows, 3)
  cu = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
  num_tokens = int(cu[-1]) + 3  # Three padding rows.
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  k = nan_fill_unused(k, tables, kv_lengths)
  v = nan_fill_unused(v, tables, kv_lengths)
  q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(k, dtype),
    jnp.asarray(v, dtype),
    jnp.asarray(tables),
    jnp.asarray(kv_lengths),
    jnp.asarray(cu),
  )


@pytest.mark.parametrize(("config", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_prefill_matches_reference_and_float64(rng, backend, config, dtype):
  arrays = make_prefill_case(rng, config, dtype)
  tol = TOLERANCES[dtype]
  o = pk.prefill_attention(*arrays, block_q=config[-1], **kwargs_for(backend))
  assert o.shape == arrays[0].shape and o.dtype == arrays[0].dtype
  o64 = np_prefill(*arrays)
  assert_close(o, o64, tol["f64"], name="o vs float64")
  if backend != "reference":
    o_ref = pk.prefill_attention(*arrays, backend="reference")
    assert_close(o, o_ref, tol["ref"], name="o vs reference")
  cu_end = int(arrays[-1][-1])
  np.testing.assert_array_equal(np.asarray(o[cu_end:], np.float32), 0.0)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_prefill_single_token_equals_decode(rng, backend):
  """A one-token chunk at the end of each sequence is decode attention."""
  num_q_heads, num_kv_heads, page_size, head_dim = 4, 2, 8, 32
  tables = np.array([[1, 2], [3, 4]], np.int32)
  lengths = np.array([11, 16], np.int32)
  k, v = random_pool(rng, num_kv_heads, 5, page_size, head_dim)
  k = nan_fill_unused(k, tables, lengths)
  v = nan_fill_unused(v, tables, lengths)
  q = jnp.asarray(rng.standard_normal((2, num_q_heads, head_dim)), jnp.float32)
  args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables))
  o = pk.prefill_attention(
    q,
    *args,
    jnp.asarray(lengths),
    jnp.array([0, 1, 2], jnp.int32),
    **kwargs_for(backend),
  )
  expected = pk.paged_attention(
    q, *args, jnp.asarray(lengths), **kwargs_for(backend)
  )
  assert_close(o, expected, 2e-5)
