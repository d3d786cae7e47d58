"""Runs a sweep spec: groups of points as compiled programs, resumable.

The points of a :class:`~prefixjax.sweep.spec.SweepSpec` that share a
compiled program form a group, and each group is one call:

* replay points that differ only in ``capacity`` are one
  :func:`prefixjax.replay.replay` call (its engines batch capacities as
  columns of one state, one stack pass, or one program run per capacity;
  vectorized, the per-capacity vllm and sglang engines run the capacities
  as one vmapped program sharded over the local devices); groups of one
  vllm policy whose ``policy_params`` live in the policy's state (``lfu``'s
  ``decay``) reuse one compiled program;
* simulate points that share the static shapes (``num_blocks``,
  ``block_size``, ``max_num_seqs``, ``max_model_len``, the scheduler, the
  clock and its presets, the arrival mode) and differ in
  ``max_num_batched_tokens``, ``chunked_prefill``, ``rate``, ``seed`` or
  ``step_time_ms`` are one :func:`prefixjax.serving.simulate_batch` call,
  vmapped over the points on accelerators, with the points' axis sharded
  over the local devices (:class:`jax.sharding.NamedSharding`).

Resumable: each finished point is written to ``DIR/points/<key>.json``
atomically (a temporary file, flushed, then :func:`os.replace`), so a run
killed at any moment (SIGKILL included) leaves only whole point files; a
rerun with the same spec skips them and ends with the rows of a clean run.
``DIR/spec.json`` records the expanded spec; a different spec in the same
``DIR`` is refused. At the end ``DIR/results.csv`` and
``DIR/results.json`` (one row per point, in spec order: :data:`ROW_HEAD`,
``workload_seed`` being the generator's seed or None for a trace, then every
field and every metric), ``DIR/timing.json`` (compile and run seconds per
group: the only numbers that differ between runs) and the plots are
written, each atomically.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from prefixjax.sweep.spec import (
  Point,
  SweepSpec,
  load_spec,
  serving_config,
)

__all__ = [
  "SweepError",
  "SweepResult",
  "run_sweep",
]

ROW_HEAD = ("index", "key", "mode", "workload", "workload_seed")

# Groups run between two drops of the compiled programs
# (``_host.release_compiled``): JAX keeps every compiled program in the
# process (on a CPU 30-150 MB each for the serving loops, and about 1,100-
# 1,300 of the kernel's 65,530 memory mappings a process may hold,
# benchmarks/RESULTS.md, sessions 32-33), and a sweep's later points reuse
# their group's program, so a sweep of many shapes runs its groups in
# waves of this many and frees the programs between waves.
GROUPS_IN_MEMORY = 16


class SweepError(ValueError):
  """The sweep cannot run as asked (a different spec in DIR, a bad DIR)."""


@dataclasses.dataclass(frozen=True)
class SweepResult:
  """What :func:`run_sweep` returns.

  Attributes:
    spec: the expanded spec.
    rows: one dict per point that ran, in spec order.
    out: the results folder (None when run without one).
    skipped: ``(point index, reason)`` of the points that could not run
      (an absent trace).
    reused: how many rows came from an earlier, interrupted run.
    files: the files written (results, plots).
    timing: per group: its points, compile and run seconds.
  """

  spec: SweepSpec
  rows: tuple[dict[str, Any], ...]
  out: pathlib.Path | None = None
  skipped: tuple[tuple[int, str], ...] = ()
  reused: int = 0
  files: tuple[str, ...] = ()
  timing: tuple[dict[str, Any], ...] = ()

  def frame(self):
    """The rows as a :class:`pandas.DataFrame` (one row per point)."""
    import pandas as pd

    return pd.DataFrame(list(self.rows), columns=columns(self.rows))

  def table(self) -> str:
    """The main columns of each mode, as a text table."""
    return results_table(self.rows)


def _atomic_write(path: pathlib.Path, text: str | bytes) -> None:
  """Writes ``path`` whole or not at all (a kill leaves the old file)."""
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  data = text.encode() if isinstance(text, str) else text
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _plain(v):
  """JSON-able Python scalars (numpy ints and floats, NaN as None)."""
  if isinstance(v, (np.integer,)):
    return int(v)
  if isinstance(v, (np.floating, float)):
    v = float(v)
    return None if not math.isfinite(v) else v
  if isinstance(v, np.bool_):
    return bool(v)
  return v


def columns(rows: Sequence[dict[str, Any]]) -> list[str]:
  """Column order: the head, then every field and metric as first seen."""
  seen = dict.fromkeys(ROW_HEAD)
  for r in rows:
    seen.update(dict.fromkeys(r))
  return list(seen)


def _csv(rows) -> str:
  buf = io.StringIO()
  names = columns(rows)
  w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
  w.writeheader()
  for r in rows:
    w.writerow({k: "" if r.get(k) is None else r[k] for k in names})
  return buf.getvalue()


def _fragmentation(trace, block_size: int) -> float:
  """Share of reserved token slots left empty: each sequence of ``P + O``
  tokens reserves ``ceil((P + O) / K)`` blocks (the seed-002 table)."""
  n = np.asarray(trace.input_lengths, np.int64) + np.asarray(
    trace.output_lengths, np.int64
  )
  reserved = -(-n // block_size) * block_size
  return float((reserved - n).sum() / max(int(reserved.sum()), 1))


def _replay_group(trace, points: Sequence[Point], devices=None):
  """Replay points differing only in capacity: one replay call (vllm and
  sglang semantics sharded over ``devices`` when given)."""
  from prefixjax import replay as rp

  p0 = points[0]
  semantics = p0.get("semantics")
  block_size, warmup = p0.get("block_size"), p0.get("warmup_fraction")
  result = rp.replay(
    trace,
    policy=p0.get("policy"),
    policy_params=json.loads(p0.get("policy_params")) or None,
    capacities=[p.get("capacity") for p in points],
    semantics=semantics,
    block_size=block_size,
    warmup_fraction=warmup,
    devices=devices,
  )
  ceiling = None
  if semantics == "kvcache-sim":
    plan = rp.plan_trace(trace, block_size=block_size, warmup_fraction=warmup)
    ceiling = rp.replay_ceiling(plan).hit_rate
  frag = _fragmentation(trace, block_size)
  rows = []
  for point in result:
    rows.append(
      {
        "hit_tokens": int(point.hit_tokens),
        "total_tokens": int(point.total_tokens),
        "hit_rate": float(point.hit_rate),
        "measured_requests": int(point.measured_requests),
        "underfilled": bool(point.underfilled),
        "ceiling_hit_rate": ceiling,
        "internal_fragmentation": frag,
      }
    )
  return rows, result.timing.compile_s, result.timing.run_s


def _cluster_group(trace, points: Sequence[Point], vectorize, devices):
  """Routed points, one :func:`prefixjax.routing.simulate_cluster` each;
  vectorized, the replica axis is sharded over ``gcd(P, devices)`` of the
  devices."""
  from prefixjax.routing import simulate_cluster

  start = time.perf_counter()
  rows = []
  for p in points:
    d = math.gcd(p.get("replicas"), len(devices or ()))
    r = simulate_cluster(
      trace,
      serving_config(dict(p.params)),
      replicas=p.get("replicas"),
      router=p.get("router"),
      mode=p.get("route_mode"),
      arrivals=p.get("arrivals"),
      step_time_ms=p.get("step_time_ms"),
      rate=p.get("rate"),
      seed=p.get("seed"),
      vectorize=vectorize,
      devices=list(devices)[:d] if vectorize and d > 1 else None,
    )
    m = {k: _plain(v) for k, v in r.metrics().items() if k != "mode"}
    m.pop("router", None)
    m.pop("replicas", None)
    rows.append({"hit_rate": m["token_hit_rate"], "status": r.status, **m})
  return rows, None, time.perf_counter() - start


def _simulate_group(trace, points: Sequence[Point], vectorize, devices, runs):
  """A group of simulate points as one :func:`simulate_batch` call;
  ``runs``: the trace's :class:`~prefixjax.serving.simulate.TraceRuns`
  (shared by the calls of one sweep on that trace; ``None`` for a router
  group, which runs through ``simulate_cluster``)."""
  p0 = points[0]
  if p0.get("router") is not None:
    return _cluster_group(trace, points, vectorize, devices)
  configs = [serving_config(dict(p.params)) for p in points]
  roofline = p0.get("clock") == "roofline"
  start = time.perf_counter()
  results = runs.simulate_batch(
    configs,
    arrivals=p0.get("arrivals"),
    step_time_ms=[p.get("step_time_ms") for p in points],
    rate=[p.get("rate") for p in points],
    seed=[p.get("seed") for p in points],
    clock=p0.get("clock"),
    model=p0.get("model") if roofline else None,
    hardware=p0.get("hardware") if roofline else None,
    vectorize=vectorize,
    devices=devices,
  )
  run_s = time.perf_counter() - start
  rows = []
  for r in results:
    m = {k: _plain(v) for k, v in r.metrics().items()}
    rows.append({"hit_rate": m["token_hit_rate"], "status": r.status, **m})
  return rows, None, run_s


_REPLAY_SHARED = (
  "semantics",
  "policy",
  "policy_params",
  "block_size",
  "warmup_fraction",
)
_SIM_SHARED = (
  "semantics",
  "num_blocks",
  "block_size",
  "max_num_seqs",
  "max_model_len",
  "scheduler",
  "clock",
  "model",
  "hardware",
  "arrivals",
  "router",
  "replicas",
  "route_mode",
)


def groups(spec: SweepSpec) -> list[list[Point]]:
  """The points that run as one program, in order of their first point."""
  out: dict[tuple, list[Point]] = {}
  for p in spec.points:
    shared = _REPLAY_SHARED if p.mode == "replay" else _SIM_SHARED
    key = (p.mode, *_workload_key(p), *(p.get(k) for k in shared))
    out.setdefault(key, []).append(p)
  return list(out.values())


def _workload_key(p: Point) -> tuple[str, int]:
  """Which trace a point runs on: its workload and seed."""
  return p.workload.name, p.workload.seed


def _row_head(p: Point) -> dict[str, Any]:
  """A row's fields before its metrics: the point's id and parameters."""
  return {
    "index": p.index,
    "key": p.key,
    "mode": p.mode,
    "workload": p.workload.name,
    "workload_seed": p.workload.seed if p.workload.generator else None,
    **dict(p.params),
  }


def _check_out(
  out: pathlib.Path, spec: SweepSpec, digests: dict[str, str]
) -> None:
  """Refuses an ``out`` that is not a writable folder, that holds other
  files than a sweep's, or another spec's results, or results computed
  from a trace file whose bytes have changed since (``digests``: the trace
  workloads' :meth:`~prefixjax.sweep.spec.WorkloadSpec.content_digest`)."""
  if out.exists() and not out.is_dir():
    raise SweepError(f"--out {out}: exists and is not a folder")
  parent = out if out.exists() else out.parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir():
    raise SweepError(f"--out {out}: {parent} is a file, not a folder")
  if not os.access(parent, os.W_OK):
    raise SweepError(f"--out {out}: {parent} is not writable")
  recorded = out / "spec.json"
  if out.is_dir() and not recorded.exists():
    # A killed run's temporary files start with a dot.
    others = sorted(f.name for f in out.iterdir() if f.name[0] != ".")
    if others:
      raise SweepError(
        f"--out {out}: holds files that are not a sweep's results ("
        f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}; no "
        "spec.json): use an empty or new folder, so nothing there is "
        "overwritten"
      )
  if recorded.exists():
    try:
      old = json.loads(recorded.read_text())
    except (OSError, ValueError) as err:
      raise SweepError(
        f"{recorded}: unreadable ({err}); use another --out"
      ) from None
    if old.get("fingerprint") != spec.fingerprint():
      raise SweepError(
        f"--out {out} holds the results of a different spec "
        f"({old.get('spec')}, {len(old.get('points', []))} points; this one "
        f"has {len(spec.points)}): use another --out, or delete {out} to "
        "start over"
      )
    for name, digest in (old.get("trace_digests") or {}).items():
      now = digests.get(name)
      if now is not None and now != digest:
        raise SweepError(
          f"--out {out}: the trace of workload {name} "
          f"({spec.workloads[name].trace}) has changed since the results "
          f"there were computed (sha256 {digest[:12]}... then, "
          f"{now[:12]}... now): use another --out, or delete {out} to "
          "start over"
        )


