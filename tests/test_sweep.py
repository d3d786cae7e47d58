"""The sweep runner: specs, grids, rows equal to the direct calls, resume.

References: the grid is checked against ``itertools.product`` written out
here; every row against :func:`prefixjax.replay.replay` /
:func:`prefixjax.serving.simulate` called for that point alone; a resumed
run against a clean one.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import xla_flags

from prefixjax import replay as rp
from prefixjax import workloads
from prefixjax.cli import main
from prefixjax.serving import ServingConfig, simulate
from prefixjax.sweep import (
  SpecError,
  SweepError,
  load_spec,
  parse_spec,
  run_sweep,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write(tmp_path, text, name="spec.toml"):
  path = tmp_path / name
  path.write_text(text)
  return path


def test_grid_is_the_product_in_field_order(rng):
  values = {
    "policy": ["fifo", "lru_leaf", "belady_leaf"],
    "block_size": [4, 8, 16, 32],
    "capacity": [5, 9, 17, 33, 65],
    "warmup_fraction": [0.0, 0.25, 0.5],
  }
  names = list(rng.permutation(list(values)))
  grid = {}
  for n in names:
    k = int(rng.integers(1, len(values[n]) + 1))
    picked = list(rng.choice(values[n], size=k, replace=False))
    grid[n] = [x.item() if hasattr(x, "item") else x for x in picked]
  spec = parse_spec(
    {
      "workloads": {"w": {"generator": "system_prompt", "requests": 5}},
      "replay": grid,
    }
  )
  want = [
    dict(zip(names, combo, strict=True))
    for combo in itertools.product(*(grid[n] for n in names))
  ]
  got = [{n: p.get(n) for n in names} for p in spec.points]
  assert got == want
  assert [p.index for p in spec.points] == list(range(len(want)))
  assert len({p.key for p in spec.points}) == len(want)


def test_policies_a_semantics_does_not_serve_are_left_out():
  spec = parse_spec(
    {
      "replay": {
        "semantics": ["kvcache-sim", "vllm", "sglang"],
        "policy": ["fifo", "lru", "lru_leaf"],
        "capacity": 8,
      }
    }
  )
  pairs = [(p.get("semantics"), p.get("policy")) for p in spec.points]
  # vllm replays every prefix-cache policy (lru on its fast engine, the
  # others through the general verbs).
  assert pairs == [
    ("kvcache-sim", "fifo"),
    ("kvcache-sim", "lru_leaf"),
    ("vllm", "fifo"),
    ("vllm", "lru"),
    ("vllm", "lru_leaf"),
    ("sglang", "lru_leaf"),
  ]
  assert sorted(spec.left_out) == sorted(
    [
      ("kvcache-sim", "lru", 1),
      ("sglang", "fifo", 1),
      ("sglang", "lru", 1),
    ]
  )


def test_schedulers_sglang_does_not_model_are_left_out():
  """A user-registered scheduler orders vLLM's loop only: its sglang
  points are left out (and counted), every built-in one runs under both."""
  from prefixjax.serving import schedulers

  longest = schedulers.Scheduler(
    name="longest_first", order=lambda state, view: -view.prompt_len
  )
  schedulers.register_scheduler(
    "longest_first", lambda: longest, overwrite=True
  )
  spec = parse_spec(
    {
      "simulate": {
        "semantics": ["vllm", "sglang"],
        "scheduler": ["fcfs", "longest_first", "priority"],
        "num_blocks": 64,
        "max_model_len": 512,
      }
    }
  )
  pairs = [(p.get("semantics"), p.get("scheduler")) for p in spec.points]
  assert pairs == [
    ("vllm", "fcfs"),
    ("vllm", "longest_first"),
    ("vllm", "priority"),
    ("sglang", "fcfs"),
    ("sglang", "priority"),
  ]
  assert spec.left_out == (("sglang", "longest_first", 1),)
  with pytest.raises(SpecError, match="routed replicas run vLLM semantics"):
    parse_spec(
      {
        "simulate": {
          "semantics": "sglang",
          "router": "round_robin",
          "replicas": 2,
          "num_blocks": 64,
          "max_model_len": 512,
        }
      }
    )


_BAD = [
  ("[replay]\ncapacity = 0\n", "replay.capacity", ">= 1"),
  ("[replay]\ncapacity = [8, 8]\n", "replay.capacity", "twice"),
  ("[replay]\ncapacity = [8, 'x']\n", "replay.capacity[1]", "integer"),
  ("[replay]\ncapasity = 8\n", "replay.capasity", "did you mean 'capacity'"),
  ("[replay]\nblock_size = 16\n", "replay", "capacity"),
  ("[replay]\ncapacity = 8\npolicy = 'lru'\n", "replay.policy", "lru"),
  ("[replay]\ncapacity = 8\nwarmup_fraction = 1.0\n", "warmup", "< 1.0"),
  (
    "[simulate]\nscheduler = 'sjf'\n",
    "simulate.scheduler",
    "not one of",
  ),
  (
    "[simulate]\nnum_blocks = 10\n",
    "simulate",
    "max_model_len=4096 needs 256 blocks",
  ),
  (
    "[simulate]\narrivals = 'poisson'\n",
    "simulate",
    "needs step_time_ms",
  ),
  (
    "[simulate]\nclock = 'roofline'\narrivals = 'poisson'\n",
    "simulate",
    "needs rate",
  ),
  ("[simulate]\nmodel = 'llama3_8b'\n", "simulate.model", "roofline"),
  ("[simulate]\nrouter = 'nearest'\n", "simulate.router", "not one of"),
  ("[simulate]\nreplicas = 2\n", "simulate", "needs a router"),
  (
    "[simulate]\nrouter = 'e2'\nclock = 'roofline'\n",
    "simulate.router",
    "clock=steps",
  ),
  ("[sweep]\nname = 3\n", "sweep.name", "string"),
  ("[sweep]\nname = '/tmp/x'\n", "sweep.name", "must be a plain name"),
  ("[sweep]\nname = '../up'\n", "sweep.name", "must be a plain name"),
  ("[sweeps]\n", "sweeps", "unknown"),
  ("", "nothing to run", "[replay]"),
  ("[replay\n", "not valid TOML", "line 1"),
  (
    "[workloads.w]\ngenerator = 'nope'\n[replay]\ncapacity = 8\n",
    "workloads.w.generator",
    "not one of",
  ),
  (
    "[workloads.w]\nrequests = 0\n[replay]\ncapacity = 8\n",
    "workloads.w.requests",
    ">= 1",
  ),
  (
    "[workloads.w]\nparams = { shared_fraction = 7 }\n[replay]\ncapacity = 8\n",
    "workloads.w.params",
    "",
  ),
  (
    "[replay]\ncapacity = 8\nworkload = 'other'\n",
    "replay.workload",
    "not a workload",
  ),
  (
    "[replay]\ncapacity = [8, 16]\n[[points]]\nmode = 'replay'\n",
    "points[0].capacity",
    "must set it",
  ),
  ("[[points]]\nmode = 'serve'\n", "points[0].mode", "replay, simulate"),
  (
    "[replay]\ncapacity = 8\n[[points]]\nmode = 'replay'\n",
    "repeats point 0",
    "",
  ),
  (
    "[replay]\ncapacity = 8\ncapacity_tokens = 64\n",
    "replay",
    "one of capacity",
  ),
  (
    "[replay]\ncapacity = 8\npolicy = 'fifo'\n"
    "policy_params = { decay = 0.9 }\n",
    'replay.policy_params={"decay": 0.9}',
    "policy fifo takes no parameter 'decay'",
  ),
  (
    "[replay]\ncapacity = 8\npolicy_params = 0.9\n",
    "replay.policy_params",
    "must be a table of the policy factory's keyword parameters",
  ),
  (
    "[replay]\ncapacity = 8\npolicy_params = [{}, { decay = [1] }]\n",
    "replay.policy_params[1].decay",
    "must be a number, string or boolean",
  ),
  (
    "[replay]\ncapacity = 8\npolicy_params = [{}, {}]\n",
    "replay.policy_params",
    "lists a value twice",
  ),
  (  # the same policy, the number written two ways
    "[replay]\ncapacity = 8\npolicy = 'lfu'\n"
    "policy_params = [{ decay = 1 }, { decay = 1.0 }]\n",
    "replay.policy_params",
    "lists a value twice",
  ),
  (
    "[replay]\ncapacity = 8\npolicy = 'lfu'\nsemantics = 'vllm'\n"
    "policy_params = { decay = 1 }\n[[points]]\nmode = 'replay'\n"
    "capacity = 8\npolicy = 'lfu'\nsemantics = 'vllm'\n"
    "policy_params = { decay = 1.0 }\n",
    "repeats point 0",
    "",
  ),
  (
    "[[points]]\nmode = 'replay'\ncapacity = 8\npolicy_params = { k = 1 }\n",
    'points[0]: replay.policy_params={"k": 1}',
    "policy lru_leaf takes no parameter 'k'",
  ),
  (
    "[workloads.w]\nseed = [0, 'x']\n[replay]\ncapacity = 8\n",
    "workloads.w.seed[1]",
    "must be an integer",
  ),
  (
    "[workloads.w]\nseed = [3, -1]\n[replay]\ncapacity = 8\n",
    "workloads.w.seed[1]",
    "must be >= 0",
  ),
  (
    "[workloads.w]\nseed = []\n[replay]\ncapacity = 8\n",
    "workloads.w.seed",
    "an empty list",
  ),
  (
    "[workloads.w]\nseed = [2, 5, 2]\n[replay]\ncapacity = 8\n",
    "workloads.w.seed",
    "lists a seed twice",
  ),
  (
    "[workloads.t]\ntrace = 't.jsonl'\nseed = [1, 2]\n[replay]\ncapacity = 8\n",
    "workloads.t.seed",
    "unknown field",
  ),
  (
    "[replay]\ncapacity = [8, 2147483647]\n",
    "replay.capacity[1]",
    "must be <= 2_147_483_646",
  ),
  (
    "[simulate]\nnum_blocks = [300, 134217728]\n",
    "simulate",
    "overflow int32 slot ids",
  ),
  (
    "[workloads.t]\ntrace = '.'\n[replay]\ncapacity = 8\n",
    "workloads.t.trace",
    "is a folder, not a trace file",
  ),
  (  # a misspelt path is not a skipped workload unless it says so
    "[workloads.t]\ntrace = 'no/such.jsonl'\n[replay]\ncapacity = 8\n",
    "workloads.t.trace",
    "no/such.jsonl does not exist",
  ),
  (
    "[workloads.t]\ntrace = 'no/such.jsonl'\noptional = 'yes'\n"
    "[replay]\ncapacity = 8\n",
    "workloads.t.optional",
    "must be true or false",
  ),
  # [full] is checked whether or not --full applies it.
  (
    "[workloads.w]\nrequests = 9\n[replay]\ncapacity = 8\n"
    "[full]\nworkloads.v.requests = 99\n",
    "full.workloads.v",
    "only the workloads the spec defines (w)",
  ),
  (
    "[replay]\ncapacity = 8\n[full]\nreplay.capasity = [9]\n",
    "full.replay.capasity",
    "did you mean 'capacity'",
  ),
  (
    "[workloads.w]\nrequests = 9\n[replay]\ncapacity = 8\n"
    "[full]\nworkloads.w.requests = -4\n",
    "workloads.w.requests",
    ">= 1, got -4 (with [full] applied)",
  ),
  ("[replay]\ncapacity = 8\n[full]\nreplay = 3\n", "full.replay", "table"),
]


@pytest.mark.parametrize(("text", "field", "rule"), _BAD)
def test_bad_specs_name_the_file_the_field_and_the_rule(
  tmp_path, text, field, rule
):
  path = _write(tmp_path, text)
  with pytest.raises(SpecError) as err:
    load_spec(path)
  message = str(err.value)
  assert message.startswith(str(path)), message
  assert field in message and rule in message, message


def test_a_spec_built_in_code_takes_numpy_numbers():
  spec = parse_spec(
    {"replay": {"capacity": [np.int64(32), 64], "warmup_fraction": 0.25}}
  )
  got = [p.get("capacity") for p in spec.points]
  assert got == [32, 64] and all(type(c) is int for c in got)
  assert (
    spec.points[0].key
    == parse_spec({"replay": {"capacity": [32, 64], "warmup_fraction": 0.25}})
    .points[0]
    .key
  )


def test_full_table_changes_only_what_it_names(tmp_path):
  path = _write(
    tmp_path,
    "[workloads.w]\nrequests = 10\n[replay]\ncapacity = [4, 8]\n"
    "[full]\nworkloads.w.requests = 99\nreplay.capacity = [16, 32, 64]\n",
  )
  small, full = load_spec(path), load_spec(path, full=True)
  assert [p.get("capacity") for p in small.points] == [4, 8]
  assert [p.get("capacity") for p in full.points] == [16, 32, 64]
  assert small.workloads["w"].requests == 10
  assert full.workloads["w"].requests == 99
  assert small.fingerprint() != full.fingerprint()


def _small_spec(rng, tmp_path, *, simulate_points=True):
  seed = int(rng.integers(0, 1000))
  caps = sorted(rng.choice(np.arange(8, 80), size=3, replace=False).tolist())
  text = f"""
