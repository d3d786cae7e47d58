"""The SGLang engine's choice of the ``k`` waiting requests with the smallest
key (``sglang_engine._smallest``), against a stable numpy sort.

The engine reads the first ``n`` lanes (``n`` = how many it returns): the
masked requests by increasing key, ties by request id (as ``lax.top_k``
orders them). Every path is checked: the bisection (``_k_smallest``, small
``k``), ``top_k`` over all requests (large ``k``) and the gathered few.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from prefixjax.serving import sglang_engine as eng

_INT32 = np.iinfo(np.int32)


@functools.cache
def _compiled(k: int, few: bool):
  return jax.jit(lambda mask, key: eng._smallest(mask, key, k, few))


def _want(mask, key, k):
  rids = np.flatnonzero(mask)
  order = rids[np.argsort(key[rids], kind="stable")]
  return order[:k]


def _keys(rng, r_len):
  """Keys of one of six kinds: distinct, many ties, negative, spread over
  the whole int32 range (the bisection's midpoint must not overflow), a
  queue's contiguous positions (the first probe ends the search), or
  both ends of the int32 range (its distance must not overflow)."""
  kind = rng.integers(6)
  if kind == 4:
    return (rng.integers(0, 1000) + rng.permutation(r_len)).astype(np.int32)
  if kind == 5:
    return rng.choice([_INT32.min + 1, _INT32.max - 1, 0], r_len).astype(
      np.int32
    )
  if kind == 0:
    return rng.permutation(4 * r_len)[:r_len].astype(np.int32)
  if kind == 1:
    return rng.integers(0, 4, r_len).astype(np.int32)
  if kind == 2:
    return rng.integers(-50, 50, r_len).astype(np.int32)
  return rng.integers(_INT32.min + 1, _INT32.max - 1, r_len).astype(np.int32)


@pytest.mark.parametrize("case", range(6))
def test_smallest_matches_a_stable_sort(rng, case):
  for _ in range(8):
    r_len = int(rng.integers(1, 200))
    # small k (bisection), large k (top_k over all), k >= R
    k = int(rng.choice([1, 2, max(1, r_len // 4), r_len, r_len + 3]))
    mask = rng.random(r_len) < rng.choice([0.0, 0.1, 0.5, 1.0])
    key = _keys(rng, r_len)
    got, n = _compiled(k, False)(mask, key)
    want = _want(mask, key, k)
    assert int(n) == len(want), (r_len, k)
    np.testing.assert_array_equal(np.asarray(got)[: len(want)], want)


def test_few_gathers_then_sorts(rng):
  r_len = int(rng.integers(20, 300))
  k = int(rng.integers(1, 16))
  mask = np.zeros(r_len, bool)
  chosen = rng.choice(r_len, size=int(rng.integers(0, k + 1)), replace=False)
  mask[chosen] = True
  key = _keys(rng, r_len)
  got, n = _compiled(k, True)(mask, key)
  want = _want(mask, key, k)
  assert int(n) == len(want)
  np.testing.assert_array_equal(np.asarray(got)[: len(want)], want)


def test_bisection_is_used_for_small_k(rng):
  """At ``R`` = 400 and ``k`` = 17 (the engine's ``max_running + 1``) the
  result comes from ``_k_smallest``, checked here on its own too: its
  lanes are the chosen requests in request order."""
  r_len, k = 400, 17
  mask = rng.random(r_len) < 0.7
  key = _keys(rng, r_len)
  n = min(int(mask.sum()), k)
  idx = jax.jit(lambda m, x: eng._k_smallest(m, x, k, n))(mask, key)
  want = _want(mask, key, k)
  np.testing.assert_array_equal(np.asarray(idx)[:n], np.sort(want))
  got, _ = _compiled(k, False)(mask, key)
  np.testing.assert_array_equal(np.asarray(got)[:n], want)


@pytest.mark.parametrize("case", range(4))
def test_first_set_equals_nonzero(rng, case):
  """``_first_set`` (blocks of 32) against ``jnp.nonzero(size=k)``: ``R``
  below, at and off multiples of 32 (and of 32 * 8, where the blocks'
  count takes ``count``'s row form), masks empty to full, ``k`` below and
  above the count."""
  for _ in range(6):
    r_len = int(
      rng.choice(
        [
          1,
          31,
          32,
          33,
          int(rng.integers(2, 700)),
          int(rng.integers(2048, 5000)),
        ]
      )
    )
    k = int(rng.integers(1, r_len + 1))
    mask = rng.random(r_len) < rng.choice([0.0, 0.02, 0.3, 1.0])
    got, count = jax.jit(lambda m, k=k: eng._first_set(m, k))(mask)
    (want,) = np.nonzero(mask)
    assert int(count) == len(want)
    want = np.concatenate([want, np.zeros(k, np.int64)])[:k]
    np.testing.assert_array_equal(np.asarray(got), want, f"{r_len=} {k=}")
