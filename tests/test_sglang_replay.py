"""SGLang-semantics trace replay against the plain-Python SGLang oracle.

Every comparison checks, request by request, the hit tokens and the free
pages left after the request (so the tree's size, not only its hits, must
follow the oracle) at several capacities, the smallest one included: there
eviction is heavy, nodes split and whole-node eviction overshoots.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models.sglang_radix import SglangRadixCache

from prefixjax.replay import sglang as sglang_replay
from prefixjax.replay.sglang import replay_sglang
from prefixjax.workloads import Trace, generate_workload, load_mooncake

MOONCAKE = (
  Path(__file__).resolve().parents[2]
  / "shared"
  / "traces"
  / "mooncake_conversation_trace.jsonl"
)


def _oracle(trace: Trace, block_size: int, capacity: int):
  """Per request: hit tokens and free pages after it, from the oracle."""
  cache = SglangRadixCache(capacity, page_size=block_size)
  hits, free = [], []
  for r in range(len(trace)):
    p, o = int(trace.input_lengths[r]), int(trace.output_lengths[r])
    if trace.has_token_ids:
      prompt = trace.input_token_ids[r].tolist()
      if trace.output_token_ids is not None:
        outputs = trace.output_token_ids[r].tolist()
      else:  # tokens no prompt uses: the pages they fill never hit
        outputs = [-1 - r] * o
      hits.append(cache.run_request(prompt, outputs))
    else:
      ids = trace.hash_ids[r].tolist()
      hits.append(cache.run_request_hashed(ids, p, o))
    free.append(cache.num_free_pages)
  return hits, free


def _min_capacity(trace: Trace, block_size: int) -> int:
  totals = trace.input_lengths + np.maximum(trace.output_lengths, 1) - 1
  return -(-int(totals.max()) // block_size)


def _check_against_oracle(trace, block_size, capacities):
  hits, free = sglang_replay.hits_and_free(trace, block_size, capacities)
  for i, capacity in enumerate(capacities):
    want_hits, want_free = _oracle(trace, block_size, capacity)
    got = hits[i].tolist()
    bad = [r for r in range(len(trace)) if got[r] != want_hits[r]]
    assert not bad, (
      f"capacity {capacity}: first wrong request {bad[0]}: "
      f"{got[bad[0]]} != {want_hits[bad[0]]}"
    )
    assert free[i].tolist() == want_free, capacity
  return hits


GENERATED = {
  "multi_turn": dict(
    num_turns=(2, 6),
    system_prompt_len=(8, 48),
    question_len=(4, 40),
    output_len=(1, 40),
    max_input_len=400,
  ),
  "system_prompt": dict(
    num_prompts=4,
    prompt_len=(8, 80),
    question_len=(1, 30),
    output_len=(1, 30),
  ),
  "few_shot": dict(
    num_tasks=3,
    instruction_len=(4, 24),
    pool_size=6,
    example_len=(4, 24),
    num_shots=(1, 4),
    question_len=(2, 16),
    output_len=(1, 16),
  ),
}


@pytest.mark.parametrize("kind", sorted(GENERATED))
def test_generated_workloads_match_oracle(kind, rng):
  trace = generate_workload(
    kind,
    num_requests=60,
    seed=int(rng.integers(0, 2**31)),
    vocab_size=int(rng.choice([2, 4, 32000])),
    **GENERATED[kind],
  )
  block_size = int(rng.choice([1, 2, 3, 4, 8]))
  need = _min_capacity(trace, block_size)
  capacities = [need, need + 1, need + 7, 3 * need, 50 * need]
  hits = _check_against_oracle(trace, block_size, capacities)
  assert hits[-1].sum() > 0  # the workload shares prefixes


def _hashed_trace(rng, num_requests: int, block_size: int) -> Trace:
  """Hash-id requests that extend earlier ones: deep sharing, many splits.

  Ids come from a small alphabet, so equal ids under different prefixes
  must stay different pages (identity is the whole path).
  """
  paths: list[list[int]] = []
  rows, prompt_lens, output_lens = [], [], []
  for _ in range(num_requests):
    base = []
    if paths and rng.random() < 0.85:
      old = paths[int(rng.integers(len(paths)))]
      base = old[: int(rng.integers(0, len(old) + 1))]
    extra = rng.integers(0, 4, size=int(rng.integers(0, 6))).tolist()
    ids = (base + extra) or [int(rng.integers(0, 4))]
    paths.append(ids)
    tail = int(rng.integers(0, block_size))  # tokens missing from the last
    prompt_lens.append(max(len(ids) * block_size - tail, 1))
    rows.append(np.asarray(ids[: -(-prompt_lens[-1] // block_size)]))
    output_lens.append(int(rng.integers(0, 3 * block_size + 2)))
  return Trace(
    np.zeros(num_requests),
    prompt_lens,
    output_lens,
    hash_ids=rows,
    hash_block_size=block_size,
    name="hashed",
  )


def test_hash_id_traces_match_oracle(rng):
  block_size = int(rng.choice([1, 2, 3, 4]))
  trace = _hashed_trace(rng, 150, block_size)
  need = _min_capacity(trace, block_size)
  capacities = [need, need + 1, need + 2, need + 5, 2 * need, 1000]
  hits = _check_against_oracle(trace, block_size, capacities)
  assert hits[-1].sum() > 0


def test_unknown_outputs_get_fresh_pages(rng):
  """Output tokens the trace does not know fill pages that never hit."""
  block_size = 2
  prompts = [rng.integers(0, 3, size=int(rng.integers(1, 12))) for _ in "x"]
  for _ in range(49):
    prompt = prompts[int(rng.integers(len(prompts)))]
    cut = prompt[: int(rng.integers(0, len(prompt) + 1))]
    tail = rng.integers(0, 3, size=int(rng.integers(1, 6)))
    prompts.append(np.concatenate([cut, tail]))
  lengths = [len(p) for p in prompts]
  outputs = rng.integers(0, 7, size=len(prompts))
  trace = Trace(
    np.zeros(len(prompts)),
    lengths,
    outputs,
    input_token_ids=prompts,
    name="no-outputs",
  )
  need = _min_capacity(trace, block_size)
  _check_against_oracle(trace, block_size, [need, need + 3, 100])


def test_vmaps_over_capacities(rng):
  """The per-capacity replay is pure: ``jax.vmap`` over capacities agrees."""
  trace = generate_workload(
    "multi_turn",
    num_requests=30,
    seed=int(rng.integers(0, 2**31)),
    **GENERATED["multi_turn"],
  )
  block_size = 4
  need = _min_capacity(trace, block_size)
  capacities = [need, need + 2, 10 * need]
  engine = sglang_replay.ENGINE
  prepared = engine.prepare(trace, capacities, block_size=block_size)
  one = functools.partial(engine.run, **prepared.static)
  hits, free, bad = jax.jit(jax.vmap(one, in_axes=(None, 0)))(
    prepared.arrays, jnp.asarray(capacities, jnp.int32)
  )
  assert not np.asarray(bad).any()
  for i, capacity in enumerate(capacities):
    want_hits, want_free = _oracle(trace, block_size, capacity)
    assert np.asarray(hits[i]).tolist() == want_hits, capacity
    assert np.asarray(free[i]).tolist() == want_free, capacity


def test_mooncake_prefix_matches_oracle():
  if not MOONCAKE.exists():
    pytest.skip(f"Mooncake trace not found at {MOONCAKE}")
  trace = load_mooncake(MOONCAKE, limit=300)
  need = _min_capacity(trace, 512)
  _check_against_oracle(trace, 512, [need, 400, 4000])


def test_points_sum_the_measured_window():
  trace = Trace(
    np.zeros(4),
    [8, 9, 9, 3],
    [1, 5, 0, 2],
    hash_ids=[np.array([1, 2]), np.array([1, 2, 3]), [1, 2, 3], [7]],
    hash_block_size=4,
  )
  points = replay_sglang(
    trace,
    block_size=4,
    capacities=[4, 8],
    warmup_fraction=0.5,
  )
  assert points.timing.compile_s >= 0.0 and points.timing.run_s > 0.0
  for point, capacity in zip(points, [4, 8], strict=True):
    assert point.policy == "lru_leaf"
    assert point.capacity_blocks == capacity and point.block_size == 4
    assert point.total_tokens == 12 and point.measured_requests == 2
    assert not point.underfilled
    hits = point.per_request_hit_tokens
    assert hits.dtype == np.int64
    assert hits.tolist() == _oracle(trace, 4, capacity)[0] == [0, 8, 8, 0]
    assert point.hit_tokens == 8 and point.hit_rate == 8 / 12


def _tokens_trace(prompts, outputs) -> Trace:
  return Trace(
    np.zeros(len(prompts)),
    [len(p) for p in prompts],
    [len(o) for o in outputs],
    input_token_ids=[np.asarray(p) for p in prompts],
    output_token_ids=[np.asarray(o) for o in outputs],
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(capacities=[3]), "cannot hold the largest request"),
    (dict(capacities=[]), "must not be empty"),
    (dict(capacities=[8], warmup_fraction=1.5), "warmup_fraction"),
    (dict(capacities=[8], block_size=0), "block_size=0"),
  ],
)
def test_bad_arguments(kwargs, match):
  trace = _tokens_trace([[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10, 11]])
  kwargs = {"block_size": 2, **kwargs}
  with pytest.raises(ValueError, match=match):
    replay_sglang(trace, **kwargs)


def test_bad_traces():
  lengths_only = Trace([0.0], [4], [1])
  with pytest.raises(ValueError, match="neither token ids nor hash ids"):
    replay_sglang(lengths_only, block_size=2, capacities=[8])
  hashed = Trace([0.0], [4], [1], hash_ids=[[1, 2]], hash_block_size=2)
  with pytest.raises(ValueError, match="hash block size 2"):
    replay_sglang(hashed, block_size=4, capacities=[8])
  empty = _tokens_trace([[]], [[1]])
  with pytest.raises(ValueError, match="non-empty prompt"):
    replay_sglang(empty, block_size=2, capacities=[8])
  with pytest.raises(TypeError, match="capacity"):
    replay_sglang(hashed, block_size=2, capacities=[2.5])
