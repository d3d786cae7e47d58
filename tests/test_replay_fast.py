"""The per-request replay engine against the per-event one and the model.

``prefixjax.replay.replay(engine="request")`` must give the same points as
``prefixjax.replay.replay`` (and so as the plain-Python model of
kvcache-simulator, ``tests/reference_models/kvcache_sim.py``), request for
request, on random hash-id traces with heavy sharing and tight capacities,
with requests cut into chunks of several widths, and on the published
Mooncake points.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_replay
from reference_models import kvcache_sim
from test_replay import PUBLISHED, mooncake_plan

from prefixjax import replay as rp

FAST_POLICIES = rp.REPLAY_POLICIES


def replay_fast(plan, **kwargs):
  return rp.replay(plan, engine="request", **kwargs)


def _random_trace(rng, num_requests, block_size):
  """Longer tails than the event-engine tests: more multi-chunk requests."""
  return test_replay._random_trace(
    rng,
    num_requests,
    block_size,
    num_prefixes=4,
    max_prefix=8,
    max_tail=6,
    tail_vocab=6,
  )


def _same(got, want, where):
  assert len(got) == len(want), where
  for g, w in zip(got, want, strict=True):
    at = f"{where} capacity {w.capacity_blocks}"
    assert g.capacity_blocks == w.capacity_blocks, at
    assert (
      g.per_request_hit_tokens.tolist() == w.per_request_hit_tokens.tolist()
    ), at
    assert g.hit_tokens == w.hit_tokens, at
    assert g.underfilled == w.underfilled, at
    assert g.total_tokens == w.total_tokens, at
    assert g.measured_requests == w.measured_requests, at


def check_against_model(got, policy, hash_ids, lengths, block_size, warmup):
  """Every point equals the plain-Python kvcache-simulator model's."""
  name = rp.KVCACHE_SIM_POLICY_NAMES[policy]
  for point in got:
    want = kvcache_sim.simulate(
      hash_ids, lengths, block_size, point.capacity_blocks, name, warmup
    )
    at = f"{policy} capacity {point.capacity_blocks}"
    assert (
      point.per_request_hit_tokens.tolist() == want["per_request_hit_tokens"]
    ), at
    assert point.hit_tokens == want["hit_tokens"], at
    assert point.underfilled == want["underfilled"], at


@pytest.mark.parametrize("width", [1, 3, 32])
@pytest.mark.parametrize("policy", FAST_POLICIES)
def test_matches_replay_and_model_on_random_traces(policy, width, rng):
  for _ in range(3):
    block_size = int(rng.integers(1, 9))
    hash_ids, lengths = _random_trace(rng, int(rng.integers(5, 90)), block_size)
    if not any(hash_ids):
      continue
    warmup = float(rng.choice([0.0, 0.25, 0.5]))
    plan = rp.prepare_replay(
      hash_ids, lengths, block_size=block_size, warmup_fraction=warmup
    )
    # Tight capacities (below one request's blocks) and roomy ones.
    capacities = sorted(set(rng.integers(0, 30, size=6).tolist()) | {0, 1, 2})
    got = replay_fast(plan, policy=policy, capacities=capacities, width=width)
    _same(
      got,
      rp.replay(plan, policy=policy, capacities=capacities, engine="event"),
      policy,
    )
    check_against_model(got, policy, hash_ids, lengths, block_size, warmup)


def test_fifo_sweep_of_every_capacity(rng):
  # More than 16 capacities: the default width narrows for fifo; every
  # capacity from 0 to past the number of nodes, unsorted.
  hash_ids, lengths = _random_trace(rng, 120, 2)
  plan = rp.prepare_replay(hash_ids, lengths, block_size=2)
  capacities = rng.permutation(plan.unique_blocks + 3).tolist()
  _same(
    replay_fast(plan, policy="fifo", capacities=capacities),
    rp.replay(plan, policy="fifo", capacities=capacities, engine="event"),
    "fifo",
  )


def test_fifo_rereads_a_run_of_new_blocks_at_every_eviction_depth(rng):
  # fifo keys a request's new blocks by one shared base: a long run of new
  # blocks, read again through prefixes of every length between requests
  # that evict part of it (or insert part of it again), meets every head.
  chain = rng.permutation(np.arange(1, 1000))[:12].tolist()
  fillers = [[2000 + 10 * i + j for j in range(i % 4 + 1)] for i in range(5)]
  hash_ids = [chain]
  for _ in range(60):
    if rng.random() < 0.5:
      hash_ids.append(fillers[int(rng.integers(len(fillers)))])
    else:
      hash_ids.append(chain[: int(rng.integers(1, len(chain) + 1))])
  lengths = [len(ids) for ids in hash_ids]
  warmup = float(rng.choice([0.0, 0.5]))
  plan = rp.prepare_replay(
    hash_ids, lengths, block_size=1, warmup_fraction=warmup
  )
  capacities = list(range(plan.unique_blocks + 2))
  want = rp.replay(plan, policy="fifo", capacities=capacities, engine="event")
  for width in (1, 3, None):
    got = replay_fast(plan, policy="fifo", capacities=capacities, width=width)
    _same(got, want, f"fifo width {width}")
  check_against_model(got, "fifo", hash_ids, lengths, 1, warmup)


