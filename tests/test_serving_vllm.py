"""The jitted vLLM FCFS serving simulator against the plain-Python scheduler.

``prefixjax.serving.simulate`` must make, step for step, the decisions of
``reference_models.vllm_scheduler.VllmScheduler`` (policy ``"fcfs"``,
arrivals ``"zero"``): the same scheduled ``[rid, num_tokens]`` list in
every step (and every other field of the step records), then the same
per-request records. Traces are drawn fresh per case with a small vocabulary
so prefixes are shared. The fast cases share array shapes (requests, pool,
slots, columns, step rows) so they compile the engine a few times only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference_models.vllm_apc import cdiv
from reference_models.vllm_scheduler import VllmScheduler, fabricated_token

import prefixjax as pj
from prefixjax import serving
from prefixjax.replay.vllm import replay_vllm
from prefixjax.serving import ServingConfig

NUM_REQUESTS = 12
MAX_STEPS = 1024  # fixed step rows: one compile per pool / slot shape


def _records(rng, n=NUM_REQUESTS, *, fabricate=False):
  """Multi-turn conversations (shared prefixes) as the harness's records."""
  t = pj.generate_workload(
    "multi_turn",
    num_requests=n,
    seed=int(rng.integers(2**31)),
    system_prompt_len=24,
    question_len=(2, 24),
    output_len=(1, 16),
    vocab_size=64,
  )
  records = serving.records_from_trace(t)
  if fabricate:  # some outputs past the trace's ids: fabricated tokens
    for rec in records:
      if rng.random() < 0.3:
        rec["output_toks"] += int(rng.integers(1, 5))
      if rng.random() < 0.2:
        del rec["output_tok_ids"]
  return records


