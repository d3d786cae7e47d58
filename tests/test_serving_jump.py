"""Quiet decode runs taken in one loop iteration (``vllm_v1.run(jump=True)``,
the default) are exact: the final engine state and every step record equal
the step-by-step loop's (``jump=False``), on random engines, schedulers,
clocks and arrivals drawn fresh per run, alone and vmapped; and the jumps
do happen (fewer loop iterations than steps)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os

import jax
import numpy as np
import pytest
from serving_compare import builder_args, random_run

from prefixjax.serving import ServingConfig
from prefixjax.serving import vllm_v1 as engine
from prefixjax.workloads import default_workload

simulate_module = importlib.import_module("prefixjax.serving.simulate")

# Random engines per run (each compiles two programs): 2 in CI, more with
# PREFIXJAX_RANDOM_CONFIGS=20.
RANDOM_CONFIGS = int(os.environ.get("PREFIXJAX_RANDOM_CONFIGS", "2"))


def _build(records, config, arrivals="poisson", rate=None, step_time_ms=None,
           clock="steps", seed=0):  # fmt: skip
  return simulate_module._build(
    *builder_args(records, config, arrivals, rate, step_time_ms, clock, seed)
  )


def _random_case(rng):
  """A random engine (block 3-32, 1-8 slots, chunked or not, tight or
  roomy pool, any scheduler) and run (Poisson on either clock, or all at
  step 0) over a small built-in workload."""
  k = int(rng.choice([3, 4, 5, 8, 16, 32]))
  mml = int(rng.choice([256, 512]))
  need = -(-mml // k)
  seqs = int(rng.integers(1, 9))
  chunked = bool(rng.random() < 0.7)
  config = ServingConfig(
    num_gpu_blocks=need + 1 + int(rng.integers(0, 4 * need)),
    block_size=k,
    max_num_seqs=seqs,
    max_num_batched_tokens=int(rng.integers(max(seqs, k, 8), 600))
    if chunked
    else int(rng.integers(mml, 2 * mml)),
    max_model_len=mml,
    chunked_prefill=chunked,
    long_prefill_token_threshold=int(rng.choice([0, 5, 64])),
    scheduler=str(rng.choice(["fcfs", "priority", "lpm", "dfs"])),
  )
  records = default_workload(
    num_requests=int(rng.integers(20, 50)), seed=int(rng.integers(0, 10**6))
  )
  return records, config, random_run(rng, all_at_once=0.25)


def _run(built, jump):
  final, trace = engine.run(
    built.state,
    built.reqs,
    built.params,
    max_steps=built.rows,
    scheduler=built.scheduler,
    clock=built.timer,
    jump=jump,
  )
  return jax.device_get((final, trace))


def _assert_same(a, b, what, fields=None):
  """Equal final states, and equal step records over the executed rows
  (``fields``: those of the records, default all)."""
  (fa, ta), (fb, tb) = a, b
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(fa), jax.tree.leaves(fb), strict=True
  ):
    np.testing.assert_array_equal(
      x, y, err_msg=f"{what}: state{jax.tree_util.keystr(path)}"
    )
  n = int(fa.num_steps)
  for name in fields or ta._fields:
    np.testing.assert_array_equal(
      np.asarray(getattr(ta, name))[:n],
      np.asarray(getattr(tb, name))[:n],
      err_msg=f"{what}: step records' {name}",
    )


def _iterations(built, blocks):
  """``run(jump=True)``'s loop, one jitted iteration at a time on the
  host: ``(final state, iterations)``."""
  advance = jax.jit(
    functools.partial(
      engine._advance,
      params=built.params,
      scheduler=built.scheduler,
      clock=built.timer,
      max_steps=built.rows,
      jump=True,
      blocks=blocks,
    )
  )
  going = jax.jit(lambda st: engine._going(st, built.reqs, built.rows))
  st, count = built.state, 0
  while bool(going(st)):
    st, _, _ = advance(st, built.reqs)
    count += 1
  return jax.device_get(engine._finish(st, built.reqs)), count


def test_low_load_jumps_and_equals_step_by_step():
  """A lightly loaded engine (roofline clock, Poisson 3 req/s): most steps
  are quiet decode steps, the loop takes them in far fewer iterations,
  and state and records equal the step-by-step loop's."""
  config = ServingConfig(
    num_gpu_blocks=513,
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    max_model_len=1024,
  )
  built = _build(
    default_workload(num_requests=24, seed=5), config, rate=3.0,
    clock="roofline",
  )  # fmt: skip
  ref = _run(built, jump=False)
  _assert_same(ref, _run(built, jump=True), "jump")
  steps = int(ref[0].num_steps)
  counts = {}
  for blocks in (False, True):
    final, counts[blocks] = _iterations(built, blocks)
    assert int(final.num_steps) == steps
    assert engine.SimStatus(int(final.error)) == engine.SimStatus.OK
    np.testing.assert_array_equal(final.finish_step, ref[0].finish_step)
  print(f"{steps} steps in {counts} iterations")
  # With few requests running, a request fills or starts a block about
  # every 15 of its decode steps: quiet runs alone take half the steps
  # or more, runs with the starts and fills inside most of them.
  assert counts[False] < 0.6 * steps, (counts, steps)
  assert counts[True] < 0.5 * counts[False], (counts, steps)