def test_reinserts_a_block_evicted_by_its_own_request():
  # Capacity 2: [1, 2] caches nodes 1, 2 (queue 1, 2); [3] evicts node 1
  # (queue 2, 3); the next [1, 2] misses node 1, whose insertion evicts node
  # 2, cached at the request's start, so node 2 is inserted again and
  # evicts node 3 (queue 1, 2). So the next [3] misses (without the
  # re-insertion it would hit), and evicts node 1.
  hash_ids = [[1, 2], [3], [1, 2], [3], [1, 2]]
  plan = rp.prepare_replay(hash_ids, [2] * 5, block_size=1, warmup_fraction=0)
  want = [0, 0, 0, 0, 0]
  for width in (1, 2):
    (point,) = replay_fast(plan, policy="fifo", capacities=[2], width=width)
    assert point.per_request_hit_tokens.tolist() == want, width
  for capacity in range(5):
    got = replay_fast(plan, policy="fifo", capacities=[capacity], width=1)
    _same(
      got,
      rp.replay(plan, policy="fifo", capacities=[capacity], engine="event"),
      "fifo",
    )


@pytest.mark.parametrize("width", [1, 2, 32])
def test_lru_leaf_evicts_its_own_insertion_when_no_older_leaf_is_left(width):
  # Capacity 2, one token per block. [1, 2, 3] inserts 1 and 2, then 3
  # finds only its own leaf 2 (its parent), evicts it and stops: {1}. The
  # next [1, 2, 3] hits 1 (protected), inserts 2, evicts it again for 3:
  # {1}. [4] fills the cache: {1, 4}. [1, 2, 3, 5] hits 1, inserts 2 over
  # the older leaf 4, then evicts 2 for 3 and stops. Capacity 1: [1, 2]
  # after [1] finds only its protected hit 1, so it inserts nothing. With
  # width 1 or 2 the evicted insertion can sit in the previous chunk.
  hash_ids = [[1, 2, 3], [1, 2, 3], [4], [1, 2, 3, 5], [1], [1, 2], [1, 2]]
  lengths = [len(ids) for ids in hash_ids]
  plan = rp.prepare_replay(hash_ids, lengths, block_size=1, warmup_fraction=0)
  (point,) = replay_fast(plan, policy="lru_leaf", capacities=[2], width=width)
  assert point.per_request_hit_tokens.tolist() == [0, 1, 0, 1, 1, 1, 2]
  capacities = list(range(7))
  got = replay_fast(plan, policy="lru_leaf", capacities=capacities, width=width)
  _same(
    got,
    rp.replay(plan, policy="lru_leaf", capacities=capacities, engine="event"),
    "lru_leaf",
  )
  for point in got:
    want = kvcache_sim.simulate(
      hash_ids, lengths, 1, point.capacity_blocks, "lru", 0.0
    )
    assert (
      point.per_request_hit_tokens.tolist() == want["per_request_hit_tokens"]
    ), point.capacity_blocks


@pytest.mark.parametrize("width", [1, 2, 32])
def test_belady_leaf_bypasses_a_block_needed_no_sooner(width):
  # Capacity 2, one token per block. [1, 2] caches both (next uses:
  # requests 2 and 3). [3, 4] is never used again and no leaf is used later
  # than that, so nothing is evicted or inserted. [1, 5] hits 1; 5 (next
  # use 4) is bypassed too: the only unprotected leaf, 2, is needed sooner
  # (request 3). So [1, 2] hits both and [1, 5] hits 1 only.
  hash_ids = [[1, 2], [3, 4], [1, 5], [1, 2], [1, 5]]
  lengths = [len(ids) for ids in hash_ids]
  plan = rp.prepare_replay(hash_ids, lengths, block_size=1, warmup_fraction=0)
  (point,) = replay_fast(
    plan, policy="belady_leaf", capacities=[2], width=width
  )
  assert point.per_request_hit_tokens.tolist() == [0, 0, 1, 2, 1]
  capacities = list(range(6))
  got = replay_fast(
    plan, policy="belady_leaf", capacities=capacities, width=width
  )
  _same(
    got,
    rp.replay(
      plan, policy="belady_leaf", capacities=capacities, engine="event"
    ),
    "belady_leaf",
  )
  for point in got:
    want = kvcache_sim.simulate(
      hash_ids, lengths, 1, point.capacity_blocks, "optimal", 0.0
    )
    assert (
      point.per_request_hit_tokens.tolist() == want["per_request_hit_tokens"]
    ), point.capacity_blocks


def test_bad_arguments_are_reported():
  plan = rp.prepare_replay([[1]], [4], block_size=4)
  with pytest.raises(ValueError, match="policy='lfu'"):
    replay_fast(plan, policy="lfu", capacities=[1])
  with pytest.raises(ValueError, match="must be >= 0"):
    replay_fast(plan, policy="fifo", capacities=[-1])
  with pytest.raises(ValueError, match="capacities must not be empty"):
    replay_fast(plan, policy="fifo", capacities=[])
  with pytest.raises(ValueError, match="width=0"):
    replay_fast(plan, policy="fifo", capacities=[1], width=0)


def check_published_points(engine, policy, reference):
  """``engine(plan, policy=, capacities=)`` gives kvcache-simulator's
  published hit tokens on the Mooncake trace, and equals ``replay``'s
  ``reference`` engine request for request."""
  _, plan = mooncake_plan()
  capacities = list(PUBLISHED)
  index = rp.REPLAY_POLICIES.index(policy)
  got = engine(plan, policy=policy, capacities=capacities)
  assert [p.hit_tokens for p in got] == [
    PUBLISHED[c][index] for c in capacities
  ]
  _same(
    got,
    rp.replay(plan, policy=policy, capacities=capacities, engine=reference),
    policy,
  )


@pytest.mark.slow
@pytest.mark.parametrize("policy", FAST_POLICIES)
def test_mooncake_published_points(policy):
  check_published_points(replay_fast, policy, "event")
