"""SGLang's loop taking quiet decode runs at once (``sglang_engine._jump``,
``Config.jump``, the default) is exact: the final state, every step record
and the tree equal the step-by-step loop's (``jump=False``), on random
engines (page size, slots, tight or roomy pools so that runs evict and end
in retractions, every policy), clocks and arrivals drawn fresh per run;
and the jumps do happen (fewer loop iterations than steps)."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from serving_compare import random_run
from serving_compare import sglang_engine_inputs as _prepare

from prefixjax.serving import ServingConfig, sglang_sim
from prefixjax.serving import sglang_engine as eng
from prefixjax.serving.engine_state import LANE_FIELDS
from prefixjax.workloads import default_workload

# Random engines per run (each compiles two programs): 1 in CI (a fresh one
# every run; the step-exact tests against the Python model jump too), more
# with PREFIXJAX_RANDOM_CONFIGS=20.
RANDOM_CONFIGS = int(os.environ.get("PREFIXJAX_RANDOM_CONFIGS", "1"))


@functools.partial(jax.jit, static_argnames=("cfg", "clock"))
def _run_counting(c, cfg, kn, clock=None):
  """``eng.run``'s loop, counting its iterations."""

  def body(x):
    s, n = x
    return eng._step(s, c, cfg, kn, clock), n + 1

  return jax.lax.while_loop(
    lambda x: eng._going(x[0]), body, (eng.init(c, cfg), np.int32(0))
  )


def _assert_same(a, b):
  la, tree_a = jax.tree.flatten_with_path(jax.device_get(a))
  lb, tree_b = jax.tree.flatten_with_path(jax.device_get(b))
  assert tree_a == tree_b
  for (path, x), (_, y) in zip(la, lb, strict=True):
    np.testing.assert_array_equal(
      np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path)
    )


def _both(consts, cfg, knobs, timer):
  """``(step-by-step final state, jumping final state, iterations)``."""
  ref = eng.run(consts, cfg._replace(jump=False), knobs, clock=timer)
  got, n = _run_counting(consts, cfg._replace(jump=True), knobs, clock=timer)
  _assert_same(ref, got)
  assert int(ref.status) == 0, int(ref.status)
  return ref, got, int(n)


