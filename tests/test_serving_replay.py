"""vLLM-semantics trace replay against the plain-Python vLLM v1 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from reference_models import vllm_apc

from prefixjax.serving_replay import replay_vllm
from prefixjax.workloads import Trace, generate_workload


def _oracle_hits(trace, block_size, capacity):
  cache = vllm_apc.VllmPrefixCache.from_capacity(
    capacity, block_size, free_order="append"
  )
  hits = []
  for r in range(len(trace)):
    prompt = trace.input_token_ids[r].tolist()
    out_len = max(int(trace.output_lengths[r]), 1)
    if trace.output_token_ids is not None:
      outputs = trace.output_token_ids[r][:out_len].tolist()
    else:
      outputs = [-1 - r] * out_len
    hits.append(cache.run_request(prompt, outputs))
  return hits


@pytest.mark.parametrize("kind", ["multi_turn", "system_prompt"])
def test_matches_vllm_oracle(kind, rng):
  trace = generate_workload(
    kind, num_requests=60, seed=int(rng.integers(0, 2**31))
  )
  block_size = int(rng.choice([8, 16]))
  largest = int(
    (trace.input_lengths + np.maximum(trace.output_lengths, 1) - 1).max()
  )
  need = -(-largest // block_size)
  capacities = [need, need + 40, 4 * need]
  points = replay_vllm(
    trace, block_size=block_size, capacities=capacities, warmup_fraction=0.0
  )
  for capacity, point in zip(capacities, points, strict=True):
    want = _oracle_hits(trace, block_size, capacity)
    assert point.per_request_hit_tokens.tolist() == want, capacity


def test_multi_turn_outputs_are_hit_when_known():
  prompt = np.arange(1, 21, dtype=np.int32)
  answer = np.arange(100, 116, dtype=np.int32)
  second = np.concatenate([prompt, answer, np.asarray([7, 8, 9], np.int32)])
  trace = Trace(
    arrival_times_s=np.zeros(2),
    input_lengths=np.asarray([20, len(second)]),
    output_lengths=np.asarray([16, 4]),
    input_token_ids=[prompt, second],
    output_token_ids=[answer, np.asarray([1, 2, 3, 4], np.int32)],
    name="two-turns",
  )
  (point,) = replay_vllm(
    trace, block_size=4, capacities=[64], warmup_fraction=0.0
  )
  # Turn 2 re-sends turn 1's prompt and answer: 20 + 15 tokens had KV,
  # whole blocks -> 32 tokens.
  assert point.per_request_hit_tokens.tolist() == [0, 32]


def test_refuses_what_it_cannot_do():
  trace = generate_workload("system_prompt", num_requests=4, seed=0)
  with pytest.raises(ValueError, match="cannot hold the largest request"):
    replay_vllm(trace, block_size=16, capacities=[2])
  lengths_only = Trace(
    arrival_times_s=np.zeros(1),
    input_lengths=np.asarray([5]),
    output_lengths=np.asarray([1]),
  )
  with pytest.raises(ValueError, match="no token ids"):
    replay_vllm(lengths_only, block_size=16, capacities=[8])


def test_publish_switch_is_equivalent_one_request_at_a_time(rng):
  trace = generate_workload(
    "multi_turn", num_requests=30, seed=int(rng.integers(0, 2**31))
  )
  early, late = (
    replay_vllm(trace, block_size=16, capacities=[400], publish=mode)[0]
    for mode in ("early", "late")
  )
  assert early.per_request_hit_tokens.tolist() == (
    late.per_request_hit_tokens.tolist()
  )
  with pytest.raises(ValueError, match="publish='eager'"):
    replay_vllm(trace, block_size=16, capacities=[400], publish="eager")


def test_early_publishing_lets_an_overlapping_request_share():
  """Two overlapping requests with the same 3-block prompt prefix: with
  early publishing the second hits the first's prefill; with late
  publishing it cannot until the first finishes."""
  import jax.numpy as jnp

  from prefixjax import hashing
  from prefixjax import prefix_cache as pc

  tokens = jnp.arange(1, 33, dtype=jnp.int32)
  keys, _ = hashing.block_hashes(tokens, 14, block_size=4)
  hits = {}
  for mode in ("early", "late"):
    s = pc.init(32, 4, max_seqs=2, max_blocks_per_seq=8)
    s, _ = pc.allocate_with_prefix(s, 0, keys, 14)
    if mode == "early":
      s, _ = pc.publish(s, 0, keys, 14)
    s, second = pc.allocate_with_prefix(s, 1, keys, 14)
    hits[mode] = int(second.hit_tokens)
  assert hits == {"early": 12, "late": 0}
