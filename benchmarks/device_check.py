"""One prepared run for a lent accelerator: correctness, then every speed
target that needs one, in one call.

No accelerator has been lent to this project yet, and a session that gets
one has 15 minutes of device time, machine start included. This script is
that visit, planned ahead: it runs in one command, each part in its own
process under its own time limit (a part that hangs or fails costs only
its share), and writes what it found under ``--out``: one JSON per part,
``summary.json`` and ``device_check.log`` (seven files: the device returns
at most eight), printing a short table last.

Parts, in order of what the open issues need:

1. ``serving`` (issue 14): one configuration alone (``simulate``, the
   slowest lane's configuration and a middle one), then ``simulate_batch``
   vmapped over 1, 16, 256 and 1,000 configurations of
   ``simulate_scaling.py --batch``'s kind (200 requests, Poisson rates 2-50
   req/s, per-configuration budgets), second (compiled) calls, vLLM
   semantics; then SGLang's at 1 and 256. A size is skipped when the
   one before it says it would not fit the part's time. Correctness: three
   lanes of each size (first, middle, last) are run again on the host CPU
   (``jax.devices("cpu")``) one by one and every metric compared.
2. ``sweep`` (issue 15): ``sweep_scaling.py``'s 256-point replay + simulate
   sweep, vectorized (the default on an accelerator), twice; and as single
   points the replay points at the smallest and largest capacity of each
   policy and the simulate points of every rate at the smallest and
   largest budget (seed 0): the low rates are the longest (most steps).
3. ``kernels`` (issue 5): ``benchmarks/kernels.py`` at full sizes, the
   Pallas kernels compiled (not interpreted) against the ``jnp``
   reference, then timed; once with the Triton-style GPU variants and once
   with the Mosaic GPU port of the attention kernels.
4. ``engine`` (issue 17): ``benchmarks/engine.py`` with Llama-3-8B-shaped
   random bf16 weights, prefix caching on and off, measured step times
   against the H200 roofline's.

On the device machine (jax, flax, orbax, chex, numpy, tqdm and matplotlib
are in its image; prefixjax is pure Python, so nothing is installed)::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/device_check.py \\
      --out $OUT --budget 480

Here, to check the script itself on small sizes (CPU, vmapped anyway)::

    python benchmarks/device_check.py --tiny --out /tmp/device_check

Usage: ``python benchmarks/device_check.py --out DIR [--budget S] [--tiny]
[--parts serving sweep kernels engine]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

PARTS = ("serving", "sweep", "kernels", "engine")
# Each part's share of the budget (the rest of an unused share passes on).
SHARE = {"serving": 0.42, "sweep": 0.23, "kernels": 0.20, "engine": 0.15}
HERE = os.path.dirname(os.path.abspath(__file__))


def _dump(path: str, obj) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1, default=str)
  os.replace(path + ".tmp", path)


def _env() -> dict:
  import jax

  dev = jax.devices()[0]
  return {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device": dev.device_kind,
    "devices": len(jax.devices()),
    "python": sys.version.split()[0],
  }


# --- serving (issue 14) ------------------------------------------------------


def _same_metrics(a: dict, b: dict) -> list[str]:
  """The metric names whose values differ (floats to 1e-9 relative)."""
  bad = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if isinstance(x, float) and isinstance(y, float):
      if not (x == y or abs(x - y) <= 1e-9 * max(abs(x), abs(y))):
        bad.append(k)
    elif x != y:
      bad.append(k)
  return bad


def serving_part(out: str, budget: float, tiny: bool) -> dict:
  import jax

  from prefixjax import serving
  from prefixjax.workloads import default_workload

  sys.path.insert(0, HERE)
  from simulate_scaling import batch_inputs

  start = time.perf_counter()
  requests = 40 if tiny else 200
  trace = default_workload(num_requests=requests, seed=0)
  cpu = jax.devices("cpu")[0]
  rows = []

  def left() -> float:
    return budget - (time.perf_counter() - start)

  def save():
    _dump(os.path.join(out, "serving.json"), {"env": _env(), "rows": rows})

  for semantics, sizes in (
    ("vllm", [1, 4] if tiny else [1, 256, 1000]),
    ("sglang", [1, 4] if tiny else [1, 256]),
  ):
    # One configuration alone: the slowest lane's (rate 2) and a middle one.
    for rate in (2.0, 26.0):
      c = batch_inputs(1, semantics)[0][0]
      kw = dict(arrivals="poisson", rate=rate, seed=0, step_time_ms=20.0)
      t0 = time.perf_counter()
      serving.simulate(trace, c, **kw)
      first = time.perf_counter() - t0
      t0 = time.perf_counter()
      r = serving.simulate(trace, c, **kw)
      second = time.perf_counter() - t0
      rows.append(
        dict(
          semantics=semantics,
          what="one",
          rate=rate,
          steps=r.num_steps,
          first_s=first,
          second_s=second,
        )
      )
      print(f"{semantics} one config rate {rate}: {second:.3f} s", flush=True)
      save()
    last = None
    for b in sizes:
      if last is not None:
        # A new compile (about the last one) and two runs, linear in the
        # configurations, with half again for margin.
        lb, lfirst, lsecond = last
        guess = 1.5 * ((lfirst - lsecond) + 2 * lsecond * b / lb)
        if guess > left():
          rows.append(
            dict(
              semantics=semantics,
              what="vmapped",
              configs=b,
              skipped=f"expected {guess:.0f} s, {left():.0f} s left",
            )
          )
          print(f"{semantics} {b} configs: skipped (time)", flush=True)
          save()
          break
      configs, kw = batch_inputs(b, semantics)
      t0 = time.perf_counter()
      serving.simulate_batch(trace, configs, vectorize=True, **kw)
      first = time.perf_counter() - t0
      t0 = time.perf_counter()
      res = serving.simulate_batch(trace, configs, vectorize=True, **kw)
      second = time.perf_counter() - t0
      last = (b, first, second)
      checked, wrong = [], {}
      for i in sorted({0, b // 2, b - 1}):
        one = dict(kw, rate=kw["rate"][i], seed=kw["seed"][i])
        with jax.default_device(cpu):
          ref = serving.simulate_batch(
            trace, [configs[i]], vectorize=False, **one
          )[0]
        bad = _same_metrics(res[i].metrics(), ref.metrics())
        checked.append(i)
        if bad:
          wrong[i] = bad
      rows.append(
        dict(
          semantics=semantics,
          what="vmapped",
          configs=b,
          first_s=first,
          second_s=second,
          steps_max=max(r.num_steps for r in res),
          lanes_checked=checked,
          lanes_wrong=wrong,
        )
      )
      print(
        f"{semantics} {b} configs vmapped: {second:.3f} s "
        f"(first {first:.1f} s), lanes {checked} "
        f"{'WRONG ' + str(wrong) if wrong else 'equal to the CPU'}",
        flush=True,
      )
      save()
  return {"rows": rows}


# --- sweep (issue 15) --------------------------------------------------------


def sweep_part(out: str, budget: float, tiny: bool) -> dict:
  sys.path.insert(0, HERE)
  from sweep_scaling import measure

  path = os.path.join(out, "sweep.json")
  res = measure(
    40 if tiny else 300,
    # Seed 0 at the smallest and largest budget: every rate, the low ones
    # the longest.
    alone=lambda row: (
      row["seed"] == 0 and row["max_num_batched_tokens"] in (512, 4096)
    ),
    vectorize=True if tiny else None,
    on_single=lambda singles: _dump(path, {"singles": singles}),
  )
  res["env"] = _env()
  _dump(path, res)
  second, worst = res["sweep_second_s"], res["largest_single_s"]
  print(
    f"sweep {second:.2f} s / largest single {worst:.3f} s = "
    f"{second / worst:.1f}x",
    flush=True,
  )
  return res


# --- kernels (issue 5) -------------------------------------------------------


def kernels_part(out: str, budget: float, tiny: bool) -> dict:
  """Both GPU variants, each in its own process: the Triton-style one
  (``kernels.json``), then the Mosaic GPU port of the attention kernels
  (``kernels_mosaic.json``); the first may use half the share, the second
  what is left."""
  result = {}
  start = time.time()
  runs = (("triton", "kernels.json"), ("mosaic", "kernels_mosaic.json"))
  for i, (variant, name) in enumerate(runs):
    cmd = [
      sys.executable,
      os.path.join(HERE, "kernels.py"),
      "--gpu-variant",
      variant,
      "--json",
      os.path.join(out, name),
    ] + (["--tiny"] if tiny else [])
    left = (budget - (time.time() - start)) / (len(runs) - i)
    if left < 10:
      result[variant] = "skipped: no time left"
      continue
    try:
      result[variant] = subprocess.call(cmd, timeout=left)
    except subprocess.TimeoutExpired:
      result[variant] = "timed out"
  result["rc"] = max(
    (v for v in result.values() if isinstance(v, int)), default=1
  )
  return result


# --- engine (issue 17) -------------------------------------------------------


def engine_part(out: str, budget: float, tiny: bool) -> dict:
  """``benchmarks/engine.py``: Llama-3-8B-shaped random weights in bf16
  behind the scheduler, caching on and off, and the H200 roofline's
  step times against the measured ones (the calibration that means
  something only on that chip)."""
  size = (
    ["--model", "tiny", "--repeats", "1"]
    if tiny
    else [
      "--model",
      "llama3_8b",
      "--hardware",
      "h200",
      "--requests",
      "16",
      "--system-tokens",
      "1024",
      "--user-tokens",
      "64",
      "--max-new-tokens",
      "32",
      "--repeats",
      "2",
    ]
  )
  cmd = [sys.executable, os.path.join(HERE, "engine.py"), *size]
  cmd += ["--json", os.path.join(out, "engine.json")]
  return {"rc": subprocess.call(cmd, timeout=budget)}


# --- driver ------------------------------------------------------------------


def _one_part(name: str, out: str, budget: float, tiny: bool) -> None:
  """In the child process: one part, its result or its traceback saved."""
  fn = {
    "serving": serving_part,
    "sweep": sweep_part,
    "kernels": kernels_part,
    "engine": engine_part,
  }
  try:
    res = fn[name](out, budget, tiny)
    _dump(os.path.join(out, f"{name}.done.json"), {"ok": True, **res})
  except Exception:
    traceback.print_exc()
    _dump(
      os.path.join(out, f"{name}.done.json"),
      {"ok": False, "error": traceback.format_exc()},
    )
    raise


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="folder for JSON and logs")
  p.add_argument("--budget", type=float, default=480.0, help="seconds")
  p.add_argument("--tiny", action="store_true", help="small sizes (CPU)")
  p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.part:  # a child
    return _one_part(args.part, args.out, args.budget, args.tiny)
  start = time.perf_counter()
  summary = {}
  shares = {k: SHARE[k] for k in args.parts}
  for i, name in enumerate(args.parts):
    left = args.budget - (time.perf_counter() - start)
    weight = shares[name] / sum(shares[k] for k in args.parts[i:])
    limit = max(left * weight, 10.0)
    log = os.path.join(args.out, f"{name}.log")
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      "--out",
      args.out,
      "--part",
      name,
      # The part plans for 90% of its limit; the rest is its start-up.
      "--budget",
      str(0.9 * limit),
    ] + (["--tiny"] if args.tiny else [])
    t0 = time.perf_counter()
    print(f"== {name}: at most {limit:.0f} s", flush=True)
    with open(log, "w") as f:
      proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
      try:
        rc = proc.wait(timeout=limit)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    summary[name] = {"rc": rc, "seconds": time.perf_counter() - t0}
    # What comes back from the device is at most 8 files: the parts' logs
    # go into one, their outcomes into the summary.
    done = os.path.join(args.out, f"{name}.done.json")
    if os.path.exists(done):
      with open(done) as f:
        summary[name]["outcome"] = json.load(f)
      os.remove(done)
    with open(log) as f:
      text = f.read()
    os.remove(log)
    with open(os.path.join(args.out, "device_check.log"), "a") as f:
      f.write(f"== {name} (rc={rc})\n{text}\n")
    tail = text.splitlines()[-12:]
    print("\n".join("   " + line for line in tail), flush=True)
  _dump(os.path.join(args.out, "summary.json"), summary)
  print("== summary")
  for name, s in summary.items():
    print(f"{name:>8}: rc={s['rc']} in {s['seconds']:.0f} s")


if __name__ == "__main__":
  main()
