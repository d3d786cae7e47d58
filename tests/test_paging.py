"""Tests of the paging core against a plain-Python model and by hand."""

from __future__ import annotations

import os

import chex
import hypothesis
import hypothesis.stateful
import jax
import jax.numpy as jnp
import numpy as np
import paging_harness as harness
import pytest
from hypothesis import strategies as st
from reference_models import paging_model

from prefixjax.cache import paging
from prefixjax.cache.checked import paging as checked

SIZES = [
  dict(num_blocks=9, block_size=4, max_seqs=4, max_blocks_per_seq=3),
  dict(num_blocks=24, block_size=2, max_seqs=6, max_blocks_per_seq=5),
  dict(num_blocks=5, block_size=1, max_seqs=3, max_blocks_per_seq=4),
  dict(num_blocks=40, block_size=8, max_seqs=5, max_blocks_per_seq=8),
  dict(num_blocks=64, block_size=16, max_seqs=8, max_blocks_per_seq=6),
]


def _small():
  return paging.init(
    num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=3
  )


def test_status_codes_match_model():
  assert [int(s) for s in paging.Status] == list(range(7))
  assert paging.Status.OUT_OF_BLOCKS == paging_model.OUT_OF_BLOCKS
  assert paging.Status.BAD_COUNT == paging_model.BAD_COUNT


