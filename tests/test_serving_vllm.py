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
import os

import numpy as np
import pytest
from reference_models.vllm_apc import cdiv
from reference_models.vllm_scheduler import (
  VllmScheduler,
  fabricated_token,
  model_kwargs,
)
from serving_compare import assert_same_run

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


def _compare(records, config, *, max_steps=MAX_STEPS, step_time_ms=None):
  """Runs both; asserts equal steps, then equal requests; returns steps.

  With ``step_time_ms`` both run the trace's arrival times (the model's
  ``arrivals="time"``, the simulator's ``"trace"``).
  """
  model = VllmScheduler(**model_kwargs(config))
  timed = {} if step_time_ms is None else dict(step_dt_ms=step_time_ms)
  steps, reqs = model.simulate(
    records, "time" if timed else "zero", check_invariants=True, **timed
  )
  got = serving.simulate(
    records,
    config,
    max_steps=max_steps,
    arrivals="trace" if timed else "zero",
    step_time_ms=step_time_ms,
  )
  assert_same_run(got, steps, reqs)
  assert got.scheduled() == [s["sched"] for s in steps]
  assert got.metrics()["evictions"] == model.cache.evictions
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
  kw = {**model_kwargs(_config()), **change}
  if field != "max_model_len":
    with pytest.raises(ValueError):
      VllmScheduler(**kw)


