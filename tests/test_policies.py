"""Eviction policies: the device cache vs plain-Python models of each policy.

Random prompt-only workloads with heavy sharing (a few shared prefixes,
chat-like extensions, repeats, salts) and eviction pressure (pools of 9 to 14
usable blocks, prompts of up to 8 blocks) run on the device as one
``lax.scan`` (one request at a time: allocate_with_prefix, publish the
prompt's full blocks, release) and on
:class:`reference_models.policy_models.PolicyPrefixCache`. Per request the
hit tokens, the fresh blocks (unhashed ones, then the victims: every victim and
its order) and the eviction count must be equal; at the end, which blocks
are cached. ``lru`` itself is checked by ``test_prefix_cache.py`` (vLLM
oracle, unchanged).
"""

from __future__ import annotations

import doctest
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models import policy_models, sglang_radix, vllm_apc

from prefixjax.cache import hashing, paging, policies
from prefixjax.cache import prefix_cache as pc
from prefixjax.cache.checked import prefix_cache as checked

K = 4
M = 8
T = M * K
N = 11  # 10 usable blocks, prompts of up to M = 8 blocks: heavy pressure
R = 160  # requests per scan; one shape, so each policy compiles once
NEVER = policies.NEVER
NO_BLOCK_ID = paging.NO_BLOCK


@functools.cache
def largest_id() -> policies.EvictionPolicy:
  """The user-defined example: evict the free cached block with the largest
  id (its metadata is just the block ids)."""
  return policies.EvictionPolicy(
    init=lambda num_blocks: jnp.arange(num_blocks, dtype=jnp.int32),
    score=lambda block_ids, now: -block_ids,
  )


policies.register_policy("test_largest_id", largest_id, overwrite=True)


def _policy(name):
  if name == "largest_id":
    return policies.get_policy("test_largest_id")
  return policies.get_policy(name)


# ---------------------------------------------------------------------------
# Workloads.


