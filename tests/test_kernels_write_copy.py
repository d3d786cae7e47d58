"""write_kv and copy_blocks: every variant, interpret mode, exact results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_kernels_support import ALL_BACKENDS, kwargs_for, random_pool

import pallas_kernels as pk


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_write_kv_scatters_rows_and_skips_negative_slots(rng, backend, dtype):
  num_kv_heads, num_pages, page_size, head_dim, num_tokens = 2, 6, 8, 32, 7
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  k[:, 0] = np.nan  # The null page's garbage must stay untouched.
  slots = rng.choice(num_pages * page_size, num_tokens, replace=False)
  slots = slots.astype(np.int32)
  slots[rng.integers(num_tokens)] = -1
  k_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
  v_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
  cast = [jnp.asarray(x, dtype) for x in (k, v, k_new, v_new)]
  k_out, v_out = pk.write_kv(*cast, jnp.asarray(slots), **kwargs_for(backend))
  assert k_out.dtype == cast[0].dtype and k_out.shape == k.shape
  for pages, new, out in ((cast[0], cast[2], k_out), (cast[1], cast[3], v_out)):
    expected = np.array(pages.astype(jnp.float32))
    new = np.asarray(new.astype(jnp.float32))
    for t, slot in enumerate(slots):
      if slot >= 0:
        expected[:, slot // page_size, slot % page_size] = new[t]
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_copy_blocks_copies_pages_and_skips_padding(rng, backend, dtype):
  num_kv_heads, num_pages, page_size, head_dim = 2, 8, 16, 32
  k, v = random_pool(rng, num_kv_heads, num_pages, page_size, head_dim)
  ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  src = np.array([ids[0], ids[1], -1, ids[0], 0], np.int32)
  dst = np.array([ids[2], ids[3], ids[4], ids[5], 0], np.int32)
  k_in, v_in = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
  k_out, v_out = pk.copy_blocks(
    k_in, v_in, jnp.asarray(src), jnp.asarray(dst), **kwargs_for(backend)
  )
  for before, out in ((k_in, k_out), (v_in, v_out)):
    expected = np.array(before.astype(jnp.float32))
    for s, d in zip(src, dst, strict=True):
      if s >= 0 and d >= 0:
        expected[:, d] = expected[:, s]
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_self_copy_pair_is_a_no_op_in_any_order(rng, backend):
  """``(b, b)`` beside ``(a, b)``: page ``b`` gets ``a``'s rows whichever
  pair comes first (the reference wrote ``b`` twice, in order)."""
  k, v = random_pool(rng, 1, 6, 4, 32)
  a, b = (int(x) for x in rng.choice(np.arange(1, 6), 2, replace=False))
  for src, dst in (([a, b], [b, b]), ([b, a], [b, b])):
    k_out, _ = pk.copy_blocks(
      jnp.asarray(k),
      jnp.asarray(v),
      jnp.asarray(src, jnp.int32),
      jnp.asarray(dst, jnp.int32),
      **kwargs_for(backend),
    )
    expected = k.copy()
    expected[:, b] = k[:, a]
    np.testing.assert_array_equal(np.asarray(k_out), expected)


def test_copy_blocks_with_no_pairs_returns_pools(rng):
  k, v = random_pool(rng, 1, 3, 8, 32)
  empty = jnp.zeros((0,), jnp.int32)
  k_out, _ = pk.copy_blocks(jnp.asarray(k), jnp.asarray(v), empty, empty)
  np.testing.assert_array_equal(np.asarray(k_out), k)


def test_tpu_dma_kernels_are_race_free(rng):
  """TPU interpret mode's race detector, with DMAs executed eagerly.

  Passing an ``InterpretParams`` instance as ``interpret`` reaches
  ``pallas_call`` unchanged. The detector's verdict lives in a private
  module; the test skips if that moved.
  """
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  except ImportError:
    pytest.skip("TPU interpret internals moved")
  params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
  k, v = (jnp.asarray(x) for x in random_pool(rng, 2, 6, 8, 32))
  rows = jnp.asarray(rng.standard_normal((3, 2, 32)), jnp.float32)
  slots = jnp.array([3, 17, -1], jnp.int32)
  ids = jnp.array([1, 2], jnp.int32), jnp.array([3, 4], jnp.int32)
  found = []
  for run in (
    lambda: pk.write_kv(
      k, v, rows, rows, slots, backend="pallas_tpu", interpret=params
    ),
    lambda: pk.copy_blocks(k, v, *ids, backend="pallas_tpu", interpret=params),
  ):
    jax.block_until_ready(run())
    races = getattr(interpret_pallas_call, "races", None)
    if races is None:
      pytest.skip("race detector state not exposed")
    found.append(races.races_found)
  assert found == [False, False]