def test_block_tables_past_int32_entries_are_refused():
  """max_num_seqs x ceil(max_model_len / block_size) entries index the
  block tables with int32 ids."""
  cols = -(-_config().max_model_len // _config().block_size)
  most = (2**31 - 1) // cols
  _config(max_num_seqs=most, max_num_batched_tokens=most)  # fits
  with pytest.raises(ValueError, match="ServingConfig.max_num_seqs=.*int32"):
    _config(max_num_seqs=most + 1, max_num_batched_tokens=most + 1)


_INT_FIELDS = (
  "num_gpu_blocks",
  "block_size",
  "max_num_seqs",
  "max_num_batched_tokens",
  "max_model_len",
  "long_prefill_token_threshold",
)


@pytest.mark.parametrize("field", _INT_FIELDS)
def test_config_values_past_int32_are_refused(rng, field):
  """The simulator holds every size in int32: 2**31 and up would fail in
  numpy's cast after the work had started, naming no field."""
  big = int(rng.integers(2**31, 2**62)) * int(rng.choice([-1, 1]))
  with pytest.raises(ValueError, match=rf"ServingConfig.{field}=.*2\*\*31"):
    _config(**{field: big})


@pytest.mark.parametrize("field", _INT_FIELDS)
def test_numpy_ints_are_config_values_as_python_ints(rng, field):
  value = getattr(_config(), field)
  config = _config(**{field: np.int64(value)})
  assert type(getattr(config, field)) is int
  assert config == _config()


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
def _random_config(rng, policy="fcfs"):
  """A small random engine (block 1-8, 1-5 slots, chunked or not, tight
  pools) for the fuzz tests."""
  block_size = int(rng.choice([1, 2, 4, 8]))
  max_model_len = 96
  need = cdiv(max_model_len, block_size)
  seqs = int(rng.integers(1, 6))
  chunked = bool(rng.random() < 0.7)
  return ServingConfig(
    num_gpu_blocks=need + 1 + int(rng.integers(0, need)),
    block_size=block_size,
    max_num_seqs=seqs,
    max_num_batched_tokens=int(rng.integers(max(seqs, 8), 80))
    if chunked
    else int(rng.integers(max_model_len, 200)),
    max_model_len=max_model_len,
    chunked_prefill=chunked,
    long_prefill_token_threshold=int(rng.choice([0, 5, 17])),
    scheduler=policy,
  )


# Random configurations per run (each compiles its own program): 2 in CI
# (fresh ones every run), more with PREFIXJAX_RANDOM_CONFIGS=20.
RANDOM_CONFIGS = int(os.environ.get("PREFIXJAX_RANDOM_CONFIGS", "2"))


@pytest.mark.slow
def test_random_configs_match_model(rng):
  for _ in range(RANDOM_CONFIGS):
    config = _random_config(rng)
    max_model_len = config.max_model_len
    records = _long_pair(rng, max_model_len) + _records(rng, 8, fabricate=True)
    _compare(records, config)


# ------------------------------------------------------------ arrivals
class _InstrumentedModel(VllmScheduler):
  """The model, noting per executed step what its records leave out."""

  def _reset(self):
    super()._reset()
    self.frag = []  # reserved but unused slots after scheduling

  def schedule(self):
    out = super().schedule()
    if out.scheduled:
      k = self.block_size
      self.frag.append(sum(-r.num_computed_tokens % k for r in self.running))
    return out


def _timed_records(
  rng, records, step_time_ms, *, idle_gaps=True, late_from=None
):
  """Random arrival times: bursts, and gaps long enough to go idle; the
  late arrival is one of ``late_from`` (default: any record)."""
  t = 0
  for rec in records:
    rec["arrival_time_ns"] = t
    gap = rng.exponential(3 * step_time_ms * 1e6)
    if idle_gaps and rng.random() < 0.25:
      gap += rng.integers(50, 200) * step_time_ms * 1e6
    t += int(gap) if rng.random() < 0.8 else 0
  if idle_gaps:  # one arrival long after the others are done: idle
    # The shortest prompt, so it is never rejected (a rejected late
    # arrival executes no step after the gap).
    late = min(late_from or records, key=lambda r: len(r["input_tok_ids"]))
    late["arrival_time_ns"] += int(5000 * step_time_ms * 1e6)
  rng.shuffle(records)  # arrival order is not record order
  return records


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "tight"])
def test_trace_arrivals_match_model_step_by_step(rng, preempt):
  step_time_ms = float(rng.choice([0.5, 2.0, 7.3]))
  if preempt:
    config = _config(num_gpu_blocks=cdiv(128, 4) + 1 + 8)
    pair = _long_pair(rng, 128)
    records = pair + _records(rng, NUM_REQUESTS - 2)
  else:
    config = _config(long_prefill_token_threshold=int(rng.choice([0, 7])))
    records = _records(rng, fabricate=True)
  others = records[2:] if preempt else records
  records = _timed_records(rng, records, step_time_ms, late_from=others)
  if preempt:  # the long pair together: one of them is preempted
    for rec in pair:
      rec["arrival_time_ns"] = 0
  steps, reqs = _compare(records, config, step_time_ms=step_time_ms)
  arrival = [r["arrival_step"] for r in reqs]
  assert len(set(arrival)) > 1
  assert steps[-1]["step"] + 1 > len(steps)  # the clock skipped steps
  if preempt:
    assert sum(len(s["preempted"]) for s in steps) >= 1