def make_workload(rng, num_requests, max_blocks, vocab=5):
  """Prompts (token lists, salt) from 3 shared prefixes, extensions of
  recent prompts, exact repeats and random suffixes."""
  max_tokens = max_blocks * K
  prefixes = [
    rng.integers(0, vocab, size=int(rng.integers(K, 6 * K))) for _ in range(3)
  ]
  reqs: list[tuple[np.ndarray, int]] = []
  for _ in range(num_requests):
    roll = rng.random()
    if reqs and roll < 0.15:
      reqs.append(reqs[int(rng.integers(max(0, len(reqs) - 6), len(reqs)))])
      continue
    if reqs and roll < 0.35:
      prev, salt = reqs[int(rng.integers(max(0, len(reqs) - 6), len(reqs)))]
      prompt = np.concatenate([prev, rng.integers(0, vocab, size=K + 1)])
    else:
      base = prefixes[int(rng.integers(3))] if rng.random() < 0.9 else []
      cut = (
        len(base) if rng.random() < 0.7 else int(rng.integers(len(base) + 1))
      )
      suffix = rng.integers(0, vocab, size=int(rng.integers(1, 3 * K)))
      prompt = np.concatenate([base[:cut], suffix])
      salt = 1 if rng.random() < 0.1 else 0
    prompt = prompt[:max_tokens].astype(np.int32)
    if rng.random() < 0.3 and len(prompt) >= K:
      prompt = prompt[: len(prompt) // K * K]
    reqs.append((prompt, salt))
  return reqs


def _arrays(reqs):
  """Device arrays and per-request next-use steps (request ``i`` is step
  ``i + 1``; a key is used by a request if a lookup may hit it)."""
  n = len(reqs)
  tokens = np.zeros((n, T), np.int32)
  for i, (prompt, _) in enumerate(reqs):
    tokens[i, : len(prompt)] = prompt
  lens = np.asarray([len(p) for p, _ in reqs], np.int32)
  salts = np.asarray([s for _, s in reqs], np.uint32)
  keys = [vllm_apc.block_keys_for_tokens(list(p), K, s) for p, s in reqs]
  next_use = policies.next_use_from_keys(keys, (lens - 1) // K)
  nu = np.full((n, M), NEVER, np.int32)
  for i, row in enumerate(next_use):
    nu[i, : len(row)] = row
  return tokens, lens, salts, nu, next_use


def _steps(state, tokens, lens, salts, next_use):
  def step(state, req):
    toks, p, salt, nu = req
    keys, _ = hashing.block_hashes(toks, p, block_size=K, extra=salt[None])
    seq = jnp.int32(0)
    state, a = pc.allocate_with_prefix(state, seq, keys, p, nu)
    state, pub = pc.publish(state, seq, keys, p, nu)
    state, _ = pc.release(state, seq)
    return state, dict(
      status=a.status,
      hit_tokens=a.hit_tokens,
      new_blocks=a.new_blocks,
      num_evicted=a.num_evicted,
      dropped=pub.num_dropped,
    )

  return jax.lax.scan(step, state, (tokens, lens, salts, next_use))


_run = jax.jit(_steps)


def run_device(state, reqs):
  tokens, lens, salts, nu, _ = _arrays(reqs)
  final, outs = _run(state, tokens, lens, salts, nu)
  return final, jax.tree.map(np.asarray, outs)


def run_model(reqs, num_blocks, policy, decay=None, next_use=True):
  """Runs ``reqs`` on the model; ``next_use=False`` gives none (NEVER)."""
  model = policy_models.PolicyPrefixCache(num_blocks, K, policy, decay=decay)
  next_use = _arrays(reqs)[-1] if next_use else [[]] * len(reqs)
  hits, news, evicted = [], [], []
  for i, (prompt, salt) in enumerate(reqs):
    prompt = [int(t) for t in prompt]
    model.add_request(i, prompt, salt)
    model.set_next_use(i, next_use[i])
    before = len(model.victims)
    hit_blocks, hit = model.get_computed_blocks(i)
    new = model.allocate_slots(i, len(prompt) - hit, hit_blocks)
    assert new is not None
    model.free(i)
    hits.append(hit)
    news.append(new)
    evicted.append(len(model.victims) - before)
  model.check_invariants()
  return model, hits, news, evicted


def compare(reqs, num_blocks, policy, decay=None):
  state = pc.init(
    num_blocks, K, max_seqs=1, max_blocks_per_seq=M, policy=_policy(policy)
  )
  if decay is not None:  # a hyperparameter in the state: no recompilation
    state = state.replace(
      policy_state=state.policy_state._replace(decay=jnp.float32(decay))
    )
  final, outs = run_device(state, reqs)
  model, hits, news, evicted = run_model(reqs, num_blocks, policy, decay)
  for i in range(len(reqs)):
    where = f"{policy} request {i}"
    assert outs["status"][i] == 0, where
    assert outs["dropped"][i] == 0, where
    assert outs["hit_tokens"][i] == hits[i], where
    got = outs["new_blocks"][i][: len(news[i])].tolist()
    assert got == news[i], where
    assert outs["num_evicted"][i] == evicted[i], where
  cached = np.asarray(final.paging.published)
  want = [model.block_hash(b) is not None for b in range(num_blocks)]
  assert cached.tolist() == want
  assert pc.check_invariants(final) == []
  assert sum(evicted) > 0, "no eviction pressure"
  return sum(hits)


# ---------------------------------------------------------------------------
# Random workloads vs the models.

CASES = [
  ("fifo", None),
  ("lfu", None),
  ("lfu", 0.5),
  ("lru_leaf", None),
  ("belady", None),
  ("belady_leaf", None),
  ("largest_id", None),
]


@pytest.mark.parametrize(
  "policy, decay", CASES, ids=[f"{p}-decay{d}" for p, d in CASES]
)
def test_random_workloads_match_model(rng, policy, decay):
  reqs = make_workload(rng, R, M)
  assert compare(reqs, N, policy, decay) > 0


def test_belady_beats_online_policies():
  """On fixed workloads (model only), the offline rules hit more than every
  online rule. Not a theorem for a prefix cache (see ``policies.belady``);
  a check of the next-use plumbing and the deepest-first tie-break."""
  totals: dict[str, int] = {}
  for seed in range(3):
    reqs = make_workload(np.random.default_rng(seed), 200, 8)
    for policy in ("fifo", "lfu", "lru_leaf", "belady", "belady_leaf"):
      hits = sum(run_model(reqs, 12, policy)[1])
      totals[policy] = totals.get(policy, 0) + hits
  online = max(totals[p] for p in ("fifo", "lfu", "lru_leaf"))
  assert totals["belady"] > online, totals
  assert totals["belady_leaf"] > online, totals


# ---------------------------------------------------------------------------
# lru_leaf vs the SGLang radix model.


def test_lru_leaf_matches_sglang_page_radix(rng):
  """``lru_leaf`` equals ``SglangRadixCache(granularity="page",
  conservative_evict=False)`` when no duplicate blocks arise.

  Differences found (so the workload avoids them): the device keeps vLLM's
  duplicate blocks (a fully cached prompt of whole blocks recomputes its
  last block into a second block with the same key, which takes a block of
  capacity until evicted) while SGLang's tree frees the duplicate page at
  once; and SGLang's default ``conservative_evict`` evicts a page more than
  the allocation needs. Prompts here never end on a block boundary, so the
  capped hit never drops a cached block and no duplicate is made.
  """
  reqs = make_workload(rng, R, M)
  reqs = [(p if len(p) % K else p[:-1], s) for p, s in reqs]
  state = pc.init(N, K, max_seqs=1, max_blocks_per_seq=M, policy="lru_leaf")
  _, outs = run_device(state, reqs)
  radix = sglang_radix.SglangRadixCache(
    N - 1, K, granularity="page", conservative_evict=False
  )
  want = [radix.run_request(list(p), [0], extra=s) for p, s in reqs]
  assert outs["hit_tokens"].tolist() == want
  assert radix.stats["evicted_pages"] > 0
  assert run_model(reqs, N, "lru_leaf")[1] == want


# ---------------------------------------------------------------------------
# Tie-breaking, the user-defined policy, decode, vmap, errors.


def _prompt(seed, n):
  return np.random.default_rng(seed).integers(100, 200, size=n)


# A: 4 blocks (1-4, step 1), B: 4 blocks (5-8, step 2), both cached and
# free; C (step 3) needs 4 blocks: the free unhashed blocks 9, 10, then the
# policy's 2 victims (vLLM's queue head first, as 4 one-block takes). The
# rest of the scan is 1-token filler requests.
SCENARIO = [(_prompt(seed, 4 * K), 0) for seed in (1, 2, 3)]
FILLER = [(np.asarray([7], np.int32), 0)] * (R - len(SCENARIO))


@pytest.mark.parametrize(
  "policy, expected",
  [
    ("lru", [9, 10, 4, 3]),  # the free queue: unhashed, then A tail first
    ("fifo", [9, 10, 4, 3]),  # A's blocks (step 1), deepest first
    ("lfu", [9, 10, 4, 8]),  # all counts 1: deepest (4, 8), lowest id first
    ("belady", [9, 10, 4, 8]),  # no next-use given: all NEVER, as lfu
    ("lru_leaf", [9, 10, 4, 3]),  # leaves 4 (step 1), 8: 4, then 3 is a leaf
    ("belady_leaf", [9, 10, 4, 8]),  # leaves 4, 8 tie: 4; 8 deeper than 3
    ("test_largest_id", [9, 10, 8, 7]),  # the user-defined policy
  ],
)
def test_tie_breaking(policy, expected):
  state = pc.init(N, K, max_seqs=1, max_blocks_per_seq=M, policy=policy)
  final, outs = run_device(state, SCENARIO + FILLER)
  assert outs["new_blocks"][2][:4].tolist() == expected
  assert outs["num_evicted"][2] == 2
  assert pc.check_invariants(final) == []
  if policy != "lru":
    name = policy.removeprefix("test_")
    _, _, news, _ = run_model(SCENARIO, N, name, next_use=False)
    assert news[2] == expected


def test_belady_uses_next_use():
  """With next-use times, belady keeps the blocks needed soonest: A's are
  needed at step 10, B's never, so B's go first (deepest first)."""
  next_use = np.full((R, M), NEVER, np.int32)
  next_use[0, :4] = 10
  state = pc.init(N, K, max_seqs=1, max_blocks_per_seq=M, policy="belady")
  tokens, lens, salts, _, _ = _arrays(SCENARIO + FILLER)
  _, outs = _run(state, tokens, lens, salts, next_use)
  assert np.asarray(outs["new_blocks"][2][:4]).tolist() == [9, 10, 8, 7]


def test_user_defined_policy_by_name():
  assert "test_largest_id" in policies.policy_names()
  policy = policies.get_policy("test_largest_id")
  assert policy is largest_id()
  state = pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, policy=policy)
  assert state.policy is policy
  assert state.free_order == "prepend_unhashed"


_DECODE_CASES = ["lfu", "lru_leaf"]


@functools.partial(jax.jit, static_argnames=())
def _run_decode(state, tokens, lens, outs, salts):
  def step(state, req):
    toks, p, o, salt = req
    total = p + o - 1
    keys, _ = hashing.block_hashes(toks, total, block_size=K, extra=salt[None])
    seq = jnp.int32(0)
    state, a = pc.allocate_with_prefix(state, seq, keys, p)
    state, _ = pc.publish(state, seq, keys, p)

    def decode(i, c):
      state, bad = c
      state, ap = pc.append(state, seq, jnp.int32(1))
      state, _ = pc.publish(state, seq, keys, p + i + 1)
      return state, bad | (ap.status != 0)

    state, bad = jax.lax.fori_loop(0, o - 1, decode, (state, False))
    state, _ = pc.release(state, seq)
    return state, (a.status, bad, a.hit_tokens, a.new_blocks)

  return jax.lax.scan(step, state, (tokens, lens, outs, salts))


@pytest.mark.parametrize("policy", _DECODE_CASES)
def test_decode_appends_take_policy_victims(rng, policy):
  """Blocks for decode (``append``) also go through the policy: hits per
  request equal the model's with outputs that fill blocks."""
  num_blocks = 12
  reqs = make_workload(rng, 120, 6)
  outputs = [rng.integers(0, 5, size=int(rng.integers(1, 7))) for _ in reqs]
  n = len(reqs)
  tokens = np.zeros((n, T), np.int32)
  for i, ((p, _), o) in enumerate(zip(reqs, outputs, strict=True)):
    seq = np.concatenate([p, o])[:T]
    tokens[i, : len(seq)] = seq
  lens = np.asarray([len(p) for p, _ in reqs], np.int32)
  olens = np.asarray(
    [
      min(len(o), T - len(p) + 1)
      for (p, _), o in zip(reqs, outputs, strict=True)
    ],
    np.int32,
  )
  salts = np.asarray([s for _, s in reqs], np.uint32)
  state = pc.init(
    num_blocks, K, max_seqs=1, max_blocks_per_seq=M, policy=policy
  )
  final, (status, bad, hit_tokens, new_blocks) = _run_decode(
    state, tokens, lens, olens, salts
  )
  assert not np.asarray(bad).any() and not np.asarray(status).any()
  model = policy_models.PolicyPrefixCache(num_blocks, K, policy)
  for i, ((prompt, salt), o) in enumerate(zip(reqs, olens, strict=True)):
    prompt = [int(t) for t in prompt]
    model.add_request(i, prompt, salt)
    hits, hit = model.get_computed_blocks(i)
    new = model.allocate_slots(i, len(prompt) - hit, hits)
    for k in range(int(o)):
      model.append_tokens(i, [int(tokens[i, len(prompt) + k])])
      if k + 1 < o:
        assert model.allocate_slots(i, 1) is not None
    model.free(i)
    assert int(hit_tokens[i]) == hit, f"request {i}"
    assert np.asarray(new_blocks[i])[: len(new)].tolist() == new
  assert len(model.victims) > 0
  assert pc.check_invariants(final) == []
  cached = np.asarray(final.paging.published).tolist()
  assert cached == [model.block_hash(b) is not None for b in range(num_blocks)]


@pytest.mark.parametrize("policy", ["fifo", "lfu", "test_largest_id"])
def test_one_append_of_many_blocks_equals_one_block_at_a_time(rng, policy):
  """An ``append`` that needs the free blocks without a hash and some
  victims hands out the blocks (and leaves the queue) of one-block appends
  in a row: unhashed ones first, then the victims in choice order. (The
  replay's one-call decode relies on it; victims first, as before, made a
  ``largest_id`` replay differ from the token-at-a-time model.)"""
  state = pc.init(N, K, max_seqs=2, max_blocks_per_seq=M, policy=policy)
  state, _ = run_device(state, make_workload(rng, R, M))
  # Seq 1 takes blocks and is released unpublished: they go back to the
  # queue head without a hash; seq 0 starts on one of them.
  fresh = jnp.asarray(rng.integers(100, 200, size=3 * K), jnp.int32)
  keys, _ = hashing.block_hashes(fresh, 3 * K, block_size=K)
  state, _ = checked.allocate_with_prefix(state, 1, keys, 3 * K)
  state, _ = checked.release(state, 1)
  state, _ = checked.allocate_with_prefix(state, 0, keys, 1)
  unhashed = int(state.paging.num_free - state.stats.num_cached_free)
  assert unhashed >= 1
  need = int(
    rng.integers(unhashed + 1, min(M - 1, int(state.paging.num_free)) + 1)
  )
  one, r = checked.append(state, 0, need * K)
  many = state
  for _ in range(need):
    many, a = checked.append(many, 0, K)
  assert int(r.num_new_blocks) == need
  assert (
    one.paging.block_tables[0].tolist() == many.paging.block_tables[0].tolist()
  )
  assert paging.free_queue_order(one.paging) == paging.free_queue_order(
    many.paging
  )
  np.testing.assert_array_equal(one.paging.published, many.paging.published)
  assert pc.check_invariants(one) == []


def test_vmap_over_configurations_equals_one_at_a_time(rng):
  """Two configurations (``lfu`` with decay 1 and 0.5, each on its own
  workload) in one vmapped scan give the results of two separate runs."""
  reqs_a = make_workload(rng, R, M)
  reqs_b = make_workload(rng, R, M)
  base = pc.init(N, K, max_seqs=1, max_blocks_per_seq=M, policy="lfu")
  halved = base.replace(
    policy_state=base.policy_state._replace(decay=jnp.float32(0.5))
  )
  arrays = [_arrays(r)[:4] for r in (reqs_a, reqs_b)]
  states = jax.tree.map(lambda a, b: jnp.stack([a, b]), base, halved)
  batched = jax.tree.map(
    lambda a, b: jnp.stack([a, b]),
    *[tuple(map(jnp.asarray, x)) for x in arrays],
  )
  finals, outs = jax.jit(jax.vmap(_steps))(states, *batched)
  for j, (state, args) in enumerate(((base, arrays[0]), (halved, arrays[1]))):
    final, single = _run(state, *args)
    for key in single:
      np.testing.assert_array_equal(outs[key][j], single[key], key)
    for a, b in zip(
      jax.tree.leaves(jax.tree.map(operator.itemgetter(j), finals)),
      jax.tree.leaves(final),
      strict=True,
    ):
      np.testing.assert_array_equal(a, b)
  # The decayed configuration equals the model with decay 0.5.
  _, hits, _, _ = run_model(reqs_b, N, "lfu", decay=0.5)
  assert outs["hit_tokens"][1].tolist() == hits


def test_registry_and_init_errors():
  assert {"lru", "fifo", "lfu", "lru_leaf", "belady", "belady_leaf"} <= set(
    policies.policy_names()
  )
  assert policies.get_policy("lfu", decay=0.9) is policies.lfu(decay=0.9)
  with pytest.raises(ValueError, match="unknown policy"):
    policies.get_policy("nope")
  with pytest.raises(ValueError, match="already registered"):
    policies.register_policy("lru", policies.lru)
  with pytest.raises(ValueError, match="decay"):
    policies.lfu(decay=1.5)
  with pytest.raises(ValueError, match="prepend_unhashed"):
    pc.init(
      8, K, max_seqs=1, max_blocks_per_seq=M, policy="fifo", free_order="append"
    )
  with pytest.raises(TypeError, match="policy"):
    pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, policy=3)
  state = pc.init(8, K, max_seqs=1, max_blocks_per_seq=M)
  # vLLM 0.33's order is the default since issue 13 (0.22's was "append").
  assert state.policy is policies.lru()
  assert state.free_order == "prepend_unhashed"
  with pytest.raises(ValueError, match="next_use"):
    checked.allocate_with_prefix(
      state, 0, jnp.zeros((1, 2), jnp.uint32), 4, next_use=jnp.zeros((2, 2))
    )
  assert paging.Status.OK == 0


