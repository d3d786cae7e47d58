"""Compares ``vllm_scheduler.VllmScheduler`` with the real vLLM 0.33 scheduler.

Run by hand, never collected by pytest (no ``test_`` prefix): it needs the
oracle of ``/work/shared/oracle`` set up (``./setup.sh``) in a scratch copy,
and prefixjax in the running interpreter (to generate the traces)::

  cp -r /work/shared/oracle /tmp/oracle_sched && (cd /tmp/oracle_sched &&
    ./setup.sh)
  python tests/reference_models/vllm_scheduler_check.py \\
    --oracle-dir /tmp/oracle_sched [--config NAME ...] [--work-dir DIR]

For every config it writes a token-id trace (``input_tok_ids``,
``output_toks``, ``output_tok_ids``, ``arrival_time_ns``, ``priority``),
runs ``sched_harness.py`` on it (the real ``Scheduler``), runs the model on
the same records and compares every line of ``steps.jsonl`` (every field the
model computes, ``sched`` included) and of ``requests.jsonl``. It prints one
line per config and the first differences, and exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: import reference_models

from reference_models.vllm_scheduler import VllmScheduler  # noqa: E402


@dataclass
class Config:
  name: str
  kind: str = "multi_turn"
  num_requests: int = 200
  seed: int = 1
  workload: dict = field(default_factory=dict)
  block_size: int = 16
  num_gpu_blocks: int = 4096
  max_num_seqs: int = 16
  max_num_batched_tokens: int = 2048
  max_model_len: int = 8192
  chunked_prefill: bool = True
  policy: str = "fcfs"
  long_prefill_token_threshold: int = 0
  arrivals: str = "zero"
  step_dt_ms: float | None = None
  num_priorities: int = 0  # random priorities in [0, K) from the seed
  output_ids: bool = True  # write the trace's output ids
  records: list | None = None  # a fixed trace instead of a generated one


CONFIGS = [
  # (a) FCFS, chunked prefill, no memory pressure, arrivals over time.
  Config("a_fcfs_chunked", arrivals="time", step_dt_ms=20.0),
  Config("a_fcfs_chunked_zero"),
  Config(
    "a_sysprompt_burst",
    kind="system_prompt",
    num_requests=300,
    seed=2,
    max_num_seqs=32,
  ),
  # (b) FCFS with few blocks: preemption, rejections, outputs cut.
  Config("b_fcfs_pressure", num_gpu_blocks=256, max_model_len=4080),
  Config(
    "b_fcfs_pressure_time",
    num_gpu_blocks=300,
    max_model_len=4096,
    arrivals="time",
    step_dt_ms=5.0,
    seed=3,
  ),
  Config(
    "b_fewshot_pressure",
    kind="few_shot",
    num_requests=400,
    seed=4,
    workload=dict(example_len=(16, 96)),
    num_gpu_blocks=96,
    max_model_len=760,
    max_num_seqs=24,
    block_size=8,
    output_ids=False,
  ),
  # (c) priority policy, random priorities, pressure.
  Config(
    "c_priority_pressure",
    policy="priority",
    num_priorities=4,
    num_gpu_blocks=256,
    max_model_len=4080,
    seed=5,
  ),
  Config(
    "c_priority_time",
    policy="priority",
    num_priorities=3,
    num_gpu_blocks=300,
    max_model_len=4096,
    arrivals="time",
    step_dt_ms=5.0,
    seed=6,
  ),
  Config(
    "c_priority_sysprompt",
    kind="system_prompt",
    num_requests=300,
    policy="priority",
    num_priorities=5,
    num_gpu_blocks=200,
    max_model_len=3072,
    max_num_seqs=32,
    seed=7,
  ),
  # (d) no chunked prefill (the budget must cover max_model_len).
  Config(
    "d_no_chunk",
    chunked_prefill=False,
    max_num_batched_tokens=8192,
    max_model_len=8192,
    num_gpu_blocks=2048,
  ),
  Config(
    "d_no_chunk_pressure",
    chunked_prefill=False,
    max_num_batched_tokens=4096,
    max_model_len=4096,
    num_gpu_blocks=300,
    seed=8,
  ),
  Config(
    "d_no_chunk_priority",
    chunked_prefill=False,
    policy="priority",
    num_priorities=3,
    max_num_batched_tokens=4096,
    max_model_len=4096,
    num_gpu_blocks=300,
    arrivals="time",
    step_dt_ms=5.0,
    seed=9,
  ),
  # Extras: one request at a time; the long-prefill cap; the field arrivals.
  Config(
    "e_k1",
    max_num_seqs=1,
    chunked_prefill=False,
    max_num_batched_tokens=8192,
    num_gpu_blocks=1024,
  ),
  Config(
    "e_threshold",
    long_prefill_token_threshold=256,
    num_gpu_blocks=400,
    max_model_len=4096,
    seed=10,
  ),
  Config(
    "e_field_arrivals",
    kind="agent",
    num_requests=150,
    arrivals="field",
    num_gpu_blocks=512,
    max_model_len=8000,
    seed=11,
  ),
]


def hand_configs() -> list[Config]:
  """The small cases of tests/test_vllm_scheduler_model.py (HAND_CASES)."""
  from test_vllm_scheduler_model import HAND_CASES

  return [
    Config(
      f"hand_{name}",
      records=case["records"],
      arrivals=case["arrivals"],
      **case["config"],
    )
    for name, case in HAND_CASES.items()
  ]


def random_configs() -> list[Config]:
  """Small pools under pressure, traces from the CI test's generator."""
  import numpy as np
  from test_vllm_scheduler_model import _chat_trace

  out = []
  variants = [
    ("fcfs", True, 0),
    ("fcfs", True, 7),
    ("fcfs", False, 0),
    ("priority", True, 0),
    ("priority", False, 0),
    ("priority", True, 5),
  ]
  for k, (policy, chunked, threshold) in enumerate(variants):
    rng = np.random.default_rng(100 + k)
    records = _chat_trace(rng, 150, max_prompt=110)
    for rec in records:
      rec["arrival_step"] = int(rng.integers(0, 600))
      rec["priority"] = int(rng.integers(0, 4))
    block_size = [2, 4, 8][k % 3]
    out.append(
      Config(
        f"rand_{policy}_{'chunk' if chunked else 'nochunk'}_t{threshold}",
        records=records,
        arrivals="field",
        block_size=block_size,
        num_gpu_blocks=96 // block_size + 1 + 3 * k,
        max_num_seqs=4 + k,
        max_num_batched_tokens=24 + 8 * k if chunked else 128,
        max_model_len=96,
        chunked_prefill=chunked,
        policy=policy,
        long_prefill_token_threshold=threshold,
      )
    )
  return out


