"""The tournament tree against a plain numpy argmin over all leaves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax.cache import victim_tree as vt
from prefixjax.cache.paging import NO_BLOCK


def numpy_best(valid, score, depth):
  """Lowest score, then largest depth, then lowest id; ``NO_BLOCK`` if none."""
  ids = np.flatnonzero(valid)
  if not len(ids):
    return NO_BLOCK
  order = np.lexsort((ids, -depth[ids], score[ids]))
  return int(ids[order[0]])


def make_rank(n):
  def rank(valid, score, depth, ids):
    inside = (ids >= 0) & (ids < n)
    safe = jnp.where(inside, ids, 0)
    return inside & valid[safe], score[safe], depth[safe]

  return rank


@functools.partial(jax.jit, static_argnums=0)
def _refresh_all(n, tree, leaves, valid, score, depth):
  rank = functools.partial(make_rank(n), valid, score, depth)

  def body(i, tree):
    return vt.refresh(tree, leaves[i], jnp.bool_(True), rank)

  return jax.lax.fori_loop(0, leaves.shape[0], body, tree)


@pytest.mark.parametrize("n", [1, 32, 33, 1025, 40_000])
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_incremental_equals_scan(rng, n, dtype):
  tree = vt.init(n)
  valid = np.zeros(n, bool)
  # Few distinct scores and depths so the tie-breaks decide often.
  score = rng.integers(0, 4, n).astype(dtype)
  depth = rng.integers(0, 3, n).astype(np.int32)
  assert int(vt.victim(tree)) == NO_BLOCK
  for _ in range(12):
    leaves = rng.integers(0, n, size=int(rng.integers(1, 20)))
    valid[leaves] = rng.random(len(leaves)) < 0.6
    score[leaves] = rng.integers(0, 4, len(leaves)).astype(dtype)
    depth[leaves] = rng.integers(0, 3, len(leaves))
    tree = _refresh_all(
      n,
      tree,
      jnp.asarray(leaves, jnp.int32),
      jnp.asarray(valid),
      jnp.asarray(score),
      jnp.asarray(depth),
    )
    assert int(vt.victim(tree)) == numpy_best(valid, score, depth)
  rank = functools.partial(
    make_rank(n), jnp.asarray(valid), jnp.asarray(score), jnp.asarray(depth)
  )
  for got, want in zip(tree, vt.build(n, rank), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_stale_leaf_is_not_fixed_without_refresh(rng):
  """The tree only learns what it is told: a change without a refresh is
  visible as a difference from :func:`build` (what the cache checks)."""
  n = 100
  valid = np.ones(n, bool)
  score = rng.permutation(n).astype(np.int32)
  depth = np.zeros(n, np.int32)
  rank = functools.partial(
    make_rank(n), jnp.asarray(valid), jnp.asarray(score), jnp.asarray(depth)
  )
  tree = vt.build(n, rank)
  first = int(vt.victim(tree))
  assert first == int(np.argmin(score))
  valid[first] = False
  stale = int(vt.victim(tree))
  tree = _refresh_all(
    n,
    tree,
    jnp.asarray([first], jnp.int32),
    jnp.asarray(valid),
    jnp.asarray(score),
    jnp.asarray(depth),
  )
  assert stale == first != int(vt.victim(tree))
  assert int(vt.victim(tree)) == numpy_best(valid, score, depth)


def test_init_rejects_empty():
  with pytest.raises(ValueError, match="num_leaves"):
    vt.init(0)