def _check_on_trace(spec: SweepSpec, p: Point, trace) -> None:
  """The rules that need the workload read, checked for every point before
  any runs (a spec cannot know them): a simulated trace has an output
  token per request, a hash-id trace (Mooncake) replays at its hash block
  size only, and the vllm and sglang replay engines need room for the
  largest request."""
  where = (
    f"{spec.path or '<spec>'}: {p.mode} point {p.index} (workload "
    f"{p.workload.name}"
  )
  if p.mode == "simulate" and p.workload.trace is not None:
    from prefixjax.serving.simulate import no_output_message

    if why := no_output_message(trace, p.workload.trace):
      raise SweepError(f"{where}): {why}")
  if p.mode == "simulate" and p.get("semantics") == "sglang":
    from prefixjax.serving.simulate import prefill_only_message

    config = serving_config(dict(p.params))
    if why := prefill_only_message(trace.input_lengths, config):
      raise SweepError(f"{where}, num_blocks={p.get('num_blocks')}): {why}")
  if p.mode != "replay":
    return
  where += ")"
  block_size = p.get("block_size")
  if trace.has_hash_ids and block_size != trace.hash_block_size:
    raise SweepError(
      f"{where}: block_size={block_size} differs from the hash block size "
      f"{trace.hash_block_size} of {p.workload.trace}: hash ids name "
      f"blocks of that size only; set block_size = {trace.hash_block_size} "
      "for this workload's replay points"
    )
  if p.get("semantics") in ("vllm", "sglang") and len(trace):
    from prefixjax.replay.frame import largest_request_blocks

    need, biggest = largest_request_blocks(trace, block_size)
    if p.get("capacity") < need:
      raise SweepError(
        f"{where}: capacity={p.get('capacity')} blocks cannot hold the "
        f"largest request under {p.get('semantics')} semantics (request "
        f"{biggest}: {need} blocks of {block_size} tokens); give "
        f"replay.capacity values of at least {need}"
      )


