"""The ``prefixjax`` command line.

Subcommands:

* ``demo``: parallel sampling through the paging core, by block size, on a
  built-in generated workload (no files needed).
* ``replay``: hit-rate replay of a trace (or the built-in workload) through
  caches of several capacities and policies, one compiled program per policy.
* ``simulate``: engine-step serving simulation of a trace through vLLM
  0.33's v1 FCFS scheduler (latency, hit-rate, block, throughput metrics).

Bad arguments and bad input files exit with status 2 and a one-line message;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

EXIT_USAGE = 2

# True in the console script's own process (:func:`run`), False when
# :func:`main` is called from other code (a test, a notebook).
_OWN_PROCESS = False


class CliError(Exception):
  """A user-facing error: printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"{value} must be > 0")
  return value


def _add_debug(parser) -> None:
  # SUPPRESS keeps a subcommand from resetting a --debug given before it.
  parser.add_argument(
    "--debug",
    action="store_true",
    default=argparse.SUPPRESS,
    help="show tracebacks on errors",
  )


def _add_cache_flags(parser, name, default, folder_help, off_help) -> None:
  """``--NAME-cache DIR`` or ``--no-NAME-cache`` (``"off"``)."""
  group = parser.add_mutually_exclusive_group()
  group.add_argument(
    f"--{name}-cache", metavar="DIR", default=default, help=folder_help
  )
  group.add_argument(
    f"--no-{name}-cache",
    dest=f"{name}_cache",
    action="store_const",
    const="off",
    help=off_help,
  )


def _add_compile_cache(parser) -> None:
  _add_cache_flags(
    parser,
    "compile",
    None,
    "folder of JAX's persistent compilation cache (default: "
    "$PREFIXJAX_COMPILE_CACHE, else ~/.cache/prefixjax/jax); a second run "
    "with the same shapes loads its programs instead of compiling",
    "compile afresh, keep nothing on disk",
  )


def _add_trace_cache(parser) -> None:
  _add_cache_flags(
    parser,
    "trace",
    True,
    "folder of parsed traces, keyed by the file's bytes (default: "
    "$PREFIXJAX_TRACE_CACHE, else ~/.cache/prefixjax/traces); a second run "
    "on the same file reads it instead of parsing",
    "parse the trace file every time, keep nothing on disk",
  )


def _start_jax(args, one_program: bool = False) -> None:
  """Every command's start: JAX imported, its compilation cache as the
  flags say; in the console script's own process, the imported modules
  frozen (:func:`run`), and, for a command that runs one program at a time
  (``one_program``), XLA:CPU asked for one thread unless the environment
  names a count (:func:`prefixjax._host.one_xla_thread`)."""
  if one_program and _OWN_PROCESS:
    from prefixjax._host import one_xla_thread

    one_xla_thread()
  from prefixjax.compile_cache import enable_compile_cache

  enable_compile_cache(args.compile_cache)  # imports jax
  if _OWN_PROCESS:
    # The modules just imported (jax's tens of thousands of objects) live
    # as long as the process: out of the garbage collector's walks, which
    # tracing triggers often (a warm replay of the 12 Mooncake points
    # 0.03-0.05 s faster here).
    gc.freeze()