def _long_pair(rng, max_model_len):
  """Two requests that each run to ``max_model_len`` tokens."""
  return [
    dict(
      input_tok_ids=rng.integers(100, 200, max_model_len // 3).tolist(),
      output_toks=max_model_len,
    )
    for _ in range(2)
  ]


def _compare(records, config, *, max_steps=MAX_STEPS):
  """Runs both; asserts equal steps, then equal requests; returns steps."""
  model = VllmScheduler(**dataclasses.asdict(config))
  steps, reqs = model.simulate(records, check_invariants=True)
  got = serving.simulate(records, config, max_steps=max_steps)
  assert got.status == "OK"
  mine = got.steps()
  for s_model, s_mine in zip(steps, mine, strict=False):
    assert s_mine["sched"] == s_model["sched"], f"step {s_model['step']}"
    assert s_mine == s_model, f"step {s_model['step']}"
  assert len(mine) == len(steps)
  assert got.scheduled() == [s["sched"] for s in steps]
  for r_model, r_mine in zip(reqs, got.requests(), strict=True):
    assert r_mine == r_model, f"request {r_model['rid']}"
  return steps, reqs


def _config(**kw):
  base = dict(
    num_gpu_blocks=200,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=40,
    max_model_len=128,
  )
  return ServingConfig(**{**base, **kw})


# ------------------------------------------------------------------ (a), (c)
@pytest.mark.parametrize(
  "chunked, budget, threshold",
  [(True, 40, 0), (True, 24, 7), (False, 160, 0)],
  ids=["chunked", "chunked-threshold", "no-chunking"],
)
def test_matches_model_without_memory_pressure(rng, chunked, budget, threshold):
  config = _config(
    max_num_batched_tokens=budget,
    chunked_prefill=chunked,
    long_prefill_token_threshold=threshold,
  )
  records = _records(rng, fabricate=True)
  steps, reqs = _compare(records, config)
  assert not any(s["preempted"] for s in steps)
  assert any(r.get("hit_first_sched") for r in reqs)  # prefixes were shared


# ----------------------------------------------------------------------- (b)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_matches_model_with_preemption(rng, chunked):
  max_model_len = 128
  need = cdiv(max_model_len, 4)
  # Fewer blocks than two full-length sequences need: the long pair cannot
  # finish side by side, so the later one is preempted.
  config = _config(
    num_gpu_blocks=need + 1 + 8,
    max_num_batched_tokens=40 if chunked else 160,
    chunked_prefill=chunked,
  )
  records = _long_pair(rng, max_model_len) + _records(
    rng, NUM_REQUESTS - 2, fabricate=True
  )
  steps, reqs = _compare(records, config)
  assert sum(len(s["preempted"]) for s in steps) >= 1
  assert any(s["resumed"] for s in steps)


# ----------------------------------------------------------------------- (d)
def test_one_at_a_time_matches_model_and_sequential_replay(rng):
  max_model_len = 256
  config = ServingConfig(
    num_gpu_blocks=cdiv(max_model_len, 4) + 1 + int(rng.integers(0, 40)),
    block_size=4,
    max_num_seqs=1,
    max_num_batched_tokens=max_model_len,
    max_model_len=max_model_len,
    chunked_prefill=False,
  )
  trace = pj.generate_workload(
    "multi_turn",
    num_requests=NUM_REQUESTS,
    seed=int(rng.integers(2**31)),
    system_prompt_len=24,
    question_len=(2, 24),
    output_len=(1, 16),
    vocab_size=64,
    max_input_len=max_model_len - 16,  # no request cut or rejected
  )
  steps, reqs = _compare(serving.records_from_trace(trace), config)
  assert all(len(s["sched"]) == 1 for s in steps)
  got = serving.simulate(trace, config, max_steps=MAX_STEPS)  # a Trace too
  assert got.requests() == reqs
  lens = np.asarray(trace.input_lengths) + np.asarray(trace.output_lengths)
  assert np.all(lens < max_model_len)  # so every request is comparable
  (point,) = replay_vllm(
    trace,
    block_size=4,
    capacities=[config.usable_blocks],
    warmup_fraction=0.0,
  )
  assert point.per_request_hit_tokens.tolist() == [
    r["hit_first_sched"] for r in reqs
  ]
  assert any(r["hit_first_sched"] for r in reqs)


# ------------------------------------------------------------ configuration
@pytest.mark.parametrize(
  "change, field",
  [
    (dict(num_gpu_blocks=0), "num_gpu_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=3), "max_num_batched_tokens"),
    (dict(chunked_prefill=False), "max_num_batched_tokens"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold=129), "long_prefill_token_threshold"),
    (dict(num_gpu_blocks=32), "num_gpu_blocks"),
    (dict(max_model_len=0), "max_model_len"),
  ],
)
def test_bad_config_names_the_field(change, field):
  with pytest.raises(ValueError, match=f"ServingConfig.{field}="):
    _config(**change)
  # The oracle refuses the same configurations (max_model_len=0 aside,
  # which it catches only through num_gpu_blocks).
  kw = {**dataclasses.asdict(_config()), **change}
  if field != "max_model_len":
    with pytest.raises(ValueError):
      VllmScheduler(**kw)


def test_bad_config_types():
  with pytest.raises(TypeError, match="ServingConfig.block_size"):
    _config(block_size=4.0)
  with pytest.raises(TypeError, match="ServingConfig.chunked_prefill"):
    _config(chunked_prefill=1)


def test_fabricated_token_is_the_harness_rule():
  assert [serving.fabricated_token(3, j) for j in range(3)] == [
    fabricated_token(3, j) for j in range(3)
  ]


# --------------------------------------------------------------- slow: fuzz
@pytest.mark.slow
def test_random_configs_match_model(rng):
  for _ in range(6):
    block_size = int(rng.choice([1, 2, 4, 8]))
    max_model_len = 96
    need = cdiv(max_model_len, block_size)
    seqs = int(rng.integers(1, 6))
    chunked = bool(rng.random() < 0.7)
    config = ServingConfig(
      num_gpu_blocks=need + 1 + int(rng.integers(0, need)),
      block_size=block_size,
      max_num_seqs=seqs,
      max_num_batched_tokens=int(rng.integers(max(seqs, 8), 80))
      if chunked
      else int(rng.integers(max_model_len, 200)),
      max_model_len=max_model_len,
      chunked_prefill=chunked,
      long_prefill_token_threshold=int(rng.choice([0, 5, 17])),
    )
    records = _long_pair(rng, max_model_len) + _records(rng, 8, fabricate=True)
    _compare(records, config)