def make_trace(cfg: Config) -> list[dict]:
  import numpy as np

  if cfg.records is not None:
    return [dict(rec) for rec in cfg.records]

  import prefixjax as pj

  t = pj.generate_workload(
    cfg.kind, num_requests=cfg.num_requests, seed=cfg.seed, **cfg.workload
  )
  rng = np.random.default_rng(cfg.seed + 1000)
  records = []
  for i in range(len(t.input_lengths)):
    rec = {
      "input_tok_ids": [int(x) for x in t.input_token_ids[i]],
      "output_toks": int(t.output_lengths[i]),
      "arrival_time_ns": int(round(float(t.arrival_times_s[i]) * 1e9)),
    }
    if cfg.output_ids and t.output_token_ids is not None:
      rec["output_tok_ids"] = [int(x) for x in t.output_token_ids[i]]
    if cfg.num_priorities:
      rec["priority"] = int(rng.integers(cfg.num_priorities))
    if cfg.arrivals == "field":
      rec["arrival_step"] = int(rng.integers(0, 40 * cfg.num_requests))
    records.append(rec)
  return records


def run_oracle(cfg: Config, trace: Path, out: Path, oracle: Path) -> float:
  args = [
    str(oracle / "venv" / "bin" / "python"),
    str(oracle / "sched_harness.py"),
    "--trace",
    str(trace),
    "--out-dir",
    str(out),
    "--block-size",
    str(cfg.block_size),
    "--num-gpu-blocks",
    str(cfg.num_gpu_blocks),
    "--max-num-seqs",
    str(cfg.max_num_seqs),
    "--max-num-batched-tokens",
    str(cfg.max_num_batched_tokens),
    "--max-model-len",
    str(cfg.max_model_len),
    "--chunked-prefill" if cfg.chunked_prefill else "--no-chunked-prefill",
    "--policy",
    cfg.policy,
    "--long-prefill-token-threshold",
    str(cfg.long_prefill_token_threshold),
    "--arrivals",
    cfg.arrivals,
  ]
  if cfg.step_dt_ms:
    args += ["--step-dt-ms", str(cfg.step_dt_ms)]
  t0 = time.perf_counter()
  subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
  return time.perf_counter() - t0