def test_poisson_arrivals_are_seeded_trace_arrivals(rng):
  config = _config()
  records = _records(rng)
  rate, seed, step_time_ms = 200.0, int(rng.integers(2**31)), 1.5
  got = serving.simulate(
    records,
    config,
    arrivals="poisson",
    rate=rate,
    seed=seed,
    step_time_ms=step_time_ms,
    max_steps=MAX_STEPS,
  )
  gaps = np.random.default_rng(seed).exponential(1 / rate, len(records))
  times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
  for rec, x in zip(records, times, strict=True):
    rec["arrival_time_ns"] = int(round(x * 1e9))
  model = VllmScheduler(**model_kwargs(config))
  steps, reqs = model.simulate(records, "time", step_time_ms)
  assert got.steps() == steps
  assert got.requests() == reqs
  assert got.metrics()["idle_steps"] == _model_idle_steps(steps, reqs)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(arrivals="later"), "arrivals="),
    (dict(arrivals="trace"), "step_time_ms"),
    (dict(arrivals="poisson", step_time_ms=1.0), "rate"),
    (dict(arrivals="poisson", step_time_ms=1.0, rate=-1.0), "rate"),
    (dict(step_time_ms=0.0), "step_time_ms"),
    (dict(step_time_ms=float("inf")), "step_time_ms=inf must be a finite"),
    (dict(arrivals="poisson", step_time_ms=1.0, rate=float("nan")), "rate"),
    (dict(seed=-1), "seed=-1 must be >= 0"),
    (dict(max_steps=0), r"max_steps=0 must be in \[1, 2\*\*31\)"),
    (dict(max_steps=-1), "max_steps=-1"),
  ],
)
def test_bad_arrivals_are_refused(kw, match):
  records = [dict(input_tok_ids=[1, 2, 3], output_toks=2)]
  with pytest.raises(ValueError, match=match):
    serving.simulate(records, _config(), **kw)
  if kw.get("arrivals") == "trace":
    with pytest.raises(ValueError, match="arrival_time_ns"):
      serving.simulate(records, _config(), arrivals="trace", step_time_ms=1.0)


@pytest.mark.parametrize(
  "bad", [float("nan"), float("inf"), -float("inf"), "12", True, 2.0**70]
)
def test_arrival_times_that_are_not_finite_numbers_name_the_record(rng, bad):
  records = [
    dict(input_tok_ids=[1, 2, 3], output_toks=2, arrival_time_ns=i * 1000)
    for i in range(int(rng.integers(2, 6)))
  ]
  rid = int(rng.integers(len(records)))
  records[rid]["arrival_time_ns"] = bad
  with pytest.raises(ValueError, match=rf"record {rid}: arrival_time_ns="):
    serving.simulate(records, _config(), arrivals="trace", step_time_ms=1.0)


def test_a_trace_arrival_past_int64_nanoseconds_names_the_request(rng):
  trace = pj.default_workload(num_requests=6, seed=int(rng.integers(99)))
  i = int(rng.integers(1, len(trace)))
  times = np.asarray(trace.arrival_times_s, np.float64).copy()
  times[i:] = 1e300
  far = dataclasses.replace(trace, arrival_times_s=times)
  with pytest.raises(ValueError, match=rf"trace request {i}: arrival_times_s"):
    serving.simulate(far, _config(max_model_len=128), arrivals="zero")


# ------------------------------------------------------------- metrics
def _model_idle_steps(steps, reqs):
  """The harness's idle steps from the records: the clock's jumps.

  The jumps telescope: from step 0 to the first executed step, over each
  gap after a step that left the engine empty, and, past the last step, to
  the last arrival (requests arriving then are all rejected: the harness
  still jumps to them).
  """
  idle = steps[0]["step"]  # from step 0 to the first arrival
  for prev, cur in zip(steps, steps[1:], strict=False):
    if prev["running"] + prev["waiting"] == 0:
      idle += cur["step"] - prev["step"] - 1
  last = steps[-1]["step"]
  late = [r["arrival_step"] for r in reqs if r["arrival_step"] > last]
  return idle + (max(late) - last - 1 if late else 0)


def _pcts(prefix, x, scale):
  out = {}
  for q in (50, 90, 99):
    v = float(np.percentile(np.asarray(x, np.float64), q))
    out[f"{prefix}_steps_p{q}"] = v
    out[f"{prefix}_s_p{q}"] = v * scale
  return out


