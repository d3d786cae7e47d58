"""On-device replay (kvcache-simulator semantics) against independent models.

Oracles: the plain-Python model of kvcache-simulator 0.1.3
(``tests/reference_models/kvcache_sim.py``), the real package on random
traces when it is installed, and the simulator's published Mooncake numbers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference_models import kvcache_sim, shared_trace, shared_traces_dir

from prefixjax import replay as rp
from prefixjax.workloads import generate_workload, load_mooncake

MOONCAKE = "mooncake_conversation_trace.jsonl"
PUBLISHED = {  # capacity: (fifo, lru_leaf, belady_leaf) hit tokens
  1827: (3_602_280, 3_704_049, 17_434_225),
  9139: (12_102_727, 13_865_669, 27_038_068),
  18279: (17_387_598, 19_962_647, 27_038_068),
  36558: (22_099_608, 24_900_024, 27_038_068),
}


def _random_trace(
  rng,
  num_requests,
  block_size,
  *,
  num_prefixes=5,
  max_prefix=6,
  max_tail=4,
  tail_vocab=8,
):
  """Heavy sharing: a few prefixes, short random tails, partial last blocks,
  a few empty requests."""
  prefixes = [
    rng.integers(0, 6, size=rng.integers(1, max_prefix + 1)).tolist()
    for _ in range(num_prefixes)
  ]
  hash_ids, lengths = [], []
  for _ in range(num_requests):
    ids = (
      prefixes[rng.integers(0, len(prefixes))]
      + rng.integers(0, tail_vocab, size=rng.integers(0, max_tail + 1)).tolist()
    )
    if rng.random() < 0.05:
      ids = []  # dropped by the simulator's parser
    hash_ids.append(ids)
    lengths.append(
      max(len(ids) * block_size - int(rng.integers(0, block_size)), 1)
    )
  return hash_ids, lengths


@pytest.mark.parametrize("policy", rp.REPLAY_POLICIES)
def test_matches_model_on_random_traces(policy, rng):
  block_size = int(rng.integers(1, 9))
  for _ in range(3):
    hash_ids, lengths = _random_trace(rng, int(rng.integers(5, 80)), block_size)
    warmup = float(rng.choice([0.0, 0.25, 0.5]))
    plan = rp.prepare_replay(
      hash_ids, lengths, block_size=block_size, warmup_fraction=warmup
    )
    capacities = sorted(set(rng.integers(0, 40, size=6).tolist()))
    points = rp.replay(plan, policy=policy, capacities=capacities)
    for capacity, point in zip(capacities, points, strict=True):
      want = kvcache_sim.simulate(
        hash_ids,
        lengths,
        block_size,
        capacity,
        rp.KVCACHE_SIM_POLICY_NAMES[policy],
        warmup,
      )
      where = f"{policy} capacity {capacity}"
      assert (
        point.per_request_hit_tokens.tolist()
        == (want["per_request_hit_tokens"])
      ), where
      assert point.hit_tokens == want["hit_tokens"], where
      assert point.underfilled == want["underfilled"], where
      assert point.total_tokens == want["total_tokens"], where


def test_ceiling_matches_model(rng):
  hash_ids, lengths = _random_trace(rng, 60, 4)
  plan = rp.prepare_replay(hash_ids, lengths, block_size=4)
  got = rp.replay_ceiling(plan)
  want = kvcache_sim.ceiling(hash_ids, lengths, 4)
  assert got.hit_tokens == want["hit_tokens"]
  assert got.per_request_hit_tokens.tolist() == want["per_request_hit_tokens"]


def test_token_trace_replay_matches_model(rng):
  trace = generate_workload(
    "multi_turn", num_requests=40, seed=int(rng.integers(0, 2**31))
  )
  block_size = 16
  hash_ids = trace.block_hash_ids(block_size)
  plan = rp.prepare_replay(hash_ids, trace.input_lengths, block_size=16)
  (point,) = rp.replay(plan, policy="lru_leaf", capacities=[50])
  want = kvcache_sim.simulate(hash_ids, trace.input_lengths, 16, 50, "lru")
  assert point.per_request_hit_tokens.tolist() == want["per_request_hit_tokens"]


def test_real_package_agrees(rng, tmp_path):
  kvcache_sim_pkg = pytest.importorskip(
    "kvcache_sim.policies", reason="kvcache-simulator is not installed"
  )
  from kvcache_sim.plan import build_execution_plan
  from kvcache_sim.trace import parse_trace_file

  hash_ids, lengths = _random_trace(rng, 50, 8)
  path = tmp_path / "trace.jsonl"
  with open(path, "w") as f:
    for i, (ids, n) in enumerate(zip(hash_ids, lengths, strict=True)):
      row = dict(timestamp=i, input_length=n, output_length=1, hash_ids=ids)
      f.write(json.dumps(row) + "\n")
  trace = parse_trace_file(str(path), block_size=8)
  their_plan = build_execution_plan(trace, 0.5)
  plan = rp.prepare_replay(hash_ids, lengths, block_size=8)
  for policy in rp.REPLAY_POLICIES:
    name = rp.KVCACHE_SIM_POLICY_NAMES[policy]
    points = rp.replay(plan, policy=policy, capacities=[3, 9, 20])
    for capacity, point in zip([3, 9, 20], points, strict=True):
      theirs = kvcache_sim_pkg.simulate_policy(their_plan, name, capacity)
      if theirs.measurementMode == "underfilled_at_window":
        assert point.underfilled, (policy, capacity)
      else:
        assert point.hit_tokens == theirs.hitTokens, (policy, capacity)
        assert point.total_tokens == theirs.totalTokens, (policy, capacity)


def test_bad_arguments_are_reported():
  with pytest.raises(ValueError, match="2 hash-id rows but 1 input lengths"):
    rp.prepare_replay([[1], [2]], [4], block_size=4)
  with pytest.raises(ValueError, match="warmup_fraction=1.5"):
    rp.prepare_replay([[1]], [4], block_size=4, warmup_fraction=1.5)
  with pytest.raises(
    ValueError, match=r"warmup_fraction=1.0 must be in \[0, 1\)"
  ):
    rp.prepare_replay([[1]], [4], block_size=4, warmup_fraction=1.0)
  with pytest.raises(TypeError, match="warmup_fraction='0.5' must be a number"):
    rp.prepare_replay([[1]], [4], block_size=4, warmup_fraction="0.5")
  tokens = generate_workload("system_prompt", num_requests=4, seed=0)
  with pytest.raises(ValueError, match="block_size=0 must be >= 1"):
    rp.replay(tokens, policy="fifo", capacities=[8], block_size=0)
  for kw in (
    dict(policy="fifo"),
    dict(semantics="vllm"),
    dict(semantics="sglang"),
  ):
    with pytest.raises(ValueError, match=r"block_size=2147483648 must be <"):
      rp.replay(tokens, capacities=[8], block_size=2**31, **kw)  # int32
  for capacities in (None, "12", 8):
    with pytest.raises(TypeError, match="must be a sequence of ints"):
      rp.replay(tokens, policy="fifo", capacities=capacities)
  with pytest.raises(ValueError, match="publish='late' is a vllm-semantics"):
    rp.replay(tokens, policy="fifo", capacities=[8], publish="late")
  with pytest.raises(ValueError, match="input_length=0"):
    rp.prepare_replay([[1]], [0], block_size=4)
  # more blocks than the prompt covers: ceil(5 / 4) = 2
  with pytest.raises(ValueError, match=r"request 1 has 3 blocks but input_"):
    rp.prepare_replay([[1], [1, 2, 3]], [4, 5], block_size=4)
  with pytest.raises(
    ValueError, match=r"input_lengths\[1\]=4.5 must be a whole"
  ):
    rp.prepare_replay([[1], [2]], [4, 4.5], block_size=4)
  with pytest.raises(ValueError, match="input_lengths must be integers"):
    rp.prepare_replay([[1], [2]], ["4", "4"], block_size=4)
  whole = rp.prepare_replay([[1], [1, 2]], np.array([4.0, 5.0]), block_size=4)
  exact = rp.prepare_replay([[1], [1, 2]], [4, 5], block_size=4)
  assert np.array_equal(whole.weight, exact.weight)
  plan = rp.prepare_replay([[1]], [4], block_size=4)
  with pytest.raises(ValueError, match="policy='lfu'"):
    rp.replay(plan, policy="lfu", capacities=[1])
  with pytest.raises(ValueError, match="must be >= 0"):
    rp.replay(plan, policy="fifo", capacities=[-1])


def mooncake_plan():
  """The Mooncake trace and its block-512 plan, or skip when it is absent."""
  path = shared_trace(MOONCAKE)
  if path is None:
    pytest.skip(f"real trace {MOONCAKE} not found in {shared_traces_dir()}")
  trace = load_mooncake(path)
  plan = rp.prepare_replay(trace.hash_ids, trace.input_lengths, block_size=512)
  return trace, plan


@pytest.mark.slow
def test_mooncake_published_points():
  trace, plan = mooncake_plan()
  capacities = list(PUBLISHED)
  for index, policy in enumerate(rp.REPLAY_POLICIES):
    points = rp.replay(plan, policy=policy, capacities=capacities)
    got = [p.hit_tokens for p in points]
    assert got == [PUBLISHED[c][index] for c in capacities], policy
    assert all(p.total_tokens == 67_915_607 for p in points)
  whole = rp.prepare_replay(
    trace.hash_ids, trace.input_lengths, block_size=512, warmup_fraction=0.0
  )
  ceiling = rp.replay_ceiling(whole)
  assert round(ceiling.hit_rate, 3) == 0.374  # the shared README's figure
  assert np.isclose(rp.replay_ceiling(plan).hit_tokens, 27_038_068)


def test_plan_numbers_nodes_in_order_of_first_sight(rng):
  """prepare_replay's vectorised numbering equals PrefixNumbering's
  one-block-at-a-time rule (node (parent, id), numbered as first seen)."""
  from prefixjax.workloads import PrefixNumbering

  rows = [
    rng.integers(-2, 4, size=int(rng.integers(0, 9))).tolist()
    for _ in range(int(rng.integers(1, 60)))
  ]
  rows[0] = rows[0] or [1]
  lengths = [max(1, 4 * len(r) - int(rng.integers(0, 4))) for r in rows]
  plan = rp.prepare_replay(rows, lengths, block_size=4, warmup_fraction=0.0)
  numbering, nodes = PrefixNumbering(), []
  for row in rows:
    node = 0
    for block_id in row:
      node = numbering.child(node, block_id)
      nodes.append(node)
  assert plan.node.tolist() == nodes
  assert plan.parent.tolist() == numbering.parent
  assert plan.kept.tolist() == [i for i, r in enumerate(rows) if r]
