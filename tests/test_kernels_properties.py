"""Property tests (hypothesis): splitting attention and merging is exact."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_support import assert_close, nan_fill_unused, random_pool

import pallas_kernels as pk

PAGE_SIZE, PAGES, HEAD_DIM = 8, 4, 32


@settings(max_examples=25, deadline=None)
@given(
  seed=st.integers(0, 2**32 - 1),
  lengths=st.lists(st.integers(0, PAGES * PAGE_SIZE), min_size=3, max_size=3),
  split_pages=st.lists(st.integers(0, PAGES), min_size=3, max_size=3),
)
def test_any_page_split_merges_to_the_whole(seed, lengths, split_pages):
  """attention(pages[:s] + pages[s:]) == merge(attention(a), attention(b)).

  Shapes are fixed, so the jitted reference compiles once for all examples.
  """
  rng = np.random.default_rng(seed)
  tables = rng.permutation(np.arange(1, 3 * PAGES + 1)).astype(np.int32)
  tables = tables.reshape(3, PAGES)
  lengths = np.array(lengths, np.int32)
  k, v = random_pool(rng, 1, 3 * PAGES + 1, PAGE_SIZE, HEAD_DIM)
  k = nan_fill_unused(k, tables, lengths)
  v = nan_fill_unused(v, tables, lengths)
  q = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
  k, v = jnp.asarray(k), jnp.asarray(v)
  split = np.minimum(np.array(split_pages) * PAGE_SIZE, lengths)
  # Part b: the table rotated so that its pages start at the split page.
  tables_b = np.stack(
    [np.roll(row, -s) for row, s in zip(tables, split_pages, strict=True)]
  )
  whole = pk.paged_attention(
    q,
    k,
    v,
    jnp.asarray(tables),
    jnp.asarray(lengths),
    return_lse=True,
    backend="reference",
  )
  part_a = pk.paged_attention(
    q,
    k,
    v,
    jnp.asarray(tables),
    jnp.asarray(split.astype(np.int32)),
    return_lse=True,
    backend="reference",
  )
  part_b = pk.paged_attention(
    q,
    k,
    v,
    jnp.asarray(tables_b),
    jnp.asarray(lengths - split),
    return_lse=True,
    backend="reference",
  )
  merged = pk.merge_attention_states(*part_a, *part_b, backend="reference")
  assert_close(merged[0], whole[0], 1e-5, name="o")
  assert_close(merged[1], whole[1], 1e-5, name="lse")
