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


def _fields_equal(a, b):
  n = a.num_steps
  assert n == b.num_steps
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if f.name == "trace":
      for k in x._fields:
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
