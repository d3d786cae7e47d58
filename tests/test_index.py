"""Tests of the open-addressing key -> block index."""

from __future__ import annotations

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from prefixjax.cache import index

S = index.IndexStatus


def _key(lo, hi):
  return jnp.asarray(np.asarray([lo, hi], np.uint32))


def _keys(pairs):
  return jnp.asarray(np.asarray(pairs, np.uint32).reshape(-1, 2))


def test_init_sizes_and_load_validation():
  assert index.init(num_keys=100, max_load=0.5).capacity == 256
  assert index.init(num_keys=96, max_load=0.75).capacity == 128
  assert index.init(num_keys=3, capacity=4, max_load=0.75).capacity == 4
  assert index.init(num_keys=3, capacity=4, max_load=0.75).max_probes == 4
  with pytest.raises(ValueError, match=r"max_load=0.8 must be in \(0, 0.75\]"):
    index.init(num_keys=10, max_load=0.8)
  with pytest.raises(ValueError, match="capacity=64 too small: num_keys=40"):
    index.init(num_keys=40, max_load=0.5, capacity=64)
  with pytest.raises(ValueError, match="capacity=48 must be a power of two"):
    index.init(num_keys=4, capacity=48)
  with pytest.raises(ValueError, match="num_keys=0 must be >= 1"):
    index.init(num_keys=0)
  with pytest.raises(TypeError, match="num_keys=2.5 must be an int"):
    index.init(num_keys=2.5)


def test_insert_lookup_delete_basics():
  idx = index.init(num_keys=8)
  idx, r = index.insert(idx, _key(1, 2), 5)
  assert int(r.status) == S.OK
  idx, r = index.insert(idx, _key(1, 2), 6)
  assert (int(r.status), int(r.value)) == (S.PRESENT, 5)
  assert index.lookup(idx, _keys([[1, 2], [1, 3]])).tolist() == [5, -1]
  idx, r = index.update(idx, _key(1, 2), 9)
  assert int(r.status) == S.OK
  assert index.lookup(idx, _keys([[1, 2]])).tolist() == [9]
  idx, r = index.update(idx, _key(4, 4), 9)
  assert int(r.status) == S.ABSENT
  idx, r = index.delete(idx, _key(1, 2))
  assert (int(r.status), int(r.value)) == (S.OK, 9)
  idx, r = index.delete(idx, _key(1, 2))
  assert int(r.status) == S.ABSENT
  idx, r = index.insert(idx, _key(1, 2), 3, ok=False)
  assert int(r.status) == S.SKIPPED and int(idx.count) == 0
  assert index.check_invariants(idx) == []


def test_forced_bucket_collisions_probe_and_tombstones():
  # All keys share home slot 3 (equal low bits of lane 0), differ elsewhere.
  idx = index.init(num_keys=8, capacity=16, max_load=0.5, max_probes=6)
  keys = [(3 + 16 * i, 1000 + i) for i in range(6)]
  for i, (lo, hi) in enumerate(keys):
    idx, r = index.insert(idx, _key(lo, hi), i)
    assert int(r.status) == S.OK
  assert np.asarray(idx.values)[3:9].tolist() == list(range(6))
  assert index.lookup(idx, _keys(keys)).tolist() == list(range(6))
  # Probe bound: a seventh key with the same home cannot be placed.
  full = idx
  idx, r = index.insert(idx, _key(3 + 16 * 9, 7), 6)
  assert int(r.status) == S.PROBE_LIMIT
  chex.assert_trees_all_equal(idx, full)
  # Deleting from the middle leaves a tombstone; later keys stay findable.
  idx, r = index.delete(idx, _key(*keys[2]))
  assert int(r.status) == S.OK and int(idx.num_tombstones) == 1
  assert index.lookup(idx, _keys(keys)).tolist() == [0, 1, -1, 3, 4, 5]
  # A new colliding key reuses the tombstone (first free slot on the path).
  idx, r = index.insert(idx, _key(3 + 16 * 9, 7), 6)
  assert int(r.status) == S.OK and int(idx.num_tombstones) == 0
  assert int(idx.values[5]) == 6
  assert index.check_invariants(idx) == []
  # Deleting the end of a cluster clears it and the tombstones before it.
  idx, _ = index.delete(idx, _key(*keys[3]))
  idx, _ = index.delete(idx, _key(*keys[4]))
  assert int(idx.num_tombstones) == 2
  idx, _ = index.delete(idx, _key(*keys[5]))
  assert int(idx.num_tombstones) == 0
  assert np.asarray(idx.values)[6:9].tolist() == [-1, -1, -1]
  assert index.lookup(idx, _keys(keys)).tolist() == [0, 1, -1, -1, -1, -1]
  assert index.check_invariants(idx) == []


