"""Synthetic workloads: reproducibility, structure, parameter validation."""

from __future__ import annotations

import numpy as np
import pytest

from prefixjax.workloads import (
  Trace,
  default_workload,
  generate_workload,
  register_workload,
  workload_defaults,
  workload_kinds,
)
from prefixjax.workloads import synthetic as synthetic_module

KINDS = sorted(workload_kinds())


def _seed(rng):
  return int(rng.integers(2**31))


def _by_session(trace):
  """Request indices per session, in arrival order."""
  sessions = {}
  for i, session in enumerate(trace.session_ids.tolist()):
    sessions.setdefault(session, []).append(i)
  return sessions


def _starts_with(longer, shorter):
  return longer.shape[0] >= shorter.shape[0] and np.array_equal(
    longer[: shorter.shape[0]], shorter
  )


def test_every_documented_kind_is_registered():
  assert set(KINDS) >= {
    "system_prompt",
    "multi_turn",
    "few_shot",
    "parallel_sampling",
    "beam_search",
    "tree_of_thought",
    "agent",
    "default",
  }
  assert all(workload_kinds().values())  # every kind has a description


@pytest.mark.parametrize("kind", KINDS)
def test_kind_is_reproducible_and_well_formed(kind, rng):
  seed = _seed(rng)
  num_requests = int(rng.integers(1, 120))
  trace = generate_workload(kind, num_requests=num_requests, seed=seed)
  again = generate_workload(kind, num_requests=num_requests, seed=seed)
  assert len(trace) == num_requests
  assert trace.name == kind
  assert f"seed={seed}" in trace.source
  assert trace.has_token_ids and trace.output_token_ids is not None
  assert trace.session_ids is not None
  assert np.all(np.diff(trace.arrival_times_s) >= 0)
  assert np.all(trace.arrival_times_s >= 0)
  assert np.all(trace.output_lengths >= 1)
  np.testing.assert_array_equal(trace.arrival_times_s, again.arrival_times_s)
  np.testing.assert_array_equal(trace.session_ids, again.session_ids)
  for a, b in zip(trace.input_token_ids, again.input_token_ids, strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(trace.output_token_ids, again.output_token_ids, strict=True):
    np.testing.assert_array_equal(a, b)
  vocab = workload_defaults(kind)["vocab_size"]
  for ids in trace.input_token_ids + trace.output_token_ids:
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab)


@pytest.mark.parametrize("kind", KINDS)
def test_different_seeds_differ(kind, rng):
  seed = _seed(rng)
  a = generate_workload(kind, num_requests=20, seed=seed)
  b = generate_workload(kind, num_requests=20, seed=seed + 1)
  assert not all(
    np.array_equal(x, y)
    for x, y in zip(a.input_token_ids, b.input_token_ids, strict=True)
  )


@pytest.mark.parametrize("kind", ["multi_turn", "agent"])
def test_each_turn_resends_history_plus_answer(kind, rng):
  trace = generate_workload(kind, num_requests=200, seed=_seed(rng))
  grew = 0
  for indices in _by_session(trace).values():
    for before, after in zip(indices, indices[1:], strict=False):
      history = np.concatenate(
        [trace.input_token_ids[before], trace.output_token_ids[before]]
      )
      assert _starts_with(trace.input_token_ids[after], history)
      assert trace.input_lengths[after] >= history.shape[0]
      assert trace.arrival_times_s[after] >= trace.arrival_times_s[before]
      grew += 1
  assert grew > 0


def test_multi_turn_sessions_share_the_system_prompt(rng):
  trace = generate_workload(
    "multi_turn", num_requests=100, seed=_seed(rng), system_prompt_len=64
  )
  first = trace.input_token_ids[0][:64]
  assert all(_starts_with(ids, first) for ids in trace.input_token_ids)
  assert (
    trace.input_lengths.max()
    <= workload_defaults("multi_turn")["max_input_len"]
  )


def test_multi_turn_respects_max_input_len(rng):
  trace = generate_workload(
    "multi_turn",
    num_requests=200,
    seed=_seed(rng),
    max_input_len=600,
    num_turns=(20, 20),
  )
  assert trace.input_lengths.max() <= 600


def test_system_prompts_follow_zipf_popularity(rng):
  trace = generate_workload(
    "system_prompt",
    num_requests=2000,
    seed=_seed(rng),
    num_prompts=4,
    zipf_a=2.0,
    prompt_len=32,
  )
  heads = [ids[:32].tobytes() for ids in trace.input_token_ids]
  counts = sorted((heads.count(head) for head in set(heads)), reverse=True)
  assert len(counts) <= 4
  # P(rank 1) = 1 / (1 + 1/4 + 1/9 + 1/16) = 0.70.
  assert 0.6 < counts[0] / len(heads) < 0.8