[workloads.w]
generator = "system_prompt"
requests = {int(rng.integers(30, 60))}
seed = {seed}
params = {{ num_prompts = 3, prompt_len = [64, 256] }}

[replay]
policy = ["fifo", "lru_leaf"]
block_size = [8, 16]
capacity = {caps}
warmup_fraction = 0.5
"""
  if simulate_points:
    picked = rng.choice(np.arange(1, 100), 3, replace=False)
    seeds = ", ".join(str(int(x)) for x in picked)
    text += f"""
[simulate]
scheduler = "fcfs"
block_size = 8
num_blocks = {int(rng.integers(130, 400))}
max_num_seqs = 4
max_num_batched_tokens = 256
max_model_len = 1024
arrivals = "poisson"
step_time_ms = 10.0
rate = [{float(rng.uniform(5, 50)):.3f}]
seed = [0, {seeds}]
"""  # one scheduler: one compiled program (the sglang test sweeps two)
  return _write(tmp_path, text)


def test_groups_run_in_waves_with_the_programs_dropped_between(
  rng, tmp_path, monkeypatch
):
  """``GROUPS_IN_MEMORY = 2``: the small spec's 5 groups (4 replay, 1
  simulate run point by point) run in 3 waves with ``jax.clear_caches()``
  between them (2 calls; none in a run of one wave), and the rows equal
  the one-wave run's."""
  import jax

  from prefixjax.sweep import runner

  path = _small_spec(rng, tmp_path)
  calls = []
  real = jax.clear_caches

  def counted():
    calls.append(1)
    real()

  monkeypatch.setattr(jax, "clear_caches", counted)
  one = run_sweep(path, tmp_path / "one", plots=False)
  assert calls == []
  monkeypatch.setattr(runner, "GROUPS_IN_MEMORY", 2)
  waves = run_sweep(path, tmp_path / "waves", plots=False)
  assert len(calls) == 2
  assert len(waves.rows) == 16 and waves.rows == one.rows