def _load_done(
  folder: pathlib.Path, spec: SweepSpec, known=(), clean=False
) -> dict[str, dict]:
  """The rows of the point files in ``folder`` (keys in ``known`` skipped);
  ``clean`` deletes the temporary files a killed run left (only safe when
  no other process is writing into ``folder``)."""
  done = {}
  if not folder.is_dir():
    return done
  keys = {p.key for p in spec.points}
  for f in folder.iterdir():
    if f.name.startswith("."):  # a temporary file
      if clean:  # left behind by a kill
        f.unlink(missing_ok=True)
      continue
    if f.stem in known:
      continue
    if f.suffix != ".json" or f.stem not in keys:
      continue
    try:
      row = json.loads(f.read_text())
    except ValueError:
      continue  # cannot happen with atomic writes; recompute to be safe
    done[f.stem] = row
  return done


def left_out_notes(spec: SweepSpec) -> list[str]:
  """One line per kind of grid combination the spec leaves out (a policy
  or scheduler its semantics does not serve, policy parameters a policy
  does not take), with how many points each left out."""
  from prefixjax.serving.schedulers import scheduler_names

  notes = []
  for sem, policy, n in spec.left_out:
    simulate = policy in scheduler_names()  # no name is both
    what = "scheduler" if simulate else "policy"
    mode = "simulate" if simulate else "replay"
    notes.append(
      f"{mode}: {n} points of {what} {policy} left out ({sem} does not "
      "serve it)"
    )
  for policy, params, n in spec.left_out_params:
    notes.append(
      f"replay: {n} points of policy {policy} with policy_params {params} "
      f"left out ({policy} takes no such parameter)"
    )
  return notes


