"""vLLM-semantics replay under every eviction policy the prefix cache runs.

``replay(semantics="vllm", policy=...)`` runs ``lru`` on the specialised
engine and every other policy through the general prefix-cache verbs
(:data:`prefixjax.replay.vllm.GENERAL_ENGINE`). The oracle is a small
sequential Python replay over
:class:`reference_models.policy_models.PolicyPrefixCache` (vLLM v1's
automatic prefix caching with the block for reuse chosen by a policy, the
model ``tests/test_policies.py`` holds the device cache to), driven
request by request as the vLLM oracle drives ``VllmPrefixCache``
(``_run``: prefill, then one decode slot at a time, then free), with the
``belady`` next-use steps computed from the model's own block keys by
:func:`prefixjax.cache.policies.next_use_from_keys`. Traces are drawn
fresh per case, at capacities from the largest request up (every request
evicts).
"""

from __future__ import annotations

import functools
import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from reference_models import policy_models, vllm_apc

from prefixjax import replay as rp
from prefixjax.cache import policies
from prefixjax.replay import vllm as vllm_replay
from prefixjax.workloads import Trace


@functools.cache
def largest_id() -> policies.EvictionPolicy:
  """A user-defined policy (the model's ``largest_id``): evict the free
  cached block with the largest id."""
  return policies.EvictionPolicy(
    init=lambda num_blocks: jnp.arange(num_blocks, dtype=jnp.int32),
    score=lambda block_ids, now: -block_ids,
  )


policies.register_policy("test_replay_largest_id", largest_id, overwrite=True)


# ---------------------------------------------------------------------------
# Traces.