def _random_case(rng):
  """A random engine (page 1-16, 1-12 running, chunked or not, the pool
  tight (1-2x what one request needs) or roomy, any policy) and run (all
  at step 0, or Poisson on either clock) over a small built-in workload."""
  k = int(rng.choice([1, 2, 4, 8, 16]))
  mml = int(rng.choice([256, 512]))
  need = -(-mml // k) + 2
  tight = rng.random() < 0.6
  pages = need + int(rng.integers(1, need + 1 if tight else 4 * need))
  seqs = int(rng.integers(1, 13))
  chunk = int(rng.choice([0, 64, 256]))
  config = ServingConfig(
    num_gpu_blocks=pages + 1,
    block_size=k,
    max_num_seqs=seqs,
    max_num_batched_tokens=max(chunk, k) if chunk else 2 * mml,
    chunked_prefill=bool(chunk),
    max_model_len=mml,
    scheduler=str(rng.choice(["fcfs", "lpm", "dfs", "fair", "priority"])),
    semantics="sglang",
  )
  records = default_workload(
    num_requests=int(rng.integers(20, 50)), seed=int(rng.integers(0, 10**6))
  )
  return records, config, random_run(rng, all_at_once=0.3)


def test_random_engines_jump_exactly(rng):
  for _ in range(RANDOM_CONFIGS):
    records, config, run = _random_case(rng)
    print(config, run)
    _both(*_prepare(records, config, **run))


def test_decode_runs_are_jumped_and_evict_as_step_by_step(rng):
  """Everything at step 0 into a pool that holds a few requests: long
  decode runs with a full batch, evictions inside them, retractions after
  them. The loop takes far fewer iterations than steps, and the evictions
  made inside jumps are the step-by-step loop's. The policy is drawn per
  run (each compiles two programs): ``fcfs``, ``fair`` (its counters
  charged inside jumps) or ``priority`` without preemption (with it,
  SGLang tries a prefill batch every step while a request waits, so only
  runs with an empty queue are quiet)."""
  policy = str(rng.choice(["fcfs", "fair", "priority"]))
  print("policy", policy)
  records = default_workload(num_requests=40, seed=int(rng.integers(0, 10**6)))
  config = ServingConfig(
    num_gpu_blocks=int(rng.integers(140, 260)),
    block_size=4,
    max_num_seqs=int(rng.integers(4, 9)),
    max_num_batched_tokens=256,
    max_model_len=512,
    scheduler=policy,
    semantics="sglang",
    **({"priority_preemption": False} if policy == "priority" else {}),
  )
  ref, got, n = _both(*_prepare(records, config))
  steps = int(ref.row)
  assert int(ref.tree.evicted) > 0
  assert n < steps / 2, (n, steps)


def test_a_run_stops_at_the_step_rows(rng):
  """A step buffer too small for the run: the jumping loop stops with
  ``STEP_ROWS`` after the same steps as the step-by-step one. The rows
  are drawn below a bound on the run's steps from the records (every
  output token but a request's first takes a decode step of at most
  ``max_num_seqs`` requests), so no full run is needed to know it."""
  records = default_workload(num_requests=12, seed=int(rng.integers(0, 10**6)))
  config = ServingConfig(
    num_gpu_blocks=400,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=512,
    semantics="sglang",
  )
  consts, cfg, knobs, _ = _prepare(records, config)
  outputs = np.asarray(consts.max_new)
  bound = max(int(outputs.max()), int(np.sum(outputs - 1)) // 4)
  assert bound > 6, bound
  rows = int(rng.integers(5, bound))
  cfg = cfg._replace(steps=rows)
  ref = eng.run(consts, cfg._replace(jump=False), knobs)
  got = eng.run(consts, cfg._replace(jump=True), knobs)
  assert int(ref.status) == eng.Status.STEP_ROWS
  _assert_same(ref, got)


def test_vmapped_lanes_jump_exactly(rng):
  """:func:`~prefixjax.serving.sglang_engine.run_batched` (its jumps stop
  before a step that evicts; on a timed clock it does not jump) on three
  configurations of other budgets and arrivals: each lane's final state
  equals its step-by-step run's, but for the step buffers' ``[S]`` fields,
  which a batch does not record (a one-row scratch buffer)."""
  records = default_workload(num_requests=30, seed=int(rng.integers(0, 10**6)))
  policy = str(rng.choice(["fcfs", "lpm", "fair"]))
  clock = str(rng.choice(["steps", "roofline"]))
  preps = []
  for i in range(3):
    config = ServingConfig(
      num_gpu_blocks=int(rng.integers(140, 400)) if i == 0 else preps[0][4],
      block_size=4,
      max_num_seqs=6,
      max_num_batched_tokens=int(rng.integers(64, 512)),
      max_model_len=512,
      scheduler=policy,
      semantics="sglang",
    )
    run = dict(arrivals="poisson", rate=float(rng.uniform(1, 40)), clock=clock)
    if clock == "steps":
      run["step_time_ms"] = 20.0
    prep = _prepare(records, config, seed=i, **run)
    preps.append((*prep, config.num_gpu_blocks))
  steps = max(p[1].steps for p in preps)
  cfg = preps[0][1]._replace(steps=steps, jump=True)
  timer = preps[0][3]
  lanes = {
    f: np.stack([np.asarray(getattr(p[0], f)) for p in preps])
    for f in sglang_sim._PER_CONFIG
  }
  knobs = eng.Knobs(
    *(np.stack([getattr(p[2], f) for p in preps]) for f in eng.Knobs._fields)
  )
  final = sglang_sim._batched_run(cfg, timer)(preps[0][0], lanes, knobs)
  for i, (consts, _, kn, _, _) in enumerate(preps):
    # run_batched finds LRU victims by a scan (Config.lru_index False)
    ref = eng.run(
      consts, cfg._replace(jump=False, lru_index=False), kn, clock=timer
    )
    assert int(ref.status) == 0
    got = jax.tree.map(lambda x, i=i: x[i], final)
    for k in LANE_FIELDS:
      assert got.out[k].shape == (1, ref.out[k].shape[1])
    _assert_same(_scalars(ref), _scalars(got))


def _scalars(s):
  """The state with the ``[]`` fields of its step buffers only."""
  return s._replace(
    out={k: v for k, v in s.out.items() if k not in LANE_FIELDS}
  )
