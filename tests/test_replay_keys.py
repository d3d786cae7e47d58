"""The keys-and-counts replay engine against the model and the other engines.

``prefixjax.replay_keys`` must give the same points as the plain-Python
model of kvcache-simulator (``tests/reference_models/kvcache_sim.py``) and
the per-event engine (``replay(engine="event")``), request for request,
on random hash-id traces with heavy sharing, at tight and roomy capacities
and at every capacity of a dense sweep, with requests cut into chunks of
several widths, and on the published Mooncake points.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_replay_fast import (
  _random_trace,
  _same,
  check_against_model,
  check_published_points,
)

from prefixjax import replay as rp
from prefixjax.replay.kvcache_sim.stack import lru_hit_capacities

KEY_POLICIES = ("lru_leaf", "belady_leaf")


def replay_keys(plan, **kwargs):
  return rp.replay(plan, engine="keys", **kwargs)


def _plan(rng, num_requests):
  block_size = int(rng.integers(1, 9))
  hash_ids, lengths = _random_trace(rng, num_requests, block_size)
  warmup = float(rng.choice([0.0, 0.25, 0.5]))
  plan = rp.prepare_replay(
    hash_ids, lengths, block_size=block_size, warmup_fraction=warmup
  )
  return plan, (hash_ids, lengths, block_size, warmup)


def _longest(plan):
  starts = np.flatnonzero(plan.first)
  return int(np.diff(np.r_[starts, plan.num_events]).max())


@pytest.mark.parametrize("per_step", [1, 3, 32])
@pytest.mark.parametrize("policy", KEY_POLICIES)
def test_matches_replay_and_model_on_random_traces(policy, per_step, rng):
  # per_step: blocks (lru_leaf) or distinct next uses (belady_leaf) per
  # scan step; 1 and 3 split most requests over several steps.
  step = {"width" if policy == "lru_leaf" else "keys_per_step": per_step}
  for _ in range(3):
    plan, (hash_ids, lengths, block_size, warmup) = _plan(
      rng, int(rng.integers(5, 90))
    )
    # Tight capacities (below one request's blocks: lru_leaf hands those to
    # the chain engine) and roomy ones, unsorted and repeated.
    capacities = rng.integers(0, 30, size=6).tolist() + [0, 1, 2, 2]
    capacities += [_longest(plan), plan.unique_blocks + 5]
    got = replay_keys(plan, policy=policy, capacities=capacities, **step)
    assert [p.capacity_blocks for p in got] == capacities
    check_against_model(got, policy, hash_ids, lengths, block_size, warmup)


@pytest.mark.parametrize("policy", KEY_POLICIES)
def test_every_capacity_of_a_sweep(policy, rng):
  # One pass (lru_leaf, from the longest request's blocks up) or one scan
  # with a capacity axis (belady_leaf, from 0 up) for every capacity up to
  # past the number of nodes.
  plan, _ = _plan(rng, 120)
  low = _longest(plan) if policy == "lru_leaf" else 0
  capacities = list(range(low, plan.unique_blocks + 3))
  _same(
    replay_keys(plan, policy=policy, capacities=capacities),
    rp.replay(plan, policy=policy, capacities=capacities, engine="event"),
    policy,
  )


def test_lru_hit_capacities_is_the_smallest_hitting_capacity(rng):
  plan, _ = _plan(rng, 60)
  hit_capacity = lru_hit_capacities(plan, width=int(rng.integers(1, 9)))
  assert hit_capacity.shape == (plan.num_events,)
  # Blocks never seen before never hit; every other block hits from some
  # capacity on, and that capacity never exceeds the nodes seen.
  _, first_seen = np.unique(plan.node, return_index=True)
  unseen = np.zeros(plan.num_events, bool)
  unseen[first_seen] = True
  never = np.iinfo(np.int32).max
  assert (hit_capacity[unseen] == never).all()
  longest = _longest(plan)
  capacities = list(range(longest, plan.unique_blocks + 1))
  points = rp.replay(
    plan, policy="lru_leaf", capacities=capacities, engine="event"
  )
  starts = np.flatnonzero(plan.first)
  for capacity, point in zip(capacities, points, strict=True):
    hits_from_capacities = np.where(
      hit_capacity <= capacity, plan.weight, 0
    ).astype(np.int64)
    per_kept = np.add.reduceat(hits_from_capacities, starts)
    assert (
      per_kept.tolist() == point.per_request_hit_tokens[plan.kept].tolist()
    ), capacity


def test_belady_leaf_bypasses_a_block_needed_no_sooner():
  # As in tests/test_replay_fast.py: capacity 2, [1, 2] then [3, 4] (never
  # used again: bypassed), [1, 5] bypasses 5 because leaf 2 is needed
  # sooner, so [1, 2] hits both.
  hash_ids = [[1, 2], [3, 4], [1, 5], [1, 2], [1, 5]]
  lengths = [len(ids) for ids in hash_ids]
  plan = rp.prepare_replay(hash_ids, lengths, block_size=1, warmup_fraction=0)
  for per_step in (1, 2, 32):
    (point,) = replay_keys(
      plan, policy="belady_leaf", capacities=[2], keys_per_step=per_step
    )
    assert point.per_request_hit_tokens.tolist() == [0, 0, 1, 2, 1], per_step


def test_lru_leaf_short_capacities_use_the_chain_engine():
  # Capacity 2 < 3 blocks: the request evicts its own insertion (see
  # tests/test_replay_fast.py), which stack ranks cannot express.
  hash_ids = [[1, 2, 3], [1, 2, 3], [4], [1, 2, 3, 5], [1], [1, 2], [1, 2]]
  lengths = [len(ids) for ids in hash_ids]
  plan = rp.prepare_replay(hash_ids, lengths, block_size=1, warmup_fraction=0)
  got = replay_keys(plan, policy="lru_leaf", capacities=[2, 4, 1])
  assert got[0].per_request_hit_tokens.tolist() == [0, 1, 0, 1, 1, 1, 2]
  _same(
    got,
    rp.replay(plan, policy="lru_leaf", capacities=[2, 4, 1], engine="event"),
    "lru_leaf",
  )


def test_bad_arguments_are_reported():
  plan = rp.prepare_replay([[1]], [4], block_size=4)
  with pytest.raises(ValueError, match="policy='fifo'"):
    replay_keys(plan, policy="fifo", capacities=[1])
  with pytest.raises(ValueError, match="must be >= 0"):
    replay_keys(plan, policy="lru_leaf", capacities=[-1])
  with pytest.raises(ValueError, match="width=0"):
    replay_keys(plan, policy="lru_leaf", capacities=[1], width=0)
  with pytest.raises(ValueError, match="keys_per_step=0"):
    replay_keys(plan, policy="belady_leaf", capacities=[1], keys_per_step=0)
  with pytest.raises(ValueError, match="width=True"):
    lru_hit_capacities(plan, width=True)
  with pytest.raises(ValueError, match="engine='keys' serves"):
    rp.replay(plan, policy="fifo", capacities=[1], engine="keys")
  with pytest.raises(ValueError, match="engine='gpu'"):
    rp.replay(plan, policy="fifo", capacities=[1], engine="gpu")


@pytest.mark.slow
@pytest.mark.parametrize("policy", KEY_POLICIES)
def test_mooncake_published_points(policy):
  check_published_points(replay_keys, policy, "request")
