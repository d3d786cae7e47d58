"""The engine on a shared-system-prompt workload: prefix caching on vs off.

Measures :class:`prefixjax.model.Engine` (a real model's forward pass behind
vLLM 0.33's v1 scheduler and the paged prefix cache) serving ``--requests``
prompts that all arrive at t=0, each one shared system prompt of
``--system-tokens`` random ids plus ``--user-tokens`` random ids of its own
(numpy ``default_rng(--seed)``), ``--max-new-tokens`` greedy outputs each,
once with ``prefix_caching=True`` and once with ``False``. Per mode, the
median over ``--repeats`` of:

* TTFT, per request ``GenerateResult.setup_s`` (the call's set-up before
  its first step, also its own row) plus the sum of ``step_s`` up to and
  including its ``first_token_step`` (mean and p99 over requests), and
  end-to-end latency the same up to its ``finish_step``;
* output tokens/s: generated tokens over the wall time of the whole
  ``generate`` call;
* steps, prompt / hit / prefill-computed / decode tokens, preemptions;
* roofline calibration: every step's predicted seconds,
  :func:`prefixjax.serving.roofline.step_time_s` of ``--model`` on the
  ``--hardware`` preset from the step's ``schedule`` (new tokens per
  request) and ``context`` (tokens computed before the step), summed, beside
  the measured sums of ``step_s`` and ``forward_s`` and their ratios
  (measured / predicted). The prediction is for the named accelerator: the
  ratio means something only when this runs on that chip (the device kind is
  printed); on a CPU it is a scale, not a calibration.

What is warmed, and why the comparison is fair:

* Compilation: one throw-away engine first runs the per-repeat warm-up and
  the whole workload in both modes (the ``compile:`` line, untimed). The
  engine's programs are module-level ``jax.jit`` functions, cached per shape
  and static argument, so every later engine of the same configs reuses
  them.
* The prefix cache and KV pool persist across ``generate`` calls, so a
  second timed call on the same engine would hit every block of the first.
  Each repeat therefore builds a fresh :class:`~prefixjax.model.Engine`
  (empty cache, zeroed pool, the same weights) per mode; modes alternate
  within a repeat so drift hits both alike.
* Per repeat, before the timed call, the fresh engine serves the system
  prompt alone (one request, one new token, untimed), in the mode under
  test: with caching on this publishes the system prompt's full blocks, as
  on a server that has served that system prompt before, which is the point
  of a shared-prompt workload; with caching off those blocks are salted and
  no later request can hit them, so both modes do the same warm-up work.
  ``--cold`` skips it: the timed call starts from an empty cache and only
  sharing inside the batch can hit.

The cache is sized so nothing is preempted (``--num-blocks`` overrides;
preemptions are reported). On a CPU the engine's default forward is the
batch-invariant one, which runs all ``C`` chunk slots of a step one after
another whatever the step holds: step time there follows the number of steps
more than the tokens.

Usage::

  # CPU, the tiny model (well under a minute on 2 cores):
  python benchmarks/engine.py [--requests 8] [--repeats 3] [--json OUT]
  # an accelerator, a real model size with random weights, calibrated
  # against the matching preset:
  python benchmarks/engine.py --model llama3_8b --hardware h100 \\
      --requests 32 --system-tokens 1024 --user-tokens 64 \\
      --max-new-tokens 64 --max-num-batched-tokens 2048

A model over 50 M parameters on the CPU backend exits with status 2 unless
``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import _timing
import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import configs
from prefixjax.model import CacheConfig, Engine
from prefixjax.serving import roofline

CPU_PARAM_LIMIT = 50_000_000
MODES = (("on", True), ("off", False))
CHECKS = dict(
  same_outputs_on_off="generated tokens identical, caching on vs off",
  same_outputs_as_compile_pass="timed tokens identical to the compile pass",
  same_schedule_across_repeats="schedule identical across repeats",
  no_preemption="no preemption",
  all_tokens_generated="every request generated --max-new-tokens",
)


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def _nonnegative(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
  if not 0 <= value < 2**31:
    raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**31)")
  return value


def _preset(lookup):
  def parse(name: str):
    try:
      return lookup(name)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None

  parse.__name__ = lookup.__name__  # argparse names the type in errors
  return parse


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  d = " (default %(default)s)"
  p.add_argument(
    "--model",
    type=_preset(configs.model_config),
    default="tiny",
    help=f"model preset, one of {', '.join(configs.MODELS)}; random "
    "weights" + d,
  )
  p.add_argument(
    "--hardware",
    type=_preset(configs.hardware_config),
    default="h100",
    help="accelerator preset the roofline predicts for, one of "
    f"{', '.join(configs.HARDWARE)}" + d,
  )
  ints = (
    ("--requests", 8, "prompts, all arriving at t=0"),
    ("--system-tokens", 100, "ids of the shared system prompt"),
    ("--user-tokens", 16, "random ids after it, per prompt"),
    ("--max-new-tokens", 16, "greedy outputs per request"),
    ("--block-size", 16, "tokens per KV block"),
    ("--repeats", 3, "timed runs per mode (median reported)"),
  )
  for flag, default, text in ints:
    p.add_argument(flag, type=_positive, default=default, help=text + d)
  p.add_argument(
    "--max-num-seqs",
    type=_positive,
    help="most running requests (default --requests)",
  )
  p.add_argument(
    "--max-num-batched-tokens",
    type=_positive,
    help="token budget of a step (default max(256, max_num_seqs))",
  )
  p.add_argument(
    "--num-blocks",
    type=_positive,
    help="KV blocks incl. the null block (default: enough that nothing is "
    "preempted)",
  )
  p.add_argument(
    "--seed", type=_nonnegative, default=0, help="workload and weights" + d
  )
  p.add_argument(
    "--cold",
    action="store_true",
    help="no per-repeat system-prompt warm-up: start from an empty cache",
  )
  p.add_argument(
    "--batch-invariant",
    choices=("auto", "yes", "no"),
    default="auto",
    help="the engine's forward mode; auto: yes on CPU, no elsewhere" + d,
  )
  p.add_argument(
    "--force",
    action="store_true",
    help=f"run a model over {CPU_PARAM_LIMIT / 1e6:.0f} M parameters on CPU",
  )
  p.add_argument("--json", metavar="OUT", help="write every number here")
  args = p.parse_args(argv)
  if args.max_num_seqs is None:
    args.max_num_seqs = args.requests
  if args.max_num_batched_tokens is None:
    args.max_num_batched_tokens = max(256, args.max_num_seqs)
  if args.json:
    folder = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(folder):
      p.error(f"--json {args.json}: folder {folder} does not exist")
  prompt_len = args.system_tokens + args.user_tokens
  per_request = -(-(prompt_len + args.max_new_tokens) // args.block_size)
  warm_blocks = -(-(args.system_tokens + 1) // args.block_size)
  need = 1 + args.requests * per_request + warm_blocks
  if args.num_blocks is None:
    args.num_blocks = need
  try:
    args.cache = CacheConfig(
      block_size=args.block_size,
      num_blocks=args.num_blocks,
      max_num_seqs=args.max_num_seqs,
      max_num_batched_tokens=args.max_num_batched_tokens,
      max_model_len=prompt_len + args.max_new_tokens,
    )
  except (TypeError, ValueError) as e:
    p.error(str(e))
  args.blocks_needed = need
  return args


def workload(args) -> tuple[list[int], list[list[int]]]:
  """``(system prompt, prompts)``: one shared prefix, random user ids."""
  rng = np.random.default_rng(args.seed)
  v = args.model.vocab_size
  system = rng.integers(0, v, args.system_tokens).tolist()
  prompts = [
    system + rng.integers(0, v, args.user_tokens).tolist()
    for _ in range(args.requests)
  ]
  return system, prompts


def predicted_steps(model, hardware, res) -> np.ndarray:
  """Roofline seconds of every step of ``res``, float64 ``[steps]``."""
  lanes = max(len(s) for s in res.schedule)
  new = np.zeros((len(res.schedule), lanes), np.int32)
  ctx = np.zeros_like(new)
  for i, (sched, context) in enumerate(
    zip(res.schedule, res.context, strict=True)
  ):
    for j, ((rid, n), (rid_c, c)) in enumerate(
      zip(sched, context, strict=True)
    ):
      assert rid == rid_c, f"step {i}: schedule and context disagree"
      new[i, j], ctx[i, j] = n, c
  t = roofline.step_time_s(model, hardware, jnp.asarray(new), jnp.asarray(ctx))
  return np.asarray(t, np.float64)


def prefill_steps(res, prompt_lens) -> np.ndarray:
  """``[steps]`` bool: the step computes some prompt token."""
  return np.asarray(
    [
      any(c < prompt_lens[rid] for rid, c in context) for context in res.context
    ],
    bool,
  )


def measure(eng, prompts, args, caching, system) -> tuple[dict, object]:
  """One repeat of one mode on a fresh engine: the numbers and the result."""
  if not args.cold:
    eng.generate([system], 1, prefix_caching=caching)
  t0 = time.perf_counter()
  res = eng.generate(prompts, args.max_new_tokens, prefix_caching=caching)
  wall = time.perf_counter() - t0
  step_s = np.asarray(res.step_s)
  forward_s = np.asarray(res.forward_s)
  elapsed = res.setup_s + np.cumsum(step_s)
  ttft = elapsed[np.asarray(res.first_token_step)]
  e2e = elapsed[np.asarray(res.finish_step)]
  pred = predicted_steps(args.model, args.hardware, res)
  pre = prefill_steps(res, [len(p) for p in prompts])
  st = res.stats
  hw_overhead = args.hardware.step_overhead_s
  row = dict(
    ttft_mean_s=float(ttft.mean()),
    ttft_p99_s=float(np.percentile(ttft, 99)),
    e2e_mean_s=float(e2e.mean()),
    e2e_p99_s=float(np.percentile(e2e, 99)),
    wall_s=wall,
    setup_s=res.setup_s,
    output_tokens_per_s=st["generated_tokens"] / wall,
    steps=st["steps"],
    prompt_tokens=st["prompt_tokens"],
    hit_tokens=st["hit_tokens"],
    prefill_tokens_computed=st["prefill_tokens_computed"],
    decode_tokens=st["decode_tokens"],
    generated_tokens=st["generated_tokens"],
    preemptions=st["preemptions"],
    blocks_peak=st["blocks_peak"],
    step_sum_s=float(step_s.sum()),
    forward_sum_s=float(forward_s.sum()),
    predicted_sum_s=float(pred.sum()),
    overhead_sum_s=float(np.sum(pred > 0)) * hw_overhead,
    prefill_steps=int(pre.sum()),
    decode_steps=int((~pre).sum()),
    prefill_step_sum_s=float(step_s[pre].sum()),
    prefill_forward_sum_s=float(forward_s[pre].sum()),
    prefill_predicted_sum_s=float(pred[pre].sum()),
    prefill_overhead_sum_s=float(np.sum(pred[pre] > 0)) * hw_overhead,
    decode_step_sum_s=float(step_s[~pre].sum()),
    decode_forward_sum_s=float(forward_s[~pre].sum()),
    decode_predicted_sum_s=float(pred[~pre].sum()),
    decode_overhead_sum_s=float(np.sum(pred[~pre] > 0)) * hw_overhead,
    per_request=dict(
      ttft_s=ttft.tolist(),
      e2e_s=e2e.tolist(),
      first_token_step=list(res.first_token_step),
      finish_step=list(res.finish_step),
    ),
    per_step=dict(
      step_s=res.step_s,
      forward_s=res.forward_s,
      predicted_s=pred.tolist(),
      prefill=pre.tolist(),
      schedule=res.schedule,
      context=res.context,
    ),
  )
  return row, res


def _ratio(a: float, b: float) -> float:
  return a / b if b else math.nan


def summarize(runs: list[dict]) -> dict:
  """Median over repeats of every scalar, plus the measured/predicted
  ratios of those medians."""
  keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
  med = {k: float(np.median([r[k] for r in runs])) for k in keys}
  for phase in ("", "prefill_", "decode_"):
    pred = med[f"{phase}predicted_sum_s"]
    for what in ("step", "forward"):
      med[f"{phase}{what}_over_predicted"] = _ratio(
        med[f"{phase}{what}_sum_s"], pred
      )
  return med


def environment(argv) -> dict:
  dev = jax.devices()[0]
  env = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    argv=list(argv),
    python=platform.python_version(),
    jax=jax.__version__,
    jaxlib=getattr(jax.lib, "__version__", None),
    numpy=np.__version__,
    backend=jax.default_backend(),
    device_kind=dev.device_kind,
    device_count=jax.device_count(),
    processor=platform.processor() or platform.machine(),
    cpu_count=os.cpu_count(),
  )
  try:
    here = os.path.dirname(os.path.abspath(__file__))
    git = ["git", "-C", here]
    env["git_commit"] = subprocess.run(
      [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      [*git, "status", "--porcelain"], capture_output=True, text=True
    ).stdout
    env["git_dirty"] = bool(dirty.strip())
  except (OSError, subprocess.CalledProcessError):
    env["git_commit"] = None
  return env


def _finite(x):
  """``x`` with every non-finite float replaced by None (strict JSON)."""
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def _ms(x: float) -> str:
  return f"{x * 1e3:.2f}"


def _times(x: float) -> str:
  return f"{x:.2f}" if math.isfinite(x) else "-"


def _speedup(x: float) -> str:
  return f"{x:.2f}x" if math.isfinite(x) else "-"


def print_table(summary: dict, args) -> dict:
  """The per-mode table; returns the speed-ups (caching on vs off)."""
  on, off = summary["on"], summary["off"]
  speedup = dict(
    ttft_mean=_ratio(off["ttft_mean_s"], on["ttft_mean_s"]),
    ttft_p99=_ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
    e2e_mean=_ratio(off["e2e_mean_s"], on["e2e_mean_s"]),
    e2e_p99=_ratio(off["e2e_p99_s"], on["e2e_p99_s"]),
    wall=_ratio(off["wall_s"], on["wall_s"]),
    output_tokens_per_s=_ratio(
      on["output_tokens_per_s"], off["output_tokens_per_s"]
    ),
  )
  rows = [
    ("TTFT mean (ms)", "ttft_mean_s", _ms, "ttft_mean"),
    ("TTFT p99 (ms)", "ttft_p99_s", _ms, "ttft_p99"),
    ("end-to-end mean (ms)", "e2e_mean_s", _ms, "e2e_mean"),
    ("end-to-end p99 (ms)", "e2e_p99_s", _ms, "e2e_p99"),
    ("generate wall (ms)", "wall_s", _ms, "wall"),
    ("  of it setup (ms)", "setup_s", _ms, None),
    (
      "output tokens/s",
      "output_tokens_per_s",
      "{:.1f}".format,
      "output_tokens_per_s",
    ),
    ("steps", "steps", "{:.0f}".format, None),
    ("prompt tokens", "prompt_tokens", "{:.0f}".format, None),
    ("hit tokens", "hit_tokens", "{:.0f}".format, None),
    (
      "prefill tokens computed",
      "prefill_tokens_computed",
      "{:.0f}".format,
      None,
    ),
    ("decode tokens", "decode_tokens", "{:.0f}".format, None),
    ("generated tokens", "generated_tokens", "{:.0f}".format, None),
    ("preemptions", "preemptions", "{:.0f}".format, None),
    ("blocks peak", "blocks_peak", "{:.0f}".format, None),
  ]
  print(
    f"\nmedian of {args.repeats} repeat(s)"
    f"\n{'':26s}{'caching on':>12s}{'caching off':>13s}{'on vs off':>11s}"
  )
  for label, key, fmt, sp in rows:
    cell = _speedup(speedup[sp]) if sp else ""
    print(f"{label:26s}{fmt(on[key]):>12s}{fmt(off[key]):>13s}{cell:>11s}")
  print("(on vs off: off/on for times, on/off for tokens/s)")
  return speedup


def print_roofline(summary: dict, args, env) -> None:
  hw = args.hardware
  print(
    f"\nroofline calibration: measured on {env['backend']} "
    f"(device kind {env['device_kind']!r}) against the {hw.name} preset's "
    f"prediction: the ratio is meaningful only when run on that chip"
  )
  print(f"{'':26s}{'caching on':>12s}{'caching off':>13s}")
  on, off = summary["on"], summary["off"]
  for phase, title in (
    ("", "all steps"),
    ("prefill_", "steps with prompt tokens"),
    ("decode_", "decode-only steps"),
  ):
    count = "steps" if not phase else phase + "steps"
    print(f"{title:26s}{on[count]:>12.0f}{off[count]:>13.0f}")
    for label, key, fmt in (
      ("  sum step_s (ms)", "step_sum_s", _ms),
      ("  sum forward_s (ms)", "forward_sum_s", _ms),
      ("  sum predicted (ms)", "predicted_sum_s", _ms),
      ("    of it overhead (ms)", "overhead_sum_s", _ms),
      ("  step_s / predicted", "step_over_predicted", _times),
      ("  forward_s / predicted", "forward_over_predicted", _times),
    ):
      a, b = on[phase + key], off[phase + key]
      print(f"{label:26s}{fmt(a):>12s}{fmt(b):>13s}")
  print(
    f"(overhead: the preset's assumed step_overhead_s = "
    f"{hw.step_overhead_s * 1e3:g} ms per step, not a measurement)"
  )


def main(argv=None) -> int:
  args = parse_args(argv)
  model, hw, cache = args.model, args.hardware, args.cache
  backend = jax.default_backend()
  if backend == "cpu" and model.num_params > CPU_PARAM_LIMIT and not args.force:
    print(
      f"error: --model {model.name} has {model.num_params / 1e9:.2f} B "
      f"parameters ({model.weight_bytes / 2**30:.1f} GiB of {model.dtype} "
      "weights) and the JAX backend is cpu: it needs an accelerator (or "
      f"pass --force). Models up to {CPU_PARAM_LIMIT / 1e6:.0f} M "
      "parameters run without it, e.g. --model tiny.",
      file=sys.stderr,
    )
    return 2
  invariant = {"auto": None, "yes": True, "no": False}[args.batch_invariant]
  env = environment(sys.argv if argv is None else ["engine.py", *argv])
  system, prompts = workload(args)
  prompt_len = args.system_tokens + args.user_tokens
  full_blocks = args.system_tokens // args.block_size
  print(_timing.machine() + f", device kind {env['device_kind']!r}")
  print(
    f"model {model.name} ({model.num_params / 1e6:.2f} M params, "
    f"{model.dtype}); roofline preset {hw.name}"
  )
  print(
    f"workload: {args.requests} requests at t=0, each {args.system_tokens} "
    f"shared system + {args.user_tokens} own random ids ({prompt_len} "
    f"tokens), {args.max_new_tokens} greedy new tokens, seed {args.seed}"
  )

  def engine(params=None):
    return Engine(
      model, cache, seed=args.seed, params=params, batch_invariant=invariant
    )

  t0 = time.perf_counter()
  first = engine()
  params = first.params
  print(
    f"cache: block_size {cache.block_size}, num_blocks {cache.num_blocks} "
    f"(all requests' blocks at once: {args.blocks_needed}), max_num_seqs "
    f"{cache.max_num_seqs}, max_num_batched_tokens "
    f"{cache.max_num_batched_tokens}, max_model_len {cache.max_model_len}, "
    f"C={first.num_chunks} chunk slots, batch_invariant "
    f"{first.batch_invariant}"
  )
  # Compile pass: every shape the timed calls use, on a throw-away engine.
  outputs = {}
  for _, caching in MODES:
    eng = first if caching else engine(params)
    eng.generate([system], 1, prefix_caching=caching)
    outputs[caching] = eng.generate(
      prompts, args.max_new_tokens, prefix_caching=caching
    ).tokens
  compile_s = time.perf_counter() - t0
  resolved_invariant = first.batch_invariant
  del first, eng
  print(
    f"compile: a throw-away engine ran the warm-up and the workload in "
    f"both modes, untimed ({compile_s:.1f} s with weight init)"
  )
  if args.cold:
    warmed = (
      "nothing per repeat (--cold): each timed call starts from an empty "
      "prefix cache; only sharing inside the batch can hit"
    )
  else:
    warmed = (
      "per repeat, the fresh engine first served the system prompt alone "
      "(1 request, 1 new token, untimed) in the mode under test: with "
      f"caching on this publishes its {full_blocks} full blocks "
      f"({full_blocks * args.block_size} tokens); with caching off its "
      "blocks are salted and cannot be hit"
    )
  print(f"warmed: compiled programs (reused by every engine); {warmed}")
  print(
    f"timed: {args.repeats} repeat(s), a fresh Engine (empty cache, same "
    "weights) per mode and repeat, modes alternating"
  )

  runs = {"on": [], "off": []}
  results = {"on": [], "off": []}
  for rep in range(args.repeats):
    for name, caching in MODES:
      row, res = measure(engine(params), prompts, args, caching, system)
      runs[name].append(row)
      results[name].append(res)
      print(
        f"  repeat {rep} caching {name:3s}: wall {_ms(row['wall_s'])} ms, "
        f"TTFT mean {_ms(row['ttft_mean_s'])} ms, {row['steps']} steps",
        flush=True,
      )

  summary = {name: summarize(runs[name]) for name in runs}
  speedup = print_table(summary, args)
  print_roofline(summary, args, env)

  checks = dict(
    same_outputs_on_off=results["on"][0].tokens == results["off"][0].tokens,
    same_outputs_as_compile_pass=all(
      results[n][0].tokens == outputs[c] for n, c in MODES
    ),
    same_schedule_across_repeats=all(
      r.schedule == results[n][0].schedule for n in results for r in results[n]
    ),
    no_preemption=all(r["preemptions"] == 0 for n in runs for r in runs[n]),
    all_tokens_generated=all(
      r["generated_tokens"] == args.requests * args.max_new_tokens
      for n in runs
      for r in runs[n]
    ),
  )
  print("\nchecks:")
  for k, v in checks.items():
    print(f"  {CHECKS[k]}: {'yes' if v else 'NO'}")
  if not checks["same_outputs_on_off"]:
    print(
      "  (expected bitwise only with batch_invariant; the batched forward "
      "agrees to rounding, which can flip a greedy token)"
    )
  if not checks["no_preemption"]:
    print(
      f"  warning: preemptions: raise --num-blocks (>= "
      f"{args.blocks_needed}); the numbers include recomputation"
    )

  if args.json:
    out = dict(
      env=env,
      model=dataclasses.asdict(model),
      hardware=dataclasses.asdict(hw),
      cache=dataclasses.asdict(cache),
      workload=dict(
        requests=args.requests,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        cold=args.cold,
      ),
      batch_invariant=resolved_invariant,
      warmed=warmed,
      compile_s=compile_s,
      repeats=args.repeats,
      summary=summary,
      speedup=speedup,
      checks=checks,
      runs=runs,
    )
    with open(args.json, "w") as f:
      json.dump(_finite(out), f, indent=1, allow_nan=False)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
