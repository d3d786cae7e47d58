"""``sglang_engine._when``, the engine's 0-or-1-trip branch, and
``prefixjax._masked.barrier``, which keeps a branch's work in it.

XLA's loop-invariant code motion hoists out of a while loop whatever the
body computes from carry parts it returns unchanged, so a branch that is
rarely taken paid for its reads of the request arrays at every call (the
waiting-queue refresh's ordering: about an eighth of SGLang's loop at
10,000 requests). Read through ``barrier`` anchored on the loop's counter,
that work stays in the loop; the compiled program is checked for it here.
Values: random arrays of every dtype the engine carries, against numpy."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax import _masked
from prefixjax.serving import sglang_engine as eng


def _values(rng, n: int):
  return (
    rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32),
    rng.random(n) < 0.5,
    rng.standard_normal(n).astype(np.float32),
    rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
  )


def test_barrier_returns_every_dtype_unchanged(rng):
  arrays = _values(rng, int(rng.integers(1, 50)))
  scalars = tuple(a[0] for a in _values(rng, 1))
  anchor = jnp.int32(rng.integers(0, 100))
  out = jax.jit(_masked.barrier)(anchor, *arrays, *scalars)
  assert len(out) == len(arrays) + len(scalars)
  for got, want in zip(out, arrays + scalars, strict=True):
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("trip", [False, True])
def test_when_runs_fn_exactly_when_asked(rng, trip):
  a, b, x, _ = _values(rng, int(rng.integers(2, 40)))
  shift = int(rng.integers(1, 1000))

  def fn(v, *counter):
    assert len(counter) == int(trip)
    k = counter[0] if trip else 1
    ints, flags, floats = v
    return ints + shift * k, ~flags, floats * 2.0

  run = jax.jit(lambda p, v: eng._when(p, fn, v, trip))
  for pred in (False, True):
    got = run(jnp.bool_(pred), (a, b, x))
    want = (a + shift, ~b, x * np.float32(2.0)) if pred else (a, b, x)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(g), w)


def _entry(hlo: str) -> str:
  """The ENTRY computation of an HLO module's text."""
  start = hlo.index("\nENTRY ")
  return hlo[start : hlo.index("\n}\n", start)]


def test_a_branch_reading_through_its_counter_keeps_its_work(rng):
  """A branch that sums an input it returns unchanged: read directly, XLA
  moves the sum out of the loop (where it runs untaken too); read through
  ``barrier(trip, ...)``, the sum stays in the loop's body."""
  n = 4096 + int(rng.integers(0, 64))
  marks = rng.random(n) < 0.3

  def branch(read_through):
    def fn(v, trip):
      flags, total = v
      seen = _masked.barrier(trip, flags)[0] if read_through else flags
      return flags, total + jnp.sum(jnp.where(seen, 3, 1))

    return jax.jit(lambda p, v: eng._when(p, fn, v, True))

  args = (jnp.bool_(False), (jnp.asarray(marks), jnp.int32(0)))
  sum_over_n = re.compile(rf"s32\[{n}\]")
  for read_through in (True, False):
    run = branch(read_through)
    np.testing.assert_array_equal(run(*args)[1], 0)
    taken = run(jnp.bool_(True), args[1])[1]
    np.testing.assert_array_equal(taken, 3 * marks.sum() + (n - marks.sum()))
    entry = _entry(run.lower(*args).compile().as_text())
    hoisted = bool(sum_over_n.search(entry))
    if read_through:
      assert not hoisted, "the branch's sum was moved out of its loop"
    elif not hoisted:
      pytest.skip("this XLA does not hoist the plain read (nothing to keep)")
