"""shared_prefix_attention: every variant, interpret mode.

Checks against the reference, against float64 numpy on the concatenated
tables, and against paged_attention on the concatenated tables (the
contract). Groups include an empty group, a group of one, a group with an
empty prefix and requests with empty suffixes; unused slots hold NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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

CONFIGS = {
  "gqa1-k8-d32": (2, 2, 8, 32),
  "gqa4-k16-d64": (8, 2, 16, 64),
  "gqa8-k8-d128": (8, 1, 8, 128),
}

CASES = [(c, "float32") for c in CONFIGS.values()] + [
  (CONFIGS["gqa4-k16-d64"], "bfloat16")
]
CASE_IDS = [f"{name}-float32" for name in CONFIGS] + ["gqa4-k16-d64-bfloat16"]


def make_shared_case(rng, config, dtype):
  """Four groups (sizes 3, 1, 0, 2) over one shuffled pool."""
  num_q_heads, num_kv_heads, page_size, head_dim = config
  num_pages = 16
  ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())
  prefix_rows = [
    [next(ids), next(ids)],  # group 0: 2 pages, 3 members
    [next(ids)],  # group 1: 1 page, a group of one
    [next(ids), next(ids)],  # group 2: no members
    [],  # group 3: empty prefix, 2 members
  ]
  prefix_lengths = np.array([2, 1, 2, 0], np.int32) * page_size
  group_of = rng.permutation(np.array([0, 0, 0, 1, 3, 3], np.int32))
  suffix_lengths = np.array(
    [
      1,
      0,
      page_size + int(rng.integers(1, page_size)),
      2 * page_size,
      int(rng.integers(1, page_size)),
      0,
    ],
    np.int32,
  )
  suffix_rows = [
    [next(ids) for _ in range(-(-int(n) // page_size))] for n in suffix_lengths
  ]
  prefix_tables = pad_tables(prefix_rows, 2)
  suffix_tables = pad_tables(suffix_rows, 2)
  # Concatenated tables: what each request reads, in order.
  cat_rows = [
    prefix_rows[g][: prefix_lengths[g] // page_size] + suffix_rows[b]
    for b, g in enumerate(group_of)
  ]
  cat_tables = pad_tables(cat_rows, 4)
  cat_lengths = prefix_lengths[group_of] + suffix_lengths
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  k = nan_fill_unused(k, cat_tables, cat_lengths)
  v = nan_fill_unused(v, cat_tables, cat_lengths)
  q = rng.standard_normal((len(group_of), num_q_heads, head_dim))
  arrays = (
    jnp.asarray(q, dtype),
    jnp.asarray(k, dtype),
    jnp.asarray(v, dtype),
    jnp.asarray(prefix_tables),
    jnp.asarray(prefix_lengths),
    jnp.asarray(group_of),
    jnp.asarray(suffix_tables),
    jnp.asarray(suffix_lengths),
  )
  return arrays, (cat_tables, cat_lengths)


@pytest.mark.parametrize(("config", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_shared_prefix_matches_concatenated_paged_attention(
  rng, backend, config, dtype
):
  arrays, (cat_tables, cat_lengths) = make_shared_case(rng, config, dtype)
  q, k, v = arrays[:3]
  tol = TOLERANCES[dtype]
  o, lse = pk.shared_prefix_attention(
    *arrays, return_lse=True, **kwargs_for(backend)
  )
  assert o.shape == q.shape and o.dtype == q.dtype
  o64, lse64 = np_attention(q, k, v, cat_tables, cat_lengths)
  assert_close(o, o64, tol["f64"], name="o vs float64")
  assert_close(lse, lse64, tol["lse"], name="lse vs float64")
  if backend != "reference":
    o_ref, lse_ref = pk.shared_prefix_attention(
      *arrays, return_lse=True, backend="reference"
    )
    assert_close(o, o_ref, tol["ref"], name="o vs reference")
    assert_close(lse, lse_ref, tol["lse"], name="lse vs reference")
  o_paged, lse_paged = pk.paged_attention(
    q,
    k,
    v,
    jnp.asarray(cat_tables),
    jnp.asarray(cat_lengths),
    return_lse=True,
    **kwargs_for(backend),
  )
  assert_close(o, o_paged, tol["ref"], name="o vs paged_attention")
  assert_close(lse, lse_paged, tol["lse"], name="lse vs paged_attention")


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_shared_prefix_under_user_jit_with_static_group_bound(rng, backend):
  """Traced group ids need an explicit ``max_group_size``; extra room is ok."""
  arrays, (cat_tables, cat_lengths) = make_shared_case(
    rng, (4, 1, 8, 32), "float32"
  )

  @jax.jit
  def step(*arrays):
    return pk.shared_prefix_attention(
      *arrays, max_group_size=5, backend=backend, interpret=True
    )

  o64, _ = np_attention(*arrays[:3], cat_tables, cat_lengths)
  assert_close(step(*arrays), o64, 1e-4)


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_members_past_the_group_bound_under_jit_are_nan(rng, backend):
  """Group 0 has 3 members and the bound is 2: under jit this cannot be
  refused, so its third member's row is NaN (it used to get the second
  member's prefix result, off by up to 0.27); every other row is right."""
  arrays, (cat_tables, cat_lengths) = make_shared_case(
    rng, (4, 1, 8, 32), "float32"
  )

  @jax.jit
  def step(*arrays):
    return pk.shared_prefix_attention(
      *arrays, max_group_size=2, backend=backend, interpret=True
    )

  o = np.asarray(step(*arrays))
  group_of = np.asarray(arrays[5])
  third = int(np.flatnonzero(group_of == 0)[2])
  assert np.isnan(o[third]).all()
  o64, _ = np_attention(*arrays[:3], cat_tables, cat_lengths)
  rest = np.arange(len(group_of)) != third
  assert_close(o[rest], np.asarray(o64)[rest], 1e-4)


