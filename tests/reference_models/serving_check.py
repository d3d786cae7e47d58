"""Compares ``prefixjax.serving.simulate`` with the real vLLM 0.33 Scheduler.

Run by hand in a scratch environment, never collected by pytest: it needs
the oracle of ``/work/shared/oracle`` set up in a copy (``./setup.sh``)::

  python tests/reference_models/serving_check.py /tmp/oracle_sched

For each config it writes a generated token-id trace, runs the real
scheduler (``sched_harness.py``, zero arrivals) and the jitted simulator,
and compares the scheduled ``[rid, tokens]`` list of every step.
"""

import json
import subprocess
import sys
import tempfile

import numpy as np

import prefixjax as pj
from prefixjax.serving import ServingConfig, records_from_trace, simulate

ORACLE = sys.argv[1] if len(sys.argv) > 1 else "/tmp/oracle_sched"
WORK = tempfile.mkdtemp(prefix="serving_check_")
configs = [
  dict(
    name="fcfs-chunked",
    kind="multi_turn",
    n=150,
    seed=11,
    bs=16,
    blocks=4096,
    seqs=16,
    mbt=2048,
    mml=8192,
    chunked=True,
  ),
  dict(
    name="fcfs-pressure",
    kind="multi_turn",
    n=150,
    seed=12,
    bs=16,
    blocks=600,
    seqs=16,
    mbt=1024,
    mml=8192,
    chunked=True,
  ),
  dict(
    name="fcfs-nochunk-pressure",
    kind="system_prompt",
    n=150,
    seed=13,
    bs=8,
    blocks=1200,
    seqs=8,
    mbt=8192,
    mml=8192,
    chunked=False,
  ),
  dict(
    name="fcfs-tiny",
    kind="multi_turn",
    n=120,
    seed=14,
    bs=4,
    blocks=2100,
    seqs=4,
    mbt=256,
    mml=8192,
    chunked=True,
  ),
]
allok = True
for c in configs:
  trace = pj.generate_workload(c["kind"], num_requests=c["n"], seed=c["seed"])
  recs = records_from_trace(trace)
  path = f"{WORK}/{c['name']}.jsonl"
  with open(path, "w") as f:
    for r in recs:
      f.write(
        json.dumps(
          {
            k: (list(map(int, v)) if isinstance(v, (list, np.ndarray)) else v)
            for k, v in r.items()
          }
        )
        + "\n"
      )
  out = f"{WORK}/{c['name']}"
  cmd = [
    f"{ORACLE}/venv/bin/python",
    f"{ORACLE}/sched_harness.py",
    "--trace",
    path,
    "--n",
    str(c["n"]),
    "--block-size",
    str(c["bs"]),
    "--num-gpu-blocks",
    str(c["blocks"]),
    "--max-num-seqs",
    str(c["seqs"]),
    "--max-num-batched-tokens",
    str(c["mbt"]),
    "--max-model-len",
    str(c["mml"]),
    "--out-dir",
    out,
  ]
  cmd += ["--chunked-prefill"] if c["chunked"] else ["--no-chunked-prefill"]
  subprocess.run(cmd, check=True, capture_output=True, cwd=ORACLE)
  with open(f"{out}/steps.jsonl") as f:
    real = [json.loads(line) for line in f]
  cfg = ServingConfig(
    num_gpu_blocks=c["blocks"],
    block_size=c["bs"],
    max_num_seqs=c["seqs"],
    max_num_batched_tokens=c["mbt"],
    max_model_len=c["mml"],
    chunked_prefill=c["chunked"],
  )
  res = simulate(trace, cfg)
  ours = res.scheduled()
  theirs = [s["sched"] for s in real]
  same = ours == theirs
  pre = sum(len(s.get("preempted", [])) for s in real)
  first = next(
    (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
    None,
  )
  print(
    f"{c['name']:>24}: steps ours {len(ours)} real {len(theirs)}, "
    f"preemptions {pre}, schedules equal: {same}"
    + ("" if same else f" (first diff step {first})"),
    flush=True,
  )
  allok &= same
print("ALL EQUAL" if allok else "DIFFERENCES")
sys.exit(0 if allok else 1)