def test_probing_wraps_around_the_table():
  idx = index.init(num_keys=4, capacity=8, max_load=0.5)
  keys = [(7, i) for i in range(4)]  # home slot 7: wraps to 0, 1, 2
  for i, (lo, hi) in enumerate(keys):
    idx, _ = index.insert(idx, _key(lo, hi), i)
  assert index.lookup(idx, _keys(keys)).tolist() == [0, 1, 2, 3]
  assert np.asarray(idx.values).tolist()[:3] == [1, 2, 3]
  assert index.check_invariants(idx) == []


@jax.jit
def _apply(idx, op, key, value, expected):
  def do_insert(i):
    return index.insert(i, key, value, jnp.bool_(True))

  def do_delete(i):
    return index.delete(i, key, jnp.bool_(True))

  def do_update(i):
    return index.update(i, key, value, jnp.bool_(True))

  def do_unlink(i):  # value < 0: delete where the key maps to expected
    return index.unlink(i, key, expected, value, jnp.bool_(True))

  return jax.lax.switch(op, [do_insert, do_delete, do_update, do_unlink], idx)


def _run_against_dict(ops, capacity, max_probes, num_keys):
  """Applies ``(op, key_id, value, flag)`` tuples; compares with a dict.

  Op 3 is :func:`index.unlink`: ``flag`` says whether ``expected`` is the
  key's current value (else one it never holds), and an odd ``value``
  means delete (successor -1).
  """
  idx = index.init(
    num_keys=num_keys, capacity=capacity, max_load=0.75, max_probes=max_probes
  )
  # Few distinct keys, many sharing lane-0 low bits (bucket collisions).
  universe = np.asarray(
    [[(i % 3) + capacity * (i // 3), 77 * i] for i in range(12)], np.uint32
  )
  model: dict[int, int] = {}
  for op, kid, value, flag in ops:
    key = jnp.asarray(universe[kid])
    expected = model.get(kid, value) if flag else 5000 + value
    if op == 3 and value % 2:
      value = -1
    idx, r = _apply(
      idx, jnp.int32(op), key, jnp.int32(value), jnp.int32(expected)
    )
    status = int(r.status)
    if op == 0:
      if kid in model:
        assert (status, int(r.value)) == (S.PRESENT, model[kid])
      elif status == S.OK:
        model[kid] = value
      else:
        # Only a full probe path may refuse; the model may not hold more
        # than capacity * 0.75 keys anyway.
        assert status == S.PROBE_LIMIT
    elif op == 1:
      if kid in model:
        assert (status, int(r.value)) == (S.OK, model.pop(kid))
      else:
        assert status == S.ABSENT
    elif op == 2:
      if kid in model:
        assert status == S.OK
        model[kid] = value
      else:
        assert status == S.ABSENT
    else:
      assert int(r.value) == model.get(kid, -1)
      if model.get(kid) == expected:
        assert status == S.OK
        if value < 0:
          del model[kid]
        else:
          model[kid] = value
      else:
        assert status == S.ABSENT
    assert index.check_invariants(idx) == [], (op, kid)
    assert int(idx.count) == len(model)
    got = index.lookup(idx, jnp.asarray(universe)).tolist()
    assert got == [model.get(i, -1) for i in range(len(universe))]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
  ops=st.lists(
    st.tuples(
      st.sampled_from([0, 0, 1, 2, 3]),
      st.integers(0, 11),
      st.integers(0, 1000),
      st.booleans(),
    ),
    max_size=60,
  ),
  small=st.booleans(),
)
def test_random_sequences_match_a_dict(ops, small):
  if small:
    # Tiny table: probe limits, wrap-around and tombstone reuse all happen.
    _run_against_dict(ops, capacity=8, max_probes=3, num_keys=6)
  else:
    _run_against_dict(ops, capacity=16, max_probes=16, num_keys=12)


@pytest.mark.parametrize(
  "max_load, max_probes, max_refused",
  [(0.5, 64, 0.0), (0.75, 64, 0.01)],
  ids=["load0.5", "load0.75"],
)
def test_many_keys_with_churn(rng, max_load, max_probes, max_refused):
  """Fill to ``max_load`` then replace half the keys four times.

  At load 0.5 nothing is refused; at 0.75 linear probing's long clusters
  refuse a few inserts (``PROBE_LIMIT``, table unchanged), never corrupt.
  """
  n = 3000
  idx = index.init(num_keys=n, max_load=max_load, max_probes=max_probes)
  keys = rng.integers(0, 2**32, size=(3 * n, 2)).astype(np.uint32)
  keys = np.unique(keys, axis=0)[: 2 * n]
  rng.shuffle(keys)

  @jax.jit
  def insert_all(idx, keys, values):
    def body(i, c):
      idx, status = c
      idx, r = index.insert(idx, keys[i], values[i], jnp.bool_(True))
      return idx, status.at[i].set(r.status)

    status = jnp.zeros(keys.shape[0], jnp.int32)
    return jax.lax.fori_loop(0, keys.shape[0], body, (idx, status))

  @jax.jit
  def delete_all(idx, keys):
    def body(i, c):
      idx, bad = c
      idx, r = index.delete(idx, keys[i], jnp.bool_(True))
      return idx, bad + (r.status != S.OK).astype(jnp.int32)

    return jax.lax.fori_loop(0, keys.shape[0], body, (idx, jnp.int32(0)))

  values = np.arange(len(keys), dtype=np.int32)
  live = np.zeros(len(keys), bool)
  refused = 0
  todo = np.arange(n)
  for round_ in range(5):
    idx, status = insert_all(
      idx, jnp.asarray(keys[todo]), jnp.asarray(values[todo])
    )
    status = np.asarray(status)
    assert set(status.tolist()) <= {S.OK, S.PROBE_LIMIT}
    live[todo[status == S.OK]] = True
    refused += int((status != S.OK).sum())
    assert index.check_invariants(idx) == []
    if round_ == 4:
      break
    gone = rng.choice(np.nonzero(live)[0], size=n // 2, replace=False)
    idx, bad = delete_all(idx, jnp.asarray(keys[gone]))
    assert int(bad) == 0
    live[gone] = False
    todo = rng.choice(np.nonzero(~live)[0], size=n // 2, replace=False)
  got = np.asarray(index.lookup(idx, jnp.asarray(keys)))
  np.testing.assert_array_equal(got, np.where(live, values, -1))
  # lookup_run: lookup's values up to the first absent key (or the limit).
  run_of = jax.jit(index.lookup_run)
  for start in rng.choice(len(keys) - 64, size=40, replace=False):
    rows = keys[start : start + 64].copy()
    present = np.nonzero(live[start : start + 64])[0]
    rows[: len(present)] = keys[start + present]  # a longer run of hits
    want = np.asarray(index.lookup(idx, jnp.asarray(rows)))
    for limit in (0, 1, 17, 64):
      out, run = run_of(idx, jnp.asarray(rows), jnp.int32(limit))
      stop = np.concatenate([np.nonzero(want[:limit] < 0)[0], [limit]])[0]
      assert int(run) == stop
      np.testing.assert_array_equal(
        np.asarray(out), np.where(np.arange(64) < stop, want, -1)
      )
  assert refused <= max_refused * 3 * n, refused
  # Tombstones stay bounded under churn.
  assert int(idx.num_tombstones) < idx.capacity // 4
  print(f"refused {refused}, tombstones {int(idx.num_tombstones)}")


def test_lookup_vmaps_over_tables():
  a = index.init(num_keys=4)
  b = index.init(num_keys=4)
  a, _ = index.insert(a, _key(5, 6), 1)
  b, _ = index.insert(b, _key(5, 6), 2)
  both = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
  got = jax.vmap(index.lookup, in_axes=(0, None))(both, _keys([[5, 6]]))
  assert got.tolist() == [[1], [2]]
