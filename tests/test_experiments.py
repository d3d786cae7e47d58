"""The experiment scripts run end to end on small built-in workloads."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np

from prefixjax.workloads import default_workload

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
  spec = importlib.util.spec_from_file_location(
    name, ROOT / "experiments" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_serving_semantics_agree_without_eviction(tmp_path, rng):
  """With room for every block, vLLM's and SGLang's rules give the same
  hits (both cache the full blocks of prompt + output - 1 tokens and cap
  hits at P - 1); kvcache-sim reports a cache that never filled during
  warm-up as underfilled (0 hits), as the simulator does."""
  requests = int(rng.integers(60, 120))
  trace = default_workload(num_requests=requests)
  held = trace.input_lengths + np.maximum(trace.output_lengths, 1) - 1
  everything = int(np.sum(-(-held // 16))) + 1
  smallest = int(-(-int(held.max()) // 16))
  out = tmp_path / "sem"
  argv = ["--limit", str(requests), "--out", str(out), "--capacity"]
  argv += [str(smallest), str(everything)]
  assert _load("serving_semantics").main(argv) == 0
  rows = json.loads(out.with_suffix(".json").read_text())["points"]
  hits = {(r["semantics"], r["capacity_blocks"]): r["hit_tokens"] for r in rows}
  assert len(hits) == 6
  assert hits["vllm", everything] == hits["sglang", everything] > 0
  modes = {(r["semantics"], r["capacity_blocks"]): r["mode"] for r in rows}
  assert modes["kvcache-sim", everything] == "underfilled"
  assert hits["kvcache-sim", everything] == 0
  assert hits["vllm", smallest] <= hits["vllm", everything]
  assert out.with_suffix(".png").stat().st_size > 0
