"""The serving simulator's timed clocks (roofline, user functions).

A timed run is checked against two independent things: its decisions
against the plain-Python vLLM model fed the same arrival steps, and its
times against a float64 host recomputation of the clock, step by step,
from the model's own batches (each lane's new tokens and the tokens it had
computed before the step), with the rule that a request is queued by the
first step that starts at or after its arrival and an empty engine jumps
to the next arrival.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from reference_models.vllm_scheduler import VllmScheduler, model_kwargs

import prefixjax as pj
from prefixjax import configs, serving
from prefixjax.serving import ServingConfig, roofline


class _BatchModel(VllmScheduler):
  """The model, noting each executed step's ``(new, context)`` lanes."""

  def _reset(self):
    super()._reset()
    self.batches = []

  def schedule(self):
    out = super().schedule()
    if out.scheduled:
      self.batches.append(
        [(n, req.num_computed_tokens - n) for req, n in out.scheduled.items()]
      )
    return out


def _records(rng, n=14):
  t = pj.generate_workload(
    "multi_turn",
    num_requests=n,
    seed=int(rng.integers(2**31)),
    system_prompt_len=32,
    question_len=(4, 40),
    output_len=(1, 12),
    vocab_size=200,
  )
  records = serving.records_from_trace(t)
  times = np.cumsum(rng.exponential(0.02, n))  # seconds
  times[rng.integers(n)] += 5.0  # one long gap: the engine goes idle
  # In rid order: the model queues arrivals of one step by rid, the timed
  # engine by time.
  times = np.sort(times) - times.min()
  for rec, x in zip(records, times, strict=True):
    rec["arrival_time_ns"] = int(round(x * 1e9))
  return records


def _config(rng):
  return ServingConfig(
    num_gpu_blocks=int(rng.choice([40, 200])),
    block_size=4,
    max_num_seqs=int(rng.integers(2, 5)),
    max_num_batched_tokens=48,
    max_model_len=128,
  )


@pytest.mark.parametrize("kind", ["roofline", "function"])
def test_timed_clock_matches_model_and_host_times(rng, kind):
  config = _config(rng)
  records = _records(rng)
  if kind == "roofline":
    model = configs.ModelConfig.llama3_8b()
    hw = configs.hardware_config(str(rng.choice(list(configs.HARDWARE))))
    clock = roofline.RooflineClock(model, hw)
    got = serving.simulate(
      records,
      config,
      arrivals="trace",
      clock="roofline",
      model=model,
      hardware=hw,
    )
  else:
    a, b = float(rng.uniform(1e-3, 5e-3)), float(rng.uniform(1e-6, 1e-4))

    def fn(n, c):
      return (
        a
        + b * jnp.sum(n).astype(jnp.float32)
        + 1e-7 * jnp.sum(c).astype(jnp.float32)
      )

    clock = roofline.FunctionClock(fn)
    got = serving.simulate(records, config, arrivals="trace", clock=fn)
  assert got.ok and got.timed
  # Decisions: the model, fed the arrival steps the timed run reports.
  fed = [
    dict(rec, arrival_step=int(s))
    for rec, s in zip(records, got.arrival_step, strict=True)
  ]
  model_ = _BatchModel(**model_kwargs(config))
  steps, reqs = model_.simulate(fed, "field")
  mine = got.steps()
  assert [s["sched"] for s in mine] == [s["sched"] for s in steps]
  # Times: recomputed in float64 from the model's batches.
  s_lanes = config.max_num_seqs
  arrival = np.asarray([rec["arrival_time_ns"] for rec in records]) / 1e9
  t = 0.0
  starts, ends = [], []
  for i, batch in enumerate(model_.batches):
    queued_by_now = arrival[got.arrival_step <= i]
    t = max(t, queued_by_now.max())  # an idle engine jumps to the arrival
    new = np.zeros(s_lanes, np.int32)
    ctx = np.zeros(s_lanes, np.int32)
    for j, (n, c) in enumerate(batch):
      new[j], ctx[j] = n, c
    dt = float(clock.step_time_s(jnp.asarray(new), jnp.asarray(ctx)))
    starts.append(t)
    t += dt
    ends.append(t)
  start, end = got.step_times_s()
  np.testing.assert_allclose(start, starts, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(end, ends, rtol=1e-6, atol=1e-7)
  # The queueing rule: the first step that started at or after arrival.
  for rid in range(len(records)):
    s = got.arrival_step[rid]
    if got.rejected[rid]:
      continue
    assert starts[s] >= arrival[rid] - 1e-6
    assert s == 0 or starts[s - 1] < arrival[rid] + 1e-6
  # Per-request times and metrics follow from the step times.
  rec = got.requests()
  m = got.metrics()
  ttft = [
    r["first_token_s"] - r["arrival_s"]
    for r in rec
    if r["status"] == "finished"
  ]
  assert m["ttft_s_p50"] == pytest.approx(float(np.percentile(ttft, 50)))
  assert m["makespan_s"] == pytest.approx(ends[-1])
  assert m["idle_steps"] == 0


def test_hits_make_roofline_prefill_cheaper(rng):
  """Two prompts sharing a 2048-token prefix, one after the other: the
  second hits it and skips its compute (a 2048-token prefill of a 7B model
  is compute bound on an H100: 27 ms of FLOPs against 4 ms of weights)."""
  prefix = rng.integers(1, 500, 2048).tolist()
  records = [
    dict(
      input_tok_ids=prefix + rng.integers(1, 500, 16).tolist(),
      output_toks=1,
      arrival_time_ns=int(i * 1e9),
    )
    for i in range(2)
  ]
  config = ServingConfig(
    num_gpu_blocks=400,
    block_size=16,
    max_num_seqs=1,
    max_num_batched_tokens=4096,
    max_model_len=4096,
  )
  got = serving.simulate(
    records,
    config,
    arrivals="trace",
    clock="roofline",
    model="llama2_7b",
    hardware="h100",
  )
  r0, r1 = got.requests()
  assert r1["hit_first_sched"] == 2048
  assert r1["ttft_s"] < 0.5 * r0["ttft_s"], (r0["ttft_s"], r1["ttft_s"])


def _one_request():
  """A one-request run on a 2-slot engine, for the argument checks."""
  records = [dict(input_tok_ids=[1, 2, 3], output_toks=2)]
  config = ServingConfig(
    num_gpu_blocks=40,
    block_size=4,
    max_num_seqs=2,
    max_num_batched_tokens=64,
    max_model_len=64,
  )
  return records, config


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(clock="sundial"), "clock='sundial'"),
    (dict(clock="steps", model="llama3_8b"), "need clock='roofline'"),
    (dict(clock="roofline", model="gpt5"), "gpt5"),
    (dict(clock="roofline", hardware="abacus"), "abacus"),
    (dict(clock="roofline", step_time_ms=1.0), "step_time_ms"),
  ],
)
def test_bad_clock_arguments(kw, match):
  records, config = _one_request()
  with pytest.raises(ValueError, match=match):
    serving.simulate(records, config, **kw)