@pytest.mark.parametrize("module", [policies, pc], ids=["policies", "cache"])
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0


def test_leaf_fallback_when_every_free_parent_has_a_pinned_child():
  """Duplicates can leave a pinned block whose recorded parent is free: with
  no free leaf left, ``lru_leaf`` evicts that parent (the fallback rule) and
  the child's parent link is cleared. Device and model agree at each step.

  B recomputes A's first block (a duplicate, block 3) and decodes A's second
  block into block 4 (parent 3); C evicts A's second block (2), so that key
  now names block 4; S hits blocks 1 and 4 and needs 2 more: the free block
  without a hash (2), then the only cached free block, 3, not a leaf.
  """
  n = 5
  t0, t1, t2, t3 = (list(range(10 * i, 10 * i + K)) for i in range(1, 5))
  state = pc.init(n, K, max_seqs=1, max_blocks_per_seq=M, policy="lru_leaf")
  model = policy_models.PolicyPrefixCache(n, K, "lru_leaf")

  def start(rid, prompt, decode=()):
    nonlocal state
    seq = prompt + list(decode)
    keys, _ = hashing.block_hashes(jnp.asarray(seq), len(seq), block_size=K)
    state, r = checked.allocate_with_prefix(state, 0, keys, len(prompt))
    state, _ = checked.publish(state, 0, keys, len(prompt))
    model.add_request(rid, prompt)
    hits, hit = model.get_computed_blocks(rid)
    new = model.allocate_slots(rid, len(prompt) - hit, hits)
    assert int(r.hit_tokens) == hit
    assert r.new_blocks[: len(new)].tolist() == new
    for k, tok in enumerate(decode):
      state, a = pc.append(state, 0, 1)
      state, _ = checked.publish(state, 0, keys, len(prompt) + k + 1)
      model.append_tokens(rid, [tok])
      want = model.allocate_slots(rid, 1)
      assert a.new_blocks[: len(want)].tolist() == want
    state, _ = pc.release(state, 0)
    model.free(rid)
    model.check_invariants()
    assert pc.check_invariants(state) == []
    return new

  assert start("A", t0 + t1 + [0]) == [1, 2, 3]
  assert start("B", t0, decode=t1) == [3]
  assert start("C", t0[:3]) == [2]
  assert start("S", t0 + t1 + t2 + t3) == [2, 3]
  assert model.victims == [2, 3]
  parents = np.asarray(state.block_parent).tolist()
  assert parents[4] == NO_BLOCK_ID and parents[2] == 4 and parents[3] == 2