def test_metrics_match_numpy_over_model_records(rng):
  step_time_ms = 2.0
  config = _config(num_gpu_blocks=cdiv(128, 4) + 1 + 8)
  pair = _long_pair(rng, 128)
  records = _timed_records(
    rng, pair + _records(rng, NUM_REQUESTS - 2), step_time_ms
  )
  for rec in pair:  # together: one of them is preempted
    rec["arrival_time_ns"] = 0
  model = _InstrumentedModel(**model_kwargs(config))
  steps, reqs = model.simulate(records, "time", step_time_ms)
  got = serving.simulate(
    records,
    config,
    arrivals="trace",
    step_time_ms=step_time_ms,
    max_steps=MAX_STEPS,
  )
  m = got.metrics()
  scale = step_time_ms / 1e3
  k, usable = config.block_size, config.usable_blocks
  ok = [r for r in reqs if r["status"] != "rejected"]
  done = [r for r in ok if r["status"] == "finished"]
  prompt = sum(r["prompt_len"] for r in ok)
  hit = sum(r["hit_first_sched"] for r in ok)
  in_use = np.array([usable - s["free_blocks"] for s in steps])
  frag = np.array(model.frag)
  makespan = steps[-1]["step"] + 1
  out_tokens = sum(r["num_output_tokens"] for r in ok)
  multi = [r for r in done if r["num_output_tokens"] > 1]
  want = dict(
    steps=len(steps),
    idle_steps=_model_idle_steps(steps, reqs),
    makespan_steps=makespan,
    makespan_s=makespan * scale,
    requests=len(reqs),
    finished=len(done),
    rejected=len(reqs) - len(ok),
    prompt_tokens=prompt,
    hit_tokens=hit,
    token_hit_rate=hit / prompt,
    prefill_tokens_computed=sum(s["prefill_tokens"] for s in steps),
    prefill_tokens_saved=hit + sum(r["resume_hit_tokens"] for r in ok),
    preemptions=sum(len(s["preempted"]) for s in steps),
    evictions=model.cache.evictions,
    peak_blocks_in_use=int(in_use.max()),
    mean_blocks_in_use=float(in_use.mean()),
    internal_fragmentation_tokens=float(frag.mean()),
    internal_fragmentation=float(np.mean(frag / np.maximum(in_use * k, 1))),
    **_pcts(
      "ttft",
      [r["first_token_step"] + 1 - r["arrival_step"] for r in done],
      scale,
    ),
    **_pcts(
      "tpot",
      [
        (r["finish_step"] - r["first_token_step"])
        / (r["num_output_tokens"] - 1)
        for r in multi
      ],
      scale,
    ),
    **_pcts(
      "e2e", [r["finish_step"] + 1 - r["arrival_step"] for r in done], scale
    ),
    **_pcts(
      "queue",
      [r["first_sched_step"] - r["arrival_step"] for r in done],
      scale,
    ),
    output_tokens=out_tokens,
    throughput_tokens_per_step=out_tokens / makespan,
    throughput_tokens_per_s=out_tokens / (makespan * scale),
    throughput_requests_per_step=len(done) / makespan,
    throughput_requests_per_s=len(done) / (makespan * scale),
  )
  assert sorted(m) == sorted(want)
  for key, value in want.items():
    assert m[key] == pytest.approx(value, rel=1e-12), key
  assert m["preemptions"] >= 1 and m["hit_tokens"] > 0
  assert m["internal_fragmentation_tokens"] > 0 and m["evictions"] > 0


def test_metrics_without_step_time_have_no_seconds(rng):
  got = serving.simulate(_records(rng), _config(), max_steps=MAX_STEPS)
  m = got.metrics()
  assert m["idle_steps"] == 0 and m["makespan_steps"] == m["steps"]
  assert m["ttft_s_p50"] is None and m["throughput_tokens_per_s"] is None
  assert m["ttft_steps_p50"] >= 1


# ------------------------------------------------------- policy "priority"
def _with_priorities(rng, records, low=-2, high=3):
  """Random priorities (lower first), some records without one (0)."""
  for rec in records:
    if rng.random() < 0.85:
      rec["priority"] = int(rng.integers(low, high))
  return records


