"""Single runs in segments, both semantics (``sglang_engine.resume``;
``vllm_v1.run`` resumed from its ``OUT_OF_STEPS`` state): the step buffers
hold ``engine_state.segment_rows`` rows, the host keeps each full
segment's rows and resumes the same state into fresh buffers. With 64-row
segments (many per run) every result field, the whole step trace
included, must equal one segment holding the whole run, on random traces
with each semantics' schedulers, both clocks and pools small enough to
preempt; the progress reports must count the steps across segments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefixjax import serving
from prefixjax.serving import ServingConfig, engine_state
from prefixjax.workloads import default_workload

POLICIES = {
  "sglang": ("fcfs", "lpm", "dfs", "fair", "priority"),
  "vllm": ("fcfs", "priority", "lpm", "fair"),
}


def _fields_equal(a, b, skip=()):
  """Every field of two results equal; the step traces to ``num_steps``
  rows, but for the fields named in ``skip``."""
  n = a.num_steps
  assert n == b.num_steps
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if f.name == "trace":
      for k in set(x._fields) - set(skip):
        np.testing.assert_array_equal(
          np.asarray(getattr(x, k))[:n], np.asarray(getattr(y, k))[:n], k
        )
    elif isinstance(x, np.ndarray):
      np.testing.assert_array_equal(x, y, f.name)
    else:
      assert x == y, f.name


def _case(rng, semantics):
  trace = default_workload(
    num_requests=int(rng.integers(30, 60)), seed=int(rng.integers(1 << 20))
  )
  pages = int(rng.choice([300, 2000]))  # 300: retractions likely
  config = ServingConfig(
    num_gpu_blocks=pages,
    block_size=16,
    max_num_seqs=int(rng.choice([4, 16, 32])),
    max_num_batched_tokens=int(rng.choice([256, 1024])),
    max_model_len=4096,
    scheduler=str(rng.choice(POLICIES[semantics])),
    semantics=semantics,
  )
  kw = dict(arrivals="poisson", rate=float(rng.uniform(5, 60)))
  kw["seed"] = int(rng.integers(1 << 20))
  if rng.random() < 0.5:
    kw["clock"] = "roofline"
  else:
    kw["step_time_ms"] = float(rng.uniform(5, 30))
  return trace, config, kw


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
@pytest.mark.parametrize("case", range(2))
def test_segments_equal_one_segment(rng, monkeypatch, case, semantics):
  trace, config, kw = _case(rng, semantics)
  whole = serving.simulate(trace, config, max_steps=1 << 15, **kw)
  assert whole.status == "OK"
  monkeypatch.setattr(engine_state, "SEGMENT_BYTES", 1)  # 64-row segments
  got = serving.simulate(trace, config, **kw)
  assert whole.num_steps > 3 * 64  # several segments
  _fields_equal(got, whole)
  assert got.trace.sched_rid.shape[0] < whole.num_steps + 64


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_progress_counts_across_segments(rng, monkeypatch, semantics):
  import tqdm

  seen = []

  class Bar(tqdm.tqdm):  # the real bar, its step counts recorded
    def set_postfix_str(self, s="", refresh=True):
      seen.append(int(s.split()[0].replace(",", "")))
      super().set_postfix_str(s, refresh)

  trace, config, kw = _case(rng, semantics)
  monkeypatch.setattr(engine_state, "SEGMENT_BYTES", 1)
  monkeypatch.setattr(tqdm, "tqdm", Bar)
  r = serving.simulate(trace, config, progress=True, **kw)
  every = serving.vllm_v1.PROGRESS_EVERY
  assert r.num_steps >= every
  assert len(seen) == r.num_steps // every  # 64-row segments, no jump > 64
  assert seen == sorted(seen) and seen[-1] <= r.num_steps
  assert [s // every for s in seen] == list(range(1, len(seen) + 1))


def test_segment_rows(rng):
  fields = len(engine_state.StepRecord._fields)  # 18, 5 of them [S]
  for _ in range(20):
    S = int(rng.integers(0, 3000))
    bound = 1 << int(rng.integers(3, 24))
    rows = engine_state.segment_rows(bound, S)
    per = 4 * (fields - 5 + 5 * max(S, 1))
    budget = engine_state.SEGMENT_BYTES
    assert rows & (rows - 1) == 0 and rows <= bound  # a power of two
    assert rows == bound or rows >= 64
    assert rows * per <= budget or rows in (64, bound)
    assert rows == bound or rows == 64 or 2 * rows * per > budget


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_vmapped_segments_equal_one_run_each(rng, monkeypatch, semantics):
  """``simulate_batch(vectorize=True)`` in 64-row segments (every lane
  stopped once one lane's buffers fill, all resumed together): each
  configuration's result equals its own run in one segment, but for the
  ``[S]`` trace fields a batch does not record. On the steps clock: under
  this suite's XLA flags (fusion emitters off) SGLang's vmapped roofline
  times can differ from a single run's in float32's last bits, with or
  without segments (seen 2026-12-08)."""
  trace, config, kw = _case(rng, semantics)
  kw = dict(arrivals="poisson", step_time_ms=float(rng.uniform(5, 30)))
  n = 3
  configs = [
    dataclasses.replace(config, max_num_batched_tokens=int(b))
    for b in rng.choice([128, 256, 512, 1024], n)
  ]
  rates = [float(r) for r in rng.uniform(5, 60, n)]
  seeds = [int(x) for x in rng.integers(0, 1 << 20, n)]
  monkeypatch.setattr(engine_state, "SEGMENT_BYTES", 1)
  got = serving.simulate_batch(
    trace, configs, rate=rates, seed=seeds, vectorize=True, **kw
  )
  monkeypatch.undo()
  for c, rate, seed, g in zip(configs, rates, seeds, got, strict=True):
    whole = serving.simulate(
      trace, c, rate=rate, seed=seed, max_steps=1 << 15, **kw
    )
    assert whole.status == "OK"
    assert not g.lanes_recorded
    _fields_equal(
      dataclasses.replace(g, lanes_recorded=True),
      whole,
      skip=engine_state.LANE_FIELDS,
    )
  assert max(g.num_steps for g in got) > 3 * 64  # several segments