def test_uniform_popularity_with_zipf_zero(rng):
  trace = generate_workload(
    "system_prompt",
    num_requests=2000,
    seed=_seed(rng),
    num_prompts=2,
    zipf_a=0.0,
    prompt_len=16,
  )
  heads = [ids[:16].tobytes() for ids in trace.input_token_ids]
  assert 0.4 < heads.count(heads[0]) / len(heads) < 0.6


def test_parallel_sampling_groups_share_prompt_and_arrival(rng):
  trace = generate_workload(
    "parallel_sampling", num_requests=41, seed=_seed(rng), n=4
  )
  groups = _by_session(trace)
  assert sorted(len(g) for g in groups.values())[1:] == [4] * 10
  for indices in groups.values():
    first = indices[0]
    for i in indices[1:]:
      np.testing.assert_array_equal(
        trace.input_token_ids[i], trace.input_token_ids[first]
      )
      assert trace.arrival_times_s[i] == trace.arrival_times_s[first]


def _resends_an_earlier_state(trace, indices):
  """Every request after the first round re-sends an earlier request's
  prompt plus that request's answer (the trajectory it extends)."""
  states = {}
  for i in indices:
    states.setdefault(
      np.concatenate(
        [trace.input_token_ids[i], trace.output_token_ids[i]]
      ).tobytes(),
      i,
    )
  roots = trace.input_token_ids[indices[0]].tobytes()
  for i in indices:
    prompt = trace.input_token_ids[i].tobytes()
    assert prompt == roots or prompt in states, i


def test_beam_search_beams_share_prompt_and_extend_parents(rng):
  trace = generate_workload(
    "beam_search", num_requests=120, seed=_seed(rng), beam_width=3
  )
  for indices in _by_session(trace).values():
    root = trace.input_token_ids[indices[0]]
    for i in indices:
      assert _starts_with(trace.input_token_ids[i], root)
    _resends_an_earlier_state(trace, indices)


def test_tree_of_thought_branches_resend_shared_states(rng):
  trace = generate_workload(
    "tree_of_thought",
    num_requests=150,
    seed=_seed(rng),
    branching=3,
    depth=3,
    keep=2,
  )
  trees = _by_session(trace)
  for indices in trees.values():
    _resends_an_earlier_state(trace, indices)
    prompts = [trace.input_token_ids[i].tobytes() for i in indices]
    # Each state is proposed from `branching` times.
    assert all(prompts.count(p) in (1, 2, 3) for p in prompts)
  complete = [ix for ix in trees.values() if len(ix) == 3 + 6 + 6]
  assert complete  # 3 proposals at the root, then 2 kept states x 3, twice
  for indices in complete:
    prompts = [trace.input_token_ids[i].tobytes() for i in indices]
    assert all(prompts.count(p) == 3 for p in prompts)


def test_few_shot_fixed_shots_share_instruction_and_examples(rng):
  trace = generate_workload(
    "few_shot",
    num_requests=300,
    seed=_seed(rng),
    num_tasks=2,
    instruction_len=10,
    example_len=10,
    num_shots=(2, 2),
  )
  for indices in _by_session(trace).values():
    first = trace.input_token_ids[indices[0]][:30]
    for i in indices:
      assert _starts_with(trace.input_token_ids[i], first)
  shuffled = generate_workload(
    "few_shot",
    num_requests=300,
    seed=_seed(rng),
    num_tasks=1,
    instruction_len=10,
    example_len=10,
    num_shots=(3, 3),
    pool_size=8,
    shuffle_shots=True,
  )
  starts = {ids[:30].tobytes() for ids in shuffled.input_token_ids}
  assert len(starts) > 1


def test_default_workload_is_a_moderate_mix():
  trace = default_workload()
  assert len(trace) == 2000 and trace.name == "default"
  assert trace.has_token_ids and trace.output_token_ids is not None
  summary = trace.summary()
  assert 300 < summary["input_mean"] < 2000
  assert summary["input_max"] <= 4096
  again = default_workload()
  np.testing.assert_array_equal(trace.input_lengths, again.input_lengths)
  chat = [s for s, ix in _by_session(trace).items() if len(ix) > 1]
  assert chat  # the multi-turn half has sessions with several turns
  small = default_workload(num_requests=10, seed=3)
  assert len(small) == 10


