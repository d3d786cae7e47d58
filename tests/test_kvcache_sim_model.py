"""The plain-Python kvcache-simulator model against published numbers and
against the real package (when installed).

The 12 published points (Mooncake conversation trace, block 512) need the
shared trace; the comparisons with `kvcache-simulator` need that package
(`pip install kvcache-simulator==0.1.3`; pure Python, no dependencies, plus
a C++ core compiled on first use for its `cpp` backend). Hand-made cases
pin down each rule without either.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from reference_models import kvcache_sim, shared_trace, shared_traces_dir

from prefixjax.workloads import load_mooncake

MOONCAKE = "mooncake_conversation_trace.jsonl"
# capacity_blocks: (fifo, lru, optimal) hit tokens out of 67,915,607.
PUBLISHED = {
  1827: (3_602_280, 3_704_049, 17_434_225),
  9139: (12_102_727, 13_865_669, 27_038_068),
  18279: (17_387_598, 19_962_647, 27_038_068),
  36558: (22_099_608, 24_900_024, 27_038_068),
}
MEASURED_TOKENS = 67_915_607


@pytest.fixture(scope="module")
def mooncake_plan():
  path = shared_trace(MOONCAKE)
  if path is None:
    pytest.skip(
      f"real trace {MOONCAKE} not found in {shared_traces_dir()} (set "
      "PREFIXJAX_TRACES_DIR to the shared traces directory)"
    )
  trace = load_mooncake(path)
  return trace, kvcache_sim.prepare(trace.hash_ids, trace.input_lengths, 512)


def test_reproduces_the_published_points(mooncake_plan):
  _, plan = mooncake_plan
  got = {
    capacity: tuple(
      kvcache_sim.simulate_plan(plan, capacity, policy)["hit_tokens"]
      for policy in kvcache_sim.POLICIES
    )
    for capacity in PUBLISHED
  }
  assert got == PUBLISHED
  result = kvcache_sim.simulate_plan(plan, 1827, "lru")
  assert result["total_tokens"] == MEASURED_TOKENS
  assert result["measured_requests"] == 12031 - 12031 // 2
  assert not result["underfilled"]


def test_trace_facts_and_ceiling(mooncake_plan):
  trace, plan = mooncake_plan
  assert sum(len(row) for row in plan.nodes) == 288_500
  assert plan.unique_blocks == 182_790
  whole = kvcache_sim.ceiling(trace.hash_ids, trace.input_lengths, 512, 0.0)
  assert round(whole["hit_tokens"] / whole["total_tokens"], 3) == 0.374
  window = kvcache_sim.ceiling(trace.hash_ids, trace.input_lengths, 512)
  assert window["hit_tokens"] == 27_038_068  # = optimal with room to spare


# -- hand-made cases, one rule each --------------------------------------------
def _hits(rows, lengths, block_size, capacity, warmup=0.5):
  return {
    policy: kvcache_sim.simulate(
      rows, lengths, block_size, capacity, policy, warmup
    )["hit_tokens"]
    for policy in kvcache_sim.POLICIES
  }


def test_hit_counts_tokens_of_the_cached_run_with_partial_last_block():
  # Block 4: weights 4, 4, 2 then 4, 4, 4; the third block differs.
  got = _hits([[1, 2, 3], [1, 2, 9]], [10, 12], 4, capacity=3)
  assert got == {"fifo": 8, "lru": 8, "optimal": 8}


def test_blocks_past_input_length_weigh_one_token():
  assert [kvcache_sim.block_tokens(5, 4, j) for j in range(4)] == [4, 1, 1, 1]


def test_policies_differ_when_a_request_overflows_the_cache():
  # Capacity 2, one request of 3 blocks sent twice: fifo evicts the
  # request's own first block; lru keeps the root (leaf-only eviction
  # breaks the insert); optimal bypasses the third block.
  got = _hits([[1, 2, 3], [1, 2, 3]], [3, 3], 1, capacity=2)
  assert got == {"fifo": 0, "lru": 1, "optimal": 2}


def test_block_identity_is_the_whole_prefix():
  # Id 2 after id 1 is not the same block as id 2 at the start.
  result = kvcache_sim.ceiling([[1, 2], [2], [1, 2]], [2, 1, 2], 1, 0.0)
  assert result["per_request_hit_tokens"] == [0, 0, 2]


def test_a_miss_ends_the_hit_even_if_later_blocks_are_cached():
  # fifo has no trie constraint: block 3 stays cached after 1 is evicted.
  rows = [[5], [1, 2, 3], [4], [1, 2, 3]]
  result = kvcache_sim.simulate(rows, [1, 3, 1, 3], 1, 3, "fifo", 0.5)
  assert result["per_request_hit_tokens"] == [0, 0, 0, 0]


def test_underfilled_when_warmup_never_fills_the_cache():
  result = kvcache_sim.simulate([[1], [1]], [1, 1], 1, 5, "lru", 0.5)
  assert result["underfilled"]
  assert result["hit_tokens"] == 0  # as kvcache-simulator reports it
  assert result["per_request_hit_tokens"] == [0, 1]
  assert result["total_tokens"] == 1


def test_zero_warmup_is_always_underfilled_and_zero_capacity_never():
  rows, lengths = [[1], [1]], [1, 1]
  assert kvcache_sim.simulate(rows, lengths, 1, 1, "fifo", 0.0)["underfilled"]
  no_cache = kvcache_sim.simulate(rows, lengths, 1, 0, "fifo")
  assert not no_cache["underfilled"] and no_cache["hit_tokens"] == 0


def test_requests_without_blocks_are_dropped():
  result = kvcache_sim.simulate(
    [[1], [], [], [1]], [1, 0, 0, 1], 1, 1, "lru", 0.5
  )
  assert result["measured_requests"] == 1
  assert result["per_request_hit_tokens"] == [0, 0, 0, 1]
  assert result["hit_tokens"] == 1


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="policy='lfu'"):
    kvcache_sim.simulate([[1]], [1], 1, 1, "lfu")
  with pytest.raises(ValueError, match="input_length=0"):
    kvcache_sim.simulate([[1]], [0], 1, 1, "lru")
  with pytest.raises(ValueError, match="no request has any block"):
    kvcache_sim.simulate([[]], [0], 1, 1, "lru")


# -- agreement with the real package -------------------------------------------
def _random_trace(rng):
  """A small trace with shared prefixes and a tiny id alphabet."""
  block_size = int(rng.choice([1, 2, 4, 16]))
  alphabet = int(rng.integers(2, 30))
  rows, lengths = [], []
  for _ in range(int(rng.integers(1, 40))):
    ids = []
    if rows and rng.random() < 0.7:
      base = rows[int(rng.integers(len(rows)))]
      ids = base[: int(rng.integers(0, len(base) + 1))]
    ids = ids + rng.integers(0, alphabet, int(rng.integers(0, 6))).tolist()
    if ids and rng.random() < 0.8:  # consistent with ceil(length / block)
      length = (len(ids) - 1) * block_size + int(
        rng.integers(1, block_size + 1)
      )
    else:  # anything positive: extra blocks weigh one token
      length = int(rng.integers(1, block_size * (len(ids) + 2) + 1))
    rows.append(ids)
    lengths.append(length)
  if not any(rows):
    rows[0] = [0]
  return rows, lengths, block_size


def _package_trace(kvcache_trace, rows, lengths, block_size):
  lines = [
    json.dumps({"hash_ids": ids, "input_length": length})
    for ids, length in zip(rows, lengths, strict=True)
  ]
  return kvcache_trace.parse_trace_lines(lines, block_size=block_size)


@pytest.mark.parametrize("case", range(40))
def test_agrees_with_kvcache_simulator_python_backend(rng, case):
  kvcache_trace = pytest.importorskip(
    "kvcache_sim.trace",
    reason="kvcache-simulator==0.1.3 not installed (optional reference)",
  )
  from kvcache_sim.plan import build_execution_plan
  from kvcache_sim.policies import simulate_policy

  rows, lengths, block_size = _random_trace(rng)
  warmup = float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, rng.random()]))
  package_plan = build_execution_plan(
    _package_trace(kvcache_trace, rows, lengths, block_size), warmup
  )
  plan = kvcache_sim.prepare(rows, lengths, block_size, warmup)
  assert plan.unique_blocks == package_plan.unique_blocks
  for capacity in range(plan.unique_blocks + 2):
    for policy in kvcache_sim.POLICIES:
      theirs = simulate_policy(package_plan, policy, capacity)
      ours = kvcache_sim.simulate_plan(plan, capacity, policy)
      assert (
        ours["hit_tokens"],
        ours["total_tokens"],
        ours["underfilled"],
      ) == (
        theirs.hitTokens,
        theirs.totalTokens,
        theirs.measurementMode == "underfilled_at_window",
      ), (policy, capacity, rows, lengths, block_size, warmup)


@pytest.mark.skipif(
  shutil.which("c++") is None, reason="no c++ compiler for the C++ backend"
)
def test_agrees_with_kvcache_simulator_cpp_backend(rng):
  kvcache_trace = pytest.importorskip(
    "kvcache_sim.trace",
    reason="kvcache-simulator==0.1.3 not installed (optional reference)",
  )
  from kvcache_sim.cpp_backend import run_cpp_sweep

  for _ in range(5):
    rows, lengths, block_size = _random_trace(rng)
    plan = kvcache_sim.prepare(rows, lengths, block_size, 0.5)
    capacities = list(range(1, plan.unique_blocks + 2))
    sweep = run_cpp_sweep(
      _package_trace(kvcache_trace, rows, lengths, block_size),
      capacities=capacities,
      policies=list(kvcache_sim.POLICIES),
      warmup_requests=plan.warmup_requests,
    )
    for capacity in capacities:
      for policy in kvcache_sim.POLICIES:
        theirs = sweep.results[(policy, capacity)]
        ours = kvcache_sim.simulate_plan(plan, capacity, policy)
        assert (ours["hit_tokens"], ours["underfilled"]) == (
          theirs.hitTokens,
          theirs.measurementMode == "underfilled_at_window",
        ), (policy, capacity, rows, lengths, block_size)


def test_model_is_deterministic_for_arrays_and_lists(rng):
  rows, lengths, block_size = _random_trace(rng)
  as_arrays = [np.asarray(ids, np.int64) for ids in rows]
  for policy in kvcache_sim.POLICIES:
    assert kvcache_sim.simulate(
      as_arrays, np.asarray(lengths), block_size, 3, policy
    ) == kvcache_sim.simulate(rows, lengths, block_size, 3, policy)
