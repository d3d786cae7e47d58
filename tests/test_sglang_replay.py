"""SGLang-semantics trace replay against the plain-Python SGLang oracle.

Every comparison checks, request by request, the hit tokens and the free
pages left after the request (so the tree's size, not only its hits, must
follow the oracle) at several capacities, the smallest one included: there
eviction is heavy, nodes split and whole-node eviction overshoots.

The replay's default refreshes waiting prefixes as SGLang 0.5.23 does
(``touch_waiting_prefix`` every 32nd priority computation), so the oracle
runs with ``waiting_refresh_interval=32`` unless a test says otherwise.
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models.sglang_radix import SglangRadixCache

from prefixjax.replay import sglang as sglang_replay
from prefixjax.replay.sglang import WAITING_REFRESH_INTERVAL, replay_sglang
from prefixjax.workloads import Trace, generate_workload, load_mooncake

MOONCAKE = (
  Path(__file__).resolve().parents[2]
  / "shared"
  / "traces"
  / "mooncake_conversation_trace.jsonl"
)


DEFAULT = object()  # the replay's default waiting_refresh_interval


def _oracle(
  trace: Trace,
  block_size: int,
  capacity: int,
  waiting_refresh_interval: int | None = WAITING_REFRESH_INTERVAL,
):
  """Per request: hit tokens and free pages after it, from the oracle."""
  cache = SglangRadixCache(
    capacity,
    page_size=block_size,
    waiting_refresh_interval=waiting_refresh_interval,
  )
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


def _check_against_oracle(trace, block_size, capacities, interval=DEFAULT):
  """The replay with ``waiting_refresh_interval=interval`` (its default if
  ``DEFAULT``) equals the oracle with that interval (32 for ``DEFAULT``)."""
  kwargs = (
    {} if interval is DEFAULT else dict(waiting_refresh_interval=interval)
  )
  want_interval = 32 if interval is DEFAULT else interval
  hits, free = sglang_replay.hits_and_free(
    trace, block_size, capacities, **kwargs
  )
  for i, capacity in enumerate(capacities):
    want_hits, want_free = _oracle(trace, block_size, capacity, want_interval)
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


# SGLang 0.5.23 touches a waiting request's whole prompt on its 1st, 33rd,
# 65th, ... priority computation; requests 32, 64, ... find a full tree.
@pytest.mark.parametrize(
  "interval", [DEFAULT, None, 1], ids=["default", "none", "every"]
)
@pytest.mark.parametrize("source", ["multi_turn", "few_shot", "hashed"])
def test_waiting_refresh_matches_oracle(source, interval, rng):
  """At tight capacities, where LRU order decides hits, the replay with
  the default, with no refresh and with a touch on every request equals
  the oracle run with the same interval."""
  if source == "hashed":
    block_size = int(rng.choice([1, 2, 3, 4]))
    trace = _hashed_trace(rng, 130, block_size)
  else:
    trace = generate_workload(
      source,
      num_requests=130,
      seed=int(rng.integers(0, 2**31)),
      vocab_size=int(rng.choice([2, 4, 32000])),
      **GENERATED[source],
    )
    block_size = int(rng.choice([1, 2, 4]))
  need = _min_capacity(trace, block_size)
  capacities = [need, need + 1, need + 3, 2 * need]
  _check_against_oracle(trace, block_size, capacities, interval)


def _touch_trace() -> Trace:
  """Page size 1, 10 pages: request 32's touch decides what it evicts.

  Requests 0-1 leave ``[1 2] -> {[3 4], [9]}``, ``[3 4]`` the least
  recently used leaf; 29 requests refresh ``[5 6]`` and request 31 fills
  the pool. Request 32 (prompt ``1 2 3``) hits ``1 2`` and must evict one
  leaf for its prefill: without the touch that is ``[3 4]`` (its capped
  match does not reach page 3); the touch refreshes ``[3 4]``, so ``[9]``
  goes and request 33 (``1 2 9 10``) hits 2 tokens instead of 3.
  """
  prompts = [[1, 2, 3, 4], [1, 2, 9]] + [[5, 6]] * 29
  prompts += [[20, 21, 22], [1, 2, 3], [1, 2, 9, 10]]
  return _tokens_trace(prompts, [[0]] * len(prompts))


def test_waiting_refresh_is_observable():
  trace = _touch_trace()
  assert len(trace) == 34
  want = {}
  for interval in (32, None):
    hits, free = _oracle(trace, 1, 10, interval)
    want[interval] = hits
    assert hits[-3:] == [0, 2, 3 if interval is None else 2]
    got, got_free = sglang_replay.hits_and_free(
      trace, 1, [10], waiting_refresh_interval=interval
    )
    assert got[0].tolist() == hits and got_free[0].tolist() == free
  assert want[32] != want[None]
  for kwargs, interval in [
    ({}, 32),
    (dict(waiting_refresh_interval=np.int64(32)), 32),
    (dict(waiting_refresh_interval=None), None),
  ]:
    (point,) = replay_sglang(
      trace, block_size=1, capacities=[10], warmup_fraction=0.0, **kwargs
    )
    assert point.per_request_hit_tokens.tolist() == want[interval]


def _touch_prone_trace(rng, block_size: int) -> Trace:
  """A random hash-id trace whose request 32 may evict differently with
  and without its touch (the randomised :func:`_touch_trace`).

  Requests 0-1 (``a + b``, ``a + c``) split ``a | b``, leaving ``b`` the
  oldest leaf; fillers refresh a few short prompts; request 31 is fresh;
  request 32's prompt is ``a`` plus ``b``'s first page (its capped match
  stops at ``a``, its touch walks into ``b``); requests 33-34 then ask
  for ``c`` and the whole of ``b``. Every capacity a little above the
  largest request is tried, so at one of them request 32's prefill finds
  the pool full.
  """
  fresh = itertools.count(100)

  def ids(low, high):
    return [next(fresh) for _ in range(int(rng.integers(low, high)))]

  a, b, c = ids(1, 4), ids(1, 4), ids(1, 4)
  fillers = [ids(1, 4) for _ in range(int(rng.integers(1, 4)))]
  paths = [a + b, a + c]
  paths += [fillers[int(rng.integers(len(fillers)))] for _ in range(29)]
  paths += [ids(1, 5), a + b[:1], a + c + ids(1, 2), a + b + ids(1, 2)]
  exact = {0, 1, 31, 32}  # prompts of whole pages
  prompt_lens, output_lens = [], []
  for r, path in enumerate(paths):
    tail = 0 if r in exact else int(rng.integers(0, block_size))
    prompt_lens.append(len(path) * block_size - tail)
    if r in (1, 32, 33, 34):
      output_lens.append(int(rng.integers(0, 2 * block_size + 2)))
    else:  # no decode page: the tree only grows by prompt pages
      output_lens.append(int(rng.integers(0, 2)))
  return Trace(
    np.zeros(len(paths)),
    prompt_lens,
    output_lens,
    hash_ids=[np.asarray(path) for path in paths],
    hash_block_size=block_size,
    name="touch-prone",
  )


def test_waiting_refresh_changes_lru_order_on_random_traces(rng):
  """A random trace where the oracle's two settings differ (most draws
  are; the first such of 20 is taken), and the replay equals the oracle
  with each setting at every capacity tried."""
  for _ in range(20):
    block_size = int(rng.choice([1, 2, 3, 4]))
    trace = _touch_prone_trace(rng, block_size)
    need = _min_capacity(trace, block_size)
    capacities = list(range(need, need + 40))
    runs = {
      interval: [_oracle(trace, block_size, c, interval) for c in capacities]
      for interval in (32, None)
    }
    if runs[32] != runs[None]:
      break
  else:
    pytest.fail("no drawn trace tells the two settings apart")
  for name, kwargs, interval in [
    ("default", {}, 32),
    ("None", dict(waiting_refresh_interval=None), None),
  ]:
    hits, free = sglang_replay.hits_and_free(
      trace, block_size, capacities, **kwargs
    )
    for i, capacity in enumerate(capacities):
      assert hits[i].tolist() == runs[interval][i][0], (name, capacity)
      assert free[i].tolist() == runs[interval][i][1], (name, capacity)


@pytest.mark.parametrize("value", [0, -3, 2**31, 2.5, True, "32"], ids=repr)
def test_bad_waiting_refresh_interval(value):
  trace = _tokens_trace([[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10, 11]])
  match = re.escape(f"waiting_refresh_interval={value!r} must be None")
  with pytest.raises(ValueError, match=match):
    replay_sglang(
      trace, block_size=2, capacities=[8], waiting_refresh_interval=value
    )
  with pytest.raises(ValueError, match=match):
    sglang_replay.hits_and_free(trace, 2, [8], waiting_refresh_interval=value)
  with pytest.raises(ValueError, match=match):
    sglang_replay.ENGINE.prepare(
      trace, [8], block_size=2, waiting_refresh_interval=value
    )


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
