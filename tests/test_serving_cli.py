"""``prefixjax simulate``: the serving simulator from the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from reference_models.vllm_scheduler import VllmScheduler, model_kwargs

import prefixjax as pj
from prefixjax import serving
from prefixjax.cli import main

FLAGS = [
  "--workload", "multi_turn", "--requests", "8", "--seed", "3",
  "--block-size", "16", "--num-blocks", "160", "--max-num-seqs", "4",
  "--max-num-batched-tokens", "256", "--max-model-len", "2048",
  "--no-compile-cache",
]  # fmt: skip
CONFIG = serving.ServingConfig(
  num_gpu_blocks=161,
  block_size=16,
  max_num_seqs=4,
  max_num_batched_tokens=256,
  max_model_len=2048,
)


def test_json_and_jsonl_match_simulate_and_model(tmp_path, capsys):
  out, reqs_out = tmp_path / "m.json", tmp_path / "r.jsonl"
  argv = [*FLAGS, "--arrivals", "trace", "--step-time-ms", "5"]
  argv += ["--json", str(out), "--requests-out", str(reqs_out)]
  assert main(["simulate", *argv]) == 0
  assert "token_hit_rate" in capsys.readouterr().out
  trace = pj.generate_workload("multi_turn", num_requests=8, seed=3)
  got = serving.simulate(trace, CONFIG, arrivals="trace", step_time_ms=5.0)
  summary = json.loads(out.read_text())
  assert summary == json.loads(json.dumps(got.metrics()))
  assert {"steps", "hit_tokens", "preemptions", "evictions"} <= set(summary)
  model = VllmScheduler(**model_kwargs(CONFIG))
  _, reqs = model.simulate(serving.records_from_trace(trace), "time", 5.0)
  lines = [json.loads(x) for x in reqs_out.read_text().splitlines()]
  assert len(lines) == len(trace)
  assert lines == [
    dict(
      id=r["rid"],
      prompt_tokens=r["prompt_len"],
      hit_tokens=r.get("hit_first_sched"),  # rejected: no such keys
      first_token_step=r.get("first_token_step"),
      finish_step=r.get("finish_step"),
      preemptions=r.get("num_preemptions", 0),
    )
    for r in reqs
  ]


@pytest.mark.parametrize(
  "extra, flag",
  [
    (["--num-blocks", "3"], "--num-blocks"),
    (["--max-num-batched-tokens", "2"], "--max-num-batched-tokens"),
    (["--block-size", "0"], "--block-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--scheduler", "lifo"], "--scheduler"),
    (
      ["--priority-preemption-threshold", "3"],
      "--priority-preemption-threshold",
    ),
    (["--max-prefill-tokens", "100"], "--max-prefill-tokens"),
    (["--semantics", "sglang", "--num-blocks", "120"], "--num-blocks"),
    (["--arrivals", "trace"], "--step-time-ms"),
    (["--arrivals", "poisson", "--step-time-ms", "1"], "--rate"),
    (["--arrivals", "zero", "--rate", "3"], "--rate"),
    (["--workload", "nope"], "--workload"),
    (["--json", "/no/such/folder/m.json"], "--json"),
    (["--requests-out", "/no/such/folder/r.jsonl"], "--requests-out"),
  ],
)
def test_bad_flags_exit_2_naming_the_flag(extra, flag, capsys, monkeypatch):
  def boom(*a, **k):  # refused before any work
    raise AssertionError("simulate ran")

  monkeypatch.setattr(serving, "simulate", boom)
  argv = [*FLAGS, "--arrivals", "zero", *extra]
  assert main(["simulate", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and flag in err, err


def test_priority_scheduler_matches_simulate_and_model(tmp_path, capsys):
  out, reqs_out = tmp_path / "m.json", tmp_path / "r.jsonl"
  argv = [*FLAGS, "--arrivals", "trace", "--step-time-ms", "5"]
  argv += ["--scheduler", "priority", "--num-blocks", "33"]
  argv += ["--max-model-len", "512"]
  argv += ["--json", str(out), "--requests-out", str(reqs_out)]
  assert main(["simulate", *argv]) == 0
  capsys.readouterr()
  config = dataclasses.replace(
    CONFIG, num_gpu_blocks=34, max_model_len=512, scheduler="priority"
  )
  trace = pj.generate_workload("multi_turn", num_requests=8, seed=3)
  records = serving.records_from_trace(trace)  # no priorities: all 0
  got = serving.simulate(records, config, arrivals="trace", step_time_ms=5.0)
  assert json.loads(out.read_text()) == json.loads(json.dumps(got.metrics()))
  model = VllmScheduler(**model_kwargs(config))
  steps, reqs = model.simulate(records, "time", 5.0)
  assert got.steps() == steps and got.requests() == reqs
  lines = [json.loads(x) for x in reqs_out.read_text().splitlines()]
  assert [x["finish_step"] for x in lines] == [
    r.get("finish_step") for r in reqs
  ]


def test_sglang_semantics_from_the_command_line(tmp_path, capsys):
  """``--semantics sglang``: the JSON is the API's metrics, each JSONL line
  the Python model's request (SGLang 0.5.23's loop, written from source)."""
  from reference_models.sglang_scheduler import SglangScheduler

  out, reqs_out = tmp_path / "m.json", tmp_path / "r.jsonl"
  argv = [*FLAGS, "--semantics", "sglang", "--scheduler", "lpm"]
  argv += ["--max-prefill-tokens", "512"]
  argv += ["--json", str(out), "--requests-out", str(reqs_out)]
  assert main(["simulate", *argv]) == 0
  assert "token_hit_rate" in capsys.readouterr().out
  config = dataclasses.replace(
    CONFIG, semantics="sglang", scheduler="lpm", max_prefill_tokens=512
  )
  trace = pj.generate_workload("multi_turn", num_requests=8, seed=3)
  got = serving.simulate(trace, config)
  assert json.loads(out.read_text()) == json.loads(json.dumps(got.metrics()))
  model = SglangScheduler(
    num_pages=160,
    page_size=16,
    max_running_requests=4,
    chunked_prefill_size=256,
    max_prefill_tokens=512,
    max_model_len=2048,
    policy="lpm",
  )
  _, reqs = model.simulate(serving.records_from_trace(trace), [0] * 8)
  lines = [json.loads(x) for x in reqs_out.read_text().splitlines()]
  assert [(x["hit_tokens"], x["finish_step"]) for x in lines] == [
    (None, None) if r["rejected"] else (r["hit_tokens"], r["finish_step"])
    for r in reqs
  ]


def test_a_trace_is_served_whole_unless_requests_says(tmp_path, capsys, rng):
  """``--requests`` sizes a generated workload (default 200); a trace is
  served whole by default (it used to be cut at 200, without a word)."""
  n = 200 + int(rng.integers(1, 6))
  path = tmp_path / "t.jsonl"
  with path.open("w") as f:
    for _ in range(n):
      rec = dict(
        input_tok_ids=rng.integers(1, 50, int(rng.integers(2, 9))).tolist(),
        output_toks=int(rng.integers(1, 3)),
        arrival_time_ns=0,
      )
      f.write(json.dumps(rec) + "\n")
  out = tmp_path / "m.json"
  argv = ["simulate", "--trace", str(path), "--num-blocks", "64"]
  argv += ["--max-model-len", "64", "--no-compile-cache", "--json", str(out)]
  assert main(argv) == 0
  capsys.readouterr()
  assert json.loads(out.read_text())["requests"] == n


def test_rejected_requests_are_reported(rng, capsys):
  """Prompts of ``max_model_len`` tokens or more are rejected (vLLM's input
  check); the CLI says how many, and when none is left to simulate."""
  trace = pj.generate_workload("multi_turn", num_requests=8, seed=3)
  lens = sorted(int(x) for x in trace.input_lengths)
  # A limit between two prompt lengths: some requests are rejected.
  mml = int(rng.integers(lens[2], lens[-1])) + 1
  mml = max(mml, 64)
  argv = [*FLAGS[:-3], "--max-model-len", str(mml), "--no-compile-cache"]
  assert main(["simulate", *argv]) == 0
  err = capsys.readouterr().err
  n = sum(x >= mml for x in lens)
  assert f"{n} of 8 requests rejected ({n} with prompts of" in err
  assert "nothing was simulated" not in err
  argv = [*FLAGS[:-3], "--max-model-len", "16", "--no-compile-cache"]
  argv[argv.index("--max-num-batched-tokens") + 1] = "16"
  assert main(["simulate", *argv]) == 0
  err = capsys.readouterr().err
  assert "8 of 8 requests rejected" in err and "nothing was simulated" in err