def _add_demo(subparsers) -> None:
  p = subparsers.add_parser(
    "demo",
    help="parallel sampling on the paging core, by block size",
    description=(
      "Replays a generated parallel-sampling workload (prompts forked into n "
      "samples that decode one token at a time) through the paging core in "
      "one jitted scan per block size, and prints peak blocks with and "
      "without sharing, copy-on-write copies, out-of-block events and "
      "internal fragmentation."
    ),
  )
  p.add_argument(
    "--block-sizes",
    type=_positive_int,
    nargs="+",
    default=[8, 16, 32, 64],
    metavar="K",
  )
  p.add_argument("--requests", type=_positive_int, default=64)
  p.add_argument("--samples", type=_positive_int, default=4, metavar="N")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--pool-tokens",
    type=_positive_int,
    default=65_536,
    help="KV pool size in tokens (blocks = pool_tokens // block_size + 1)",
  )
  p.add_argument("--json", metavar="OUT", help="also write results as JSON")
  _add_compile_cache(p)
  _add_debug(p)
  p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
  import dataclasses

  _check_outputs([("--json", args.json)])
  _start_jax(args)

  import jax

  from prefixjax.demo import format_table, run_demo

  print(
    f"prefixjax demo: {args.requests} requests, {args.samples} samples per "
    f"prompt, pool {args.pool_tokens:,} tokens, jax {jax.__version__} on "
    f"{jax.default_backend()}",
    flush=True,
  )
  rows = run_demo(
    block_sizes=args.block_sizes,
    num_requests=args.requests,
    samples=args.samples,
    seed=args.seed,
    pool_tokens=args.pool_tokens,
  )
  print(format_table(rows))
  print(
    "peak blocks: most blocks in use at once; unshared: the same samples "
    "without fork sharing;\nCoW: copy-on-write copies; OOB: allocations "
    "refused for lack of blocks; frag: unused slots in held blocks."
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    print(f"wrote {args.json}")
  return 0


SEMANTICS = ("kvcache-sim", "vllm", "sglang")


def _fraction(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not 0.0 <= value <= 1.0:
    raise argparse.ArgumentTypeError(f"{value} must be in [0, 1)")
  return value


def _nonnegative_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"{value} must be >= 0")
  return value


def _capacity(text: str) -> int:
  """A cache capacity in blocks: 0 up to the int32 counters' limit (the
  replay engines' rule, checked here before the trace is read)."""
  value = _nonnegative_int(text)
  if value > 2**31 - 2:
    raise argparse.ArgumentTypeError(
      f"{value} must be at most {2**31 - 2:_} (int32 block counts)"
    )
  return value


def _policy_param(text: str) -> tuple[str, object]:
  """``KEY=VALUE`` of ``--policy-param``: the value as JSON (a number,
  ``true``, ``false``), else as the string itself."""
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
  try:
    parsed = json.loads(value)
  except ValueError:
    parsed = value
  if not isinstance(parsed, (bool, int, float, str)):
    parsed = value
  return key.strip(), parsed


def _add_replay(subparsers) -> None:
  from prefixjax.cache.policies import policy_names
  from prefixjax.replay.kvcache_sim import POLICIES as REPLAY_POLICIES

  p = subparsers.add_parser(
    "replay",
    help="hit-rate replay of a trace through caches of several capacities",
    description=(
      "Replays a trace one request at a time through a cache of each "
      "--capacity (in blocks) under each --policy, as one jitted scan "
      "per policy serving every capacity, and prints hit tokens per point. "
      "Without --trace, replays the built-in generated workload."
    ),
  )
  p.add_argument(
    "--trace", metavar="PATH", help="trace file (default: built-in)"
  )
  _add_trace_cache(p)
  p.add_argument(
    "--format", default="auto", choices=("auto", "mooncake", "tokens", "csv")
  )
  p.add_argument(
    "--block-size",
    type=_positive_int,
    default=None,
    metavar="N",
    help="tokens per block (Mooncake: its hash block size, 512; else 16)",
  )
  p.add_argument(
    "--capacity",
    type=_capacity,
    nargs="+",
    default=None,
    metavar="C",
    help="cache capacities in blocks (default: kvcache-sim 1%%, 5%%, 10%%, "
    "20%% of the trace's distinct blocks; vllm and sglang 2, 8, 32 and 128 "
    "times the blocks of the largest request)",
  )
  p.add_argument(
    "--policy",
    nargs="+",
    default=None,
    choices=tuple(dict.fromkeys((*REPLAY_POLICIES, *policy_names()))),
    metavar="P",
    help=f"kvcache-sim: {', '.join(REPLAY_POLICIES)} (default: all); "
    "vllm: one of lru (default), "
    f"{', '.join(n for n in policy_names() if n != 'lru')}; "
    "sglang: lru_leaf",
  )
  p.add_argument(
    "--policy-param",
    type=_policy_param,
    action="append",
    default=None,
    metavar="KEY=VALUE",
    help="vllm semantics: a keyword parameter of the policy's factory, "
    "e.g. --policy lfu --policy-param decay=0.5 (repeat for several)",
  )
  p.add_argument("--semantics", default="kvcache-sim", choices=SEMANTICS)
  p.add_argument(
    "--publish",
    default="early",
    choices=("early", "late"),
    help="vllm semantics: hash blocks as they fill (early) or when the "
    "request finishes (late)",
  )
  p.add_argument(
    "--vllm-version",
    default=None,
    metavar="V",
    help="vllm semantics: the vLLM release whose rules to follow "
    "(default 0.33, the current one: freed blocks without a hash are "
    "reused first; 0.22 for the older order)",
  )
  p.add_argument(
    "--waiting-refresh-interval",
    type=_refresh_interval,
    default=32,
    metavar="N",
    help="sglang semantics: SGLang's waiting-prefix refresh, every N-th "
    "priority computation touches the request's prompt (default 32, "
    "SGLang 0.5.23's; 'off' as SGLANG_ENABLE_WAITING_PREFIX_REFRESH=0)",
  )
  p.add_argument(
    "--warmup-fraction",
    type=_fraction,
    default=0.5,
    metavar="F",
    help="share of requests before hits are counted (default 0.5)",
  )
  p.add_argument("--limit", type=_positive_int, help="read only N requests")
  p.add_argument(
    "--model",
    default=None,
    metavar="NAME",
    help="a model preset (prefixjax.configs: llama3_8b, ...) whose KV bytes "
    "per token put each capacity in GiB (table, JSON, the plot's top axis)",
  )
  p.add_argument(
    "--cpu-threads",
    type=_nonnegative_int,
    default=1,
    metavar="T",
    help="XLA:CPU threads (default 1: the replays are sequential scans, "
    "about 2x faster on one thread; 0 = XLA's default, all cores)",
  )
  p.add_argument("--json", metavar="OUT", help="also write results as JSON")
  p.add_argument(
    "--plot",
    metavar="PNG",
    help="also plot hit rate against capacity: a 300 dpi PNG and a PDF "
    "beside it, or only .pdf / .svg (needs prefixjax[plot])",
  )
  _add_compile_cache(p)
  _add_debug(p)
  p.set_defaults(func=_cmd_replay)


def _set_cpu_threads(threads: int) -> None:
  """Sizes XLA:CPU's thread pool through ``NPROC``, which XLA reads when its
  CPU backend starts (the first computation), so call it before any.
  Measured with jax 0.10.2 on 2 cores: the 12 Mooncake replay points take
  0.6 s on one thread and 1.1 s on two."""
  if not threads:
    return
  try:
    from jax._src import xla_bridge

    started = xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # other jax internals: leave it be
    started = True
  # Once the backend runs, NPROC cannot help, and changing what XLA reads
  # mid-process (e.g. when tests call main()) is asking for trouble.
  if not started:
    os.environ["NPROC"] = str(threads)


def _warn(message: str, command: str = "replay") -> None:
  print(f"prefixjax {command}: warning: {message}", file=sys.stderr)


def _check_output(flag: str, path: str) -> None:
  """Refuses an output path whose folder is missing or not writable."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise CliError(f"{flag} {path}: is a directory, not a file")
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise CliError(f"{flag} {path}: {folder} is a file, not a folder")
  if not os.path.isdir(folder):
    raise CliError(f"{flag} {path}: folder {folder} does not exist")
  if not os.access(folder, os.W_OK):
    raise CliError(f"{flag} {path}: folder {folder} is not writable")


def _check_outputs(outputs, inputs=()) -> None:
  """:func:`_check_output` for each ``(flag, path)`` of ``outputs`` (None
  paths skipped), and no output the same file as an input or as another
  output: writing it would destroy the input, or one result the other."""
  seen: dict[str, str] = {}
  for flag, path in inputs:
    if path:
      seen[os.path.realpath(path)] = flag
  given = {os.path.realpath(path) for _, path in inputs if path}
  for flag, path in outputs:
    if not path:
      continue
    _check_output(flag, path)
    real = os.path.realpath(path)
    if real in seen:
      what = "the input" if real in given else "the output"
      raise CliError(
        f"{flag} {path}: is {what} of {seen[real]}; writing it would "
        "overwrite that file (give another path)"
      )
    seen[real] = flag


def _check_replay_args(args) -> None:
  """Flag rules checked before any work (the trace is not read yet)."""
  if args.limit is not None and not args.trace:
    raise CliError(
      "--limit reads the first N requests of --trace; for the built-in "
      "workload there is no trace to cut (give --trace PATH)"
    )
  _check_outputs(
    [("--json", args.json), ("--plot", args.plot)], [("--trace", args.trace)]
  )
  if args.plot:
    try:
      from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
      raise CliError(
        "--plot needs matplotlib: pip install 'prefixjax[plot]'"
      ) from None
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(args.plot)[1].lower().lstrip(".")
    if ext not in kinds:
      raise CliError(
        f"--plot {args.plot}: unknown figure format {ext or '(none)'!r}; "
        f"use one of {', '.join(sorted(kinds))}"
      )
  if args.model is not None:
    from prefixjax import configs

    if args.model not in configs.MODELS:
      raise CliError(
        f"--model {args.model}: unknown; use one of "
        f"{', '.join(sorted(configs.MODELS))}"
      )
  if args.waiting_refresh_interval != 32 and args.semantics != "sglang":
    raise CliError(
      "--waiting-refresh-interval is an sglang-semantics rule; "
      f"--semantics {args.semantics} has none"
    )
  if args.publish != "early" and args.semantics != "vllm":
    raise CliError(
      f"--publish {args.publish} is a vllm-semantics rule; "
      f"--semantics {args.semantics} has no publish choice"
    )
  if args.vllm_version is not None:
    if args.semantics != "vllm":
      raise CliError(
        f"--vllm-version is a vllm-semantics rule; --semantics "
        f"{args.semantics} has none"
      )
    from prefixjax.cache.prefix_state import vllm_free_order

    vllm_free_order(args.vllm_version)  # a ValueError names the choices
  _check_replay_policy(args)
  if args.warmup_fraction >= 1.0:
    raise CliError(
      f"--warmup-fraction {args.warmup_fraction:g} leaves no request in the "
      "measured window (use a value below 1)"
    )
  if args.capacity and 0 in args.capacity:
    _warn("capacity 0 holds no block: its hit tokens are 0 by definition")


def _policy_params(args) -> dict:
  """``--policy-param`` pairs as a dict (a key given twice is an error)."""
  params: dict = {}
  for key, value in args.policy_param or ():
    if key in params:
      raise CliError(f"--policy-param {key}= is given twice")
    params[key] = value
  return params


def _check_replay_policy(args) -> None:
  """``--policy`` and ``--policy-param`` against the semantics."""
  from prefixjax import replay as rp

  params = _policy_params(args)
  if params and args.semantics != "vllm":
    raise CliError(
      f"--policy-param is for --semantics vllm: the {args.semantics} "
      "replay engines run their policies with default parameters only"
    )
  if args.semantics == "kvcache-sim":
    for policy in args.policy or ():
      if policy not in rp.REPLAY_POLICIES:
        what = " (vLLM's free-queue order)" if policy == "lru" else ""
        raise CliError(
          f"policy {policy}{what} needs --semantics vllm; kvcache-sim "
          f"policies are {', '.join(rp.REPLAY_POLICIES)}"
        )
  if args.semantics != "vllm":
    return
  if args.policy and len(args.policy) > 1:
    raise CliError(
      "--semantics vllm replays one policy per run; got --policy "
      + " ".join(args.policy)
    )
  policy = args.policy[0] if args.policy else "lru"
  shown = " ".join(f"--policy-param {k}={v}" for k, v in params.items())
  try:
    rp.resolve_policy(policy, params)
  except (TypeError, ValueError) as err:
    raise CliError(f"--policy {policy} {shown}: {err}") from None
  if policy != "lru" and args.vllm_version is not None:
    from prefixjax.cache.prefix_state import vllm_free_order

    if vllm_free_order(args.vllm_version) != "prepend_unhashed":
      raise CliError(
        f"--policy {policy} needs --vllm-version 0.23 or later (free "
        "blocks without a hash at the queue head, used before any "
        f"victim); {args.vllm_version} queues them at the tail"
      )


def _cmd_replay(args) -> int:
  import time

  _set_cpu_threads(args.cpu_threads)
  _check_replay_args(args)
  _start_jax(args)

  import jax

  from prefixjax import replay as rp
  from prefixjax.workloads import default_workload, load_trace

  start = time.perf_counter()
  if args.trace:
    trace = load_trace(
      args.trace,
      args.format,
      block_size=args.block_size,
      limit=args.limit,
      cache=args.trace_cache,
    )
  else:
    trace = default_workload()
  if args.semantics in SERVING:
    return _replay_serving(args, trace, time.perf_counter() - start)
  if not (trace.has_hash_ids or trace.has_token_ids):
    _warn(
      f"{trace.name} has lengths only (no token ids, no hash ids): it "
      "carries no prefix sharing, so every hit is 0"
    )
  # The loader read hash ids at --block-size (or the trace's own size).
  plan = rp.plan_trace(
    trace,
    block_size=None if trace.has_hash_ids else args.block_size,
    warmup_fraction=args.warmup_fraction,
  )
  block_size = plan.block_size
  load_s = time.perf_counter() - start
  capacities = args.capacity or [
    max(1, plan.unique_blocks * pct // 100) for pct in (1, 5, 10, 20)
  ]
  print(
    f"prefixjax replay: {trace.name} ({len(trace):,} requests, "
    f"{plan.num_events:,} blocks of {block_size} tokens, "
    f"{plan.unique_blocks:,} distinct), kvcache-sim semantics, warm-up "
    f"{args.warmup_fraction:g}, jax {jax.__version__} on "
    f"{jax.default_backend()}",
    flush=True,
  )
  policies = args.policy or list(rp.REPLAY_POLICIES)
  timing = rp.Timing()
  points = []
  bar = _progress(policies, "policies", "policy")
  for policy in bar:
    bar.set_postfix_str(policy)
    result = rp.replay(plan, policy=policy, capacities=capacities)
    timing, points = timing + result.timing, points + list(result)
  ceiling = rp.replay_ceiling(plan)
  if any(p.underfilled for p in points):
    print(
      "underfilled: the cache never filled during warm-up, so (as in "
      "kvcache-simulator) its hit tokens are reported as 0"
    )
  return _report(args, trace, points, ceiling, load_s, timing)


# Serving semantics: their one policy and what it is.
SERVING = {
  "vllm": ("lru", "vLLM's free-queue order"),
  "sglang": ("lru_leaf", "SGLang's radix-tree LRU"),
}


def _replay_serving(args, trace, load_s) -> int:
  import dataclasses

  import jax

  from prefixjax import replay as rp
  from prefixjax.cache.prefix_state import DEFAULT_VLLM_VERSION

  policy, order = SERVING[args.semantics]
  params = _policy_params(args)
  if args.semantics == "vllm" and args.policy:
    policy = args.policy[0]  # any prefix-cache policy, checked already
  elif args.policy not in (None, [policy]):
    raise CliError(
      f"--semantics {args.semantics} uses {order}: pass --policy {policy} "
      f"(got {' '.join(args.policy)})"
    )
  label = policy
  if params:
    label += "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
  if trace.has_token_ids:
    block_size = args.block_size or 16
    source = "token ids"
  elif trace.has_hash_ids:
    # The loader read the hash ids with --block-size (or the trace's own).
    block_size = trace.hash_block_size
    source = "hash ids, output-filled blocks never hit"
  else:
    raise CliError(
      f"{trace.name}: {args.semantics} semantics needs token ids or "
      "per-block hash ids "
      "(a token-id trace, a Mooncake trace or the built-in workload); this "
      "trace has lengths only"
    )
  largest = int((trace.input_lengths + trace.output_lengths).max())
  need = -(-largest // block_size)
  capacities = args.capacity or [need * f for f in (2, 8, 32, 128)]
  # Checked here too (the replays' rule) so that a bad capacity fails
  # before the points before it are computed one capacity at a time.
  fits = -(-int(trace.kv_tokens.max()) // block_size)
  if min(capacities) < fits:
    raise CliError(
      f"capacity={min(capacities)} blocks cannot hold the largest request "
      f"({fits} blocks of {block_size} tokens)"
    )
  rules = {
    "vllm": f"vLLM {args.vllm_version or DEFAULT_VLLM_VERSION}",
    "sglang": "SGLang 0.5.23 RadixCache, waiting-prefix refresh "
    + (
      "off"
      if args.waiting_refresh_interval is None
      else f"every {args.waiting_refresh_interval}"
    ),
  }[args.semantics]
  print(
    f"prefixjax replay: {trace.name} ({len(trace):,} requests, {source}), "
    f"{args.semantics} semantics ({rules}; one request at a time, policy "
    f"{label}), "
    f"block {block_size}, warm-up {args.warmup_fraction:g}, "
    f"jax {jax.__version__} on {jax.default_backend()}",
    flush=True,
  )
  timing = rp.Timing()
  points = []
  bar = _progress(capacities, "capacities", "capacity")
  for capacity in bar:
    bar.set_postfix_str(f"{capacity:,} blocks")
    result = rp.replay(
      trace,
      semantics=args.semantics,
      policy=policy,
      policy_params=params or None,
      block_size=block_size,
      capacities=[capacity],
      warmup_fraction=args.warmup_fraction,
      publish=args.publish,
      vllm_version=args.vllm_version,
      waiting_refresh_interval=args.waiting_refresh_interval,
    )
    # The table, JSON and plot name the policy with its parameters.
    timing = timing + result.timing
    points += [dataclasses.replace(p, policy=label) for p in result]
  # Nothing is evicted at the ceiling's capacity, so every policy's
  # ceiling is lru's (on its fast engine).
  ceiling, spent = _serving_ceiling(args, trace, block_size, points[0])
  return _report(args, trace, points, ceiling, load_s, timing + spent)


def _serving_ceiling(args, trace, block_size, like):
  """The same semantics with room for every block of the trace at once
  (nothing is ever evicted): the ceiling of any capacity. Reported over
  the measured window of ``like``, never underfilled; with its timing."""
  import dataclasses

  from prefixjax import replay as rp

  unbounded = int((-(-trace.kv_tokens // block_size)).sum()) + 1
  result = rp.replay(
    trace,
    semantics=args.semantics,
    block_size=block_size,
    capacities=[unbounded],
    warmup_fraction=args.warmup_fraction,
    publish=args.publish,
    vllm_version=args.vllm_version,
    waiting_refresh_interval=args.waiting_refresh_interval,
  )
  (point,) = result
  warm = len(trace) - like.measured_requests
  return dataclasses.replace(
    point,
    policy="ceiling",
    hit_tokens=int(point.per_request_hit_tokens[warm:].sum()),
    total_tokens=like.total_tokens,
    underfilled=False,
  ), result.timing


def _progress(items, desc: str, unit: str):
  """A progress bar over ``items`` on a terminal (none when piped)."""
  from tqdm import tqdm

  return tqdm(
    items, desc=desc, unit=unit, leave=False, disable=not sys.stderr.isatty()
  )


def _report(args, trace, points, ceiling, load_s, run_timing) -> int:
  """Prints the table and timings; writes ``--json`` and ``--plot``."""
  bytes_per_token = None
  if args.model is not None:
    from prefixjax import configs

    bytes_per_token = configs.model_config(args.model).kv_bytes_per_token
  rows = [_point_row(p, bytes_per_token) for p in points]
  extra = [] if ceiling is None else [_point_row(ceiling, bytes_per_token)]
  print(_replay_table(rows + extra))
  timing = {
    "load_s": load_s,
    "compile_s": run_timing.compile_s,
    "run_s": run_timing.run_s,
  }
  print(
    f"load {load_s:.2f} s, compile {timing['compile_s']:.2f} s, run "
    f"{timing['run_s']:.2f} s ({len(points)} point"
    f"{'' if len(points) == 1 else 's'})"
  )
  if args.json:
    payload = {
      "points": rows,
      "timing": timing,
      "trace": trace.name,
      "semantics": args.semantics,
      "warmup_fraction": args.warmup_fraction,
    }
    if ceiling is not None:
      payload["ceiling"] = extra[0]
    if args.model is not None:  # the model behind capacity_gib
      payload["model"] = args.model
    with open(args.json, "w") as f:
      json.dump(payload, f, indent=2)
    print(f"wrote {args.json}")
  if args.plot:
    from prefixjax.plots import plot_hit_rates

    # A PNG gets a vector PDF beside it (a paper wants both).
    also = ("pdf",) if args.plot.lower().endswith(".png") else ()
    written = plot_hit_rates(
      rows,
      args.plot,
      trace=trace.name,
      semantics=args.semantics,
      warmup_fraction=args.warmup_fraction,
      ceiling=None if ceiling is None else ceiling.hit_rate,
      bytes_per_token=bytes_per_token,
      also=also,
    )
    print(f"wrote {', '.join(written)}")
  return 0


def _point_row(point, bytes_per_token=None) -> dict:
  row = {
    "policy": point.policy,
    "capacity_blocks": int(point.capacity_blocks),
    "block_size": int(point.block_size),
    "hit_tokens": int(point.hit_tokens),
    "total_tokens": int(point.total_tokens),
    "hit_rate": float(point.hit_rate),
    "measured_requests": int(point.measured_requests),
    "mode": "underfilled" if point.underfilled else "measured",
  }
  if bytes_per_token is not None:
    row["capacity_gib"] = (
      point.capacity_blocks * point.block_size * bytes_per_token / 2**30
    )
  return row


def _replay_table(rows: list[dict]) -> str:
  gib = bool(rows) and "capacity_gib" in rows[0]
  header = (
    f"{'policy':>12} {'capacity':>9} "
    + (f"{'GiB':>8} " if gib else "")
    + f"{'hit tokens':>13} {'of tokens':>13} {'hit rate':>8} {'mode':>11}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r['policy']:>12} {r['capacity_blocks']:>9,} "
      + (f"{r['capacity_gib']:>8.2f} " if gib else "")
      + f"{r['hit_tokens']:>13,} {r['total_tokens']:>13,} "
      f"{r['hit_rate']:>8.2%} {r['mode']:>11}"
    )
  return "\n".join(lines)


def _refresh_interval(text: str) -> int | None:
  if text == "off":
    return None
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a positive integer or 'off'"
    ) from None
  if not 1 <= value < 2**31:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1 (or 'off')")
  return value


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not (value > 0 and math.isfinite(value)):
    raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
  return value


def _add_simulate(subparsers) -> None:
  p = subparsers.add_parser(
    "simulate",
    help="engine-step serving simulation (vLLM 0.33's or SGLang 0.5.23's "
    "scheduler loop)",
    description=(
      "Serves a trace (or a generated workload) through vLLM 0.33's v1 "
      "scheduler loop (FCFS, priority, or the lpm / dfs / fair orders) on "
      "the on-device prefix cache, or with --semantics sglang through "
      "SGLang 0.5.23's scheduler loop (fcfs, lpm, dfs, fair) over its radix "
      "cache, one jitted loop over engine steps, with a step-counting or a "
      "roofline clock, and prints latency, hit-rate, block and throughput "
      "metrics."
    ),
  )
  src = p.add_mutually_exclusive_group()
  src.add_argument(
    "--trace",
    metavar="PATH",
    help=(
      "trace file: token ids (JSONL), Mooncake hash ids (served with tokens "
      "synthesised per hash id) or length-only CSV (no sharing)"
    ),
  )
  src.add_argument(
    "--workload",
    metavar="NAME",
    help="a generate_workload kind (default: the built-in workload)",
  )
  _add_trace_cache(p)
  p.add_argument(
    "--format", default="auto", choices=("auto", "mooncake", "tokens", "csv")
  )
  p.add_argument(
    "--requests",
    type=_positive_int,
    default=None,
    metavar="N",
    help="requests of the generated workload (default 200), or the first N "
    "of --trace (default: all of it)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--block-size", type=int, default=16, metavar="K")
  p.add_argument(
    "--num-blocks",
    type=_positive_int,
    default=2048,
    metavar="N",
    help="usable KV blocks (vLLM's null block is extra)",
  )
  p.add_argument("--max-num-seqs", type=int, default=64)
  p.add_argument("--max-num-batched-tokens", type=int, default=2048)
  p.add_argument(
    "--max-model-len",
    type=int,
    default=4096,
    metavar="L",
    help="longest sequence (default 4096): vllm rejects prompts of L tokens "
    "or more and stops outputs at L; under --semantics sglang it is "
    "--context-length (prompts of L - 6 or more aborted, outputs at most "
    "L - 2 - prompt)",
  )
  p.add_argument(
    "--chunked-prefill",
    action=argparse.BooleanOptionalAction,
    default=True,
  )
  p.add_argument(
    "--arrivals",
    default="zero",
    choices=("trace", "zero", "poisson"),
    help="zero (default): every request at step 0; trace: at the trace's "
    "timestamps, one step per --step-time-ms; poisson: at --rate "
    "requests/s",
  )
  p.add_argument(
    "--rate", type=_positive_float, metavar="R", help="poisson: requests/s"
  )
  p.add_argument(
    "--step-time-ms",
    type=_positive_float,
    default=None,
    metavar="MS",
    help="milliseconds per engine step of --clock steps (needed by "
    "trace / poisson arrivals)",
  )
  p.add_argument(
    "--clock",
    default="steps",
    choices=("steps", "roofline"),
    help="steps (default): every step lasts --step-time-ms; roofline: each "
    "step's time from its batch's FLOPs and bytes on --model / --hardware",
  )
  p.add_argument(
    "--model",
    default=None,
    help="roofline model preset (default llama3_8b): "
    "tiny, llama2_7b, llama3_8b, llama3_70b",
  )
  p.add_argument(
    "--hardware",
    default=None,
    help="roofline hardware preset (default h100): "
    "h100, h200, tpu_v5e, tpu_v5p, tpu_v6e",
  )
  p.add_argument(
    "--scheduler",
    default="fcfs",
    help="fcfs (default) or priority: vLLM's own policies (priority reads "
    "each record's priority field of a token-id JSONL trace, lower first; "
    "a record without one gets 0; with --semantics sglang it is SGLang's "
    "priority scheduling, higher first, with its preemption); lpm, dfs "
    "(SGLang's orders) or fair (VTC) inside vLLM's loop; from Python, "
    "prefixjax.cli.main also takes a name registered with "
    "prefixjax.serving.schedulers.register_scheduler",
  )
  p.add_argument(
    "--semantics",
    default="vllm",
    choices=("vllm", "sglang"),
    help="vllm (default): vLLM 0.33's v1 scheduler and block pool; sglang: "
    "SGLang 0.5.23's scheduler loop over its paged radix cache (schedulers "
    "fcfs, lpm, dfs, fair, priority; --max-num-seqs is its "
    "--max-running-requests, --max-num-batched-tokens its "
    "--chunked-prefill-size)",
  )
  p.add_argument(
    "--low-priority-first",
    action="store_true",
    default=None,
    help="sglang, --scheduler priority: lower priority values go first "
    "(SGLang's --schedule-low-priority-values-first; SGLang's default, and "
    "ours, is higher first; vLLM's priority is always lower first)",
  )
  p.add_argument(
    "--no-priority-preemption",
    action="store_true",
    default=None,
    help="sglang, --scheduler priority: never preempt running requests for "
    "a higher-priority one (SGLang's --disable-priority-preemption)",
  )
  p.add_argument(
    "--priority-preemption-threshold",
    type=int,
    default=None,
    metavar="N",
    help="sglang, --scheduler priority: the priority difference a waiting "
    "request must exceed to preempt a running one (SGLang's "
    "--priority-scheduling-preemption-threshold, default 10)",
  )
  p.add_argument(
    "--max-prefill-tokens",
    type=int,
    default=None,
    metavar="N",
    help="sglang: prefill tokens of one batch (SGLang's --max-prefill-tokens, "
    "default 16384)",
  )
  p.add_argument("--json", metavar="OUT", help="write the metrics as JSON")
  p.add_argument(
    "--requests-out", metavar="OUT", help="one JSON line per request"
  )
  _add_compile_cache(p)
  _add_debug(p)
  p.set_defaults(func=_cmd_simulate)


def _simulate_config(args):
  """The ServingConfig of the flags; its errors named by flag."""
  from prefixjax.serving import ServingConfig

  flags = dict(
    num_gpu_blocks="--num-blocks",
    block_size="--block-size",
    max_num_seqs="--max-num-seqs",
    max_num_batched_tokens="--max-num-batched-tokens",
    max_model_len="--max-model-len",
    chunked_prefill="--[no-]chunked-prefill",
    scheduler="--scheduler",
    semantics="--semantics",
    max_prefill_tokens="--max-prefill-tokens",
    parallel_sampling="--semantics",
    priority_preemption_threshold="--priority-preemption-threshold",
    low_priority_first="--low-priority-first",
    priority_preemption="--no-priority-preemption",
  )
  extra = {}
  if args.max_prefill_tokens is not None:
    extra["max_prefill_tokens"] = args.max_prefill_tokens
  if args.low_priority_first:
    extra["low_priority_first"] = True
  if args.no_priority_preemption:
    extra["priority_preemption"] = False
  if args.priority_preemption_threshold is not None:
    extra["priority_preemption_threshold"] = args.priority_preemption_threshold
  try:
    return ServingConfig(
      num_gpu_blocks=args.num_blocks + 1,
      block_size=args.block_size,
      max_num_seqs=args.max_num_seqs,
      max_num_batched_tokens=args.max_num_batched_tokens,
      max_model_len=args.max_model_len,
      chunked_prefill=args.chunked_prefill,
      scheduler=args.scheduler,
      semantics=args.semantics,
      **extra,
    )
  except ValueError as err:
    msg = str(err)
    field = msg.split("=", 1)[0].removeprefix("ServingConfig.")
    raise CliError(f"{flags.get(field, field)}: {msg}") from None


def _check_simulate_args(args):
  """Flag rules checked before any work; returns the ServingConfig."""
  from prefixjax.serving.schedulers import scheduler_names

  if args.scheduler not in scheduler_names():
    raise CliError(
      f"--scheduler {args.scheduler}: unknown; use one of "
      f"{', '.join(scheduler_names())}"
    )
  if args.clock == "steps":
    if args.arrivals in ("trace", "poisson") and args.step_time_ms is None:
      raise CliError(
        f"--arrivals {args.arrivals} needs --step-time-ms (or --clock roofline)"
      )
    for flag in ("model", "hardware"):
      if getattr(args, flag) is not None:
        raise CliError(f"--{flag} is for --clock roofline")
  else:
    from prefixjax import configs

    if args.step_time_ms is not None:
      raise CliError("--step-time-ms is for --clock steps, not roofline")
    for flag, known in (
      ("model", configs.MODELS),
      ("hardware", configs.HARDWARE),
    ):
      name = getattr(args, flag)
      if name is not None and name not in known:
        raise CliError(
          f"--{flag} {name}: unknown; use one of {', '.join(sorted(known))}"
        )
  if args.arrivals == "poisson" and args.rate is None:
    raise CliError("--arrivals poisson needs --rate")
  if args.rate is not None and args.arrivals != "poisson":
    raise CliError(f"--rate is for --arrivals poisson, not {args.arrivals}")
  if args.workload is not None:
    from prefixjax.workloads import workload_kinds

    if args.workload not in workload_kinds():
      raise CliError(
        f"--workload {args.workload}: unknown; use one of "
        f"{', '.join(workload_kinds())}"
      )
  _check_outputs(
    [("--json", args.json), ("--requests-out", args.requests_out)],
    [("--trace", args.trace)],
  )
  return _simulate_config(args)


def _cmd_simulate(args) -> int:
  config = _check_simulate_args(args)
  _start_jax(args, one_program=True)

  import time

  import numpy as np

  from prefixjax import serving
  from prefixjax.workloads import (
    default_workload,
    generate_workload,
    load_trace,
  )

  start = time.perf_counter()
  n = args.requests or 200  # a generated workload's size
  if args.trace:
    trace = load_trace(
      args.trace, args.format, limit=args.requests, cache=args.trace_cache
    )
    from prefixjax.serving.simulate import no_output_message

    if why := no_output_message(trace, args.trace):
      raise CliError(why)
    if not trace.has_token_ids and not trace.has_hash_ids:
      _warn(
        f"{args.trace} has lengths only (no token ids, no hash ids): it "
        "carries no prefix sharing, so each request is served with tokens "
        "of its own and every hit is 0",
        "simulate",
      )
    # Hash ids (Mooncake) become tokens, equal ids equal tokens.
    trace = trace.with_token_ids()
  elif args.workload:
    trace = generate_workload(args.workload, num_requests=n, seed=args.seed)
  else:
    trace = default_workload(num_requests=n, seed=args.seed)
  load_s = time.perf_counter() - start
  prompts = np.asarray(trace.input_lengths)
  if (
    len(prompts) and not ((prompts > 0) & (prompts < config.prompt_limit)).any()
  ):
    # Every request would be rejected (serving.simulate's input rule, as
    # vLLM's InputProcessor or SGLang's input check): say so before
    # compiling anything.
    raise CliError(
      f"all {len(prompts):,} requests would be rejected: prompts of "
      f"{int(prompts.min()):,}-{int(prompts.max()):,} tokens, none both "
      f"non-empty and shorter than {_prompt_limit_words(config)}"
    )
  print(_simulate_header(args, trace, config), flush=True)
  start = time.perf_counter()
  result = serving.simulate(
    trace,
    config,
    arrivals=args.arrivals,
    step_time_ms=args.step_time_ms,
    rate=args.rate,
    seed=args.seed,
    progress=sys.stderr.isatty(),
    **(
      dict(clock="roofline", model=args.model, hardware=args.hardware)
      if args.clock == "roofline"
      else {}
    ),
  )
  run_s = time.perf_counter() - start
  if not result.ok:
    raise CliError(f"simulation ended with status {result.status}")
  metrics = result.metrics()
  if metrics["rejected"]:
    # The input check: a prompt of config.prompt_limit tokens or more (or
    # an empty one) is refused before it is queued.
    lens = result.prompt_len[result.rejected]
    long = lens[lens > 0]
    why = []
    if len(long):
      why.append(
        f"{len(long)} with prompts of {int(long.min()):,}-"
        f"{int(long.max()):,} tokens, not shorter than "
        f"{_prompt_limit_words(config)}"
      )
    if len(long) < len(lens):
      why.append(f"{len(lens) - len(long)} with empty prompts")
    _warn(
      f"{metrics['rejected']} of {metrics['requests']} requests rejected "
      f"({'; '.join(why)})",
      "simulate",
    )
  shown = {k: v for k, v in metrics.items() if v is not None}
  width = max(map(len, shown))
  for key, value in shown.items():
    text = f"{value:,.4f}" if isinstance(value, float) else f"{value:,}"
    print(f"{key:<{width}}  {text:>14}")
  untimed = [
    k
    for k, v in metrics.items()
    if v is None and (k.endswith(("_s", "_per_s")) or "_s_p" in k)
  ]
  if untimed:
    print(
      f"({len(untimed)} metrics in seconds need times: pass "
      "--step-time-ms MS or --clock roofline; --json writes them as null)"
    )
  print(
    f"load {load_s:.2f} s, compile and run {run_s:.2f} s "
    f"({metrics['steps']:,} steps)"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(metrics, f, indent=2)
      f.write("\n")
  if args.requests_out:
    with open(args.requests_out, "w") as f:
      for rec in result.requests():
        line = dict(
          id=rec["rid"],
          status=rec["status"],  # finished, rejected, or waiting at the end
          prompt_tokens=rec["prompt_len"],
          max_output_tokens=rec["max_tokens"],
          output_tokens=rec.get("num_output_tokens", 0),
          hit_tokens=rec.get("hit_first_sched"),
          first_token_step=rec.get("first_token_step"),
          finish_step=rec.get("finish_step"),
          preemptions=rec.get("num_preemptions", 0),
        )
        if "parent" in rec:  # parallel sampling: the prompt's request
          line.update(parent=rec["parent"], sample=rec["sample"])
        for key in (
          "arrival_s",
          "first_token_s",
          "finish_s",
          "ttft_s",
          "e2e_s",
        ):
          if key in rec:
            line[key] = rec[key]
        f.write(json.dumps(line) + "\n")
  return 0


def _prompt_limit_words(config) -> str:
  """The rejection limit of :attr:`ServingConfig.prompt_limit` in words."""
  if config.semantics == "sglang":
    return (
      f"{config.prompt_limit:,} tokens (SGLang's max_req_input_len: "
      f"--max-model-len {config.max_model_len:,} - 6)"
    )
  return f"--max-model-len {config.max_model_len:,}"


def _simulate_header(args, trace, config) -> str:
  """What ``prefixjax simulate`` is about to run, in one line."""
  import jax

  scheduler = config.scheduler
  if not isinstance(scheduler, str):
    scheduler = getattr(scheduler, "name", type(scheduler).__name__)
  rules = {"vllm": "vLLM 0.33 scheduler", "sglang": "SGLang 0.5.23"}
  if args.clock == "roofline":
    from prefixjax.serving.simulate import DEFAULT_HARDWARE, DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    clock = f"roofline clock ({model} on {args.hardware or DEFAULT_HARDWARE})"
  elif args.step_time_ms is not None:
    clock = f"steps of {args.step_time_ms:g} ms"
  else:
    clock = "steps clock"
  threads = ""
  if jax.default_backend() == "cpu":
    from prefixjax._host import xla_threads

    threads = f" ({xla_threads()})"
  arrivals = {
    "zero": "every request arriving at step 0",
    "trace": "arrivals at the trace's timestamps",
    "poisson": f"Poisson arrivals at {args.rate or 0:g}/s",
  }[args.arrivals]
  return (
    f"prefixjax simulate: {trace.name} ({len(trace):,} requests), "
    f"{config.semantics} semantics ({rules[config.semantics]}), "
    f"{scheduler} scheduler, {config.num_gpu_blocks - 1:,} blocks of "
    f"{config.block_size} tokens, max_num_seqs {config.max_num_seqs}, "
    f"max_num_batched_tokens {config.max_num_batched_tokens:,}, "
    f"max_model_len {config.max_model_len:,}, chunked prefill "
    f"{'on' if config.chunked_prefill else 'off'}, {clock}, {arrivals}, "
    f"jax {jax.__version__} on {jax.default_backend()}{threads}"
  )


def _add_sweep(subparsers) -> None:
  from prefixjax.sweep import command

  p = subparsers.add_parser(
    "sweep",
    help="run a sweep spec: results table, CSV, JSON, plots",
    description=command.DESCRIPTION,
  )
  command.configure(p)
  _add_compile_cache(p)
  _add_debug(p)
  p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args) -> int:
  from prefixjax.sweep import command

  _start_jax(args)
  return command.run(args)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser (exposed for tests and docs)."""
  from prefixjax import __version__

  parser = argparse.ArgumentParser(
    prog="prefixjax",
    description="On-device paged KV caches with prefix sharing.",
  )
  parser.add_argument(
    "--version", action="version", version=f"prefixjax {__version__}"
  )
  parser.add_argument(
    "--debug", action="store_true", help="show tracebacks on errors"
  )
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  _add_demo(subparsers)
  _add_replay(subparsers)
  _add_simulate(subparsers)
  _add_sweep(subparsers)
  return parser


def main(argv=None) -> int:
  """Runs one command line; returns its exit status."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return EXIT_USAGE
  try:
    return args.func(args)
  except (CliError, ValueError, TypeError, OSError, OverflowError) as err:
    if args.debug:
      raise
    print(f"prefixjax {args.command}: error: {err}", file=sys.stderr)
    return EXIT_USAGE
  except MemoryError as err:
    if args.debug:
      raise
    print(
      f"prefixjax {args.command}: error: out of host memory ({err}): the "
      "workload or configuration is too large for this machine",
      file=sys.stderr,
    )
    return EXIT_USAGE


def run() -> None:
  """The ``prefixjax`` console script (and ``python -m prefixjax``):
  :func:`main` in a process of its own, which then exits with its status.

  Python's last garbage collections at exit walk every object JAX left
  behind: 0.10 s of a 1.3 s warm replay on this 2-core CPU.
  ``gc.freeze()`` moves those objects out of their way first. Nothing is
  skipped: exit handlers, thread joins and file flushes run as usual.
  """
  global _OWN_PROCESS
  _OWN_PROCESS = True
  status = main()
  gc.freeze()
  sys.exit(status)


if __name__ == "__main__":
  run()