@pytest.mark.parametrize(
  "semantics, bad", [("vllm", float("nan")), ("sglang", -1e-3)]
)
def test_a_bad_step_time_stops_the_run_with_a_status(rng, semantics, bad):
  """A user's clock that gives NaN, a negative or an infinite time stops
  the run at that step with status BAD_STEP_TIME (the clock does not
  move), not metrics computed from garbage times."""
  records = _records(rng, n=6)
  config = ServingConfig(
    num_gpu_blocks=200,
    block_size=4,
    max_num_seqs=2,
    max_num_batched_tokens=48,
    max_model_len=128,
    semantics=semantics,
  )
  limit = int(rng.integers(2, 30))  # the first step past it is bad

  def fn(n, c):
    del c
    return jnp.where(jnp.sum(n) > limit, jnp.float32(bad), jnp.float32(1e-3))

  got = serving.simulate(records, config, arrivals="trace", clock=fn)
  assert got.status == "BAD_STEP_TIME" and not got.ok
  new = [sum(x for _, x in s["sched"]) for s in got.steps()]
  assert new[-1] > limit and all(x <= limit for x in new[:-1]), new


def test_a_clock_of_the_wrong_shape_or_kind_is_refused():
  records, config = _one_request()
  with pytest.raises(TypeError, match=r"one number of seconds.*shape \(2,\)"):
    serving.simulate(records, config, clock=lambda n, c: n.astype(jnp.float32))

  class NotAClock:
    step_time_s = 3

  with pytest.raises(TypeError, match="clock.step_time_s must be a method"):
    serving.simulate(records, config, clock=NotAClock())


def _held_at_last_step(n_tokens, block_size):
  """Blocks in use and unused slots in the last step of one request whose
  prompt is ``n_tokens - 1`` tokens and which samples 2 tokens (so it
  computes ``n_tokens`` tokens)."""
  records = [dict(input_tok_ids=list(range(1, n_tokens)), output_toks=2)]
  config = ServingConfig(
    num_gpu_blocks=-(-256 // block_size) + 1,
    block_size=block_size,
    max_num_seqs=1,
    max_num_batched_tokens=256,
    max_model_len=256,
  )
  got = serving.simulate(records, config)
  last = got.num_steps - 1
  in_use = config.usable_blocks - int(got.trace.free_blocks[last])
  return in_use, int(got.trace.frag_tokens[last])


@pytest.mark.parametrize(
  "block_size, blocks, unused", [(4, 25, 0), (16, 7, 12)]
)
def test_seed_block_size_table(block_size, blocks, unused):
  """Seed 002's table: a 100-token request holds 25 blocks with no unused
  slot at block size 4, and 7 blocks with 12 unused at block size 16."""
  assert _held_at_last_step(100, block_size) == (blocks, unused)


def test_internal_fragmentation_is_the_last_block_s_empty_slots(rng):
  k = int(rng.choice([1, 2, 3, 8, 32]))
  n = int(rng.integers(2, 200))
  assert _held_at_last_step(n, k) == (-(-n // k), -n % k)