def test_init_state_is_valid_and_queue_in_id_order():
  state = _small()
  assert paging.check_invariants(state) == []
  assert paging.free_queue_order(state) == list(range(1, 8))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(num_blocks=1), "num_blocks=1 must be >= 2"),
    (dict(block_size=0), "block_size=0 must be >= 1"),
    (dict(max_seqs=-3), "max_seqs=-3 must be >= 1"),
    (dict(max_blocks_per_seq=0), "max_blocks_per_seq=0 must be >= 1"),
    (dict(num_blocks=2**27, block_size=64), "overflow int32"),
  ],
)
def test_init_rejects_bad_sizes(kwargs, message):
  sizes = dict(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  sizes.update(kwargs)
  with pytest.raises(ValueError, match=message):
    paging.init(**sizes)


def test_init_rejects_non_int():
  with pytest.raises(TypeError, match="block_size=2.5 must be an int"):
    paging.init(num_blocks=8, block_size=2.5, max_seqs=2, max_blocks_per_seq=2)
  with pytest.raises(TypeError, match="must be an int"):
    paging.init(num_blocks=True, block_size=2, max_seqs=2, max_blocks_per_seq=2)


def test_verbs_reject_bad_arguments_at_the_boundary():
  state = _small()
  with pytest.raises(ValueError, match="num_tokens=-1 must be >= 0"):
    checked.allocate(state, 0, -1)
  with pytest.raises(TypeError, match="seq_id must have an integer dtype"):
    checked.allocate(state, jnp.float32(0), 3)
  with pytest.raises(ValueError, match="seq_id must be a scalar"):
    checked.release(state, jnp.zeros(2, jnp.int32))
  with pytest.raises(TypeError, match="not a bool"):
    checked.fork(state, True, 1)
  with pytest.raises(TypeError, match="state must be a PagingState"):
    checked.release({"block_tables": 0}, 0)
  with pytest.raises(ValueError, match="positions must be 1-D"):
    checked.slot_mapping(state, jnp.zeros(2, jnp.int32), jnp.zeros((2, 1)))
  # Concrete arrays are range-checked before the int32 cast (no wrap).
  with pytest.raises(ValueError, match="seq_id=8589934600 does not fit"):
    checked.allocate(state, np.array(2**33 + 8), 1)
  with pytest.raises(ValueError, match="seq_id=4294967295 does not fit"):
    checked.allocate(state, np.uint32(2**32 - 1), 1)
  with pytest.raises(ValueError, match=r"child_id=\d+ is outside \[0, "):
    checked.fork(state, 0, state.max_seqs)
  with pytest.raises(TypeError, match="num_tokens=None must be an integer"):
    checked.allocate(state, 0, None)
  # ... and so are arrays of ids and positions (int64 2**32 + 1 wrapped to 1).
  wide = np.array([2**32 + 1], np.int64)
  with pytest.raises(ValueError, match=r"positions\[0\]=4294967297 does not"):
    checked.slot_mapping(state, np.array([0]), wide)
  with pytest.raises(ValueError, match=r"seq_ids\[0\]=4294967297 does not"):
    checked.slot_mapping(state, wide, np.array([1]))
  with pytest.raises(ValueError, match=r"seq_ids\[0\]=4294967297 is out"):
    checked.batch_view(state, wide)


def test_traced_verbs_refuse_ids_and_counts_that_are_not_integers():
  """A bool sequence id was read as sequence 1 (status OK); a float failed
  deep inside jax's indexing."""
  state = _small()
  for seq, n in [(True, 3), (jnp.float32(0), 3), (0, 2.5), (0, jnp.bool_(1))]:
    with pytest.raises(TypeError, match="must be integers, got dtype"):
      paging.allocate(state, seq, n)
  with pytest.raises(TypeError, match="sequence ids must be integers"):
    jax.jit(paging.release)(state, jnp.float32(0))


def test_traced_bad_values_become_status_and_state_is_unchanged():
  state = _small()

  @jax.jit
  def go(state, seq, n):
    return paging.allocate(state, seq, n)

  for seq, n, want in [
    (5, 3, paging.Status.BAD_SEQUENCE),
    (0, -4, paging.Status.BAD_COUNT),
    (0, 13, paging.Status.TABLE_OVERFLOW),
    # Counts near int32's limit: ceil(n / K) and tokens + n must not wrap.
    (0, 2**31 - 1, paging.Status.TABLE_OVERFLOW),
    (1, 2**31 - 2, paging.Status.TABLE_OVERFLOW),
  ]:
    new, result = go(state, jnp.int32(seq), jnp.int32(n))
    assert int(result.status) == want
    chex.assert_trees_all_equal(new, state)
  held, result = go(state, jnp.int32(0), jnp.int32(3))
  assert int(result.status) == paging.Status.OK
  for n in (2**31 - 1, 2**31 - 3, 2**31 - 4):
    new, result = jax.jit(paging.append)(held, jnp.int32(0), jnp.int32(n))
    assert int(result.status) == paging.Status.TABLE_OVERFLOW, n
    chex.assert_trees_all_equal(new, held)


def test_blocks_for_is_the_ceiling_without_overflow(rng):
  n = np.concatenate(
    [rng.integers(-(2**31), 2**31, 200), [2**31 - 1, -(2**31), 0, 1, -1]]
  ).astype(np.int32)
  for k in (1, 3, 16, int(rng.integers(2, 1000))):
    want = -(-n.astype(np.int64) // k)  # exact, in int64
    got = np.asarray(paging.blocks_for(jnp.asarray(n), k))
    np.testing.assert_array_equal(got, want)


def test_out_of_blocks_leaves_state_unchanged():
  state = paging.init(
    num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=4
  )
  state, r = paging.allocate(state, 0, 5)  # 3 blocks: the whole pool
  assert int(r.status) == paging.Status.OK
  new, r = paging.allocate(state, 1, 1)
  assert int(r.status) == paging.Status.OUT_OF_BLOCKS
  chex.assert_trees_all_equal(new, state)
  new, r = paging.append(state, 0, 2)
  assert int(r.status) == paging.Status.OUT_OF_BLOCKS
  chex.assert_trees_all_equal(new, state)


def test_release_is_tail_first_and_allocation_reuses_deepest_first():
  state = paging.init(
    num_blocks=8, block_size=2, max_seqs=2, max_blocks_per_seq=4
  )
  state, _ = paging.allocate(state, 0, 7)  # blocks 1..4
  state, r = paging.release(state, 0, vllm_version="0.22")
  assert r.freed_blocks[: int(r.num_freed)].tolist() == [4, 3, 2, 1]
  assert paging.free_queue_order(state) == [5, 6, 7, 4, 3, 2, 1]
  state, _ = paging.allocate(state, 1, 8)
  assert state.block_tables[1].tolist() == [5, 6, 7, 4]


def test_release_follows_the_named_vllm_release():
  """vLLM >= 0.23's order (0.33.0 ``BlockPool.free_blocks``, the default):
  in reverse table order, unpublished blocks go to the head keeping that
  order, the published ones to the tail; ``"0.22"`` and older put every
  freed block at the tail."""
  state = paging.init(
    num_blocks=8, block_size=2, max_seqs=2, max_blocks_per_seq=4
  )
  state, _ = paging.allocate(state, 0, 7)  # blocks 1..4
  published = state.published.at[jnp.array([1, 3])].set(True)
  state = state.replace(published=published)
  head = [4, 2, 5, 6, 7, 3, 1]
  for version, queue in (
    ("0.22", [5, 6, 7, 4, 3, 2, 1]),
    ("0.8.0", [5, 6, 7, 4, 3, 2, 1]),
    ("0.23", head),
    ("latest", head),
    ("0.33", head),
  ):
    s, r = checked.release(state, 0, vllm_version=version)
    assert r.freed_blocks[: int(r.num_freed)].tolist() == [4, 3, 2, 1]
    assert paging.free_queue_order(s) == queue
    assert paging.check_invariants(s) == []
  # The next allocation reuses the last unpublished block first.
  s, _ = paging.allocate(s, 1, 3)
  assert s.block_tables[1].tolist() == [4, 2, 0, 0]
  # A block still shared is not freed, whatever its flag.
  state, _ = paging.fork(state, 0, 1)
  s, r = paging.release(state, 0)
  assert int(r.num_freed) == 0 and paging.free_queue_order(s) == [5, 6, 7]
  with pytest.raises(ValueError, match="vllm_version='0.7' is not supported"):
    checked.release(state, 0, vllm_version="0.7")
  with pytest.raises(TypeError, match="vllm_version must be a string"):
    checked.release(state, 0, vllm_version=0.33)


def test_fork_then_append_copies_only_the_shared_partial_block():
  state = paging.init(
    num_blocks=10, block_size=4, max_seqs=3, max_blocks_per_seq=4
  )
  state, _ = paging.allocate(state, 0, 6)  # blocks 1, 2 (2 is half full)
  state, status = paging.fork(state, 0, 1)
  assert int(status) == paging.Status.OK
  state, r = paging.append(state, 1, 3)  # writes into shared block 2
  assert int(r.num_copies) == 1
  assert (int(r.src[0]), int(r.dst[0])) == (2, 3)
  assert state.block_tables[1].tolist() == [1, 3, 4, 0]
  assert state.refcounts[1:5].tolist() == [2, 1, 1, 1]
  # The parent is now sole owner of block 2: no copy.
  state, r = paging.append(state, 0, 1)
  assert int(r.num_copies) == 0
  assert paging.check_invariants(state) == []


def test_published_block_is_copied_even_with_one_owner():
  state = _small()
  state, _ = paging.allocate(state, 0, 2)
  state = state.replace(published=state.published.at[1].set(True))
  state, r = paging.copy_on_write(state, 0)
  assert (int(r.src[0]), int(r.dst[0]), int(r.num_copies)) == (1, 2, 1)
  # Block 1 lost its only reference: back on the free queue, at the tail.
  assert paging.free_queue_order(state)[-1] == 1
  assert paging.check_invariants(state) == []


def test_slot_mapping_and_batch_view(rng):
  state = paging.init(
    num_blocks=32, block_size=4, max_seqs=4, max_blocks_per_seq=6
  )
  lengths = rng.integers(0, 24, size=4)
  for seq, n in enumerate(lengths.tolist()):
    state, r = paging.allocate(state, seq, n)
    assert int(r.status) == paging.Status.OK
  seqs = rng.integers(-1, 5, size=50).astype(np.int32)
  positions = rng.integers(-2, 26, size=50).astype(np.int32)
  slots = np.asarray(paging.slot_mapping(state, seqs, positions))
  tables = np.asarray(state.block_tables)
  for seq, pos, slot in zip(seqs, positions, slots, strict=True):
    if 0 <= seq < 4 and 0 <= pos < lengths[seq]:
      assert slot == tables[seq, pos // 4] * 4 + pos % 4
    else:
      assert slot == -1
  view = paging.batch_view(state, jnp.array([2, 0, 7], jnp.int32))
  assert view.block_tables[0].tolist() == tables[2].tolist()
  assert view.lengths.tolist() == [lengths[2], lengths[0], 0]
  assert view.block_tables[2].tolist() == [0] * 6
  # Inside jit a bad row is a status (the checked layer raises instead).
  state, _ = paging.release(state, 1)
  ids = rng.integers(-3, 7, size=12).astype(np.int32)
  view = jax.jit(paging.batch_view)(state, jnp.asarray(ids))
  S = paging.Status
  want = [
    S.BAD_SEQUENCE
    if not 0 <= i < 4
    else S.SEQUENCE_INACTIVE
    if i == 1
    else S.OK
    for i in ids
  ]
  assert view.status.tolist() == want
  bad = np.asarray(view.status) != S.OK
  assert not np.asarray(view.lengths)[bad].any()
  assert not np.asarray(view.block_tables)[bad].any()


@pytest.mark.parametrize("sizes", SIZES[:3], ids=["a", "b", "c"])
def test_random_streams_match_model(sizes, rng):
  ops = harness.random_ops(rng, 1500, sizes)
  harness.compare_stream(sizes, ops, check_every=1)


@pytest.mark.parametrize("sizes", SIZES[:4], ids=["a", "b", "c", "d"])
def test_random_streams_with_unpublished_first_releases_match_model(sizes, rng):
  """Both release orders mixed in one stream (half the releases
  ``unpublished_first``), with many published blocks."""
  ops = harness.random_ops(
    rng, 1500, sizes, head_releases=0.5, publish_share=0.15
  )
  assert (ops[:, 0] == harness.RELEASE_HEAD).any()
  harness.compare_stream(sizes, ops, check_every=1)


def test_many_random_operations_match_model(rng):
  """10^5 random operations per CI run (PREFIXJAX_PAGING_OPS to change),
  full state compared with the model after every step."""
  total = 0
  per_config = int(os.environ.get("PREFIXJAX_PAGING_OPS", 100_000)) // len(
    SIZES
  )
  for i, sizes in enumerate(SIZES):
    ops = harness.random_ops(rng, per_config, sizes, head_releases=i % 2 / 2)
    total += harness.compare_stream(sizes, ops, check_every=97)
  assert total >= per_config * len(SIZES)
  print(f"compared {total} operations with 0 violations")


class PagingMachine(hypothesis.stateful.RuleBasedStateMachine):
  """Hypothesis drives verbs one call at a time; model and device compared.

  Arguments are drawn from the live / free slots the model knows of, so even
  short runs reach sharing, copy on write and pool exhaustion; one rule
  sends arbitrary (often invalid) arguments.
  """

  SIZES = SIZES[0]

  def __init__(self):
    super().__init__()
    self.state = paging.init(**self.SIZES)
    self.model = paging_model.PagingModel(**self.SIZES)
    self.calls = 0

  def _live(self, data):
    return data.draw(st.sampled_from(sorted(self.model.tables)))

  def _free(self, data):
    free = [s for s in range(self.model.max_seqs) if s not in self.model.tables]
    return data.draw(st.sampled_from(free))

  def has_live(self):
    return bool(self.model.tables)

  def has_free(self):
    return len(self.model.tables) < self.model.max_seqs

  def _tokens(self, data):
    k = self.SIZES["block_size"]
    return data.draw(st.integers(0, 3 * k + 1))

  def _run(self, kind, a, b):
    ops = np.asarray([[kind, a, b]], np.int32)
    self.state, (_, result) = harness.run_stream(self.state, ops)
    out = harness._apply_model(self.model, kind, a, b)
    if out is not None:
      assert int(result["status"][0]) == out.status, (kind, a, b)
      src = [c[0] for c in out.copies]
      assert np.asarray(result["src"][0]).tolist() == (src or [-1])
    self.calls += 1

  @hypothesis.stateful.precondition(lambda self: self.has_free())
  @hypothesis.stateful.rule(data=st.data())
  def allocate(self, data):
    self._run(harness.ALLOCATE, self._free(data), self._tokens(data))

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.rule(data=st.data())
  def append(self, data):
    self._run(harness.APPEND, self._live(data), self._tokens(data))

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.precondition(lambda self: self.has_free())
  @hypothesis.stateful.rule(data=st.data())
  def fork(self, data):
    self._run(harness.FORK, self._live(data), self._free(data))

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.rule(data=st.data())
  def copy_on_write(self, data):
    self._run(harness.COPY, self._live(data), 0)

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.rule(data=st.data())
  def release(self, data):
    self._run(harness.RELEASE, self._live(data), 0)

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.rule(data=st.data())
  def release_unpublished_first(self, data):
    self._run(harness.RELEASE_HEAD, self._live(data), 0)

  @hypothesis.stateful.precondition(lambda self: self.has_live())
  @hypothesis.stateful.rule(data=st.data())
  def publish(self, data):
    col = data.draw(st.integers(0, self.SIZES["max_blocks_per_seq"] - 1))
    self._run(harness.PUBLISH, self._live(data), col)

  @hypothesis.stateful.rule(
    kind=st.integers(0, harness.NUM_KINDS - 1),
    a=st.integers(-2, 6),
    b=st.integers(-2, 40),
  )
  def anything(self, kind, a, b):
    self._run(kind, a, b)

  @hypothesis.stateful.invariant()
  def same_state_as_model(self):
    harness.assert_state_equal(self.state, self.model, f"call {self.calls}")
    assert paging.check_invariants(self.state) == []


PagingMachine.TestCase.settings = hypothesis.settings(
  max_examples=60, stateful_step_count=40, deadline=None
)
test_hypothesis_operation_sequences = PagingMachine.TestCase


def test_each_verb_compiles_once_across_inputs(rng):
  state = paging.init(
    num_blocks=32, block_size=4, max_seqs=4, max_blocks_per_seq=6
  )
  verbs = {
    "allocate": lambda s, a, b: paging.allocate(s, a, b),
    "append": lambda s, a, b: paging.append(s, a, b),
    "fork": lambda s, a, b: paging.fork(s, a, b),
    "copy_on_write": lambda s, a, b: paging.copy_on_write(s, a),
    "release": lambda s, a, b: paging.release(s, a),
    "release_0.22": lambda s, a, b: paging.release(s, a, vllm_version="0.22"),
  }
  for name, verb in verbs.items():
    traced = jax.jit(chex.assert_max_traces(verb, n=1))
    s = state
    for _ in range(6):
      a, b = rng.integers(0, 4, size=2).tolist()
      s, _ = traced(s, jnp.int32(a), jnp.int32(b))
    assert s.num_blocks == 32, name
  # The public wrappers hit one cached executable for Python ints and arrays.
  before = paging.allocate._cache_size()
  s = state
  for a, b in rng.integers(0, 4, size=(5, 2)).tolist():
    s, _ = checked.allocate(s, a, b)
    s, _ = checked.allocate(s, np.int32(a), np.int64(b))
  assert paging.allocate._cache_size() - before <= 1


def test_vmap_over_configurations_equals_one_at_a_time(rng):
  """A batch of pools (different histories) stepped by one vmapped scan."""
  sizes = SIZES[1]
  streams = np.stack([harness.random_ops(rng, 300, sizes) for _ in range(4)])
  state = paging.init(**sizes)
  batched = jax.tree.map(lambda x: jnp.stack([x] * 4), state)
  final, (_, results) = jax.vmap(harness.run_stream)(
    batched, jnp.asarray(streams)
  )
  for b in range(4):
    one_final, (_, one_results) = harness.run_stream(
      state, jnp.asarray(streams[b])
    )
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x, b=b: x[b], final), one_final
    )
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x, b=b: x[b], results), one_results
    )
