"""The ``prefixjax`` CLI and the built-in demo, checked against arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from reference_models import sglang_radix

from prefixjax import cli, demo, generate_workload, replay
from prefixjax.workloads import load_trace as pj_load


@pytest.mark.parametrize("block_size", [8, 16])
def test_demo_matches_closed_form(block_size, rng):
  seed = int(rng.integers(0, 2**31))
  samples = int(rng.integers(2, 5))
  requests = samples * int(rng.integers(2, 5))
  (row,) = demo.run_demo(
    block_sizes=[block_size],
    num_requests=requests,
    samples=samples,
    seed=seed,
    pool_tokens=1 << 16,
  )
  trace = generate_workload(
    "parallel_sampling", num_requests=requests, seed=seed, n=samples
  )
  copies, peak = 0, 0
  for group in np.unique(trace.session_ids):
    members = np.nonzero(trace.session_ids == group)[0]
    prompt = int(trace.input_lengths[members[0]])
    full = prompt // block_size
    # Round-robin decode: every sample but the last to write copies the
    # shared partial prompt block; full prompt blocks stay shared.
    copies += (len(members) - 1) * (prompt % block_size != 0)
    held = [
      -(-(prompt + int(trace.output_lengths[r])) // block_size) for r in members
    ]
    peak = max(peak, full + sum(h - full for h in held))
  assert row.copies == copies
  assert row.peak_blocks == peak
  assert row.out_of_blocks == 0


def test_demo_reports_out_of_blocks_in_a_small_pool():
  (row,) = demo.run_demo(
    block_sizes=[16], num_requests=8, samples=4, seed=1, pool_tokens=512
  )
  assert row.out_of_blocks > 0


def test_cli_demo_prints_table_and_json(tmp_path, capsys):
  out = tmp_path / "demo.json"
  code = cli.main(
    ["demo", "--requests", "8", "--block-sizes", "16", "32", "--json", str(out)]
  )
  assert code == 0
  text = capsys.readouterr().out
  assert "peak blocks" in text and "CoW" in text
  rows = json.loads(out.read_text())
  assert [r["block_size"] for r in rows] == [16, 32]


@pytest.mark.parametrize(
  "argv, message",
  [
    (["demo", "--block-sizes", "0"], "0 must be > 0"),
    (["demo", "--requests", "x"], "'x' is not an integer"),
  ],
)
def test_cli_rejects_bad_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_cli_errors_are_one_line_exit_2(capsys):
  code = cli.main(["demo", "--requests", "2", "--samples", "4"])
  assert code == 2
  err = capsys.readouterr().err
  assert err.startswith("prefixjax demo: error: num_requests=2 must be >=")
  assert "Traceback" not in err


def test_console_script_help_lists_subcommands():
  result = subprocess.run(
    [sys.executable, "-m", "prefixjax.cli", "--help"],
    capture_output=True,
    text=True,
    check=True,
  )
  assert "demo" in result.stdout


def _write_mooncake(path, rows):
  """A Mooncake-format JSONL of ``(hash_ids, input_length, output_length)``."""
  path.write_text(
    "".join(
      json.dumps(
        dict(timestamp=i, input_length=n, output_length=o, hash_ids=ids)
      )
      + "\n"
      for i, (ids, n, o) in enumerate(rows)
    )
  )


def test_python_m_prefixjax_runs_a_command_in_its_own_process(tmp_path, rng):
  """``python -m prefixjax`` (the console script's :func:`cli.run`): a
  replay's JSON equals the library's, bad input exits 2 with the one-line
  message, and the process exits cleanly after ``gc.freeze``."""
  trace = tmp_path / "t.jsonl"
  rows = []
  for _ in range(int(rng.integers(4, 9))):
    steps = rng.integers(1, 3, int(rng.integers(1, 5)))
    ids = [int(x) for x in np.cumsum(steps)]
    rows.append((ids, 10 * len(ids) - int(rng.integers(0, 10))))
  _write_mooncake(trace, [(ids, n, 1) for ids, n in rows])
  out = tmp_path / "r.json"
  argv = [sys.executable, "-m", "prefixjax", "replay", "--trace", str(trace)]
  argv += ["--block-size", "10", "--capacity", "2", "5", "--policy", "fifo"]
  env = {**os.environ, "PREFIXJAX_COMPILE_CACHE": "off"}
  done = subprocess.run(
    [*argv, "--json", str(out)], capture_output=True, text=True, env=env
  )
  assert done.returncode == 0, done.stderr
  plan = replay.prepare_replay(
    [r[0] for r in rows], [r[1] for r in rows], block_size=10
  )
  want = replay.replay(plan, policy="fifo", capacities=[2, 5])
  got = json.loads(out.read_text())["points"]
  assert [p["hit_tokens"] for p in got] == [w.hit_tokens for w in want]
  bad = subprocess.run(
    [*argv, "--json", str(tmp_path / "no" / "such" / "dir" / "r.jsonx")],
    capture_output=True,
    text=True,
    env=env,
  )
  assert bad.returncode == 2
  assert bad.stderr.startswith("prefixjax replay: error:"), bad.stderr
  assert "Traceback" not in bad.stderr


def test_cli_replay_json_matches_library(tmp_path, capsys):
  trace = tmp_path / "t.jsonl"
  rows = [([1, 2], 20), ([1, 2, 3], 30), ([1, 4], 17), ([1, 2, 3], 24)]
  _write_mooncake(trace, [(ids, n, 1) for ids, n in rows])
  out = tmp_path / "r.json"
  argv = ["replay", "--trace", str(trace), "--block-size", "10"]
  argv += ["--capacity", "2", "8", "--policy", "fifo", "lru_leaf"]
  argv += ["--warmup-fraction", "0.25", "--json", str(out)]
  assert cli.main(argv) == 0
  assert "lru_leaf" in capsys.readouterr().out
  payload = json.loads(out.read_text())
  assert set(payload["timing"]) == {"load_s", "compile_s", "run_s"}
  keys = {
    "policy",
    "capacity_blocks",
    "block_size",
    "hit_tokens",
    "total_tokens",
    "hit_rate",
    "measured_requests",
    "mode",
  }
  assert all(set(p) == keys for p in payload["points"])
  plan = replay.prepare_replay(
    [r[0] for r in rows],
    [r[1] for r in rows],
    block_size=10,
    warmup_fraction=0.25,
  )
  want = replay.replay(plan, policy="lru_leaf", capacities=[2, 8])
  got = [p for p in payload["points"] if p["policy"] == "lru_leaf"]
  assert [p["hit_tokens"] for p in got] == [w.hit_tokens for w in want]


@pytest.mark.parametrize(
  "content, message",
  [
    ("", ":1: "),
    ('{"timestamp": 1, "input_length": 10}\n', ":1: "),
    ("not json\n", ":1: "),
    (
      '{"timestamp": 1, "input_length": 10, "output_length": 1, '
      '"hash_ids": [1]}\n{"timestamp": 2, "input_length": -1, '
      '"output_length": 1, "hash_ids": []}\n',
      ":2: ",
    ),
  ],
)
def test_cli_replay_bad_trace_is_one_line_exit_2(
  tmp_path, capsys, content, message
):
  trace = tmp_path / "bad.jsonl"
  trace.write_text(content)
  assert cli.main(["replay", "--trace", str(trace)]) == 2
  err = capsys.readouterr().err
  assert f"{trace}{message}" in err or (content == "" and str(trace) in err)
  assert "Traceback" not in err


def test_cli_debug_shows_the_exception(tmp_path):
  trace = tmp_path / "bad.jsonl"
  trace.write_text("not json\n")
  from prefixjax import TraceFormatError

  with pytest.raises(TraceFormatError):
    cli.main(["replay", "--trace", str(trace), "--debug"])


def test_cli_replay_sglang_semantics_equals_oracle(tmp_path, capsys, rng):
  # A Mooncake-format trace, block 4: prefixes of three chains of ids.
  rows = []
  for _ in range(12):
    chain = 100 * int(rng.integers(0, 3))
    ids = list(range(chain, chain + int(rng.integers(1, 7))))
    n = 4 * len(ids) - int(rng.integers(0, 4))
    rows.append((ids, n, int(rng.integers(1, 9))))
  trace = tmp_path / "mooncake.jsonl"
  _write_mooncake(trace, rows)
  out = tmp_path / "s.json"
  argv = ["replay", "--trace", str(trace), "--semantics", "sglang"]
  argv += ["--block-size", "4", "--warmup-fraction", "0"]
  assert cli.main(argv + ["--capacity", "9", "30", "--json", str(out)]) == 0
  points = json.loads(out.read_text())["points"]
  for point, capacity in zip(points, (9, 30), strict=True):
    radix = sglang_radix.SglangRadixCache(capacity, 4)
    want = sum(radix.run_request_hashed(ids, n, o) for ids, n, o in rows)
    assert point["policy"] == "lru_leaf"
    assert point["hit_tokens"] == want, capacity
  assert cli.main(argv + ["--capacity", "9", "--policy", "lru"]) == 2
  assert "--policy lru_leaf" in capsys.readouterr().err


def test_cli_replay_vllm_semantics_on_token_trace(tmp_path, capsys):
  trace = tmp_path / "tokens.jsonl"
  shared = list(range(1, 33))
  rows = [shared + [40, 41], shared + [50], shared + [60, 61, 62]]
  trace.write_text(
    "".join(
      json.dumps(
        dict(
          input_toks=len(ids),
          output_toks=2,
          arrival_time_ns=i,
          input_tok_ids=ids,
        )
      )
      + "\n"
      for i, ids in enumerate(rows)
    )
  )
  out = tmp_path / "v.json"
  argv = ["replay", "--trace", str(trace), "--semantics", "vllm"]
  argv += ["--block-size", "8", "--capacity", "40", "--warmup-fraction", "0"]
  argv += ["--json", str(out)]
  assert cli.main(argv) == 0
  (point,) = json.loads(out.read_text())["points"]
  # Requests 2 and 3 hit the 32-token shared prefix (4 whole blocks).
  assert point["hit_tokens"] == 64 and point["policy"] == "lru"
  # Any prefix-cache policy runs under vllm, but only on vLLM >= 0.23's
  # release order (see test_cli_replay_vllm_policy_with_parameters).
  assert cli.main(argv + ["--policy", "fifo", "--vllm-version", "0.22"]) == 2
  assert "--vllm-version 0.23 or later" in capsys.readouterr().err


def test_cli_replay_vllm_semantics_on_mooncake_trace(tmp_path, capsys):
  trace = tmp_path / "mooncake.jsonl"
  # Block 4: request 0's partial block (id 3) fills during decode and is
  # never hit; request 1 caches id 3 as a full block; requests 2 and 3 hit
  # 3 blocks each (request 3's whole-block prompt recomputes its last).
  rows = [([1, 2, 3], 10, 7), ([1, 2, 3, 9], 13, 1), ([1, 2, 3, 4], 16, 1)]
  rows.append(rows[-1])
  _write_mooncake(trace, rows)
  out = tmp_path / "v.json"
  argv = ["replay", "--trace", str(trace), "--semantics", "vllm"]
  argv += ["--block-size", "4", "--warmup-fraction", "0"]
  assert cli.main(argv + ["--capacity", "8", "40", "--json", str(out)]) == 0
  assert "hash ids" in capsys.readouterr().out
  payload = json.loads(out.read_text())
  assert set(payload["timing"]) == {"load_s", "compile_s", "run_s"}
  assert payload["semantics"] == "vllm"
  points = payload["points"]
  assert [p["capacity_blocks"] for p in points] == [8, 40]
  assert all(p["policy"] == "lru" and p["block_size"] == 4 for p in points)
  assert [p["hit_tokens"] for p in points] == [32, 32]
  assert points[0]["total_tokens"] == 10 + 13 + 16 + 16
  # Request 0 holds 10 + 7 - 1 = 16 tokens: 4 blocks.
  assert cli.main(argv + ["--capacity", "8", "3"]) == 2
  err = capsys.readouterr().err
  assert "capacity=3 blocks cannot hold the largest request (4 blocks" in err


def test_cli_replay_vllm_semantics_refuses_length_only_trace(tmp_path, capsys):
  trace = tmp_path / "lengths.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,2\n")
  argv = ["replay", "--trace", str(trace), "--semantics", "vllm"]
  assert cli.main(argv + ["--capacity", "8"]) == 2
  assert "lengths only" in capsys.readouterr().err


def test_plot_hit_rates_writes_png(tmp_path):
  pytest.importorskip("matplotlib", reason="matplotlib is not installed")
  from prefixjax.plots import plot_hit_rates

  rows = [
    dict(policy=p, capacity_blocks=c, hit_rate=r, mode=m)
    for p, c, r, m in [
      ("fifo", 10, 0.1, "underfilled"),
      ("fifo", 100, 0.3, "measured"),
      ("lru_leaf", 10, 0.2, "measured"),
      ("lru_leaf", 100, 0.4, "measured"),
      ("belady_leaf", 10, 0.0, "underfilled"),  # no measured point at all
    ]
  ]
  path = tmp_path / "hits.png"
  plot_hit_rates(rows, str(path), title="t", ceiling=0.5)
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize(
  "extra, message",
  [
    (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json"),
    (["--plot", "hits.xyz"], "unknown figure format 'xyz'"),
    (["--publish", "late"], "--publish late is a vllm-semantics rule"),
    (["--warmup-fraction", "1"], "leaves no request in the measured window"),
    (["--policy", "lru"], "policy lru (vLLM's free-queue order) needs --sem"),
  ],
)
def test_cli_replay_flags_are_checked_before_the_trace_is_read(
  extra, message, tmp_path, capsys
):
  # The trace does not exist: a flag error must come first, before any
  # loading (and so before any compile or run).
  if "--plot" in extra:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
  missing = tmp_path / "not_there.jsonl"
  argv = ["replay", "--trace", str(missing), *extra]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and "not found" not in err


@pytest.mark.parametrize(
  "command",
  [
    ["replay", "--json", "{trace}"],
    ["replay", "--json", "{tmp}/sub/../t.jsonl"],
    ["replay", "--plot", "{trace}"],
    ["simulate", "--json", "{trace}"],
    ["simulate", "--requests-out", "{trace}"],
    ["simulate", "--json", "{tmp}/m.json", "--requests-out", "{tmp}/m.json"],
  ],
)
def test_an_output_that_is_an_input_or_another_output_is_refused(
  command, tmp_path, capsys
):
  """Nothing is lost: an output path naming the trace (however spelt) or
  another output of the same run is refused before any work."""
  trace = tmp_path / "t.jsonl"
  _write_mooncake(trace, [([1, 2], 1000, 4), ([1, 3], 900, 4)])
  before = trace.read_bytes()
  argv = [a.format(trace=trace, tmp=tmp_path) for a in command]
  argv[1:1] = ["--trace", str(trace)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "writing it would overwrite that file" in err, err
  assert trace.read_bytes() == before
  assert not (tmp_path / "m.json").exists()


def test_cli_flag_errors_come_before_any_work(tmp_path, capsys, monkeypatch):
  """``demo --json`` into a missing folder and ``replay --limit`` without
  a trace are refused before anything runs."""
  import prefixjax.demo
  from prefixjax import workloads

  def boom(*a, **k):
    raise AssertionError("work began")

  monkeypatch.setattr(prefixjax.demo, "run_demo", boom)
  monkeypatch.setattr(workloads, "default_workload", boom)
  missing = tmp_path / "no" / "x.json"
  assert cli.main(["demo", "--requests", "4", "--json", str(missing)]) == 2
  assert f"--json {missing}: folder" in capsys.readouterr().err
  assert cli.main(["replay", "--limit", "5"]) == 2
  assert "--limit reads the first N requests of --trace" in (
    capsys.readouterr().err
  )
  with pytest.raises(SystemExit):
    cli.main(["replay", "--capacity", str(2**31 - 1)])
  assert "must be at most 2_147_483_646" in capsys.readouterr().err


def test_cli_replay_warns_that_length_only_traces_never_hit(tmp_path, capsys):
  trace = tmp_path / "lengths.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,40,2\n1,50,3\n")
  argv = ["replay", "--trace", str(trace), "--capacity", "0", "4"]
  assert cli.main(argv + ["--warmup-fraction", "0"]) == 0
  err = capsys.readouterr().err
  assert "carries no prefix sharing, so every hit is 0" in err
  assert "capacity 0 holds no block" in err


def test_cli_reuses_compiled_programs_across_processes(tmp_path):
  """A second process with the same shapes loads every program from the
  persistent cache: it writes no new entry, and prints the same points."""
  cache = tmp_path / "cache"
  argv = [
    sys.executable,
    "-m",
    "prefixjax",
    "replay",
    "--capacity",
    "50",
    "400",
    "--policy",
    "fifo",
    "lru_leaf",
    "--compile-cache",
    str(cache),
  ]
  outputs, entries = [], []
  for run in range(2):
    out = tmp_path / f"run{run}.json"
    subprocess.run([*argv, "--json", str(out)], check=True, capture_output=True)
    outputs.append(json.loads(out.read_text())["points"])
    entries.append(sorted(p.name for p in cache.iterdir()))
  assert entries[0], "the first run cached nothing"
  assert entries[1] == entries[0]
  assert outputs[1] == outputs[0]


def test_cli_compile_cache_can_be_turned_off(tmp_path):
  env = {**os.environ, "PREFIXJAX_COMPILE_CACHE": str(tmp_path / "env")}
  argv = [sys.executable, "-m", "prefixjax", "replay", "--capacity", "50"]
  subprocess.run(
    [*argv, "--no-compile-cache"], check=True, env=env, capture_output=True
  )
  assert not (tmp_path / "env").exists()
  subprocess.run(argv, check=True, env=env, capture_output=True)
  assert any((tmp_path / "env").iterdir())


def test_cli_replay_plot_writes_png_and_pdf(tmp_path, capsys):
  pytest.importorskip("matplotlib", reason="matplotlib is not installed")
  png = tmp_path / "hits.png"
  argv = ["replay", "--capacity", "50", "400", "--plot", str(png)]
  assert cli.main(argv) == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (tmp_path / "hits.pdf").read_bytes()[:4] == b"%PDF"
  assert f"wrote {png}, {tmp_path / 'hits.pdf'}" in capsys.readouterr().out


def test_cli_vllm_version_selects_the_free_order(tmp_path, capsys):
  """--vllm-version reaches the replay: 0.33 (the default) and 0.22 give
  the library's points for that release; outside vllm it is refused."""
  from prefixjax import default_workload

  trace = default_workload()  # what the CLI replays without --trace
  need = -(-int(trace.kv_tokens.max()) // 16)
  capacities = [need, 3 * need]
  lib = {
    v: [
      p.hit_tokens
      for p in replay.replay(
        trace, semantics="vllm", capacities=capacities, vllm_version=v
      )
    ]
    for v in ("0.33", "0.22")
  }
  assert lib["0.33"] != lib["0.22"]  # the workload tells the orders apart
  for version in ("0.33", "0.22", None):
    out = tmp_path / f"{version}.json"
    argv = ["replay", "--semantics", "vllm", "--json", str(out)]
    argv += ["--capacity", *map(str, capacities)]
    argv += ["--vllm-version", version] if version else []
    assert cli.main(argv) == 0
    got = [p["hit_tokens"] for p in json.loads(out.read_text())["points"]]
    assert got == lib[version or "0.33"]
  assert cli.main(["replay", "--vllm-version", "0.22"]) == 2
  assert "--vllm-version is a vllm-semantics rule" in capsys.readouterr().err
  bad = ["replay", "--semantics", "vllm", "--vllm-version", "0.x"]
  assert cli.main(bad) == 2
  assert "vllm_version='0.x' is not supported" in capsys.readouterr().err


def test_cli_no_compile_cache_turns_off_jax_own_cache_too(tmp_path):
  """--no-compile-cache means no cache at all, also when the user has
  pointed JAX's own cache somewhere (JAX_COMPILATION_CACHE_DIR)."""
  jax_dir = tmp_path / "jax"
  env = {
    **os.environ,
    "JAX_COMPILATION_CACHE_DIR": str(jax_dir),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  env.pop("PREFIXJAX_COMPILE_CACHE", None)
  argv = [sys.executable, "-m", "prefixjax", "replay", "--capacity", "50"]
  subprocess.run(
    [*argv, "--no-compile-cache"], check=True, env=env, capture_output=True
  )
  assert not jax_dir.exists() or not any(jax_dir.iterdir())


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_cli_replay_serving_semantics_reports_the_ceiling(
  semantics, tmp_path, capsys, rng
):
  """The ceiling of a serving semantics is its hits with room for every
  block: each request's longest block-aligned prefix shared with an
  earlier request's prompt and outputs (the KV it held at its finish,
  ``P + O - 1`` tokens), capped at ``P - 1``, over the measured window;
  computed here in plain Python from the token ids."""
  k = 4
  trace = generate_workload(
    "multi_turn",
    num_requests=int(rng.integers(10, 20)),
    seed=int(rng.integers(2**31)),
    system_prompt_len=12,
    question_len=(2, 12),
    output_len=(1, 8),
    vocab_size=64,
  )
  path = tmp_path / "t.jsonl"
  path.write_text(
    "".join(
      json.dumps(
        dict(
          input_tok_ids=trace.input_token_ids[i].tolist(),
          output_tok_ids=trace.output_token_ids[i].tolist(),
          output_toks=int(trace.output_lengths[i]),
          arrival_time_ns=i,
        )
      )
      + "\n"
      for i in range(len(trace))
    )
  )
  warmup = float(rng.choice([0.0, 0.5]))
  out = tmp_path / "c.json"
  argv = ["replay", "--trace", str(path), "--semantics", semantics]
  argv += ["--block-size", str(k), "--warmup-fraction", str(warmup)]
  argv += ["--capacity", "60", "--json", str(out), "--no-compile-cache"]
  assert cli.main(argv) == 0
  capsys.readouterr()
  payload = json.loads(out.read_text())
  kv = [
    np.concatenate([p, o])[: len(p) + max(len(o), 1) - 1]
    for p, o in zip(trace.input_token_ids, trace.output_token_ids, strict=True)
  ]
  want = []
  for i, prompt in enumerate(trace.input_token_ids):
    best = 0
    for seq in kv[:i]:
      m = min(len(prompt), len(seq))
      diff = np.flatnonzero(prompt[:m] != seq[:m])
      best = max(best, int(diff[0]) if len(diff) else m)
    # Whole blocks of the earlier sequence only, capped at P - 1.
    want.append(min(best, len(prompt) - 1) // k * k)
  (point,) = payload["points"]
  warm = len(trace) - point["measured_requests"]
  ceiling = payload["ceiling"]
  assert ceiling["policy"] == "ceiling"
  assert ceiling["hit_tokens"] == sum(want[warm:])
  assert ceiling["total_tokens"] == point["total_tokens"]
  assert point["hit_tokens"] <= ceiling["hit_tokens"]


def test_cli_replay_model_puts_capacities_in_gib(tmp_path, capsys, rng):
  """``--model``: each capacity's KV bytes (Llama 3 8B: 32 layers, 8 KV
  heads of 128, bf16: 128 KiB a token, from the model card's config)."""
  capacities = sorted(int(c) for c in rng.integers(50, 5000, 2))
  out = tmp_path / "g.json"
  argv = ["replay", "--model", "llama3_8b", "--json", str(out)]
  argv += ["--capacity", *map(str, capacities), "--policy", "fifo"]
  assert cli.main(argv) == 0
  assert "GiB" in capsys.readouterr().out
  payload = json.loads(out.read_text())
  assert payload["model"] == "llama3_8b"
  for row in [*payload["points"], payload["ceiling"]]:
    tokens = row["capacity_blocks"] * row["block_size"]
    want = tokens * 2 * 32 * 8 * 128 * 2 / 2**30
    assert row["capacity_gib"] == pytest.approx(want, rel=1e-12)
  assert cli.main(["replay", "--model", "gpt5"]) == 2
  assert "--model gpt5: unknown" in capsys.readouterr().err


def test_cli_replay_sglang_waiting_refresh_flag(tmp_path, capsys, rng):
  """``--waiting-refresh-interval N|off`` reaches SGLang's replay (each
  point equals ``replay()`` given the same interval) and is refused under
  other semantics before any work."""
  trace = generate_workload(
    "multi_turn", num_requests=24, seed=int(rng.integers(2**31))
  )
  path = tmp_path / "t.jsonl"
  path.write_text(
    "".join(
      json.dumps(
        dict(
          input_tok_ids=trace.input_token_ids[i].tolist(),
          output_toks=int(trace.output_lengths[i]),
          arrival_time_ns=i,
        )
      )
      + "\n"
      for i in range(len(trace))
    )
  )
  loaded = pj_load(path)
  k = 16
  fits = -(-int(loaded.kv_tokens.max()) // k)
  capacity = int(rng.integers(fits + 1, 4 * fits))
  for flag in ("off", str(int(rng.integers(1, 5)))):
    interval = None if flag == "off" else int(flag)
    out = tmp_path / f"{flag}.json"
    argv = ["replay", "--trace", str(path), "--semantics", "sglang"]
    argv += ["--block-size", str(k), "--capacity", str(capacity)]
    argv += ["--waiting-refresh-interval", flag, "--json", str(out)]
    assert cli.main(argv) == 0
    assert f"refresh {'off' if interval is None else 'every'}" in (
      capsys.readouterr().out
    )
    (want,) = replay.replay(
      loaded,
      semantics="sglang",
      block_size=k,
      capacities=[capacity],
      waiting_refresh_interval=interval,
    )
    (got,) = json.loads(out.read_text())["points"]
    assert got["hit_tokens"] == want.hit_tokens
  argv = ["replay", "--waiting-refresh-interval", "off"]
  assert cli.main(argv) == 2
  assert "sglang-semantics rule" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_:
    cli.main(["replay", "--waiting-refresh-interval", "0"])
  assert exit_.value.code == 2
  assert "0 must be >= 1" in capsys.readouterr().err


def test_cli_replay_vllm_policy_with_parameters(tmp_path, capsys, rng):
  """``--semantics vllm --policy lfu --policy-param decay=D`` equals
  ``replay()`` with ``policy_params={"decay": D}`` (the table names the
  policy with its parameters); parameters are refused before any work
  where they cannot run."""
  trace = generate_workload(
    "multi_turn", num_requests=16, seed=int(rng.integers(2**31))
  )
  path = tmp_path / "t.jsonl"
  path.write_text(
    "".join(
      json.dumps(
        dict(
          input_tok_ids=trace.input_token_ids[i].tolist(),
          output_toks=int(trace.output_lengths[i]),
          arrival_time_ns=i,
        )
      )
      + "\n"
      for i in range(len(trace))
    )
  )
  loaded = pj_load(path)
  k = 16
  capacity = -(-int(loaded.kv_tokens.max()) // k) + int(rng.integers(0, 8))
  decay = float(rng.choice([0.25, 0.5, 0.75]))
  out = tmp_path / "lfu.json"
  argv = ["replay", "--trace", str(path), "--semantics", "vllm"]
  argv += ["--block-size", str(k), "--capacity", str(capacity)]
  argv += ["--policy", "lfu"]
  lfu = argv + ["--policy-param", f"decay={decay}"]
  assert cli.main(lfu + ["--json", str(out)]) == 0
  assert f"policy lfu(decay={decay})" in capsys.readouterr().out
  (want,) = replay.replay(
    loaded,
    semantics="vllm",
    policy="lfu",
    policy_params={"decay": decay},
    block_size=k,
    capacities=[capacity],
  )
  (got,) = json.loads(out.read_text())["points"]
  assert got["hit_tokens"] == want.hit_tokens
  assert got["policy"] == f"lfu(decay={decay})"
  for extra, rule in (
    (["--policy-param", "decay=2"], "decay=2 must be in (0, 1]"),
    (["--policy-param", "window=1"], "does not take them"),
    (["--policy", "lfu", "fifo"], "replays one policy per run"),
    (["--policy-param", "decay=1", "--policy-param", "decay=1"], "twice"),
  ):
    assert cli.main(argv + extra) == 2
    assert rule in capsys.readouterr().err, extra
  base = ["replay", "--capacity", "9", "--policy-param", "decay=0.5"]
  assert cli.main(base + ["--semantics", "sglang"]) == 2
  assert "--policy-param is for --semantics vllm" in capsys.readouterr().err
  assert cli.main(["replay", "--policy", "lfu"]) == 2
  assert "policy lfu needs --semantics vllm" in capsys.readouterr().err