def test_shared_prefix_concat_block_tables_helper(rng):
  arrays, (cat_tables, cat_lengths) = make_shared_case(
    rng, (2, 1, 8, 32), "float32"
  )
  tables, lengths = pk.concat_block_tables(*arrays[3:], page_size=8)
  np.testing.assert_array_equal(np.asarray(lengths), cat_lengths)
  for row, expected, length in zip(
    np.asarray(tables), cat_tables, cat_lengths, strict=True
  ):
    used = -(-int(length) // 8)
    np.testing.assert_array_equal(row[:used], expected[:used])


def test_shared_prefix_group_bound_too_small_names_argument(rng):
  arrays, _ = make_shared_case(rng, (2, 1, 8, 32), "float32")
  with pytest.raises(ValueError, match="max_group_size"):
    pk.shared_prefix_attention(
      *arrays, max_group_size=2, backend="pallas_tpu", interpret=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_shared_prefix_one_big_group(rng, backend):
  """Eight requests share four prefix pages of 16 tokens (GQA 4:1)."""
  num_q_heads, num_kv_heads, page_size, head_dim = 8, 2, 16, 64
  batch, prefix_pages, num_pages = 8, 4, 24
  ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  prefix_tables = ids[None, :prefix_pages]
  suffix_tables = ids[prefix_pages : prefix_pages + 2 * batch].reshape(batch, 2)
  suffix_lengths = rng.integers(0, 2 * page_size + 1, batch).astype(np.int32)
  prefix_lengths = np.array([prefix_pages * page_size], np.int32)
  cat_tables = np.concatenate(
    [prefix_tables.repeat(batch, 0), suffix_tables], axis=1
  )
  cat_lengths = prefix_lengths[0] + suffix_lengths
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  k = nan_fill_unused(k, cat_tables, cat_lengths)
  v = nan_fill_unused(v, cat_tables, cat_lengths)
  q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(np.float32)
  o = pk.shared_prefix_attention(
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    jnp.asarray(prefix_tables),
    jnp.asarray(prefix_lengths),
    jnp.zeros((batch,), jnp.int32),
    jnp.asarray(suffix_tables),
    jnp.asarray(suffix_lengths),
    **kwargs_for(backend),
  )
  o64, _ = np_attention(q, k, v, cat_tables, cat_lengths)
  assert_close(o, o64, TOLERANCES["float32"]["f64"])


def test_prefer_shared_prefix_follows_the_bytes_model():
  batch = 64
  group_of = np.zeros((batch,), np.int32)
  suffix = np.full((batch,), 256, np.int32)
  # B=64 sharing 4096 tokens, 256-token suffixes: 13.6x fewer bytes.
  assert bool(
    pk.prefer_shared_prefix(
      group_of, np.array([4096], np.int32), suffix, page_size=16
    )
  )
  # Groups of one never pay off: the bytes are the same.
  assert not bool(
    pk.prefer_shared_prefix(
      np.arange(batch, dtype=np.int32),
      np.full((batch,), 4096, np.int32),
      suffix,
      page_size=16,
    )
  )
  # Traceable, for lax.cond under jit.
  fn = jax.jit(functools.partial(pk.prefer_shared_prefix, page_size=16))
  assert bool(fn(group_of, jnp.array([4096], jnp.int32), suffix))