@pytest.mark.parametrize(
  "chunked, budget, threshold",
  [(True, 40, 0), (True, 24, 7), (False, 160, 0)],
  ids=["chunked", "chunked-threshold", "no-chunking"],
)
def test_priority_matches_model_without_memory_pressure(
  rng, chunked, budget, threshold
):
  config = _config(
    max_num_batched_tokens=budget,
    chunked_prefill=chunked,
    long_prefill_token_threshold=threshold,
    scheduler="priority",
  )
  records = _with_priorities(rng, _records(rng, fabricate=True))
  if rng.random() < 0.5:  # arrival_time is then rid * 1e-3
    for rec in records:
      del rec["arrival_time_ns"]
  steps, reqs = _compare(records, config)
  assert not any(s["preempted"] for s in steps)
  assert [r["priority"] for r in reqs] == [
    rec.get("priority", 0) for rec in records
  ]

  # The first step admits by (priority, arrival time, rid); long prompts
  # are rejected.
  def key(i):
    ns = records[i].get("arrival_time_ns")
    return (
      records[i].get("priority", 0),
      ns / 1e9 if ns is not None else i * 1e-3,
      i,
    )

  want = [
    i
    for i in sorted(range(len(records)), key=key)
    if reqs[i]["status"] != "rejected"
  ]
  first = [rid for rid, _ in steps[0]["sched"]]
  assert first == want[: len(first)]


def _priority_pressure(rng, step_time_ms):
  """Low-priority long pair first, higher-priority requests later.

  The long pair cannot finish side by side in the pool; the later requests
  join a running list that holds the pair first, so the victims are often
  before the request being scheduled (already scheduled this step) and
  some requests preempt themselves.
  """
  pair = _long_pair(rng, 128)
  for rec in pair:
    rec["priority"] = int(rng.integers(3, 6))
    rec["arrival_time_ns"] = 0
  rest = _with_priorities(rng, _records(rng, NUM_REQUESTS - 2), -2, 4)
  t = int(rng.integers(1, 40) * step_time_ms * 1e6)
  for rec in rest:
    rec["arrival_time_ns"] = t
    t += int(rng.exponential(3 * step_time_ms * 1e6))
  records = pair + rest
  rng.shuffle(records)
  return records


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_priority_matches_model_with_preemption(rng, chunked):
  step_time_ms = 2.0
  config = _config(
    num_gpu_blocks=cdiv(128, 4) + 1 + 8,
    max_num_batched_tokens=40 if chunked else 160,
    chunked_prefill=chunked,
    scheduler="priority",
  )
  records = _priority_pressure(rng, step_time_ms)
  steps, _ = _compare(records, config, step_time_ms=step_time_ms)
  assert sum(len(s["preempted"]) for s in steps) >= 1
  assert any(s["resumed"] for s in steps)


def test_fcfs_reports_priorities_and_ignores_them(rng):
  config = _config(num_gpu_blocks=cdiv(128, 4) + 1 + 8)
  records = _priority_pressure(rng, 2.0)
  _, reqs = _compare(records, config, step_time_ms=2.0)
  assert any(r["priority"] for r in reqs)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(step_time_ms="10"), "step_time_ms='10' must be a number"),
    (dict(seed=1.5), "seed=1.5 must be an int"),
    (dict(seed=None), "seed=None must be an int"),
    (dict(seed=[3, 4]), r"seed=\[3, 4\] must be one value"),  # was used
    (dict(step_time_ms=[10.0]), "step_time_ms=.*must be one value"),
    (dict(max_steps=1.5), "max_steps=1.5 must be an int"),
    (dict(progress="yes"), "progress='yes' must be True or False"),
  ],
)
def test_bad_argument_types_are_refused(kw, match):
  records = [dict(input_tok_ids=[1, 2, 3], output_toks=2)]
  with pytest.raises(TypeError, match=match):
    serving.simulate(records, _config(), **kw)
  # simulate_batch takes a value per configuration (then a list is right)
  if "progress" not in kw and not any(isinstance(v, list) for v in kw.values()):
    with pytest.raises(TypeError, match=match):
      serving.simulate_batch(records, [_config()], **kw)


