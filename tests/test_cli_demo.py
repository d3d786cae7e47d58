"""The ``prefixjax`` CLI and the built-in demo, checked against arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from prefixjax import cli, demo, generate_workload


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
