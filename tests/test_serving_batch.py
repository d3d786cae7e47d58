"""``simulate_batch``: many configurations through one compiled program.

Each configuration's result, vmapped or one by one, must equal
``simulate``'s for it alone (requests and metrics), on a random trace
with per-configuration budgets, chunking, Poisson rates and seeds.
"""

from __future__ import annotations

import re

import jax
import pytest

import prefixjax as pj
from prefixjax import serving
from prefixjax.configs import HARDWARE
from prefixjax.serving import ServingConfig

BASE = dict(num_gpu_blocks=60, block_size=8, max_num_seqs=4, max_model_len=256)


def _trace(rng):
  return pj.generate_workload(
    "multi_turn",
    num_requests=16,
    seed=int(rng.integers(2**31)),
    system_prompt_len=32,
    question_len=(4, 40),
    output_len=(1, 12),
    vocab_size=200,
  )


@pytest.mark.parametrize(
  "vectorize, clock",
  [(False, "steps"), (True, "steps"), (True, "roofline")],
  ids=["loop", "vmap", "vmap-roofline"],
)
def test_batch_equals_one_by_one(rng, vectorize, clock):
  """Each configuration of a batch equals ``simulate`` alone; vmapped,
  the 3 configurations are padded to 4 and sharded over 2 of the suite's
  faked CPU devices."""
  trace = _trace(rng)
  configs = [
    ServingConfig(**BASE, max_num_batched_tokens=int(b), chunked_prefill=c)
    for b, c in ((int(rng.integers(16, 64)), True), (256, False), (64, True))
  ]
  rates = [float(x) for x in rng.uniform(5, 200, 3)]
  seeds = [int(x) for x in rng.integers(0, 2**31, 3)]
  kw = dict(arrivals="poisson", clock=clock)
  if clock == "roofline":
    kw.update(model="llama3_8b", hardware=str(rng.choice(list(HARDWARE))))
  else:
    kw.update(step_time_ms=5.0)
  devices = jax.devices()[:2] if vectorize else None
  got = serving.simulate_batch(
    trace,
    configs,
    rate=rates,
    seed=seeds,
    vectorize=vectorize,
    devices=devices,
    **kw,
  )
  for config, rate, seed, g in zip(configs, rates, seeds, got, strict=True):
    ref = serving.simulate(trace, config, rate=rate, seed=seed, **kw)
    assert g.requests() == ref.requests()
    assert g.metrics() == ref.metrics()
    assert not g.lanes_recorded
    with pytest.raises(ValueError, match="simulate_batch"):
      g.steps()


def test_sglang_batch_vmapped_equals_one_by_one(rng):
  """SGLang's loop with per-configuration budgets (chunked prefill size or
  none, ``max_prefill_tokens``), Poisson rates and seeds: vmapped (the
  budgets traced; the 3 configurations padded to 4 and sharded over 2 of
  the suite's 8 faked CPU devices): each equals ``simulate`` alone (the
  configurations one by one, the reference)."""
  trace = _trace(rng)
  scheduler = str(rng.choice(["fcfs", "lpm", "dfs"]))
  budgets = [(int(rng.integers(16, 64)), True), (256, False), (64, True)]
  configs = [
    ServingConfig(
      **BASE,
      semantics="sglang",
      scheduler=scheduler,
      max_num_batched_tokens=b,
      chunked_prefill=c,
      max_prefill_tokens=int(rng.integers(b, 2 * b + 1)),
    )
    for b, c in budgets
  ]
  rates = [float(x) for x in rng.uniform(5, 200, 3)]
  seeds = [int(x) for x in rng.integers(0, 2**31, 3)]
  kw = dict(arrivals="poisson", step_time_ms=5.0)
  devices = jax.devices()[:2]
  assert len(devices) == 2
  got = serving.simulate_batch(
    trace,
    configs,
    rate=rates,
    seed=seeds,
    vectorize=True,
    devices=devices,
    **kw,
  )
  for config, rate, seed, g in zip(configs, rates, seeds, got, strict=True):
    ref = serving.simulate(trace, config, rate=rate, seed=seed, **kw)
    assert g.requests() == ref.requests()
    assert g.metrics() == ref.metrics()
    assert not g.lanes_recorded