@pytest.mark.parametrize(
  "kind, params, error, match",
  [
    ("nope", {}, ValueError, "unknown workload kind 'nope'; expected one of"),
    ("multi_turn", {"turns": 3}, ValueError, "unknown parameter.*turns"),
    ("multi_turn", {"num_turns": (5, 2)}, ValueError, "num_turns=.*low <="),
    ("multi_turn", {"num_turns": "3"}, TypeError, "num_turns='3' must be"),
    ("multi_turn", {"rate": 0.0}, ValueError, "rate=0.0 must be finite and >"),
    ("system_prompt", {"zipf_a": -1}, ValueError, "zipf_a=-1.0 must be"),
    ("system_prompt", {"num_prompts": True}, TypeError, "num_prompts=True"),
    ("parallel_sampling", {"n": 0}, ValueError, "n=0 must be >= 1"),
    ("few_shot", {"num_shots": (1, 40)}, ValueError, "exceeds pool_size=16"),
    ("few_shot", {"shuffle_shots": 1}, TypeError, "must be a bool"),
    ("default", {"system_prompt_fraction": 2.0}, ValueError, "in \\[0, 1\\]"),
    ("agent", {"vocab_size": 1}, ValueError, "vocab_size=1 must be >= 2"),
    # Token ids are int32: 2**40 failed inside numpy's integers().
    ("agent", {"vocab_size": 2**40}, ValueError, "must be <= 2147483648"),
    # 1/rate overflowed: the error named the trace's arrival times.
    ("multi_turn", {"rate": 1e-310}, ValueError, "rate=1e-310 is too small"),
    (
      "multi_turn",
      {"think_time_s": 1e308},
      ValueError,
      "arrival times overflow float64",
    ),
  ],
)
def test_bad_parameters_are_refused(kind, params, error, match):
  with pytest.raises(error, match=match):
    generate_workload(kind, num_requests=5, seed=0, **params)


@pytest.mark.parametrize("kind", ["multi_turn", "agent"])
def test_max_input_len_bound_does_not_depend_on_the_seed(kind, rng):
  """The bound was the longest first prompt the seed happened to draw, so
  one seed accepted what another refused; it is now the ranges' longest
  (shared upper bound + first upper bound), for every seed."""
  shared = "system_prompt_len" if kind == "multi_turn" else "instructions_len"
  first = "question_len" if kind == "multi_turn" else "task_len"
  low_shared, high_shared = sorted(rng.integers(1, 60, 2).tolist())
  high_first = int(rng.integers(1, 30))
  params = {shared: (low_shared, high_shared), first: (1, high_first)}
  longest = high_shared + high_first
  for seed in rng.integers(0, 2**31, 5).tolist():
    with pytest.raises(ValueError, match=f"max_input_len={longest - 1}"):
      generate_workload(
        kind, num_requests=3, seed=seed, max_input_len=longest - 1, **params
      )
    trace = generate_workload(
      kind, num_requests=3, seed=seed, max_input_len=longest, **params
    )
    assert trace.input_lengths.max() <= longest


def test_work_follows_the_requests_not_the_group_size(rng):
  """n = 10**12 samples (or beams) of which 5 are kept used to loop for
  every sample; the kept requests are those of a small group size."""
  seed = int(rng.integers(2**31))
  for kind, param in (
    ("parallel_sampling", "n"),
    ("beam_search", "beam_width"),
  ):
    huge = generate_workload(kind, num_requests=5, seed=seed, **{param: 10**12})
    small = generate_workload(kind, num_requests=5, seed=seed, **{param: 5})
    assert huge.input_lengths.tolist() == small.input_lengths.tolist()
    assert len(set(huge.session_ids.tolist())) == 1


def test_bad_sizes_and_seeds_are_refused():
  with pytest.raises(ValueError, match="num_requests=0 must be >= 1"):
    generate_workload("agent", num_requests=0, seed=0)
  with pytest.raises(ValueError, match="seed=-1 must be >= 0"):
    generate_workload("agent", num_requests=1, seed=-1)
  with pytest.raises(TypeError, match="seed=1.5 must be an int"):
    generate_workload("agent", num_requests=1, seed=1.5)


def test_register_a_user_defined_kind():
  @register_workload("test_only_echo")
  def echo(rng, num_requests, *, length=3):
    """Every request sends the same prompt."""
    prompt = rng.integers(0, 10, length, dtype=np.int32)
    answer = np.zeros(1, np.int32)
    return Trace(
      np.zeros(num_requests),
      [length] * num_requests,
      [1] * num_requests,
      input_token_ids=[prompt] * num_requests,
      output_token_ids=[answer] * num_requests,
    )

  try:
    assert workload_kinds()["test_only_echo"] == (
      "Every request sends the same prompt."
    )
    assert workload_defaults("test_only_echo") == {"length": 3}
    trace = generate_workload("test_only_echo", num_requests=4, seed=1)
    assert trace.name == "test_only_echo"
    assert trace.input_lengths.tolist() == [3] * 4
    with pytest.raises(ValueError, match="already registered"):
      register_workload("test_only_echo")(echo)
  finally:
    synthetic_module.unregister_workload("test_only_echo")
