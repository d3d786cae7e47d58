"""``prefixjax simulate``: the serving simulator from the command line."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
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
      status=r["status"],
      prompt_tokens=r["prompt_len"],
      max_output_tokens=r["max_tokens"],
      output_tokens=r.get("num_output_tokens", 0),
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
    (["--semantics", "sglang", "--low-priority-first"], "--low-priority-first"),
    (
      ["--semantics", "sglang", "--no-priority-preemption"],
      "--no-priority-preemption",
    ),
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


@pytest.mark.parametrize(
  "extra",
  [
    ["--step-time-ms", "inf"],
    ["--step-time-ms", "nan"],
    ["--arrivals", "poisson", "--step-time-ms", "1", "--rate", "inf"],
  ],
)
def test_times_and_rates_must_be_finite(extra, capsys):
  """A JSON summary cannot hold inf (strict parsers reject ``Infinity``)."""
  with pytest.raises(SystemExit) as exit_info:
    main(["simulate", *FLAGS, *extra])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"argument {extra[-2]}" in err and "must be a finite number" in err


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


@pytest.mark.parametrize(
  "semantics, extra, lowest_first",
  [
    ("vllm", [], True),
    ("sglang", [], False),
    ("sglang", ["--low-priority-first"], True),
  ],
)
def test_a_trace_files_priorities_order_the_queue(
  tmp_path, capsys, rng, semantics, extra, lowest_first
):
  """A token-id JSONL trace's ``priority`` fields reach ``--scheduler
  priority``: one request runs at a time, all arrive at once, so requests
  start in priority order (vLLM: lowest first; SGLang: highest first unless
  ``--low-priority-first``); under vLLM every request also equals the
  Python model's, fed the file's own records."""
  n = int(rng.integers(4, 8))
  priority = rng.choice(np.arange(-40, 40), size=n, replace=False)
  records = [
    dict(
      input_tok_ids=rng.integers(1, 30000, int(rng.integers(5, 40))).tolist(),
      output_toks=int(rng.integers(1, 4)),
      arrival_time_ns=0,
      priority=int(p),
    )
    for p in priority
  ]
  trace = tmp_path / "t.jsonl"
  trace.write_text("".join(json.dumps(r) + "\n" for r in records))
  reqs_out = tmp_path / "r.jsonl"
  argv = ["--trace", str(trace), "--no-trace-cache", "--semantics", semantics]
  argv += ["--scheduler", "priority", "--arrivals", "zero", *extra]
  argv += ["--block-size", "16", "--num-blocks", "160", "--max-num-seqs", "1"]
  argv += ["--max-num-batched-tokens", "256", "--max-model-len", "2048"]
  argv += ["--no-compile-cache", "--requests-out", str(reqs_out)]
  assert main(["simulate", *argv]) == 0
  capsys.readouterr()
  lines = [json.loads(x) for x in reqs_out.read_text().splitlines()]
  started = np.argsort([x["first_token_step"] for x in lines], kind="stable")
  expect = np.argsort(priority if lowest_first else -priority)
  assert started.tolist() == expect.tolist(), priority
  if semantics == "vllm":
    config = dataclasses.replace(CONFIG, max_num_seqs=1, scheduler="priority")
    _, reqs = VllmScheduler(**model_kwargs(config)).simulate(records)
    assert [x["finish_step"] for x in lines] == [r["finish_step"] for r in reqs]


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


def test_rejected_requests_are_reported(rng, capsys, monkeypatch):
  """Prompts of ``max_model_len`` tokens or more are rejected (vLLM's input
  check); the CLI says how many, and refuses before any work a run where
  every request would be."""
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

  def boom(*a, **k):
    raise AssertionError("simulate ran")

  monkeypatch.setattr(serving, "simulate", boom)
  argv = [*FLAGS[:-3], "--max-model-len", "16", "--no-compile-cache"]
  argv[argv.index("--max-num-batched-tokens") + 1] = "16"
  assert main(["simulate", *argv]) == 2
  err = capsys.readouterr().err
  assert (
    f"all 8 requests would be rejected: prompts of {lens[0]:,}-{lens[-1]:,} "
    "tokens, none both non-empty and shorter than --max-model-len 16"
  ) in err, err


def _mooncake_rows(rng, n):
  """Mooncake records: each extends a random earlier one's first hash
  blocks (or starts afresh) with new ids; the last 512-token block partial."""
  rows, next_id = [], 0
  for _ in range(n):
    keep = []
    if rows and rng.random() < 0.8:
      base = rows[int(rng.integers(len(rows)))]["hash_ids"]
      keep = base[: int(rng.integers(1, len(base) + 1))]
    new = int(rng.integers(0 if keep else 1, 3))
    ids = keep + list(range(next_id, next_id + new))
    next_id += new
    rows.append(
      dict(
        timestamp=0,
        input_length=(len(ids) - 1) * 512 + int(rng.integers(1, 513)),
        output_length=int(rng.integers(1, 4)),
        hash_ids=ids,
      )
    )
  return rows


def test_a_trace_request_without_output_is_refused_naming_it(
  tmp_path, capsys, rng
):
  rows = _mooncake_rows(rng, int(rng.integers(3, 9)))
  empty = int(rng.integers(len(rows)))
  rows[empty]["output_length"] = 0
  path = tmp_path / "mooncake.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert main(["simulate", "--trace", str(path), "--no-compile-cache"]) == 2
  err = capsys.readouterr().err
  assert (
    f"{path}: request {empty} (0-based; 1 in all) has output_length 0" in err
  )


def test_a_mooncake_trace_is_served_with_its_sharing(tmp_path, capsys, rng):
  """Hash ids become tokens (equal ids, equal tokens). One request at a
  time in a pool that never evicts, each first-admission hit is the longest
  shared prefix with an earlier prompt, read off the hash ids alone, cut to
  whole blocks and capped at ``prompt - 1`` tokens."""
  rows = _mooncake_rows(rng, 10)
  path = tmp_path / "mooncake.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  k = 16
  argv = ["simulate", "--trace", str(path), "--format", "mooncake"]
  argv += ["--block-size", str(k), "--num-blocks", "4096"]
  argv += ["--max-num-seqs", "1", "--max-num-batched-tokens", "4096"]
  # Room for every prompt and its outputs (a chain of extensions can pass
  # 4,096 tokens: seed 598232797 drew 4,101, rejected, hit None).
  longest = max(r["input_length"] + r["output_length"] for r in rows)
  argv += ["--max-model-len", str(max(4096, longest + 1)), "--no-compile-cache"]
  argv += ["--requests-out", str(tmp_path / "r.jsonl")]
  assert main(argv) == 0
  capsys.readouterr()
  got = [
    json.loads(x)["hit_tokens"]
    for x in (tmp_path / "r.jsonl").read_text().splitlines()
  ]
  want = []
  for i, r in enumerate(rows):
    shared = 0
    for s in rows[:i]:
      a, b = r["hash_ids"], s["hash_ids"]
      m = min(len(a), len(b))
      d = next((x for x in range(m) if a[x] != b[x]), m)
      n = min(r["input_length"], s["input_length"])
      shared = max(shared, n if d == m else min(d * 512, n))
    want.append(min(shared, r["input_length"] - 1) // k * k)
  assert got == want
  assert sum(want) > 0


def test_a_length_only_trace_is_served_with_a_warning(tmp_path, capsys, rng):
  """No token ids, no hash ids: served with tokens of its own per request,
  every hit 0, and the CLI says so (the Python API refuses it unless asked
  through ``Trace.with_token_ids``)."""
  n = int(rng.integers(3, 8))
  path = tmp_path / "lengths.csv"
  lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
  for i in range(n):
    lines.append(
      f"2023-11-16 18:15:46.{i:06d},{rng.integers(20, 60)},{rng.integers(1, 4)}"
    )
  path.write_text("\n".join(lines) + "\n")
  out = tmp_path / "m.json"
  argv = ["simulate", "--trace", str(path), "--num-blocks", "64"]
  argv += ["--max-model-len", "64", "--no-compile-cache", "--json", str(out)]
  assert main(argv) == 0
  assert "lengths only" in capsys.readouterr().err
  summary = json.loads(out.read_text())
  assert summary["requests"] == n and summary["hit_tokens"] == 0
  trace = pj.load_trace(str(path))
  with pytest.raises(ValueError, match="lengths only"):
    serving.simulate(trace, CONFIG)


def test_the_table_says_what_ran_and_leaves_out_what_it_cannot_time(
  tmp_path, capsys, rng
):
  # At least the 128 blocks max_model_len 2048 needs (smaller is refused).
  blocks = int(rng.integers(128, 400))
  seqs = int(rng.integers(2, 9))
  out = tmp_path / "s.json"
  flags = [*FLAGS, "--num-blocks", str(blocks), "--max-num-seqs", str(seqs)]
  capsys.readouterr()  # the rng fixture's seed line
  assert main(["simulate", *flags, "--json", str(out)]) == 0
  lines = capsys.readouterr().out.splitlines()
  header = lines[0]
  assert header.startswith("prefixjax simulate: multi_turn (8 requests)")
  for part in (
    "vllm semantics",
    "fcfs scheduler",
    f"{blocks:,} blocks of 16 tokens",
    f"max_num_seqs {seqs},",
    "chunked prefill on",
    "steps clock",
    "every request arriving at step 0",
  ):
    assert part in header, (part, header)
  summary = json.loads(out.read_text())
  untimed = [k for k, v in summary.items() if v is None]
  assert untimed and all(k.endswith("_s") or "_s_" in k for k in untimed)
  rows = {line.split()[0]: line.split()[1] for line in lines[1:-2]}
  assert set(rows) == set(summary) - set(untimed)
  assert rows["steps"] == f"{summary['steps']:,}"
  assert lines[-2].startswith(f"({len(untimed)} metrics in seconds need")
  assert lines[-1].startswith("load ") and lines[-1].endswith(
    f"({summary['steps']:,} steps)"
  )
  # With a step time every metric has a value: no note.
  assert main(["simulate", *flags, "--step-time-ms", "10"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "steps of 10 ms" in lines[0]
  assert len(lines[1:-1]) == len(summary)
  assert not lines[-2].startswith("(")


def test_one_configuration_asks_xla_for_one_thread(monkeypatch, capsys):
  """In the console script's own process ``simulate`` sets ``PJRT_NPROC=1``
  before JAX creates its CPU client, unless the environment names a count,
  and its header says which. (This test process's client exists already:
  the variable changes nothing here, the command only sets and reads it.)"""
  from prefixjax import _host, cli

  monkeypatch.setattr(cli, "_OWN_PROCESS", True)
  monkeypatch.setattr(cli.gc, "freeze", lambda: None)
  for name in _host.XLA_THREADS_ENV:
    # set first, so that monkeypatch restores the value from before the
    # test (a variable it only deletes, absent, it leaves as the test left
    # it: PJRT_NPROC=1 would reach every later subprocess)
    monkeypatch.setenv(name, "0")
    monkeypatch.delenv(name)
  assert main(["simulate", *FLAGS]) == 0
  assert os.environ["PJRT_NPROC"] == "1"
  assert capsys.readouterr().out.splitlines()[0].endswith(" (PJRT_NPROC=1)")
  monkeypatch.delenv("PJRT_NPROC")
  monkeypatch.setenv("NPROC", "3")  # a count of the user's: kept
  assert main(["simulate", *FLAGS]) == 0
  assert "PJRT_NPROC" not in os.environ
  assert capsys.readouterr().out.splitlines()[0].endswith(" (NPROC=3)")
  # called from other code (not the console script): nothing set
  monkeypatch.setattr(cli, "_OWN_PROCESS", False)
  monkeypatch.delenv("NPROC")
  assert main(["simulate", *FLAGS]) == 0
  assert "PJRT_NPROC" not in os.environ
  assert (
    capsys.readouterr().out.splitlines()[0].endswith(" (a thread per core)")
  )


@pytest.mark.parametrize(
  "environ, set_it, words",
  [
    ({}, True, "PJRT_NPROC=1"),
    ({"PJRT_NPROC": "4"}, False, "PJRT_NPROC=4"),
    ({"NPROC": "2"}, False, "NPROC=2"),
    ({"NPROC": "2", "PJRT_NPROC": "5"}, False, "PJRT_NPROC=5"),
  ],
)
def test_one_xla_thread_keeps_a_count_already_named(environ, set_it, words):
  from prefixjax._host import one_xla_thread, xla_threads

  before = dict(environ)
  assert one_xla_thread(environ) is set_it
  assert environ == ({**before, "PJRT_NPROC": "1"} if set_it else before)
  assert xla_threads(environ) == words
