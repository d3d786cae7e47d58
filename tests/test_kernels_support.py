"""Shared helpers for the kernel tests: inputs and float64 numpy oracles.

Not a test module itself (it holds no tests); the ``test_kernels_`` prefix
keeps it inside the kernel tests' file pattern.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

PALLAS_BACKENDS = ("pallas_tpu", "pallas_gpu")
ALL_BACKENDS = ("reference", *PALLAS_BACKENDS)

# Tolerances. All variants compute in float32, so float32 results agree with
# the reference to rounding noise and with float64 numpy (fed the same
# inputs) to float32 accumulation error. bfloat16 outputs are rounded to
# bfloat16 (8 mantissa bits: relative 2**-8 of values up to ~4).
TOLERANCES = {
  "float32": {"ref": 2e-5, "f64": 1e-4, "lse": 1e-4},
  "bfloat16": {"ref": 2e-2, "f64": 3e-2, "lse": 1e-4},
}


def kwargs_for(backend: str) -> dict:
  """Call options for a backend: Pallas variants run in interpret mode."""
  if backend == "reference":
    return {"backend": "reference"}
  return {"backend": backend, "interpret": True}


def as_f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def random_pool(rng, num_kv_heads, num_pages, page_size, head_dim):
  """Random K and V pools as float32 numpy arrays ``[Hkv, N, K, D]``."""
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  return (
    rng.standard_normal(shape).astype(np.float32),
    rng.standard_normal(shape).astype(np.float32),
  )


def nan_fill_unused(pool, tables, lengths):
  """NaN in every slot that no sequence reads (incl. the null page 0)."""
  page_size = pool.shape[2]
  used = np.zeros(pool.shape[1:3], bool)
  for row, length in zip(np.asarray(tables), np.asarray(lengths), strict=True):
    for t in range(int(length)):
      used[row[t // page_size], t % page_size] = True
  out = pool.copy()
  out[:, ~used] = np.nan
  return out


def pad_tables(rows, width):
  """Rows of page ids padded with the null page 0 to ``[len(rows), width]``."""
  table = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    table[i, : len(row)] = row
  return table


def np_attention(q, k_pages, v_pages, tables, lengths, scale=None):
  """Float64 decode attention: ``(o [B, Hq, D], lse [B, Hq])``."""
  q, k_pages, v_pages = as_f64(q), as_f64(k_pages), as_f64(v_pages)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  o = np.zeros(q.shape)
  lse = np.full((batch, num_q_heads), -np.inf)
  for b in range(batch):
    length = int(lengths[b])
    if length == 0:
      continue
    pages = np.asarray(tables[b])[: -(-length // page_size)]
    k = k_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :length]
    v = v_pages[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :length]
    for h in range(num_q_heads):
      s = k[h // group] @ q[b, h] * scale
      m = s.max()
      p = np.exp(s - m)
      o[b, h] = p @ v[h // group] / p.sum()
      lse[b, h] = m + np.log(p.sum())
  return o, lse


def np_prefill(q, k_pages, v_pages, tables, kv_lengths, cu_q_lengths):
  """Float64 causal prefill over cached pages: ``o [T, Hq, D]``."""
  q, k_pages, v_pages = as_f64(q), as_f64(k_pages), as_f64(v_pages)
  tables, kv_lengths = np.asarray(tables), np.asarray(kv_lengths)
  cu_q_lengths = np.asarray(cu_q_lengths)
  num_q_heads, head_dim = q.shape[1:]
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  o = np.zeros(q.shape)
  for s, kv_length in enumerate(np.asarray(kv_lengths)):
    start, end = int(cu_q_lengths[s]), int(cu_q_lengths[s + 1])
    pages = np.asarray(tables[s])[: -(-int(kv_length) // page_size)]
    k = k_pages[:, pages].reshape(num_kv_heads, -1, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, -1, head_dim)
    for j in range(end - start):
      pos = int(kv_length) - (end - start) + j
      for h in range(num_q_heads):
        scores = (
          k[h // group, : pos + 1] @ q[start + j, h] / math.sqrt(head_dim)
        )
        p = np.exp(scores - scores.max())
        o[start + j, h] = p @ v[h // group, : pos + 1] / p.sum()
  return o


def assert_close(actual, expected, atol, *, name=""):
  """Max-abs check that also fails on NaN anywhere in ``actual``."""
  actual = as_f64(actual)
  expected = np.asarray(expected, np.float64)
  assert not np.isnan(actual).any(), f"{name}: NaN in output"
  finite = np.isfinite(expected)
  np.testing.assert_array_equal(
    np.isfinite(actual), finite, err_msg=f"{name}: finiteness differs"
  )
  np.testing.assert_allclose(
    actual[finite], expected[finite], atol=atol, rtol=atol, err_msg=name
  )
