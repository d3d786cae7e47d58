"""``prefixjax._masked.take``: a path's entries from large arrays as one
loop of dynamic slices on XLA:CPU (a fused gather from an array of 512 KiB
or more is split over threads there), the plain gather otherwise. Both forms
against numpy's reading of ``jnp`` indexing (negative indices from the end,
then clamped), on random arrays of several dtypes and random indices, in and
out of range; the loop form under ``jit``, as the engines call it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax import _masked


def _expected(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
  n = a.shape[0]
  k = np.where(idx < 0, idx + n, idx)
  return a[np.clip(k, 0, n - 1)]


def _arrays(rng, n: int):
  return (
    rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32),
    rng.random(n) < 0.5,
    rng.standard_normal(n).astype(np.float32),
  )


def _lowered(fn, *args) -> str:
  return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("loop", [True, False])
def test_take_equals_numpy_indexing(rng, monkeypatch, loop):
  """With the byte bound lowered to the arrays' size the loop form runs on
  small arrays (checked: the lowered program holds a while loop, the
  gather form none)."""
  n = int(rng.integers(1, 300))
  arrays = _arrays(rng, n)
  m = int(rng.integers(1, 130))
  # mostly in range, some negative, some past the end
  idx = rng.integers(-2 * n, 2 * n, m).astype(np.int32)
  idx[: m // 2] = rng.integers(0, n, m // 2)
  monkeypatch.setattr(_masked, "TAKE_LOOP_BYTES", int(rng.integers(1, n + 1)))

  def fn(idx, *arrays):
    return _masked.take(idx, *arrays, loop=loop)

  text = _lowered(fn, idx, *arrays)
  assert ("stablehlo.while" in text) == (
    loop and jax.default_backend() == "cpu"
  )
  got = jax.jit(fn)(idx, *arrays)
  assert len(got) == len(arrays)
  for a, g in zip(arrays, got, strict=True):
    assert g.dtype == a.dtype and g.shape == (m,)
    np.testing.assert_array_equal(np.asarray(g), _expected(a, idx))


def test_small_arrays_keep_the_gather(rng):
  """Under the byte bound (the default, 128 KiB) no loop: XLA fuses the
  gather into its consumers."""
  n = int(rng.integers(1, _masked.TAKE_LOOP_BYTES // 4))
  a = rng.integers(0, 100, n).astype(np.int32)
  idx = rng.integers(0, n, 17).astype(np.int32)
  text = _lowered(lambda i, a: _masked.take(i, a), idx, a)
  assert "stablehlo.while" not in text
  (g,) = jax.jit(lambda i, a: _masked.take(i, a))(idx, a)
  np.testing.assert_array_equal(np.asarray(g), a[idx])


def test_take_from_a_large_array(rng):
  """An array past the bound (the trie's page arrays at 10,000 requests
  are about this size), read by the loop."""
  n = _masked.TAKE_LOOP_BYTES // 4 + int(rng.integers(0, 50_000))
  a = rng.integers(0, 2**31 - 1, n).astype(np.int32)
  b = rng.random(n) < 0.3
  idx = rng.integers(0, n, 121).astype(np.int32)
  text = _lowered(lambda i, a, b: _masked.take(i, a, b), idx, a, b)
  assert ("stablehlo.while" in text) == (jax.default_backend() == "cpu")
  ga, gb = jax.jit(lambda i, a, b: _masked.take(i, a, b))(idx, a, b)
  np.testing.assert_array_equal(np.asarray(ga), a[idx])
  np.testing.assert_array_equal(np.asarray(gb), b[idx])


def test_vmapped_callers_take_the_gather(rng, monkeypatch):
  """``loop=False``, as the vmapped engines pass it: per-lane arrays and
  indices, equal to numpy lane by lane."""
  monkeypatch.setattr(_masked, "TAKE_LOOP_BYTES", 1)
  lanes, n, m = int(rng.integers(1, 6)), int(rng.integers(1, 200)), 33
  a = rng.integers(0, 1000, (lanes, n)).astype(np.int32)
  idx = rng.integers(-n, n, (lanes, m)).astype(np.int32)
  got = jax.jit(jax.vmap(lambda i, a: _masked.take(i, a, loop=False)[0]))(
    idx, a
  )
  for k in range(lanes):
    np.testing.assert_array_equal(np.asarray(got[k]), _expected(a[k], idx[k]))


def test_jnp_reads_indices_as_the_reference_does(rng):
  """The reference itself: numpy's reading equals ``jnp`` indexing."""
  n = int(rng.integers(1, 100))
  a = rng.integers(0, 1000, n).astype(np.int32)
  idx = rng.integers(-3 * n, 3 * n, 64).astype(np.int32)
  np.testing.assert_array_equal(
    np.asarray(jnp.asarray(a)[jnp.asarray(idx)]), _expected(a, idx)
  )