def run_sweep(
  spec: SweepSpec | str | os.PathLike,
  out: str | os.PathLike | None = None,
  *,
  full: bool = False,
  plots: bool = True,
  progress: bool | None = None,
  devices: Sequence[Any] | None = None,
  log: Callable[[str], None] | None = None,
  process: tuple[int, int] = (0, 1),
  poll_s: float = 0.5,
) -> SweepResult:
  """Runs every point of a spec and writes the results under ``out``.

  Args:
    spec: a :class:`SweepSpec` or a spec file path.
    out: the results folder (created; rerunning with the same spec resumes;
      a different spec is refused). None keeps the rows in memory only.
    full: with a path, apply the spec's ``[full]`` table.
    plots: write the figures (needs matplotlib).
    progress: a progress bar over points (default: when stderr is a tty).
    devices: the devices a vectorized simulate group's points are sharded
      over (default: all local devices).
    log: where to say what is skipped and reused (default: stderr).
    process: ``(index, count)`` of this process among the processes that
      share ``out`` (a multi-host run: ``prefixjax sweep --distributed``
      takes them from :func:`jax.distributed.initialize`). Process ``i``
      runs the groups ``g`` with ``g % count == i`` (groups in spec order)
      and writes their point files; process 0 then waits until every
      point's file is in ``out`` and writes the results and plots, which
      equal a single-process run's. The other processes return their own
      rows. A killed process leaves only whole point files: rerun the same
      command (any process count) to finish. ``timing.json`` then holds
      process 0's groups only.
    poll_s: how often process 0 looks for the other processes' points.

  Returns:
    A :class:`SweepResult`.

  Raises:
    SpecError: a bad spec (file, field, rule).
    SweepError: ``out`` holds another spec's results or is not writable.
    Errors of loading a trace (file and line) come before any point runs.
  """
  import jax

  if not isinstance(spec, SweepSpec):
    spec = load_spec(spec, full=full)
  index, count = process
  if not (isinstance(count, int) and count >= 1 and 0 <= index < count):
    raise SweepError(f"process={process!r}: needs 0 <= index < count")
  if count > 1 and out is None:
    raise SweepError("a multi-process sweep needs out=DIR (shared)")
  say = log or (lambda m: print(m, file=sys.stderr))
  folder = None
  done: dict[str, dict] = {}
  digests = {}
  if out is not None:
    out = pathlib.Path(out)
    digests = {
      name: d
      for name, w in sorted(spec.workloads.items())
      if (d := w.content_digest()) is not None
    }
    _check_out(out, spec, digests)
    folder = out / "points"
    done = _load_done(folder, spec, clean=count == 1)
  for note in left_out_notes(spec):
    say(note)
  missing = {}
  traces = {}
  for name, w in spec.workloads.items():
    if not any(p.workload.name == name for p in spec.points):
      continue
    why = w.missing()
    if why:
      missing[name] = why
      say(f"workload {name}: {why}; its points are skipped")
      continue
    for p in spec.points:  # a generated workload: one trace per seed
      if p.workload.name == name and p.key not in done:
        if _workload_key(p) not in traces:
          traces[_workload_key(p)] = p.workload.load()
        _check_on_trace(spec, p, traces[_workload_key(p)])
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
    # spec.json first: another process of the run then never sees a
    # folder with files but no spec.json (which _check_out refuses).
    described = {**spec.describe(), "trace_digests": digests}
    _atomic_write(out / "spec.json", json.dumps(described, indent=1))
    folder.mkdir(exist_ok=True)
  reused = len(done)
  if done:
    say(f"resuming: {len(done)} of {len(spec.points)} points already done")
  if devices is None:
    devices = jax.local_devices()
  todo = [
    g
    for i, g in enumerate(groups(spec))
    if i % count == index
    and g[0].workload.name not in missing
    and any(p.key not in done for p in g)
  ]
  total = sum(sum(p.key not in done for p in g) for g in todo)
  bar = None
  if progress is None:
    progress = sys.stderr.isatty()
  if progress and total:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"sweep {spec.name}", unit="point")
  timing = []
  # Where a simulate group's configurations run one after another (a CPU,
  # unless the spec asks for vmap), each is its own call: the same compiled
  # program, a point file as soon as it is done, the bar moving per point.
  serial = spec.vectorize is False or (
    spec.vectorize is None and jax.default_backend() == "cpu"
  )

  def split(wave):
    pieces, alone = [], []
    for g in wave:
      g = [p for p in g if p.key not in done]
      if g[0].mode == "simulate" and serial:
        # The first point compiles the group's program, alone; the others
        # reuse it on threads (below).
        pieces.append(g[:1])
        alone += [[p] for p in g[1:]]
      else:
        pieces.append(g)
    return pieces, alone

  # A trace's simulate points share its checked records and block keys
  # (the built-in workload's 4,000 requests: about 0.2 s of host work a
  # point otherwise, holding the GIL the other thread's points wait for).
  from prefixjax.serving.simulate import TraceRuns

  runs = {}
  for g in todo:
    key = _workload_key(g[0])
    if g[0].mode == "simulate" and g[0].get("router") is None:
      if key not in runs:
        runs[key] = TraceRuns(traces[key])

  def run_piece(g):
    trace = traces[_workload_key(g[0])]
    if g[0].mode == "replay":
      return _replay_group(trace, g, None if serial else devices)
    return _simulate_group(
      trace, g, spec.vectorize, devices, runs.get(_workload_key(g[0]))
    )

  def record(g, rows, compile_s, run_s):
    timing.append(
      {
        "points": [p.index for p in g],
        "mode": g[0].mode,
        "compile_s": compile_s,
        "run_s": run_s,
      }
    )
    for p, metrics in zip(g, rows, strict=True):
      row = {**_row_head(p), **metrics}
      row = {k: _plain(v) for k, v in row.items()}
      done[p.key] = row
      if folder is not None:
        _atomic_write(folder / f"{p.key}.json", json.dumps(row))
    if bar is not None:
      bar.update(len(g))

  # In each wave of GROUPS_IN_MEMORY groups, the groups (and each serial
  # simulate group's first point) run on a thread per core: each compiles
  # its own program, XLA's compile and the compiled loop release the GIL,
  # so two compile at once on two cores (experiments/scheduling.toml,
  # every program compiled: 119-123 s one group at a time, 95 s on two
  # threads). Then the other serial simulate points, the same way. Each
  # piece is recorded as soon as it is done, in whatever order they finish
  # (rows are put in spec order at the end). Between waves nothing runs and
  # the compiled programs are dropped.
  from prefixjax._host import (
    as_done_on_threads,
    release_compiled,
    release_compiled_near_map_limit,
  )

  waves = [
    todo[i : i + GROUPS_IN_MEMORY]
    for i in range(0, len(todo), GROUPS_IN_MEMORY)
  ]
  try:
    for w, wave in enumerate(waves):
      if w:
        release_compiled()
      else:  # what the process compiled before this sweep
        release_compiled_near_map_limit()
      pieces, alone = split(wave)
      for i, result in as_done_on_threads(run_piece, pieces):
        record(pieces[i], *result)
      for i, result in as_done_on_threads(run_piece, alone):
        record(alone[i], *result)
  finally:
    if bar is not None:
      bar.close()
  timing.sort(key=lambda entry: entry["points"][0])  # spec order
  if count > 1:
    needed = {p.key for p in spec.points if p.workload.name not in missing}
    if index != 0:
      mine = {p.key for g in todo for p in g}
      rows = tuple(_row(p, done) for p in spec.points if p.key in mine)
      return SweepResult(spec=spec, rows=rows, out=out, timing=tuple(timing))
    waited = False
    while not needed <= done.keys():
      if not waited:
        say(
          f"process 0 of {count}: waiting for "
          f"{len(needed - done.keys())} points of the other processes"
        )
        waited = True
      time.sleep(poll_s)
      done.update(_load_done(folder, spec, known=done.keys()))
  rows = tuple(_row(p, done) for p in spec.points if p.key in done)
  skipped = tuple(
    (p.index, missing[p.workload.name])
    for p in spec.points
    if p.workload.name in missing
  )
  files: list[str] = []
  if out is not None:
    _atomic_write(out / "results.csv", _csv(rows))
    _atomic_write(out / "results.json", json.dumps(list(rows), indent=1))
    _atomic_write(
      out / "skipped.json",
      json.dumps([{"index": i, "reason": r} for i, r in skipped], indent=1),
    )
    _atomic_write(out / "timing.json", json.dumps(timing, indent=1))
    files += [str(out / "results.csv"), str(out / "results.json")]
    if plots and rows:
      from prefixjax.sweep.figures import sweep_plots

      files += sweep_plots(rows, out / "plots", spec)
  return SweepResult(
    spec=spec,
    rows=rows,
    out=out,
    skipped=skipped,
    reused=reused,
    files=tuple(files),
    timing=tuple(timing),
  )