@pytest.mark.slow
def test_random_engines_jump_exactly(rng):
  for i in range(RANDOM_CONFIGS):
    records, config, run = _random_case(rng)
    built = _build(records, config, **run)
    _assert_same(
      _run(built, jump=False),
      _run(built, jump=True),
      f"case {i}: {config} {run}",
    )


def test_jump_windows():
  """vLLM's lru cache: runs with block starts and fills inside, up to
  JUMP_MAX steps; vmapped (no starts or fills inside) at most K - 2 steps,
  none for blocks of 1-2 tokens (every decode step starts or fills one);
  no window under a scheduler with a per-step state (fair's counters)."""
  fcfs = engine.sch.get_scheduler("fcfs")
  fair = engine.sch.get_scheduler("fair")

  def cache(k):
    config = ServingConfig(
      num_gpu_blocks=65,
      block_size=k,
      max_num_seqs=2,
      max_num_batched_tokens=64,
      max_model_len=64,
    )
    records = [dict(input_tok_ids=[1, 2], output_toks=2)]
    return _build(records, config, arrivals="zero").state.cache

  assert engine._jump_window(fcfs, cache(16), True) == engine.JUMP_MAX
  assert engine._jump_window(fcfs, cache(1), True) == engine.JUMP_MAX
  assert engine._jump_window(fcfs, cache(16), True, blocks=False) == 14
  assert engine._jump_window(fcfs, cache(64), True, blocks=False) == 32
  assert engine._jump_window(fcfs, cache(2), True, blocks=False) == 0
  assert engine._jump_window(fair, cache(16), True) == 0
  assert engine._jump_window(fcfs, cache(16), False) == 0


def test_batched_lanes_equal_step_by_step(rng):
  """``run_batched`` (jumping, vmapped over lanes of different rates and
  budgets) equals each lane run step by step alone."""
  records = default_workload(num_requests=20, seed=int(rng.integers(0, 10**6)))
  configs = [
    ServingConfig(
      num_gpu_blocks=257,
      block_size=8,
      max_num_seqs=4,
      max_num_batched_tokens=int(b),
      max_model_len=512,
    )
    for b in rng.integers(64, 512, size=3)
  ]
  rates = rng.uniform(1.0, 30.0, size=3)
  builds = [
    _build(records, c, rate=float(r), step_time_ms=20.0, seed=i)
    for i, (c, r) in enumerate(zip(configs, rates, strict=True))
  ]
  stack = lambda *xs: jax.tree.map(lambda *a: np.stack(a), *xs)  # noqa: E731
  rows = max(b.rows for b in builds)
  final, trace = engine.run_batched(
    stack(*[b.state for b in builds]),
    stack(*[b.reqs.replace(keys=None) for b in builds]),
    stack(*[b.params for b in builds]),
    builds[0].reqs.keys,
    max_steps=rows,
    scheduler=builds[0].scheduler,
  )
  final, trace = jax.device_get((final, trace))
  # Unrecorded lanes: the per-step [] fields (what the metrics read).
  fields = [f for f in trace._fields if np.ndim(getattr(trace, f)) == 2]
  for i, b in enumerate(builds):
    lane = jax.tree.map(lambda x, i=i: x[i], (final, trace))
    ref = _run(dataclasses.replace(b, rows=rows), jump=False)
    _assert_same(ref, lane, f"lane {i}", fields)