def test_rows_equal_each_point_run_alone(rng, tmp_path):
  path = _small_spec(rng, tmp_path)
  spec = load_spec(path)
  result = run_sweep(spec, tmp_path / "out", plots=False)
  assert len(result.rows) == len(spec.points) == 16
  trace = spec.workloads["w"].load()
  for row, point in zip(result.rows, spec.points, strict=True):
    assert row["index"] == point.index and row["key"] == point.key
    if point.mode == "replay":
      (alone,) = rp.replay(
        trace,
        policy=row["policy"],
        capacities=[row["capacity"]],
        block_size=row["block_size"],
        warmup_fraction=0.5,
      )
      assert row["hit_tokens"] == alone.hit_tokens
      assert row["hit_rate"] == pytest.approx(alone.hit_rate)
      n = trace.input_lengths + trace.output_lengths
      k = row["block_size"]
      slots = -(-n // k) * k
      want = (slots - n).sum() / slots.sum()
      assert row["internal_fragmentation"] == pytest.approx(want)
    else:
      config = ServingConfig(
        num_gpu_blocks=row["num_blocks"] + 1,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=1024,
        scheduler=row["scheduler"],
      )
      alone = simulate(
        trace,
        config,
        arrivals="poisson",
        rate=row["rate"],
        seed=row["seed"],
        step_time_ms=10.0,
      ).metrics()
      for key in ("steps", "hit_tokens", "preemptions", "ttft_s_p99"):
        assert row[key] == pytest.approx(alone[key]), key
  text = (tmp_path / "out" / "results.csv").read_text()
  rows = list(csv.DictReader(text.splitlines()))
  assert any(r["hit_tokens"] > 0 for r in result.rows if r["mode"] == "replay")
  assert [int(r["index"]) for r in rows] == list(range(16))
  assert [int(r["hit_tokens"]) for r in rows] == [
    r["hit_tokens"] for r in result.rows
  ]
  assert json.loads((tmp_path / "out" / "results.json").read_text()) == list(
    result.rows
  )
  frame = result.frame()
  assert list(frame["hit_tokens"]) == [r["hit_tokens"] for r in result.rows]
  # timing.json: every point once, in spec order (the simulate points ran
  # on threads and finished in any order).
  timing = json.loads((tmp_path / "out" / "timing.json").read_text())
  assert [i for t in timing for i in t["points"]] == list(range(16))
  assert timing == list(result.timing)


def test_sglang_points_equal_simulate_alone(rng, tmp_path):
  """A sweep's sglang-semantics rows are simulate()'s of each point."""
  blocks = int(rng.integers(130, 400))
  path = _write(
    tmp_path,
    f"""
[workloads.w]
generator = "system_prompt"
requests = {int(rng.integers(20, 40))}
seed = {int(rng.integers(0, 1000))}
params = {{ num_prompts = 3, prompt_len = [64, 256] }}

[simulate]
semantics = "sglang"
scheduler = ["fcfs", "lpm"]
block_size = 8
num_blocks = {blocks}
max_num_seqs = 4
max_num_batched_tokens = 256
max_model_len = 1024
""",
  )
  spec = load_spec(path)
  result = run_sweep(spec, tmp_path / "out", plots=False)
  trace = spec.workloads["w"].load()
  assert [r["scheduler"] for r in result.rows] == ["fcfs", "lpm"]
  for row in result.rows:
    config = ServingConfig(
      num_gpu_blocks=blocks + 1,
      block_size=8,
      max_num_seqs=4,
      max_num_batched_tokens=256,
      max_model_len=1024,
      scheduler=row["scheduler"],
      semantics="sglang",
    )
    alone = simulate(trace, config).metrics()
    for key in ("steps", "hit_tokens", "preemptions", "ttft_steps_p99"):
      assert row[key] == pytest.approx(alone[key]), key


def test_a_changed_spec_is_refused_and_the_same_one_reused(rng, tmp_path):
  path = _small_spec(rng, tmp_path, simulate_points=False)
  out = tmp_path / "out"
  first = run_sweep(path, out, plots=False)
  again = run_sweep(path, out, plots=False)
  assert again.reused == len(first.rows) == 12 and again.timing == ()
  assert again.rows == first.rows
  path.write_text(path.read_text().replace("fifo", "belady_leaf"))
  with pytest.raises(SweepError, match="different spec"):
    run_sweep(path, out, plots=False)
  assert sorted(p.name for p in (out / "points").iterdir()) == sorted(
    f"{r['key']}.json" for r in first.rows
  )


def test_a_spec_without_the_new_fields_keeps_its_keys():
  """The point keys (and so the fingerprint a results folder is checked
  against) of a spec using neither ``policy_params`` nor a list of seeds,
  as computed before those fields existed: such a spec still resumes in
  the folder an earlier version wrote. A field added later must stay out of
  the key at its default (``spec._ADDED``)."""
  spec = parse_spec(
    {
      "workloads": {
        "w": {"generator": "system_prompt", "requests": 5, "seed": 3}
      },
      "replay": {"policy": ["fifo", "lru_leaf"], "capacity": 8},
      "simulate": {"num_blocks": 300, "max_model_len": 1024},
    }
  )
  assert [p.key for p in spec.points] == [
    "e3a708337595b9ef",
    "5ed4436450ae12c9",
    "9f396ec15cf94038",
  ]
  explicit = parse_spec(
    {
      "workloads": {
        "w": {"generator": "system_prompt", "requests": 5, "seed": [3]}
      },
      "replay": {
        "policy": ["fifo", "lru_leaf"],
        "capacity": 8,
        "policy_params": {},
      },
      "simulate": {"num_blocks": 300, "max_model_len": 1024},
    }
  )
  assert explicit.fingerprint() == spec.fingerprint()


def test_policy_params_build_the_policy_the_replay_runs(tmp_path):
  """A factory with a keyword (``fifo`` registered again, taking
  ``window``; 0 is plain fifo): its parameters are checked by building the
  policy, carried into every row, and each value is its own group."""
  from prefixjax.cache import policies
  from prefixjax.sweep.runner import groups

  def fifo_with_window(*, window: int = 0):
    if window < 0:
      raise ValueError(f"{window=} must be >= 0")
    return policies.fifo() if window == 0 else policies.lfu(decay=0.5)

  def spec(params):
    return parse_spec(
      {
        "workloads": {"w": {"generator": "system_prompt", "requests": 30}},
        "replay": {
          "policy": "fifo",
          "policy_params": params,
          "capacity": [128, 512],
          "warmup_fraction": 0.5,
        },
      },
      source=str(tmp_path / "spec.toml"),
    )

  policies.register_policy("fifo", fifo_with_window, overwrite=True)
  try:
    for params, rule in (
      ({"window": 2}, "engines run fifo with its default parameters only"),
      ({"window": -1}, "policy fifo: window=-1 must be >= 0"),
      ({"size": 1}, "policy fifo takes no parameter 'size'"),
    ):
      with pytest.raises(SpecError) as err:
        spec(params)
      message = str(err.value)
      assert message.startswith(f"{tmp_path / 'spec.toml'}: replay.")
      assert "policy_params=" in message and rule in message, message
    both = spec([{}, {"window": 0}])
    assert len(groups(both)) == 2
    result = run_sweep(both, tmp_path / "out", plots=False)
  finally:
    policies.register_policy("fifo", policies.fifo, overwrite=True)
  assert [(r["policy_params"], r["capacity"]) for r in result.rows] == [
    ("{}", 128),
    ("{}", 512),
    ('{"window": 0}', 128),
    ('{"window": 0}', 512),
  ]
  # window=0 builds the very fifo policy: the same hits.
  hits = [r["hit_tokens"] for r in result.rows]
  assert hits[:2] == hits[2:] and hits[1] > 0
  text = (tmp_path / "out" / "results.csv").read_text()
  table = list(csv.DictReader(text.splitlines()))
  assert [json.loads(r["policy_params"]) for r in table] == [
    {},
    {},
    {"window": 0},
    {"window": 0},
  ]


def _system_prompt_trace(seed):
  return workloads.generate_workload(
    "system_prompt",
    num_requests=30,
    seed=seed,
    num_prompts=3,
    prompt_len=[64, 256],
  )


def test_a_list_of_seeds_is_a_point_per_seed(rng, tmp_path, capsys):
  # Two seeds whose workloads hit differently at capacity 8, so a sweep
  # that ran one seed's workload for both rows would fail below (two
  # random workloads can tie on hits: 1008 == 1008 once).
  def hits(seed):
    (point,) = rp.replay(
      _system_prompt_trace(seed),
      policy="lru_leaf",
      capacities=[8],
      warmup_fraction=0.5,
    )
    return point.hit_tokens

  seeds = [int(rng.integers(1000))]
  while len(seeds) < 2:
    seed = int(rng.integers(1000))
    if seed != seeds[0] and hits(seed) != hits(seeds[0]):
      seeds.append(seed)
  text = f"""
[workloads.w]
generator = "system_prompt"
requests = 30
seed = {seeds}
params = {{ num_prompts = 3, prompt_len = [64, 256] }}

[workloads.v]
generator = "system_prompt"
requests = 20
seed = 7

[replay]
capacity = [8, 32]
warmup_fraction = 0.5

[simulate]
workload = "w"
block_size = 8
num_blocks = 200
max_num_seqs = 4
max_num_batched_tokens = 256
max_model_len = 1024
seed = 5
"""
  path = _write(tmp_path, text)
  spec = load_spec(path)
  assert spec.workloads["w"].seeds == tuple(seeds)
  assert spec.workloads["w"].seed == seeds[0]
  # The seeds sit where the workload does in the grid: outermost here.
  assert [
    (p.mode, p.workload.name, p.workload.seed, dict(p.params).get("capacity"))
    for p in spec.points
  ] == [
    *(("replay", "w", s, c) for s in seeds for c in (8, 32)),
    ("replay", "v", 7, 8),
    ("replay", "v", 7, 32),
    *(("simulate", "w", s, None) for s in seeds),
  ]
  out = tmp_path / "out"
  result = run_sweep(spec, out)
  assert [r["workload_seed"] for r in result.rows] == [
    seeds[0],
    seeds[0],
    seeds[1],
    seeds[1],
    7,
    7,
    seeds[0],
    seeds[1],
  ]
  traces = {s: _system_prompt_trace(s) for s in seeds}
  for row in result.rows[:4]:
    (alone,) = rp.replay(
      traces[row["workload_seed"]],
      policy="lru_leaf",
      capacities=[row["capacity"]],
      warmup_fraction=0.5,
    )
    assert row["hit_tokens"] == alone.hit_tokens
  for row in result.rows[6:]:
    # ``seed`` is the simulate field (arrivals), apart from the workload's.
    assert row["seed"] == 5
    config = ServingConfig(
      num_gpu_blocks=201,
      block_size=8,
      max_num_seqs=4,
      max_num_batched_tokens=256,
      max_model_len=1024,
    )
    alone = simulate(traces[row["workload_seed"]], config).metrics()
    assert row["hit_tokens"] == alone["hit_tokens"]
  assert result.rows[0]["hit_tokens"] != result.rows[2]["hit_tokens"]
  text_rows = list(csv.DictReader((out / "results.csv").read_text().split()))
  assert [int(r["workload_seed"]) for r in text_rows] == [
    r["workload_seed"] for r in result.rows
  ]
  # One hit-rate figure per seed of w; v has one seed, no suffix.
  assert sorted(p.name for p in (out / "plots").glob("*.png")) == sorted(
    [f"hit_rate_w_seed{s}_kvcache-sim_k16.png" for s in seeds]
    + ["hit_rate_v_kvcache-sim_k16.png"]
  )
  # --list tells the points of one workload apart by their seed.
  from prefixjax.cli import main

  assert main(["sweep", str(path), "--list"]) == 0
  listed = [
    line.split("workload_seed=")[1].split(",")[0]
    for line in capsys.readouterr().out.splitlines()
    if line.startswith("  [")
  ]
  assert listed == [str(p.workload.seed) for p in spec.points]
  again = run_sweep(path, out, plots=False)
  assert again.reused == len(result.rows) and again.rows == result.rows
  path.write_text(text.replace(f"seed = {seeds}", f"seed = {seeds[:1]}"))
  with pytest.raises(SweepError, match="different spec"):
    run_sweep(path, out, plots=False)


def test_the_block_size_figure_is_told_its_cache_size(tmp_path, monkeypatch):
  from prefixjax import plots
  from prefixjax.sweep.figures import sweep_plots

  calls = []
  monkeypatch.setattr(
    plots,
    "plot_hit_rate_vs_block_size",
    lambda rows, path, **kw: calls.append((path.name, kw)) or [],
  )
  rows = [
    dict(
      mode="replay",
      workload="w",
      workload_seed=0,
      semantics="vllm",
      policy="lru",
      policy_params="{}",
      block_size=k,
      capacity=tokens // k,
      warmup_fraction=0.5,
      hit_rate=0.1,
      internal_fragmentation=0.01,
      underfilled=False,
    )
    for tokens in (1024, 4096)
    for k in (16, 32)
  ]
  sweep_plots(rows, tmp_path)
  assert [(name, kw["cache_tokens"]) for name, kw in calls] == [
    ("block_size_w_vllm_1024tokens.png", 1024),
    ("block_size_w_vllm_4096tokens.png", 4096),
  ]


def _hash_trace(path, rng, n):
  """A Mooncake-format trace of ``n`` requests sharing a few prefixes."""
  with open(path, "w") as f:
    for i in range(n):
      prefix = [0, 1, 2][: int(rng.integers(0, 4))]
      own = [1000 + 10 * i + j for j in range(int(rng.integers(1, 4)))]
      ids = prefix + own
      length = 512 * (len(ids) - 1) + int(rng.integers(1, 513))
      row = {"timestamp": i, "input_length": length, "output_length": 8}
      f.write(json.dumps({**row, "hash_ids": ids}) + "\n")


def test_a_changed_trace_file_is_refused_not_resumed(rng, tmp_path):
  """Rows computed from a trace file are not mixed with its new bytes: the
  results folder records the file's digest, and a rerun after the file
  changed is refused before any point runs."""
  trace = tmp_path / "t.jsonl"
  _hash_trace(trace, rng, int(rng.integers(20, 40)))
  path = _write(
    tmp_path,
    "[workloads.t]\ntrace = 't.jsonl'\n"
    "[replay]\ncapacity = [4, 16]\nblock_size = 512\n",
  )
  out = tmp_path / "out"

  def recorded(folder):
    return json.loads((folder / "spec.json").read_text())["trace_digests"]

  first = run_sweep(path, out, plots=False)
  assert run_sweep(path, out, plots=False).rows == first.rows  # unchanged
  old = hashlib.sha256(trace.read_bytes()).hexdigest()
  assert recorded(out) == {"t": old}
  before = sorted((out / "points").iterdir())
  lines = trace.read_text().splitlines()
  trace.write_text("\n".join(lines[1:]) + "\n")
  with pytest.raises(SweepError, match="t.jsonl.*has changed since"):
    run_sweep(path, out, plots=False)
  assert sorted((out / "points").iterdir()) == before
  assert recorded(out) == {"t": old}  # the refused run wrote nothing
  run_sweep(path, tmp_path / "fresh", plots=False)
  new = hashlib.sha256(trace.read_bytes()).hexdigest()
  assert recorded(tmp_path / "fresh") == {"t": new} != {"t": old}


def test_a_hash_trace_at_another_block_size_is_refused_before_any_point(
  rng, tmp_path
):
  _hash_trace(tmp_path / "t.jsonl", rng, 10)
  path = _write(
    tmp_path,
    "[workloads.a]\ngenerator = 'system_prompt'\nrequests = 20\n"
    "[workloads.t]\ntrace = 't.jsonl'\n[replay]\ncapacity = [4, 16]\n",
  )
  out = tmp_path / "out"
  with pytest.raises(SweepError) as err:
    run_sweep(path, out, plots=False)
  message = str(err.value)
  assert message.startswith(str(path)) and "workload t" in message
  assert "block_size=16 differs from the hash block size 512" in message
  assert not (out / "points").exists() or not any((out / "points").iterdir())


def test_a_capacity_below_the_largest_request_is_refused_before_any_point(
  tmp_path,
):
  """The vllm and sglang replay engines need room for the largest request;
  a sweep says so for the spec's point before running any (kvcache-sim
  points of the same grid run at such a capacity)."""
  path = _write(
    tmp_path,
    "[workloads.a]\ngenerator = 'system_prompt'\nrequests = 20\n"
    "[replay]\nsemantics = ['kvcache-sim', 'sglang']\ncapacity = [2, 4000]\n",
  )
  trace = load_spec(path).workloads["a"].load()
  need = -(-int(np.max(trace.kv_tokens)) // 16)
  assert need > 2
  out = tmp_path / "out"
  with pytest.raises(SweepError) as err:
    run_sweep(path, out, plots=False)
  message = str(err.value)
  assert message.startswith(f"{path}: replay point 2 (workload a)"), message
  assert f"at least {need}" in message and "sglang" in message
  assert not (out / "points").exists() or not any((out / "points").iterdir())


def test_a_trace_request_without_output_is_refused_before_any_point(
  rng, tmp_path
):
  trace = tmp_path / "t.jsonl"
  _hash_trace(trace, rng, 12)
  lines = trace.read_text().splitlines()
  empty = int(rng.integers(len(lines)))
  lines[empty] = lines[empty].replace(
    '"output_length": 8', '"output_length": 0'
  )
  trace.write_text("\n".join(lines) + "\n")
  path = _write(
    tmp_path,
    "[workloads.a]\ngenerator = 'system_prompt'\nrequests = 20\n"
    "[workloads.t]\ntrace = 't.jsonl'\n"
    "[simulate]\nnum_blocks = 64\nblock_size = 512\nmax_model_len = 4096\n",
  )
  out = tmp_path / "out"
  with pytest.raises(SweepError) as err:
    run_sweep(path, out, plots=False)
  assert str(err.value).startswith(
    f"{path}: simulate point 1 (workload t): {trace}: request {empty} "
    "(0-based; 1 in all) has output_length 0"
  ), err.value
  assert not (out / "points").exists() or not any((out / "points").iterdir())


def test_an_sglang_prompt_left_no_output_is_refused_before_any_point(
  rng, tmp_path
):
  """Page 16, context 127, 9 usable pages (144 tokens): SGLang's allocator
  bound ``144 - ceil_page(P) - 16 - 1`` leaves prompts of 113-120 tokens
  (still under the 121-token input limit) no output token, SGLang's
  prefill-only path; the point with that pool is refused by name before
  any runs, the one with 20 pages would run."""
  n = 6
  bad_at = int(rng.integers(n))
  bad_len = int(rng.integers(113, 121))
  lines = []
  for i in range(n):
    p = bad_len if i == bad_at else int(rng.integers(4, 100))
    tokens = rng.integers(1, 50, p).tolist()
    lines.append(
      json.dumps(
        dict(input_tok_ids=tokens, output_toks=3, arrival_time_ns=i * 1000)
      )
    )
  (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
  path = _write(
    tmp_path,
    "[workloads.t]\ntrace = 't.jsonl'\n[simulate]\nsemantics = 'sglang'\n"
    "block_size = 16\nnum_blocks = [20, 9]\nmax_num_seqs = 2\n"
    "max_num_batched_tokens = 256\nmax_model_len = 127\n",
  )
  out = tmp_path / "out"
  with pytest.raises(SweepError) as err:
    run_sweep(path, out, plots=False)
  assert str(err.value).startswith(
    f"{path}: simulate point 1 (workload t, num_blocks=9): request {bad_at} "
    f"(0-based; 1 in all): a prompt of {bad_len} tokens"
  ), err.value
  assert "prefill-only" in str(err.value)
  assert not (out / "points").exists() or not any((out / "points").iterdir())


def test_a_folder_of_other_files_is_not_written_into(tmp_path):
  path = _write(tmp_path, "[replay]\ncapacity = 8\n")
  out = tmp_path / "mine"
  out.mkdir()
  (out / "results.csv").write_text("my own numbers\n")
  with pytest.raises(SweepError, match="not a sweep's results"):
    run_sweep(path, out, plots=False)
  assert (out / "results.csv").read_text() == "my own numbers\n"
  (tmp_path / "afile").write_text("")
  with pytest.raises(SweepError, match="afile is a file, not a folder"):
    run_sweep(path, tmp_path / "afile" / "sub", plots=False)


def test_an_absent_optional_trace_skips_its_points_with_the_reason(tmp_path):
  path = _write(
    tmp_path,
    "[workloads.gone]\ntrace = 'no/such/trace.jsonl'\noptional = true\n"
    "[workloads.here]\ngenerator = 'system_prompt'\nrequests = 20\n"
    "[replay]\ncapacity = [8, 16]\nwarmup_fraction = 0.0\n",
  )
  said = []
  result = run_sweep(path, tmp_path / "out", plots=False, log=said.append)
  assert [r["workload"] for r in result.rows] == ["here", "here"]
  assert [i for i, _ in result.skipped] == [0, 1]
  absent = str(tmp_path / "no/such/trace.jsonl")
  assert all(absent in why for _, why in result.skipped)
  assert any(absent in s for s in said)


def test_list_says_what_a_run_would_leave_out_or_skip(tmp_path, capsys):
  """``--list`` prints the notes a run prints first: grid combinations
  left out (with counts) and workloads whose points would be skipped."""
  path = _write(
    tmp_path,
    "[workloads.gone]\ntrace = 'no/such/trace.jsonl'\noptional = true\n"
    "[workloads.here]\ngenerator = 'system_prompt'\nrequests = 20\n"
    "[replay]\ncapacity = [8, 16]\nsemantics = ['kvcache-sim', 'vllm']\n"
    "policy = ['fifo', 'lfu']\n",
  )
  assert main(["sweep", str(path), "--list"]) == 0
  text = capsys.readouterr().out
  # lfu is vllm's alone: kvcache-sim x lfu x 2 capacities x 2 workloads
  assert "replay: 4 points of policy lfu left out (kvcache-sim" in text
  absent = str(tmp_path / "no/such/trace.jsonl")
  assert f"workload gone: trace file {absent} is absent" in text
  assert not (tmp_path / "results").exists()


def test_sharded_over_devices_gives_the_rows_of_one(rng, tmp_path):
  """The simulate group vmapped in a subprocess with 8 faked CPU devices
  (``--xla_force_host_platform_device_count=8`` set before jax is
  imported), its configurations' axis sharded over them, and a vllm replay
  group's capacities the same, against the same groups one configuration
  at a time on one device."""
  text = f"""
[sweep]
vectorize = true
[workloads.w]
generator = "system_prompt"
requests = 16
seed = {int(rng.integers(0, 1000))}
[simulate]
block_size = 8
num_blocks = 129
max_num_seqs = 4
max_num_batched_tokens = [128, 256]
max_model_len = 1024
seed = {sorted(int(s) for s in rng.choice(100, size=2, replace=False))}
arrivals = "poisson"
step_time_ms = 5.0
rate = 40.0
[replay]
semantics = "vllm"
block_size = 16
capacity = [256, 512, 1024]
"""
  path = _write(tmp_path, text)
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_devices(8))
  probe = subprocess.run(
    [sys.executable, "-c", "import jax; print(len(jax.local_devices()))"],
    check=True,
    capture_output=True,
    env=env,
  )
  assert probe.stdout.decode().strip() == "8"
  subprocess.run(
    _sweep_argv(path, tmp_path / "eight"),
    check=True,
    capture_output=True,
    env=env,
  )
  sharded = json.loads((tmp_path / "eight" / "results.json").read_text())
  serial = run_sweep(
    parse_spec(
      {**_toml(text), "sweep": {"vectorize": False}}, source=str(path)
    ),
    tmp_path / "one",
    plots=False,
    devices=jax.local_devices()[:1],
  )
  assert len(sharded) == 7 and len(serial.rows) == 7
  assert sharded == json.loads((tmp_path / "one" / "results.json").read_text())


def _toml(text):
  import tomllib

  return tomllib.loads(text)


def _sweep_argv(path, out):
  return [
    sys.executable,
    "-m",
    "prefixjax",
    "sweep",
    str(path),
    "--out",
    str(out),
    "--no-plots",
    "--no-compile-cache",
  ]


def test_killed_at_any_moment_a_rerun_ends_with_the_clean_rows(rng, tmp_path):
  path = _small_spec(rng, tmp_path, simulate_points=False)
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_devices(1))
  start = time.monotonic()
  subprocess.run(
    _sweep_argv(path, tmp_path / "clean"),
    check=True,
    capture_output=True,
    env=env,
  )
  took = time.monotonic() - start
  killed = tmp_path / "killed"
  proc = subprocess.Popen(
    _sweep_argv(path, killed),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    env=env,
  )
  time.sleep(float(rng.uniform(0.2, 1.0)) * took)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  partial = (
    len(list((killed / "points").glob("*.json"))) if killed.exists() else 0
  )
  print(f"killed after {partial} points")
  done = subprocess.run(
    _sweep_argv(path, killed), check=True, capture_output=True, env=env
  )
  assert "points" in done.stdout.decode()
  clean = (tmp_path / "clean" / "results.csv").read_text()
  assert (killed / "results.csv").read_text() == clean
  assert json.loads((killed / "results.json").read_text()) == json.loads(
    (tmp_path / "clean" / "results.json").read_text()
  )
  assert not [p for p in (killed / "points").iterdir() if p.name[0] == "."]


def test_cli_prints_the_table_and_where_the_files_are(tmp_path, capsys):
  path = _write(
    tmp_path,
    "[workloads.w]\ngenerator = 'system_prompt'\nrequests = 30\n"
    "[replay]\npolicy = ['fifo', 'belady_leaf']\ncapacity = [8, 32, 64]\n",
  )
  out = tmp_path / "out"
  assert main(["sweep", str(path), "--out", str(out)]) == 0
  text = capsys.readouterr().out
  assert "belady_leaf" in text and str(out / "results.csv") in text
  pngs = sorted((out / "plots").glob("*.png"))
  assert [p.name for p in pngs] == ["hit_rate_w_kvcache-sim_k16.png"]
  assert pngs[0].stat().st_size > 10_000
  assert pngs[0].with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
  assert main(["sweep", str(path), "--list"]) == 0
  listing = capsys.readouterr().out
  assert listing.count("[") >= 6 and "group of 3" in listing


def test_the_table_marks_underfilled_points(tmp_path):
  """kvcache-sim reports an underfilled capacity's hits as 0; the table
  says which rows those are (the CSV's ``underfilled``)."""
  path = _write(
    tmp_path,
    "[workloads.w]\ngenerator = 'system_prompt'\nrequests = 30\n"
    "[replay]\npolicy = 'fifo'\ncapacity = [8, 100000]\n",
  )
  result = run_sweep(path, None, plots=False)
  assert [r["underfilled"] for r in result.rows] == [False, True]
  lines = result.table().splitlines()
  dashes = next(i for i, x in enumerate(lines) if set(x) <= {"-", " "})
  body = lines[dashes + 1 : dashes + 3]
  assert ["% u" in x for x in body] == [False, True]
  assert lines[-1].startswith("u: underfilled")


def test_cli_refuses_a_bad_spec_before_any_work(tmp_path, capsys):
  path = _write(tmp_path, "[replay]\ncapacity = -1\n")
  out = tmp_path / "out"
  assert main(["sweep", str(path), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert f"{path}: replay.capacity: must be >= 1" in err
  assert not out.exists()


@pytest.mark.parametrize(
  "name",
  sorted(p.stem for p in (ROOT / "experiments").glob("*.toml")),
)
def test_shipped_experiments_are_valid_specs(name):
  path = ROOT / "experiments" / f"{name}.toml"
  for full in (False, True):
    spec = load_spec(path, full=full)
    assert spec.points and spec.name == name


@pytest.mark.parametrize(
  "name",
  sorted(p.stem for p in (ROOT / "experiments").glob("*.toml")),
)
def test_shipped_experiments_load_without_the_shared_traces(name, tmp_path):
  """A shipped spec copied where its relative trace paths lead nowhere (as
  on a machine without ``../shared/traces``) still loads: a trace it reads
  is optional, its points skipped with the reason."""
  copy = tmp_path / "deep" / f"{name}.toml"
  copy.parent.mkdir()
  copy.write_text((ROOT / "experiments" / f"{name}.toml").read_text())
  spec = load_spec(copy)
  for w in spec.workloads.values():
    if w.trace is not None:
      assert w.optional and w.missing() == f"trace file {w.trace} is absent"


def test_quickstart_workload_is_the_built_in_generator():
  spec = load_spec(ROOT / "experiments" / "quickstart.toml")
  trace = spec.workloads["mixed"].load()
  again = workloads.generate_workload("default", num_requests=400, seed=0)
  assert np.array_equal(trace.input_lengths, again.input_lengths)


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(path, out, env, stream):
  """``prefixjax sweep --distributed`` as processes 0 and 1 of 2, one
  coordinator on a free localhost port."""
  port = _free_port()
  return [
    subprocess.Popen(
      [
        *_sweep_argv(path, out),
        "--distributed",
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(i),
      ],
      stdout=stream,
      stderr=stream,
      env=env,
    )
    for i in range(2)
  ]


def test_two_processes_on_localhost_give_the_rows_of_one(rng, tmp_path):
  """``--distributed`` with 2 processes (jax.distributed on CPU, one
  coordinator on localhost) into one DIR, against a single-process run."""
  path = _small_spec(rng, tmp_path, simulate_points=False)
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_devices(1))
  single = tmp_path / "single"
  subprocess.run(
    _sweep_argv(path, single), check=True, capture_output=True, env=env
  )
  both = tmp_path / "both"
  procs = _two_processes(path, both, env, subprocess.PIPE)
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_out, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err.decode()[-2000:]
  assert "process 1 of 2" in outs[1][0].decode()
  timing = json.loads((both / "timing.json").read_text())
  ran_by_0 = {i for t in timing for i in t["points"]}
  assert 0 < len(ran_by_0) < 12  # process 1 ran the rest
  for name in ("results.csv", "results.json"):
    assert (both / name).read_text() == (single / name).read_text()


def test_a_distributed_run_killed_midway_leaves_dir_resumable(rng, tmp_path):
  """Two ``--distributed`` processes, SIGKILLed at a random moment; a
  plain rerun into the same DIR ends with the rows of a clean run."""
  path = _small_spec(rng, tmp_path, simulate_points=False)
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_devices(1))
  clean = tmp_path / "clean"
  start = time.monotonic()
  subprocess.run(
    _sweep_argv(path, clean), check=True, capture_output=True, env=env
  )
  took = time.monotonic() - start
  killed = tmp_path / "killed"
  procs = _two_processes(path, killed, env, subprocess.DEVNULL)
  time.sleep(float(rng.uniform(0.1, 0.7)) * took)
  for proc in procs:
    proc.send_signal(signal.SIGKILL)
  for proc in procs:
    proc.wait()
  partial = (
    len(list((killed / "points").glob("*.json")))
    if (killed / "points").exists()
    else 0
  )
  print(f"killed after {partial} points")
  subprocess.run(
    _sweep_argv(path, killed), check=True, capture_output=True, env=env
  )
  for name in ("results.csv", "results.json"):
    assert (killed / name).read_text() == (clean / name).read_text()
  assert not [p for p in (killed / "points").iterdir() if p.name[0] == "."]


def test_distributed_flags_need_distributed(tmp_path, capsys):
  path = _write(tmp_path, "[replay]\ncapacity = 8\n")
  assert main(["sweep", str(path), "--process-id", "1"]) == 2
  assert "--process-id is for --distributed" in capsys.readouterr().err
  for address in ("nohost", "host:", ":1234", "host:99999", "host:x"):
    argv = ["sweep", str(path), "--out", str(tmp_path / "o"), "--distributed"]
    argv += ["--coordinator-address", address, "--num-processes", "2"]
    assert main([*argv, "--process-id", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--coordinator-address {address!r}: must be HOST:PORT" in err


# ---------------------------------------------------------------------------
# Eviction policies with parameters (vllm semantics).


def _small_system_prompt(seed: int):
  return {
    "generator": "system_prompt",
    "requests": 30,
    "seed": seed,
    "params": {
      "prompt_len": [64, 256],
      "question_len": [8, 64],
      "output_len": [4, 32],
    },
  }


def test_vllm_policy_grid_rows_equal_direct_replay(rng, tmp_path):
  """``policy = [lru, lfu, fifo]`` with ``policy_params = [{}, { decay }]``
  under vllm semantics: the decay table is crossed with lfu only (lru and
  fifo take no decay: left out and said), and every row equals
  :func:`prefixjax.replay.replay` called with that point's policy and
  parameters."""
  seed = int(rng.integers(1 << 30))
  workload = _small_system_prompt(seed)
  trace = workloads.generate_workload(
    "system_prompt",
    num_requests=30,
    seed=seed,
    **workload["params"],
  )
  need = -(-int(trace.kv_tokens.max()) // 16)
  capacities = [need, need + int(rng.integers(2, 40))]
  decay = float(rng.choice([0.3, 0.5, 0.9]))
  spec = parse_spec(
    {
      "workloads": {"w": workload},
      "replay": {
        "semantics": "vllm",
        "policy": ["lru", "lfu", "fifo"],
        "policy_params": [{}, {"decay": decay}],
        "capacity": capacities,
        "warmup_fraction": 0.25,
      },
    },
    source=str(tmp_path / "spec.toml"),
  )
  text = json.dumps({"decay": decay})
  assert sorted(spec.left_out_params) == [("fifo", text, 2), ("lru", text, 2)]
  said = []
  result = run_sweep(spec, tmp_path / "out", plots=False, log=said.append)
  assert any(
    f"2 points of policy fifo with policy_params {text} left out" in m
    for m in said
  )
  got = [(r["policy"], r["policy_params"], r["capacity"]) for r in result.rows]
  assert got == [
    (policy, params, c)
    for policy, params in (
      ("lru", "{}"),
      ("lfu", "{}"),
      ("lfu", text),
      ("fifo", "{}"),
    )
    for c in capacities
  ]
  for i in range(0, len(result.rows), 2):  # the capacities of one call
    rows = result.rows[i : i + 2]
    want = rp.replay(
      trace,
      semantics="vllm",
      policy=rows[0]["policy"],
      policy_params=json.loads(rows[0]["policy_params"]),
      capacities=capacities,
      warmup_fraction=0.25,
    )
    for row, point in zip(rows, want, strict=True):
      assert row["capacity"] == point.capacity_blocks
      assert row["hit_tokens"] == point.hit_tokens, row
      assert row["total_tokens"] == point.total_tokens, row
      assert row["hit_rate"] == point.hit_rate, row
  assert result.rows[-1]["hit_tokens"] > 0


def test_policy_params_spec_rules(tmp_path):
  """Combinations that cannot run are refused before any work, naming the
  file, the field and the rule."""
  source = str(tmp_path / "spec.toml")

  def refused(replay=None, points=None):
    data = {"workloads": {"w": _small_system_prompt(0)}}
    if replay is not None:
      data["replay"] = {"capacity": 64, **replay}
    if points is not None:
      data["points"] = points
    with pytest.raises(SpecError) as err:
      parse_spec(data, source=source)
    return str(err.value)

  message = refused({"policy": "lfu", "policy_params": {"decay": 0.5}})
  assert message.startswith(f"{source}: replay.policy: ")
  assert "no listed semantics serves lfu (semantics vllm does)" in message
  message = refused(
    {
      "semantics": ["kvcache-sim", "sglang"],
      "policy": "lru_leaf",
      "policy_params": [{}, {"decay": 0.5}],
    }
  )
  assert message.startswith(f'{source}: replay.policy_params={{"decay": 0.5}}')
  assert "no listed policy takes it (policy lru_leaf takes no" in message
  message = refused(
    {
      "semantics": "vllm",
      "policy": ["lru", "fifo"],
      "policy_params": [{}, {"decay": 0.5}],
    }
  )
  assert "policy lru takes no parameter 'decay'" in message
  message = refused(
    {"semantics": "vllm", "policy": "lfu", "policy_params": {"decay": 1.5}}
  )
  assert 'replay.policy_params={"decay": 1.5}: policy lfu: decay=1.5' in message
  message = refused(
    points=[
      {
        "mode": "replay",
        "semantics": "vllm",
        "policy": "lru",
        "capacity": 64,
        "policy_params": {"decay": 0.5},
      }
    ]
  )
  assert message.startswith(f"{source}: points[0]: replay.policy_params=")
  assert "policy lru takes no parameter 'decay'" in message
  # lfu under vllm with a decay grid: runs (parsed), the decays apart.
  spec = parse_spec(
    {
      "workloads": {"w": _small_system_prompt(0)},
      "replay": {
        "semantics": ["kvcache-sim", "vllm"],
        "policy": ["fifo", "lfu"],
        "policy_params": [{}, {"decay": 0.5}, {"decay": 0.9}],
        "capacity": 64,
      },
    },
    source=source,
  )
  assert [
    (p.get("semantics"), p.get("policy"), p.get("policy_params"))
    for p in spec.points
  ] == [
    ("kvcache-sim", "fifo", "{}"),
    ("vllm", "fifo", "{}"),
    ("vllm", "lfu", "{}"),
    ("vllm", "lfu", '{"decay": 0.5}'),
    ("vllm", "lfu", '{"decay": 0.9}'),
  ]
  assert ("kvcache-sim", "lfu", 3) in spec.left_out