@pytest.mark.parametrize(
  "trace, error, match",
  [
    (None, TypeError, "trace must be a Trace or an iterable of records"),
    ("abc", TypeError, "got str"),
    ([1, 2], TypeError, "record 0 must be a dict, got int"),
    ([dict(output_toks=2)], ValueError, "record 0 has no input_tok_ids"),
    (
      [dict(input_tok_ids=[1], output_toks=1), dict(input_tok_ids=[2],
       output_toks=1.5)],
      ValueError,
      r"record 1: output_toks=1.5 must be an int",
    ),
    (
      [dict(input_tok_ids=[1], output_toks=1, priority="high")],
      ValueError,
      "record 0: priority='high' must be an int",
    ),
    (
      [dict(input_tok_ids=[1], output_toks=1),
       dict(input_tok_ids=[1], output_toks=2**31)],
      ValueError,
      r"record 1: max_tokens=2147483648 must be < 2\*\*31",
    ),
  ],
)  # fmt: skip
def test_bad_records_are_refused_naming_the_record(trace, error, match):
  with pytest.raises(error, match=match):
    serving.simulate(trace, _config())


@pytest.mark.parametrize("token", [2**31, 2**32 + 1, -1])
def test_token_ids_outside_int32_are_refused(token):
  """The device hashes token ids as int32 words: 2**32 + 1 would alias 1."""
  records = [dict(input_tok_ids=[1, 2, token, 4], output_toks=2)]
  with pytest.raises(
    ValueError, match=rf"record 0: input_tok_ids\[2\]={token}"
  ):
    serving.simulate(records, _config())


def test_bad_policy_is_refused():
  with pytest.raises(ValueError, match="ServingConfig.scheduler='lifo'"):
    _config(scheduler="lifo")
  with pytest.raises(TypeError, match="ServingConfig.scheduler"):
    _config(scheduler=None)
  with pytest.raises(ValueError):
    VllmScheduler(**{**model_kwargs(_config()), "policy": "lifo"})


@pytest.mark.slow
def test_priority_random_configs_match_model(rng):
  for _ in range(RANDOM_CONFIGS):
    config = _random_config(rng, policy="priority")
    max_model_len = config.max_model_len
    pair = _long_pair(rng, max_model_len)
    records = _with_priorities(rng, pair + _records(rng, 8, fabricate=True))
    step_time_ms = float(rng.choice([0.5, 2.0]))
    records = _timed_records(rng, records, step_time_ms, idle_gaps=False)
    _compare(records, config, step_time_ms=step_time_ms)


def test_frames_hold_the_records(rng):
  """``SimResult.frame``: the records and metrics as pandas DataFrames."""
  config = _config()
  got = serving.simulate(_records(rng), config, max_steps=MAX_STEPS)
  reqs, steps = got.requests(), got.steps()
  df = got.frame()
  assert df["rid"].tolist() == list(range(len(reqs)))
  for key in ("prompt_len", "num_output_tokens", "finish_step", "status"):
    # A rejected request has no such key: NaN in the frame.
    col = [None if v != v else v for v in df[key].tolist()]
    assert col == [r.get(key) for r in reqs], key
  df = got.frame("steps")
  assert len(df) == got.num_steps
  assert df["tokens"].tolist() == [s["tokens"] for s in steps]
  assert df["sched"].tolist() == got.scheduled()
  (row,) = got.frame("metrics").to_dict("records")
  for key, value in got.metrics().items():
    assert row[key] == value or (value is None and row[key] != row[key]), key
  assert row["block_size"] == config.block_size
  assert row["scheduler"] == "fcfs"
  with pytest.raises(ValueError, match="what='rows' must be"):
    got.frame("rows")