def _token_trace(rng, num_requests: int, block_size: int) -> Trace:
  """Token ids with heavy sharing: three shared prefixes, conversations
  that re-send an earlier request's prompt and outputs (so output-filled
  blocks are hit), exact repeats, prompts of whole blocks (their last block
  is recomputed into a duplicate) and outputs of 0 to 2 blocks, known for
  most requests."""
  vocab = 4
  prefixes = [
    rng.integers(0, vocab, size=int(rng.integers(1, 5 * block_size))).tolist()
    for _ in range(3)
  ]
  prompts, outputs = [], []
  for _ in range(num_requests):
    roll = rng.random()
    if prompts and roll < 0.15:
      i = int(rng.integers(max(0, len(prompts) - 5), len(prompts)))
      prompt = list(prompts[i])
    elif prompts and roll < 0.45:
      i = int(rng.integers(max(0, len(prompts) - 5), len(prompts)))
      prompt = prompts[i] + outputs[i] + rng.integers(0, vocab, 3).tolist()
    else:
      base = prefixes[int(rng.integers(3))]
      prompt = base[: int(rng.integers(0, len(base) + 1))]
      tail = rng.integers(0, vocab, int(rng.integers(1, 2 * block_size)))
      prompt = [int(t) for t in prompt] + tail.tolist()
    prompt = prompt[: 8 * block_size]
    if rng.random() < 0.25 and len(prompt) >= block_size:
      prompt = prompt[: len(prompt) // block_size * block_size]
    prompts.append(prompt)
    outputs.append(
      rng.integers(0, vocab, int(rng.integers(0, 2 * block_size + 1))).tolist()
    )
  known = [np.asarray(o, np.int32) for o in outputs]
  if rng.random() < 0.5:  # unknown outputs: their blocks never hit
    known = None
  return Trace(
    arrival_times_s=np.arange(num_requests, dtype=np.float64),
    input_lengths=np.asarray([len(p) for p in prompts]),
    output_lengths=np.asarray([len(o) for o in outputs]),
    input_token_ids=[np.asarray(p, np.int32) for p in prompts],
    output_token_ids=known,
    name="tokens",
  )


def _hashed_trace(rng, num_requests: int, block_size: int) -> Trace:
  """Chained hash ids: each request extends a prefix of an earlier one (or
  starts afresh) with a short tail from a small pool; partial or whole last
  prompt blocks; outputs of 0 to 3 blocks."""
  chain: dict[tuple, int] = {}
  paths: list[list[int]] = []
  rows, prompt_lens, output_lens = [], [], []
  for _ in range(num_requests):
    labels = []
    if paths and rng.random() < 0.85:
      old = paths[int(rng.integers(len(paths)))]
      labels = old[: int(rng.integers(0, len(old) + 1))]
    labels = labels + rng.integers(0, 3, size=rng.integers(0, 4)).tolist()
    labels = (labels or [int(rng.integers(0, 3))])[:8]
    paths.append(labels)
    row, parent = [], -1
    for label in labels:
      parent = chain.setdefault((parent, label), len(chain) + 3)
      row.append(parent)
    rows.append(np.asarray(row, np.int64))
    n = len(row)
    prompt_lens.append(
      int(rng.integers((n - 1) * block_size + 1, n * block_size + 1))
    )
    output_lens.append(int(rng.integers(0, 3 * block_size + 1)))
  return Trace(
    np.arange(num_requests, dtype=np.float64),
    prompt_lens,
    output_lens,
    hash_ids=rows,
    hash_block_size=block_size,
    name="hashed",
  )


def _need(trace: Trace, block_size: int) -> int:
  return -(-int(trace.kv_tokens.max()) // block_size)


# ---------------------------------------------------------------------------
# The oracle: a sequential replay over the plain-Python policy model.


def model_hits(trace, block_size, capacity, policy, decay=None):
  """Per request hit tokens of the model (and its victim count), each
  request served alone: lookup, prefill, decode one slot at a time, free."""
  cache = policy_models.PolicyPrefixCache(
    capacity + 1, block_size, policy, decay=decay
  )
  requests = []  # (prompt length, add, outputs, keys with KV)
  for r in range(len(trace)):
    prompt_len = int(trace.input_lengths[r])
    out_len = max(int(trace.output_lengths[r]), 1)
    if trace.has_token_ids:
      prompt = trace.input_token_ids[r].tolist()
      if trace.output_token_ids is not None:
        outputs = trace.output_token_ids[r][:out_len].tolist()
      else:  # never hit: ids no prompt uses (the replay's rule)
        outputs = [-1 - r] * out_len
      keys = vllm_apc.block_keys_for_tokens(prompt + outputs[:-1], block_size)
      add = functools.partial(cache.add_request, r, prompt)
      outputs = [[t] for t in outputs]
    else:
      full = prompt_len // block_size
      ids = trace.hash_ids[r].tolist()[:full]
      kv = int(trace.kv_tokens[r])
      fresh = [object() for _ in range(kv // block_size - full)]
      keys = [vllm_apc.id_key(h) for h in ids] + fresh
      add = functools.partial(cache.add_request_hashed, r, prompt_len, ids)
      outputs = [1] * int(trace.output_lengths[r])
    requests.append((prompt_len, add, outputs, keys))
  usable = [(p - 1) // block_size for p, *_ in requests]
  next_use = policies.next_use_from_keys([k for *_, k in requests], usable)
  hits = []
  for r, (prompt_len, add, outputs, _) in enumerate(requests):
    add()
    cache.set_next_use(r, next_use[r])
    hits.append(cache._run(r, prompt_len, outputs))
  cache.check_invariants()
  return hits, len(cache.victims)


# ---------------------------------------------------------------------------
# Non-lru policies against the model.

CASES = [
  ("lfu", "tokens"),
  ("fifo", "hashed"),
  ("lru_leaf", "tokens"),
  ("belady", "hashed"),
  ("belady_leaf", "tokens"),
  ("test_replay_largest_id", "hashed"),
]
MODEL_POLICY = {"test_replay_largest_id": "largest_id"}


@pytest.mark.parametrize(("policy", "kind"), CASES, ids=lambda x: str(x))
def test_general_replay_matches_policy_model(policy, kind, rng):
  """Per request, ``replay(semantics="vllm", policy=...)`` (bucketed
  shapes, one program for every capacity) equals the model at a capacity
  holding just the largest request, a few blocks more and twice that, in
  either publish mode; ``lfu`` at a random decay."""
  if kind == "tokens":  # K >= 4: the model's nested-tuple keys stay short
    block_size = int(rng.choice([4, 8]))
    trace = _token_trace(rng, int(rng.integers(40, 70)), block_size)
  else:
    block_size = int(rng.choice([1, 2, 4]))
    trace = _hashed_trace(rng, int(rng.integers(60, 100)), block_size)
  need = _need(trace, block_size)
  capacities = [need, need + int(rng.integers(1, 5)), 2 * need]
  decay = float(rng.choice([0.5, 0.8, 1.0])) if policy == "lfu" else None
  params = None if decay is None else {"decay": decay}
  result = rp.replay(
    trace,
    semantics="vllm",
    policy=policy,
    policy_params=params,
    capacities=capacities,
    block_size=block_size,
    warmup_fraction=0.0,
    publish=str(rng.choice(["early", "late"])),
  )
  assert result.engines == ("vllm.general",) * len(capacities)
  evictions = 0
  for capacity, point in zip(capacities, result, strict=True):
    want, victims = model_hits(
      trace, block_size, capacity, MODEL_POLICY.get(policy, policy), decay
    )
    assert point.per_request_hit_tokens.tolist() == want, capacity
    assert point.policy == policy
    evictions += victims
  assert evictions > 0, "no eviction pressure"
  assert sum(result[-1].per_request_hit_tokens) > 0, "no hit at all"


def test_lfu_decays_give_different_hits_on_one_program():
  """K = 4, 4 blocks. Request ``a`` is hit five times, then ``b``, ``c``
  (twice each) and ``d`` need room: without decay ``a``'s count (6) keeps
  it and ``b`` goes; at decay 0.5 per step its count has faded below the
  recent blocks', so ``a`` goes and the last request (``a`` again) misses.
  Both decays run on one compiled program (the decay is state), and the
  model agrees with each."""
  prompts = [[1]] * 6 + [[2], [2], [3], [3], [4], [1]]
  # Each prompt: one full block (its id) and a partial one (a fresh id).
  ids = [np.asarray(p + [100 + i], np.int64) for i, p in enumerate(prompts)]
  n = len(ids)
  trace = Trace(
    np.arange(n, dtype=np.float64),
    [5] * n,
    [1] * n,
    hash_ids=ids,
    hash_block_size=4,
    name="decays",
  )
  hits, frames = {}, []
  for decay in (1.0, 0.5):
    result = rp.replay(
      trace,
      semantics="vllm",
      policy="lfu",
      policy_params={"decay": decay},
      capacities=[4],
      warmup_fraction=0.0,
    )
    hits[decay] = result[0].per_request_hit_tokens.tolist()
    assert hits[decay] == model_hits(trace, 4, 4, "lfu", decay)[0]
    frames.append(result.frame())
    if decay == 0.5:
      assert result.timing.compile_s == 0.0  # decay 1.0's program
  assert hits[1.0][-1] == 4 and hits[0.5][-1] == 0
  assert hits[1.0][:-1] == hits[0.5][:-1]
  assert [f["policy_params"].item() for f in frames] == [
    '{"decay": 1.0}',
    '{"decay": 0.5}',
  ]
  assert [f["policy"].item() for f in frames] == ["lfu", "lfu"]
  # The same policy as an object: equal hits on the same program, labelled
  # as an unnamed one.
  result = rp.replay(
    trace,
    semantics="vllm",
    policy=policies.lfu(decay=0.5),
    capacities=[4],
    warmup_fraction=0.0,
  )
  assert result[0].per_request_hit_tokens.tolist() == hits[0.5]
  assert result.timing.compile_s == 0.0
  assert result[0].policy == "custom"
  assert dict(result.parameters)["policy_params"] is None
  default = rp.replay(
    trace,
    semantics="vllm",
    policy=policies.lfu(),
    capacities=[4],
    warmup_fraction=0.0,
  )
  assert default[0].policy == "lfu"
  assert dict(default.parameters)["policy_params"] == "{}"
  assert default[0].per_request_hit_tokens.tolist() == hits[1.0]


# ---------------------------------------------------------------------------
# Next-use steps.


def test_next_use_steps_equal_next_use_from_keys(rng):
  """The vectorised next-use steps equal the host helper's, on random
  keys (``-1``: no key) and random usable prefixes."""
  for _ in range(20):
    rows, cols = int(rng.integers(1, 30)), int(rng.integers(1, 8))
    keys = rng.integers(-1, int(rng.integers(1, 12)), size=(rows, cols))
    usable = rng.integers(0, cols + 1, size=rows)
    got = vllm_replay.next_use_steps(keys, usable)
    fresh = itertools.count()
    hashable = [
      [int(k) if k >= 0 else ("none", next(fresh)) for k in row] for row in keys
    ]
    want = policies.next_use_from_keys(hashable, usable.tolist())
    assert got.tolist() == want


# ---------------------------------------------------------------------------
# Argument rules (all refused before any compile).


def test_a_broken_registered_factory_does_not_stop_naming_a_policy(monkeypatch):
  """Naming an EvictionPolicy calls every registered factory; one that
  raises (here NameError, as a doctest's factory did once its globals were
  cleared, failing later tests in the same process) is skipped."""
  from prefixjax.replay.frame import resolve_policy

  def broken():
    raise NameError("name 'gone' is not defined")

  names = policies.policy_names()
  monkeypatch.setitem(policies._REGISTRY, "broken", broken)
  pick = names[np.random.default_rng().integers(len(names))]
  built = policies.get_policy(pick)
  assert resolve_policy(built, None) == (pick, {}, built)
  custom = policies.EvictionPolicy(
    init=lambda n: jnp.zeros(n, jnp.int32), score=lambda s, now: s
  )
  assert resolve_policy(custom, None) == ("custom", None, custom)


def test_policy_argument_rules():
  trace = _hashed_trace(np.random.default_rng(0), 10, 2)
  plan = rp.plan_trace(trace, block_size=2)
  need = _need(trace, 2)

  def vllm(**kw):
    return rp.replay(trace, semantics="vllm", capacities=[need], **kw)

  with pytest.raises(ValueError, match=r"vllm_version='0.22'.*0\.23"):
    vllm(policy="fifo", vllm_version="0.22")
  with pytest.raises(ValueError, match="policy='nope' is not a registered"):
    vllm(policy="nope")
  with pytest.raises(TypeError, match="policy 'lru' does not take them"):
    vllm(policy_params={"decay": 0.5})
  with pytest.raises(ValueError, match=r"decay=1.5 must be in \(0, 1\]"):
    vllm(policy="lfu", policy_params={"decay": 1.5})
  for value in ("0.5", True):  # not "does not take them": it does
    with pytest.raises(ValueError, match=r"must be a number in \(0, 1\]"):
      vllm(policy="lfu", policy_params={"decay": value})
  with pytest.raises(TypeError, match="is an EvictionPolicy already"):
    vllm(policy=policies.lfu(), policy_params={"decay": 0.5})
  with pytest.raises(TypeError, match="must be a mapping"):
    vllm(policy="lfu", policy_params=0.5)
  with pytest.raises(TypeError, match="registered name or an EvictionPolicy"):
    vllm(policy=3)
  rp.replay(plan, policy="lru_leaf", capacities=[4], policy_params={})
  with pytest.raises(ValueError, match="this EvictionPolicy is not one of"):
    rp.replay(plan, policy=policies.lfu(decay=0.5), capacities=[4])
  with pytest.raises(ValueError, match=r"policy='lfu' is not one of"):
    rp.replay(plan, policy="lfu", capacities=[4])
  with pytest.raises(ValueError, match=r"this EvictionPolicy \(lfu\)"):
    rp.replay(trace, semantics="sglang", policy=policies.lfu(), capacities=[9])
  with pytest.raises(ValueError, match=r"this EvictionPolicy \(test_"):
    rp.replay(plan, policy=largest_id(), capacities=[4])
  assert rp.served_policies("sglang") == ("lru_leaf",)
  assert set(rp.served_policies("vllm")) >= {"lru", "lfu", "fifo", "belady"}
  assert "test_replay_largest_id" in rp.served_policies("vllm")
  with pytest.raises(ValueError, match="semantics='x' is not one of"):
    rp.served_policies("x")


def test_parameterless_engines_refuse_parameters():
  """A registered factory with a keyword (``fifo`` again, taking
  ``window``; 0 is plain fifo): the kvcache-sim engines run it only at its
  default, vllm with any value."""

  def fifo_with_window(*, window: int = 0):
    return policies.fifo() if window == 0 else policies.lfu(decay=0.5)

  plan = rp.prepare_replay([[1, 2], [1, 3]], [20, 20], block_size=10)
  policies.register_policy("fifo", fifo_with_window, overwrite=True)
  try:
    same = rp.replay(
      plan, policy="fifo", policy_params={"window": 0}, capacities=[3]
    )
    assert dict(same.parameters)["policy_params"] == json.dumps({"window": 0})
    with pytest.raises(ValueError, match="kvcache-sim replay engines run fifo"):
      rp.replay(
        plan, policy="fifo", policy_params={"window": 2}, capacities=[3]
      )
  finally:
    policies.register_policy("fifo", policies.fifo, overwrite=True)