def read_jsonl(path: Path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def diff_records(mine: list[dict], real: list[dict], what: str) -> list[str]:
  diffs = []
  if len(mine) != len(real):
    diffs.append(f"{what}: {len(mine)} in the model, {len(real)} in vLLM")
  for k, (a, b) in enumerate(zip(mine, real, strict=False)):
    bad = {
      key: (a.get(key), b.get(key))
      for key in sorted(set(a) | set(b))
      if key in a and key in b and a[key] != b[key]
    }
    missing = sorted(set(a) ^ set(b))
    if bad or missing:
      diffs.append(f"{what}[{k}]: {bad} keys in one only: {missing}")
  return diffs


def check(cfg: Config, work: Path, oracle: Path) -> dict:
  d = work / cfg.name
  d.mkdir(parents=True, exist_ok=True)
  records = make_trace(cfg)
  trace = d / "trace.jsonl"
  with open(trace, "w") as f:
    for rec in records:
      f.write(json.dumps(rec) + "\n")
  t_oracle = run_oracle(cfg, trace, d / "oracle", oracle)
  real_steps = read_jsonl(d / "oracle" / "steps.jsonl")
  real_reqs = read_jsonl(d / "oracle" / "requests.jsonl")
  summary = json.loads((d / "oracle" / "summary.json").read_text())
  t0 = time.perf_counter()
  model = VllmScheduler(
    num_gpu_blocks=cfg.num_gpu_blocks,
    block_size=cfg.block_size,
    max_num_seqs=cfg.max_num_seqs,
    max_num_batched_tokens=cfg.max_num_batched_tokens,
    max_model_len=cfg.max_model_len,
    chunked_prefill=cfg.chunked_prefill,
    policy=cfg.policy,
    long_prefill_token_threshold=cfg.long_prefill_token_threshold,
  )
  steps, reqs = model.simulate(
    records, cfg.arrivals, cfg.step_dt_ms, cached_hashes=True
  )
  t_model = time.perf_counter() - t0
  diffs = diff_records(steps, real_steps, "steps")
  diffs += diff_records(reqs, real_reqs, "requests")
  return dict(
    config=cfg.name,
    steps=len(real_steps),
    requests=len(real_reqs),
    preemptions=sum(len(s["preempted"]) for s in real_steps),
    preempted_requests=sum(1 for r in real_reqs if r.get("num_preemptions")),
    rejected=sum(1 for r in real_reqs if r.get("status") == "rejected"),
    capped=summary["requests"]["length_capped_by_max_model_len"],
    hit_tokens=summary["hit_tokens"],
    resume_hit_tokens=summary["resume_hit_tokens"],
    idle_steps=summary["idle_steps"],
    standin_misses=summary["standin_attribute_misses"],
    resolved=summary["config"]["scheduler"],
    equal=not diffs,
    num_diffs=len(diffs),
    first_diffs=diffs[:5],
    oracle_s=round(t_oracle, 1),
    model_s=round(t_model, 1),
  )


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--oracle-dir", type=Path, default=Path("/tmp/oracle_sched"))
  ap.add_argument("--work-dir", type=Path, default=Path("/tmp/vllm_sched_chk"))
  ap.add_argument(
    "--config",
    nargs="*",
    help="names, or the groups 'hand' (the CI test's HAND_CASES) and "
    "'rand' (its random generator)",
  )
  ap.add_argument("--json", type=Path, help="also write the results here")
  a = ap.parse_args()
  configs = CONFIGS + random_configs() + hand_configs()
  names = set(a.config or [])
  for group in ("hand", "rand"):
    if group in names:
      names |= {c.name for c in configs if c.name.startswith(group + "_")}
  todo = [c for c in configs if not names or c.name in names]
  unknown = names - {c.name for c in configs} - {"hand", "rand"}
  if unknown:
    known = ", ".join(c.name for c in configs)
    ap.error(f"unknown config(s) {sorted(unknown)}; known: {known}")
  os.makedirs(a.work_dir, exist_ok=True)
  results = []
  for cfg in todo:
    r = check(cfg, a.work_dir, a.oracle_dir)
    results.append(r)
    print(
      f"{r['config']:32s} equal={r['equal']!s:5s} steps={r['steps']:6d} "
      f"requests={r['requests']:4d} preemptions={r['preemptions']:4d} "
      f"({r['preempted_requests']} reqs) rejected={r['rejected']} "
      f"capped={r['capped']} hits={r['hit_tokens']} "
      f"resume_hits={r['resume_hit_tokens']} idle={r['idle_steps']} "
      f"oracle {r['oracle_s']}s model {r['model_s']}s",
      flush=True,
    )
    for line in r["first_diffs"]:
      print("   ", line[:400])
  if a.json:
    a.json.write_text(json.dumps(results, indent=1))
  total = sum(r["steps"] for r in results)
  print(
    f"{sum(r['equal'] for r in results)}/{len(results)} configs equal; "
    f"{total} steps, {sum(r['requests'] for r in results)} requests, "
    f"{sum(r['preemptions'] for r in results)} preemptions compared"
  )
  return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
