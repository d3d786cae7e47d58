"""The engine: a real model through the paged cache, prefix hits change no bit.

References: the dense causal forward of the same weights
(``Llama.__call__``, plain jnp attention, no pages); the plain-Python vLLM
0.33 scheduler model (``tests/reference_models/vllm_scheduler.py``) and the
jitted simulator (:func:`prefixjax.serving.simulate`) fed the engine's
samples as the trace's outputs; and the same engine with prefix caching off.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models.vllm_scheduler import VllmScheduler, model_kwargs

from prefixjax import serving
from prefixjax.configs import ModelConfig
from prefixjax.model import CacheConfig, Engine

MODEL = ModelConfig.tiny()
CFG = CacheConfig(
  block_size=16,
  num_blocks=65,
  max_num_seqs=4,
  max_num_batched_tokens=64,
  max_model_len=256,
)
# Few blocks: running requests preempt each other.
SMALL_POOL = CacheConfig(
  block_size=16,
  num_blocks=17,
  max_num_seqs=4,
  max_num_batched_tokens=64,
  max_model_len=256,
)


def _ids(rng, n):
  return rng.integers(0, MODEL.vocab_size, int(n)).tolist()


def _bits(a: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bitwise(a, b):
  """Two GenerateResults: equal tokens, logits equal to the bit."""
  assert a.tokens == b.tokens
  assert len(a.logits) == len(b.logits)
  for i, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
    assert x.shape == y.shape, f"request {i}"
    np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"request {i}")


def _run(batches, cache_config=CFG, *, prefix_caching=True, **kw):
  """Runs the batches in order on one engine; returns the results."""
  eng = Engine(MODEL, cache_config)
  return [
    eng.generate(
      prompts, mnt, prefix_caching=prefix_caching, return_logits=True, **kw
    )
    for prompts, mnt in batches
  ]


def _dense_logits(eng_params, prompt, out):
  """Logits of the dense forward at the positions the outputs came from."""
  from prefixjax.model import Llama

  seq = jnp.asarray([list(prompt) + list(out)], jnp.int32)
  full = np.asarray(Llama(MODEL).apply(eng_params, seq))[0]
  p = len(prompt)
  return full[p - 1 : p - 1 + len(out)]


def test_shared_system_prompt_hits_and_changes_no_bit(rng):
  system = _ids(rng, rng.integers(20, 70))
  prompts = [
    system + _ids(rng, rng.integers(1, 40))
    for _ in range(int(rng.integers(3, 7)))
  ]
  batches = [(prompts, int(rng.integers(2, 8)))]
  (on,) = _run(batches)
  (off,) = _run(batches, prefix_caching=False)
  assert_bitwise(on, off)
  assert off.stats["hit_tokens"] == 0
  assert on.stats["hit_tokens"] > 0
  for res in (on, off):
    s = res.stats
    assert s["preemptions"] == 0
    assert s["prefill_tokens_computed"] == s["prompt_tokens"] - s["hit_tokens"]
  # The hits are what vLLM's scheduler (the plain-Python model) reports.
  records = [
    dict(input_tok_ids=p, output_toks=len(o), output_tok_ids=o)
    for p, o in zip(prompts, on.tokens, strict=True)
  ]
  _, reqs = VllmScheduler(**model_kwargs(CFG.serving_config())).simulate(
    records
  )
  assert on.stats["hit_tokens"] == sum(r["num_cached_tokens"] for r in reqs)


def test_warm_cache_second_batch_hits_five_times_six_blocks(rng):
  """One prompt first, then five sharing its 100-token system prompt."""
  system = _ids(rng, 100)
  first = system + _ids(rng, rng.integers(1, 20))
  five = [system + _ids(rng, rng.integers(1, 20)) for _ in range(5)]
  a1, a2 = _run([([first], 4), (five, 4)])
  b1, b2 = _run([([first], 4), (five, 4)], prefix_caching=False)
  assert a2.stats["hit_tokens"] == 5 * 6 * 16 == 480
  assert a2.stats["prefill_tokens_computed"] == a2.stats["prompt_tokens"] - 480
  assert b2.stats["hit_tokens"] == 0
  assert_bitwise(a1, b1)
  assert_bitwise(a2, b2)


def test_multi_turn_continuation_hits_earlier_outputs(rng):
  prompts = [_ids(rng, rng.integers(10, 60)) for _ in range(3)]
  mnt = int(rng.integers(8, 24))
  eng_on, eng_off = Engine(MODEL, CFG), Engine(MODEL, CFG)
  t1 = eng_on.generate(prompts, mnt, return_logits=True)
  u1 = eng_off.generate(prompts, mnt, prefix_caching=False, return_logits=True)
  assert_bitwise(t1, u1)
  follow = [
    p + o + _ids(rng, rng.integers(1, 20))
    for p, o in zip(prompts, t1.tokens, strict=True)
  ]
  t2 = eng_on.generate(follow, 4, return_logits=True)
  u2 = eng_off.generate(follow, 4, prefix_caching=False, return_logits=True)
  assert_bitwise(t2, u2)
  # Every block turn 1 computed (all its tokens but the last sample) is a hit
  # for turn 2, up to turn 2's last prompt token.
  k = CFG.block_size
  want = sum(
    k * min((len(p) + len(o) - 1) // k, (len(f) - 1) // k)
    for p, o, f in zip(prompts, t1.tokens, follow, strict=True)
  )
  assert t2.stats["hit_tokens"] == want
  assert u2.stats["hit_tokens"] == 0


def test_full_prompt_repeat_recomputes_only_the_last_block(rng):
  k = CFG.block_size
  prompt = _ids(rng, rng.integers(k + 1, 5 * k + 1))
  a = _run([([prompt], 5), ([prompt], 5)])
  b = _run([([prompt], 5), ([prompt], 5)], prefix_caching=False)
  assert a[1].stats["hit_tokens"] == k * ((len(prompt) - 1) // k)
  assert a[1].tokens == a[0].tokens
  for x, y in zip(a, b, strict=True):
    assert_bitwise(x, y)


def test_prompts_shorter_than_a_block_match_the_dense_model(rng):
  prompts = [_ids(rng, rng.integers(1, CFG.block_size)) for _ in range(3)]
  eng = Engine(MODEL, CFG)
  res = eng.generate(prompts, 20, return_logits=True)
  assert res.stats["hit_tokens"] == 0
  for p, out, logits in zip(prompts, res.tokens, res.logits, strict=True):
    ref = _dense_logits(eng.params, p, out)
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    assert out == np.argmax(ref, axis=-1).tolist()


def test_outputs_equal_the_dense_model_with_hits(rng):
  system = _ids(rng, rng.integers(30, 80))
  prompts = [system + _ids(rng, rng.integers(1, 30)) for _ in range(4)]
  eng = Engine(MODEL, CFG)
  eng.generate(prompts[:1], 3)
  res = eng.generate(prompts[1:], 12, return_logits=True)
  assert res.stats["hit_tokens"] > 0
  for p, out, logits in zip(prompts[1:], res.tokens, res.logits, strict=True):
    ref = _dense_logits(eng.params, p, out)
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_a_request_gets_the_same_bits_whatever_else_is_in_the_batch(rng):
  mine = _ids(rng, rng.integers(5, 70))
  others = [_ids(rng, rng.integers(1, 90)) for _ in range(3)]
  alone = Engine(MODEL, CFG).generate([mine], 10, return_logits=True)
  crowd = Engine(MODEL, CFG).generate(
    [*others[:2], mine, others[2]], 10, return_logits=True
  )
  assert crowd.tokens[2] == alone.tokens[0]
  np.testing.assert_array_equal(_bits(crowd.logits[2]), _bits(alone.logits[0]))


def test_parallel_sampling_shares_the_prompt_and_changes_no_bit(rng):
  prompts = [_ids(rng, rng.integers(20, 60)) for _ in range(2)]
  kw = dict(n=3, temperature=1.0, seed=int(rng.integers(1000)))
  (on,) = _run([(prompts, 12)], **kw)
  (off,) = _run([(prompts, 12)], prefix_caching=False, **kw)
  (again,) = _run([(prompts, 12)], **kw)
  assert len(on.tokens) == 6
  assert_bitwise(on, off)
  assert_bitwise(on, again)  # seeded: reproducible
  assert len({tuple(t) for t in on.tokens}) > 2  # samples differ
  k = CFG.block_size
  # Children 1 and 2 of each prompt hit child 0's full prompt blocks.
  want = sum(2 * k * ((len(p) - 1) // k) for p in prompts)
  assert on.stats["hit_tokens"] == want


def test_preemption_under_a_small_pool_changes_no_bit(rng):
  mnt = 48
  # Not every draw preempts (seed 748883503: prompts of 80, 79, 86 and 62
  # tokens are admitted so that the running ones always fit): draw again.
  for _ in range(5):
    prompts = [_ids(rng, rng.integers(40, 90)) for _ in range(4)]
    small = _run([(prompts, mnt)], SMALL_POOL)[0]
    if small.stats["preemptions"] > 0:
      break
  small_off = _run([(prompts, mnt)], SMALL_POOL, prefix_caching=False)[0]
  roomy = _run([(prompts, mnt)], CFG)[0]
  assert small.stats["preemptions"] > 0
  assert roomy.stats["preemptions"] == 0
  assert_bitwise(small, roomy)
  assert_bitwise(small, small_off)


@pytest.mark.parametrize(
  "cache_config,scheduler",
  [(CFG, "fcfs"), (SMALL_POOL, "fcfs"), (SMALL_POOL, "priority")],
)
def test_schedule_equals_the_simulator_and_vllm_model(
  rng, cache_config, scheduler
):
  system = _ids(rng, rng.integers(16, 50))
  prompts = [
    (system if rng.random() < 0.6 else []) + _ids(rng, rng.integers(1, 70))
    for _ in range(int(rng.integers(3, 7)))
  ]
  mnt = [int(rng.integers(1, 40)) for _ in prompts]
  eng = Engine(MODEL, cache_config, scheduler=scheduler)
  res = eng.generate(prompts, mnt)
  records = [
    dict(input_tok_ids=p, output_toks=len(o), output_tok_ids=o)
    for p, o in zip(prompts, res.tokens, strict=True)
  ]
  config = cache_config.serving_config(scheduler)
  sim = serving.simulate(records, config)
  assert res.schedule == sim.scheduled()
  steps, _ = VllmScheduler(**model_kwargs(config)).simulate(records)
  assert res.schedule == [s["sched"] for s in steps]
  m = sim.metrics()
  assert res.stats["prefill_tokens_computed"] == m["prefill_tokens_computed"]
  assert res.stats["hit_tokens"] == m["hit_tokens"]
  assert res.stats["preemptions"] == m["preemptions"]
  assert res.stats["evictions"] == m["evictions"]
  assert res.stats["blocks_peak"] == m["peak_blocks_in_use"]


def test_an_end_id_stops_a_request_and_the_simulator_agrees(rng):
  prompts = [_ids(rng, rng.integers(5, 60)) for _ in range(4)]
  free = Engine(MODEL, CFG).generate(prompts, 30)
  # An id some request samples midway (after its first output).
  eos = next(t for out in free.tokens for t in out[1:-1])
  res = Engine(MODEL, CFG).generate(prompts, 30, eos_id=eos)
  for out, full in zip(res.tokens, free.tokens, strict=True):
    cut = full.index(eos) + 1 if eos in full else len(full)
    assert out == full[:cut]
  assert any(len(o) < 30 for o in res.tokens)
  records = [
    dict(input_tok_ids=p, output_toks=len(o), output_tok_ids=o)
    for p, o in zip(prompts, res.tokens, strict=True)
  ]
  assert (
    res.schedule == serving.simulate(records, CFG.serving_config()).scheduled()
  )


def test_batched_mode_agrees_within_float32_rounding(rng):
  system = _ids(rng, rng.integers(20, 60))
  prompts = [system + _ids(rng, rng.integers(1, 40)) for _ in range(3)]
  inv = Engine(MODEL, CFG).generate(prompts, 8, return_logits=True)
  fast = Engine(MODEL, CFG, batch_invariant=False).generate(
    prompts, 8, return_logits=True
  )
  assert fast.tokens == inv.tokens
  for a, b in zip(fast.logits, inv.logits, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pallas_kernels_in_interpret_mode_change_no_bit(rng):
  cfg = CacheConfig(
    block_size=8,
    num_blocks=33,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    max_model_len=64,
  )
  system = _ids(rng, rng.integers(9, 20))
  prompts = [system + _ids(rng, rng.integers(1, 8)) for _ in range(2)]
  kw = dict(return_logits=True)
  eng = Engine(MODEL, cfg, interpret=True)
  eng.generate(prompts[:1], 2)
  on = eng.generate(prompts[1:], 3, **kw)
  off = Engine(MODEL, cfg, interpret=True)
  off.generate(prompts[:1], 2, prefix_caching=False)
  off = off.generate(prompts[1:], 3, prefix_caching=False, **kw)
  ref = Engine(MODEL, cfg).generate(prompts[1:], 3, **kw)
  assert on.stats["hit_tokens"] == 8 * (len(system) // 8)
  assert_bitwise(on, off)
  for a, b in zip(on.logits, ref.logits, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_configs_and_arguments_are_refused():
  with pytest.raises(ValueError, match="CacheConfig.block_size"):
    CacheConfig(block_size=0)
  with pytest.raises(ValueError, match="CacheConfig.num_blocks"):
    CacheConfig(block_size=16, num_blocks=8, max_model_len=512)
  with pytest.raises(TypeError, match="CacheConfig.chunked_prefill"):
    CacheConfig(chunked_prefill=1)
  with pytest.raises(ValueError, match="CacheConfig.max_model_len=1 must be"):
    CacheConfig(max_model_len=1)  # no prompt could ever be served
  with pytest.raises(TypeError, match="ModelConfig"):
    Engine("tiny", CFG)
  with pytest.raises(ValueError, match="scheduler"):
    Engine(MODEL, CFG, scheduler="nope")
  with pytest.raises(ValueError, match="backend='cuda' must be None or one"):
    Engine(MODEL, CFG, backend="cuda")  # before, in the first forward
  with pytest.raises(TypeError, match="interpret=0 must be a bool"):
    Engine(MODEL, CFG, backend="pallas_tpu", interpret=0)
  eng = Engine(MODEL, CFG)
  bad = [
    (([],), {}, "prompts is empty"),
    (([[1, 2], []],), {}, r"prompts\[1\]"),
    (([[1, 999]],), {}, r"prompts\[0\] has ids outside"),
    (([[1] * 256],), {}, "max_model_len=256"),
    (([[1, 2]],), dict(n=0), "n=0"),
    (([[1, 2]],), dict(temperature=-1.0), "temperature"),
    (([[1, 2]],), dict(temperature=float("inf")), "temperature=inf must be"),
    (([[1, 2]],), dict(eos_id=256), "eos_id"),
  ]
  for args, kw, msg in bad:
    with pytest.raises((TypeError, ValueError), match=msg):
      eng.generate(*args, 4, **kw)
  with pytest.raises(ValueError, match="max_new_tokens has 1 entries"):
    eng.generate([[1, 2], [3]], [4])
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    eng.generate([[1, 2]], 0)
  # A request stops at max_model_len however large its budget (2**40 used
  # to overflow int32 in the scheduler's inputs).
  long = eng.generate([[1] * 250], 2**40)
  assert len(long.tokens[0]) == 256 - 250
  wide = dataclasses.replace(MODEL, name="wide", hidden_size=32)
  wrong = Engine(wide, CFG).params
  with pytest.raises(ValueError, match="params"):
    Engine(MODEL, CFG, params=wrong)
  # One NaN weight made every logit NaN, and greedy sampling emitted 0s.
  good = Engine(MODEL, CFG).params
  leaves, tree = jax.tree.flatten(good)
  i = int(np.random.default_rng().integers(len(leaves)))
  leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(jnp.nan)
  with pytest.raises(ValueError, match=r"holds NaN or inf \(1 arrays do\)"):
    Engine(MODEL, CFG, params=jax.tree.unflatten(tree, leaves))


def test_the_bitwise_check_sees_one_ulp_in_the_cached_pages(rng):
  """The comparison above can fail: nudge the cached keys by one ulp."""
  system = _ids(rng, 48)
  prompts = [system + _ids(rng, rng.integers(1, 10)) for _ in range(2)]
  eng = Engine(MODEL, CFG)
  eng.generate(prompts[:1], 2)
  clean = Engine(MODEL, CFG)
  clean.generate(prompts[:1], 2)
  k = np.array(eng.pool.k)  # only the first request's pages are written
  k[0] = np.nextafter(k[0], np.float32(np.inf))
  eng.pool = eng.pool.replace(k=jnp.asarray(k))
  a = eng.generate(prompts[1:], 3, return_logits=True)
  b = clean.generate(prompts[1:], 3, return_logits=True)
  assert a.stats["hit_tokens"] == b.stats["hit_tokens"] == 48
  assert not np.array_equal(_bits(a.logits[0]), _bits(b.logits[0]))
  np.testing.assert_allclose(a.logits[0], b.logits[0], rtol=1e-4, atol=1e-5)


def test_chunks_cut_on_block_boundaries_and_decode_groups(rng):
  """plan_chunks against a direct reading of its contract."""
  from prefixjax.model import forward as fwd

  k, m, c_max = 4, 8, 6 * 8 + 2
  common = rng.integers(1, 100, m)
  runs = []
  for _ in range(int(rng.integers(2, 7))):
    table = rng.integers(100, 200, m)
    keep = int(rng.integers(0, m))
    table[:keep] = common[:keep]
    stop = int(rng.integers(1, m * k))
    start = stop - (1 if rng.random() < 0.6 else int(rng.integers(1, stop + 1)))
    runs.append((start, stop, rng.integers(0, 50, m * k), table))
  arrays, last = fwd.plan_chunks(runs, k, c_max, m)
  c = 0
  for i, (start, stop, toks, table) in enumerate(runs):
    for pos in range(start, stop):  # every new token sits in one chunk row
      b, r = divmod(pos, k)
      hit = [
        j
        for j in range(c, last[i] + 1)
        if arrays["block"][j] == b and arrays["lo"][j] <= r < arrays["hi"][j]
      ]
      assert len(hit) == 1
      assert arrays["tokens"][hit[0], r] == toks[pos]
      np.testing.assert_array_equal(arrays["table"][hit[0]], table)
    c = last[i] + 1
  used = c
  assert np.all(arrays["hi"][used:] == 0)
  one = (arrays["hi"] - arrays["lo"] == 1) & (arrays["block"] > 0)
  for j in range(used):
    g, n = arrays["group"][j], arrays["shared"][j]
    members = np.flatnonzero(arrays["group"][:used] == g)
    if len(members) == 1:
      continue
    assert one[members].all()
    rows = arrays["table"][members]
    assert n <= arrays["block"][members].min()
    assert (rows[:, :n] == rows[:1, :n]).all()
    if n < arrays["block"][members].min():  # maximal
      assert not (rows[:, n] == rows[0, n]).all()
  # Every one-row chunk with the same first page is in one group.
  for a in np.flatnonzero(one):
    for b in np.flatnonzero(one):
      same = arrays["table"][a, 0] == arrays["table"][b, 0]
      assert same == (arrays["group"][a] == arrays["group"][b])


FORK = dataclasses.replace(CFG, max_num_seqs=12, parallel_sampling="fork")


@pytest.mark.parametrize(
  "fork",
  [
    FORK,
    # Too few running slots and blocks: children queue, requests preempt.
    dataclasses.replace(FORK, max_num_seqs=4, num_blocks=17),
  ],
  ids=["roomy", "pressed"],
)
def test_fork_sampling_gives_fan_out_bits_with_less_prefill(rng, fork):
  from prefixjax.cache import paging

  k = fork.block_size
  lens = [int(k * rng.integers(1, 4))]  # one prompt ends on a block
  lens += [int(x) for x in rng.integers(17, 70, 2)]
  prompts = [_ids(rng, n) for n in lens]
  kw = dict(n=3, temperature=1.0, seed=int(rng.integers(1000)))
  kw.update(return_logits=True)
  eng = Engine(MODEL, fork)
  forked = eng.generate(prompts, 12, **kw)
  fan_out = dataclasses.replace(fork, parallel_sampling="fan_out")
  fanned = Engine(MODEL, fan_out).generate(prompts, 12, **kw)
  assert_bitwise(forked, fanned)
  assert paging.check_invariants(eng.cache.paging) == []
  assert int(eng.cache.paging.num_free) == fork.num_blocks - 1
  s = forked.stats
  if fork is FORK:  # every child forks: only the parents prefill
    assert s["preemptions"] == 0
    assert s["prefill_tokens_computed"] == sum(lens)
    assert s["hit_tokens"] == 2 * sum(lens)  # the children's: shared
    assert s["prompt_tokens"] == 3 * sum(lens)
    assert s["cow_copies"] == 2 * sum(n % k != 0 for n in lens)
  else:
    assert s["preemptions"] > 0 or s["cow_copies"] < 2 * len(lens)
  assert s["prefill_tokens_computed"] < fanned.stats["prefill_tokens_computed"]
  # The simulator runs the same fork rules: the same schedule.
  records = [
    dict(
      input_tok_ids=prompts[i // 3],
      output_toks=len(out),
      output_tok_ids=out,
      parent=i // 3,
      sample=i % 3,
    )
    for i, out in enumerate(forked.tokens)
  ]
  sim = serving.simulate(records, fork.serving_config())
  assert forked.schedule == sim.scheduled()
  assert (
    sim.metrics()["prefill_tokens_computed"] == s["prefill_tokens_computed"]
  )