def test_sglang_batch_refuses_mixed_rules(rng):
  trace = _trace(rng)
  a = ServingConfig(**BASE, semantics="sglang", max_num_batched_tokens=64)
  b = ServingConfig(
    **BASE,
    semantics="sglang",
    max_num_batched_tokens=64,
    waiting_prefix_refresh=False,
  )
  with pytest.raises(ValueError, match=r"configs\[1\]\.waiting_prefix_refresh"):
    serving.simulate_batch(trace, [a, b])


def test_batch_refuses_mixed_static_shapes(rng):
  trace = _trace(rng)
  a = ServingConfig(**BASE, max_num_batched_tokens=64)
  b = ServingConfig(**{**BASE, "block_size": 16}, max_num_batched_tokens=64)
  with pytest.raises(ValueError, match=r"configs\[1\]\.block_size=16"):
    serving.simulate_batch(trace, [a, b])
  with pytest.raises(ValueError, match="rate has 1 entries for 2"):
    serving.simulate_batch(
      trace, [a, a], arrivals="poisson", rate=[5.0], step_time_ms=1.0
    )
  with pytest.raises(ValueError, match="at least one"):
    serving.simulate_batch(trace, [])


def test_progress_bar_reports_from_inside_the_loop(rng, capsys):
  records = [
    dict(input_tok_ids=rng.integers(1, 99, 12).tolist(), output_toks=200)
    for _ in range(3)
  ]
  config = ServingConfig(**BASE, max_num_batched_tokens=64)
  seen = []
  plain = serving.simulate(records, config)
  serving.vllm_v1.set_progress_sink(None)
  with_bar = serving.simulate(records, config, progress=True)
  assert with_bar.requests() == plain.requests()
  err = capsys.readouterr().err
  assert "simulate" in err and "3/3" in err
  # A report from inside the loop, once PROGRESS_EVERY steps had run (a
  # jump over quiet decode steps may cross the mark by a few).
  reported = [
    int(m.replace(",", "")) for m in re.findall(r"([\d,]+) steps", err)
  ]
  assert reported and min(reported) >= serving.vllm_v1.PROGRESS_EVERY
  assert (
    min(reported) < serving.vllm_v1.PROGRESS_EVERY + serving.vllm_v1.JUMP_MAX
  )
  # The loop itself calls the sink every PROGRESS_EVERY executed steps.
  serving.vllm_v1.set_progress_sink(lambda done, steps: seen.append(steps))
  try:
    built = serving.simulate(records, config, progress=False)
    del built
  finally:
    serving.vllm_v1.set_progress_sink(None)
  assert seen == []  # progress=False compiles no callback
  assert plain.num_steps > serving.vllm_v1.PROGRESS_EVERY


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_calls_through_one_trace_runs_equal_simulate_alone(rng, semantics):
  """``TraceRuns`` (a sweep's points on one trace) shares the checked
  records and what depends on them and the token shapes between calls:
  calls with other block sizes and ``max_model_len`` (some prompts
  rejected, some outputs cut), one after another and then on two threads
  at once, each equal a call of its own on the trace, so nothing of one
  shape leaks into another."""
  from prefixjax._host import thread_map
  from prefixjax.serving.simulate import TraceRuns

  trace = _trace(rng)
  runs = TraceRuns(trace)
  longest = int(trace.input_lengths.max())
  shapes = [
    (8, 256),
    (16, 256),
    (8, int(rng.integers(24, longest))),  # cuts some prompts and outputs
  ]
  calls = []
  for k, mml in shapes:
    config = ServingConfig(
      num_gpu_blocks=60 * 8 // k,
      block_size=k,
      max_num_seqs=4,
      max_model_len=mml,
      max_num_batched_tokens=int(rng.integers(k, 64)),
      semantics=semantics,
    )
    calls.append((config, int(rng.integers(2**31))))

  def run(call):
    config, seed = call
    kw = dict(arrivals="poisson", rate=50.0, step_time_ms=5.0)
    return (
      runs.simulate_batch([config], seed=[seed], **kw)[0],
      # A call of its own (simulate_batch equals simulate: tests above).
      serving.simulate_batch(trace, [config], seed=[seed], **kw)[0],
    )

  # One after another (each shape's first call fills the memo), then all
  # at once on two threads (the memo filled).
  pairs = [run(call) for call in calls] + thread_map(run, calls)
  assert any(r.metrics()["rejected"] for r, _ in pairs)
  for got, ref in pairs:
    assert got.requests() == ref.requests()
    assert got.metrics() == ref.metrics()
