"""``prefixjax._masked.count`` and ``some``: ``jnp.sum(mask, axis=-1)`` and
``jnp.any(mask, axis=-1)`` in the form XLA:CPU vectorises (int8 rows of 8,
the last ``n % 8`` lanes on their own), against numpy on random masks of
random lengths (below, at and off multiples of 8, short ones taking the
plain sum), densities from empty to full, 1-D and with leading axes, under
``jit`` and ``vmap``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prefixjax import _masked


def _mask(rng, shape):
  return rng.random(shape) < rng.choice([0.0, 0.01, 0.5, 0.97, 1.0])


@pytest.mark.parametrize("case", range(3))
def test_count_and_some_equal_numpy(rng, case):
  for _ in range(8):
    n = int(rng.choice([1, 7, 63, 64, 65, int(rng.integers(2, 3000))]))
    lead = tuple(
      int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 3)))
    )
    mask = _mask(rng, (*lead, n))
    got = jax.jit(_masked.count)(mask)
    assert got.dtype == np.int32 and got.shape == lead
    np.testing.assert_array_equal(np.asarray(got), mask.sum(axis=-1), f"{n=}")
    np.testing.assert_array_equal(
      np.asarray(jax.jit(_masked.some)(mask)), mask.any(axis=-1), f"{n=}"
    )


def test_count_under_vmap(rng):
  n = int(rng.integers(64, 2000))
  mask = _mask(rng, (int(rng.integers(2, 6)), n))
  got = jax.jit(jax.vmap(_masked.count))(mask)
  np.testing.assert_array_equal(np.asarray(got), mask.sum(axis=1))


def test_count_of_a_full_row_does_not_wrap(rng):
  """Every lane set: the int8 rows hold 8 each, the total (past 127 and
  past 65,535) is summed in int32."""
  n = int(rng.integers(70_000, 90_000))
  np.testing.assert_array_equal(
    np.asarray(jax.jit(_masked.count)(np.ones(n, bool))), n
  )