def _row(p: Point, done: dict[str, dict]) -> dict[str, Any]:
  """The row of a finished point. A point file written before a field was
  added lacks it: the head comes from the point (same values, same order as
  a fresh row's), the metrics from the file."""
  return {k: _plain(v) for k, v in {**_row_head(p), **done[p.key]}.items()}


_TABLE = {
  "replay": (
    ("workload", "workload", "{}"),
    ("workload_seed", "w.seed", "{}"),
    ("semantics", "semantics", "{}"),
    ("policy", "policy", "{}"),
    ("policy_params", "params", "{}"),
    ("block_size", "K", "{}"),
    ("capacity", "capacity", "{:,}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ceiling_hit_rate", "ceiling", "{:.1%}"),
  ),
  "simulate": (
    ("workload", "workload", "{}"),
    ("workload_seed", "w.seed", "{}"),
    ("semantics", "semantics", "{}"),
    ("scheduler", "scheduler", "{}"),
    ("router", "router", "{}"),
    ("route_mode", "view", "{}"),
    ("replicas", "replicas", "{}"),
    ("num_blocks", "blocks", "{:,}"),
    ("max_num_seqs", "seqs", "{}"),
    ("rate", "rate/s", "{:g}"),
    ("seed", "seed", "{}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("imbalance", "imbalance", "{:.2f}"),
    ("preemptions", "preempt", "{:,}"),
    ("ttft_s_p99", "TTFT p99 s", "{:.3f}"),
    ("throughput_tokens_per_s", "tok/s", "{:,.0f}"),
  ),
}


def results_table(rows: Sequence[dict[str, Any]]) -> str:
  """A text table per mode: the fields that vary and the main metrics."""
  parts = []
  for mode, cols in _TABLE.items():
    mine = [r for r in rows if r["mode"] == mode]
    if not mine:
      continue
    keep = [
      c
      for c in cols
      if c[0] in ("hit_rate",)
      or len({repr(r.get(c[0])) for r in mine}) > 1
      or c[0]
      in (
        "ttft_s_p99",
        "throughput_tokens_per_s",
        "preemptions",
        "ceiling_hit_rate",
        "policy",
        "scheduler",
        "imbalance",
      )
    ]
    keep = [c for c in keep if any(r.get(c[0]) is not None for r in mine)]
    cells = [[h for _, h, _ in keep]]
    for r in mine:
      row = ["-" if r.get(k) is None else f.format(r[k]) for k, _, f in keep]
      if r.get("underfilled"):
        at = [k for k, _, _ in keep].index("hit_rate")
        row[at] += " u"
      cells.append(row)
    widths = [max(len(row[i]) for row in cells) for i in range(len(keep))]
    lines = [
      "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
      for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any(r.get("underfilled") for r in mine):
      lines.append(
        "u: underfilled, the cache never filled during warm-up, so (as in "
        "kvcache-simulator) its hit tokens are reported as 0"
      )
    parts.append(f"{mode} ({len(mine)} points)\n" + "\n".join(lines))
  return "\n\n".join(parts)
