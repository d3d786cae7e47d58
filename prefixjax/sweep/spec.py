"""Sweep specs: a TOML file describing a grid of replay and simulate points.

TOML because it is readable, diffable and read by the standard library
(:mod:`tomllib`, Python 3.11+): no dependency, comments allowed, and types
(ints, floats, booleans, lists) survive without guessing. A spec::

  [sweep]
  name = "quickstart"              # default: the file's stem
  description = "..."

  [workloads.mixed]                # one table per workload; rows name it
  generator = "default"            # a prefixjax.workloads kind ...
  requests = 300
  seed = [0, 1, 2]                 # one seed, or a list: a point per seed
  params = { num_prompts = 8 }     # ... and its parameters

  [workloads.mooncake]
  trace = "../shared/traces/mooncake_trace.jsonl"  # ... or a trace file,
  format = "auto"                  # relative to the spec; an absent file
  limit = 2000                     # is an error, unless the workload is
  optional = true                  # optional: its points are then skipped,
                                   # with the reason

  [replay]                         # a grid: every field a value or a list
  semantics = "kvcache-sim"        # capacity in blocks, or capacity_tokens
  policy = ["fifo", "lru_leaf", "belady_leaf"]
  policy_params = {}               # the policy factory's keywords (a table,
                                   # or a list of tables: a grid; vllm
                                   # semantics only, e.g. lfu's decay)
  block_size = 16
  capacity = [64, 128, 256]

  [simulate]
  scheduler = ["fcfs", "lpm"]
  num_blocks = 256                 # usable blocks, as --num-blocks
  clock = "roofline"
  arrivals = "poisson"
  rate = [4.0, 8.0]
  seed = [0, 1]

  [[points]]                       # explicit points, after the grids
  mode = "simulate"
  scheduler = "priority"
  num_blocks = 512

  [full]                           # what --full changes (same tables)
  workloads.mixed.requests = 5000

The grid of a mode section is the product of its list-valued fields, in the
order the fields are written, the last varying fastest; a field left out
takes its default (:data:`REPLAY_FIELDS`, :data:`SIMULATE_FIELDS`).
``workload`` is a field too, by default every workload. An explicit point
takes each field it leaves out from its mode's section when that is a single
value, else the default; a point may not leave out a field its section
lists several values of. In a replay grid, a policy the semantics does not
serve (:func:`prefixjax.replay.served_policies`: kvcache-sim's ``fifo``,
``lru_leaf`` and ``belady_leaf``; SGLang's ``lru_leaf``; vLLM's every
policy the prefix cache runs, ``lru`` on its specialised engine, the others
through the general prefix-cache verbs) is left out of that semantics'
points, and the spec says how many were left out; a listed policy no
listed semantics serves is an error. Likewise in a simulate grid a
scheduler SGLang's semantics does not model (it serves
:data:`prefixjax.serving.SGLANG_POLICIES`: ``fcfs``, ``lpm``, ``dfs``,
``fair`` and ``priority``; a user-registered scheduler orders vLLM's loop
only) is left out of its points.

A generated workload's ``seed`` may be a list: each point of that workload
is then expanded into one point per seed, at the workload's place in the
grid's order, and the rows carry the seed as ``workload_seed`` (``seed``
is the simulate field that draws the arrival times). ``policy_params`` is
a table of keyword arguments of the policy's factory
(:func:`prefixjax.cache.policies.get_policy`: ``lfu`` takes ``decay``), a
list of tables being a grid. A table is crossed with the listed policies
that take its keywords: a policy that does not (``lru`` and ``fifo`` under
``{ decay = 0.5 }``) is left out of that table's points, and the spec
says how many; a table no listed policy takes is an error,
and so is a value the factory refuses. Only the vllm semantics runs a
policy with parameters other than its defaults (the kvcache-sim and SGLang
engines are parameterless): any other such point is an error. So::

  [replay]
  semantics = "vllm"
  policy = ["lru", "lfu", "fifo"]
  policy_params = [{}, { decay = 0.5 }, { decay = 0.9 }]

runs ``lru``, ``fifo`` and ``lfu`` with ``{}`` and ``lfu`` with each decay.
The rows carry it as a JSON text column (``"{}"`` by default).

Every error names the file, the field (``simulate.rate[1]``, ``points[2]
.scheduler``) and the rule broken, before any work.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import numbers
import pathlib
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
  "MODES",
  "REPLAY_FIELDS",
  "SIMULATE_FIELDS",
  "Point",
  "SpecError",
  "SweepSpec",
  "WorkloadSpec",
  "load_spec",
  "parse_spec",
]

MODES = ("replay", "simulate")


class SpecError(ValueError):
  """A sweep spec broke a rule; the message names file, field and rule."""


@dataclasses.dataclass(frozen=True)
class _Field:
  check: Callable[[str, Any], Any]  # (where, value) -> value, or raises
  default: Any = None
  required: bool = False
  help: str = ""


def _fail(where: str, rule: str):
  raise SpecError(f"{where}: {rule}")


def _int(minimum: int, maximum: int | None = None):
  def check(where, v):
    # numbers.Integral: Python and numpy integers (a spec built in code).
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      _fail(where, f"must be an integer, got {v!r}")
    v = int(v)
    if v < minimum:
      _fail(where, f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
      _fail(where, f"must be <= {maximum:_} (int32 block counts), got {v:_}")
    return v

  return check


def _float(low: float, high: float | None = None, *, open_low=False):
  def check(where, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
      _fail(where, f"must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or (v <= low if open_low else v < low):
      _fail(where, f"must be {'>' if open_low else '>='} {low}, got {v}")
    if high is not None and v >= high:
      _fail(where, f"must be < {high}, got {v}")
    return v

  return check


def _bool(where, v):
  if not isinstance(v, bool):
    _fail(where, f"must be true or false, got {v!r}")
  return v


def _choice(choices: Callable[[], Sequence[str]]):
  def check(where, v):
    known = tuple(choices())
    if not isinstance(v, str) or v not in known:
      _fail(where, f"{v!r} is not one of {', '.join(known)}")
    return v

  return check


def _policy_params(where, v):
  """A table of keyword arguments, as canonical JSON text (hashable, one
  cell of a results row)."""
  if not isinstance(v, Mapping):
    _fail(
      where,
      "must be a table of the policy factory's keyword parameters, e.g. "
      f"{{ decay = 0.9 }}, got {v!r}",
    )
  for k, x in v.items():
    if not isinstance(x, (bool, int, float, str)):
      _fail(f"{where}.{k}", f"must be a number, string or boolean, got {x!r}")
  return json.dumps(dict(v), sort_keys=True)


def _optional(check):
  def wrapped(where, v):
    return None if v is None else check(where, v)

  return wrapped


def _semantics():
  from prefixjax.replay import SEMANTICS

  return SEMANTICS


def _policies():
  from prefixjax.replay import SEMANTICS, served_policies

  return tuple(dict.fromkeys(p for s in SEMANTICS for p in served_policies(s)))


def _schedulers():
  from prefixjax.serving.schedulers import scheduler_names

  return scheduler_names()


def _routers():
  from prefixjax.routing import router_names

  return router_names()


def _models():
  from prefixjax import configs

  return sorted(configs.MODELS)


def _hardware():
  from prefixjax import configs

  return sorted(configs.HARDWARE)


def _workload_kinds():
  from prefixjax.workloads import workload_kinds

  return tuple(workload_kinds())


# The replay engines count blocks in int32 (prefixjax.replay.frame).
_MAX_CAPACITY = 2**31 - 2

REPLAY_FIELDS: dict[str, _Field] = {
  "workload": _Field(_choice(lambda: ()), help="a [workloads] name"),
  "semantics": _Field(_choice(_semantics), "kvcache-sim"),
  "policy": _Field(
    _optional(_choice(_policies)),
    None,
    help="default: the semantics' policy (kvcache-sim: lru_leaf)",
  ),
  "policy_params": _Field(
    _policy_params,
    "{}",
    help="keyword parameters of the policy's factory (a table)",
  ),
  "block_size": _Field(_int(1), 16),
  "capacity": _Field(
    _optional(_int(1, _MAX_CAPACITY)), None, help="cache blocks"
  ),
  "capacity_tokens": _Field(
    _optional(_int(1, 2**31 - 1)),
    None,
    help="cache size in tokens instead: capacity = capacity_tokens // K",
  ),
  "warmup_fraction": _Field(_float(0.0, 1.0), 0.5),
}
"""Fields of a replay point (:func:`prefixjax.replay.replay`)."""

SIMULATE_FIELDS: dict[str, _Field] = {
  "workload": _Field(_choice(lambda: ()), help="a [workloads] name"),
  "semantics": _Field(
    _choice(lambda: ("vllm", "sglang")),
    "vllm",
    help="vllm: vLLM 0.33's scheduler loop; sglang: SGLang 0.5.23's "
    "(schedulers fcfs, lpm, dfs, fair, priority)",
  ),
  "scheduler": _Field(_choice(_schedulers), "fcfs"),
  "block_size": _Field(_int(1), 16),
  "num_blocks": _Field(_int(1), 2048, help="usable blocks"),
  "max_num_seqs": _Field(_int(1), 64),
  "max_num_batched_tokens": _Field(_int(1), 2048),
  "max_model_len": _Field(_int(1), 4096),
  "chunked_prefill": _Field(_bool, True),
  "clock": _Field(_choice(lambda: ("steps", "roofline")), "steps"),
  "step_time_ms": _Field(_optional(_float(0.0, open_low=True)), None),
  "model": _Field(_optional(_choice(_models)), None),
  "hardware": _Field(_optional(_choice(_hardware)), None),
  "arrivals": _Field(_choice(lambda: ("zero", "trace", "poisson")), "zero"),
  "rate": _Field(_optional(_float(0.0, open_low=True)), None),
  "seed": _Field(_int(0), 0),
  "router": _Field(
    _optional(_choice(_routers)),
    None,
    help="route over replicas (prefixjax.routing.simulate_cluster)",
  ),
  "replicas": _Field(_int(1), 1, help="engines behind the router"),
  "route_mode": _Field(
    _choice(lambda: ("exact", "approximate")),
    "exact",
    help="what a cache-reading router sees of each replica's cache",
  ),
}
"""Fields of a simulate point (:func:`prefixjax.serving.simulate`, or
:func:`prefixjax.routing.simulate_cluster` with a ``router``)."""

_FIELDS = {"replay": REPLAY_FIELDS, "simulate": SIMULATE_FIELDS}
_TOP = ("sweep", "workloads", "replay", "simulate", "points", "full")
_SWEEP_KEYS = ("name", "description", "vectorize")
_WORKLOAD_KEYS = ("generator", "requests", "seed", "params", "trace")
_TRACE_KEYS = ("trace", "format", "limit", "optional")
_NOT_YET: dict[str, str] = {}


def _unknown(where: str, key: str, known: Sequence[str]):
  if key in _NOT_YET:
    _fail(f"{where}.{key}", _NOT_YET[key])
  near = difflib.get_close_matches(key, known, n=1)
  hint = f"; did you mean {near[0]!r}?" if near else ""
  _fail(
    f"{where}.{key}",
    f"unknown field (known: {', '.join(known)}){hint}",
  )


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
  """One workload of a spec: a generator's or a trace file's.

  Attributes:
    name: its key under ``[workloads]``.
    generator: a :func:`prefixjax.workloads.workload_kinds` kind, or None.
    requests, seed, params: the generator's arguments (``seed``: the
      first of ``seeds``).
    trace: the trace file (resolved against the spec's folder), or None.
    format, limit: :func:`prefixjax.workloads.load_trace`'s.
    optional: a trace that may be absent (data read in place from
      elsewhere): its points are skipped, with the reason, instead of the
      spec being refused. It does not change a result.
    seeds: every seed the spec lists for a generator, one point each
      (a point's own workload has its one seed); ``()`` for a trace.
  """

  name: str
  generator: str | None = None
  requests: int = 0
  seed: int = 0
  params: tuple[tuple[str, Any], ...] = ()
  trace: str | None = None
  format: str = "auto"
  limit: int | None = None
  seeds: tuple[int, ...] = ()
  optional: bool = False

  def identity(self) -> dict[str, Any]:
    """What a result depends on (the name only labels it; ``seeds`` lists
    the seeds of other points: a point's is ``seed``)."""
    d = dataclasses.asdict(self)
    d.pop("name")
    d.pop("seeds")
    d.pop("optional")
    d["params"] = dict(self.params)
    return d

  def each_seed(self) -> tuple[WorkloadSpec, ...]:
    """One workload per listed seed (itself for a trace)."""
    if not self.seeds:
      return (self,)
    return tuple(
      dataclasses.replace(self, seed=s, seeds=(s,)) for s in self.seeds
    )

  def missing(self) -> str | None:
    """Why the workload cannot be read (an absent trace file), or None."""
    if self.trace is not None and not pathlib.Path(self.trace).is_file():
      return f"trace file {self.trace} is absent"
    return None

  def content_digest(self) -> str | None:
    """SHA-256 of the trace file's bytes (None for a generator or an absent
    file): a results folder records it, so that a changed file is not
    resumed into rows computed from the old one."""
    if self.trace is None or self.missing():
      return None
    with open(self.trace, "rb") as handle:
      return hashlib.file_digest(handle, "sha256").hexdigest()

  def load(self):
    """The :class:`prefixjax.workloads.Trace`."""
    from prefixjax import workloads

    if self.trace is not None:
      return workloads.load_trace(self.trace, self.format, limit=self.limit)
    return workloads.generate_workload(
      self.generator,
      num_requests=self.requests,
      seed=self.seed,
      **dict(self.params),
    )


@dataclasses.dataclass(frozen=True)
class Point:
  """One point of a sweep: a mode, a workload and the mode's fields.

  Attributes:
    index: position in the expanded spec (rows keep this order).
    mode: ``"replay"`` or ``"simulate"``.
    workload: the :class:`WorkloadSpec`.
    params: every field of the mode (defaults filled in), sorted by name.
  """

  index: int
  mode: str
  workload: WorkloadSpec
  params: tuple[tuple[str, Any], ...]

  def get(self, name: str) -> Any:
    return dict(self.params)[name]

  @property
  def key(self) -> str:
    """A stable id of what the point computes (not of its index)."""
    params = {k: v for k, v in self.params if k not in _ADDED or v != _ADDED[k]}
    blob = json.dumps(
      {
        "mode": self.mode,
        "workload": self.workload.identity(),
        "params": params,
      },
      sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _by_value(v):
  """What a field's value computes: a policy_params text's numbers by value
  (``{ decay = 1 }`` and ``{ decay = 1.0 }`` build the same policy)."""
  try:
    table = json.loads(v) if isinstance(v, str) and v[:1] == "{" else None
  except ValueError:
    table = None
  if not isinstance(table, dict):
    return repr(v)
  return repr(
    sorted((k, float(x) if type(x) is int else x) for k, x in table.items())
  )


def _value_key(p: Point) -> tuple:
  """Points equal here compute the same thing (their keys may differ only
  by how a number was written)."""
  workload = json.dumps(p.workload.identity(), sort_keys=True)
  return (p.mode, workload, tuple((k, _by_value(v)) for k, v in p.params))


# Fields added after sweeps had written results, with their defaults: left
# out of a point's key at the default, so a spec that does not use them keeps
# the keys (and the fingerprint) it had, and its results folder resumes.
_ADDED = {"policy_params": "{}"}


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """A parsed, validated, expanded spec.

  Attributes:
    name, description: from ``[sweep]``.
    path: the file (None when parsed from a mapping).
    workloads: by name.
    points: every point, grids first (replay, then simulate), then the
      explicit points.
    left_out: ``(semantics, policy)`` pairs of the replay grid (or
      ``(semantics, scheduler)`` of the simulate grid) that the semantics
      does not serve, with how many points each left out.
    left_out_params: ``(policy, policy_params)`` pairs of the replay grid
      where the policy takes no such parameter, with how many points each
      left out.
    vectorize: ``[sweep] vectorize``: True, False or None (automatic: see
      :func:`prefixjax.serving.simulate_batch`).
    full: whether ``[full]`` was applied.
  """

  name: str
  description: str
  path: str | None
  workloads: dict[str, WorkloadSpec]
  points: tuple[Point, ...]
  left_out: tuple[tuple[str, str, int], ...] = ()
  left_out_params: tuple[tuple[str, str, int], ...] = ()
  vectorize: bool | None = None
  full: bool = False

  def fingerprint(self) -> str:
    """Hash of everything the results depend on, in order."""
    blob = json.dumps([p.key for p in self.points])
    return hashlib.sha256(blob.encode()).hexdigest()

  def describe(self) -> dict[str, Any]:
    """A JSON-able summary (written beside the results)."""
    return {
      "name": self.name,
      "description": self.description,
      "spec": self.path,
      "full": self.full,
      "fingerprint": self.fingerprint(),
      "workloads": {
        n: {**w.identity(), **({"seeds": list(w.seeds)} if w.seeds else {})}
        for n, w in sorted(self.workloads.items())
      },
      "points": [
        {
          "index": p.index,
          "key": p.key,
          "mode": p.mode,
          "workload": p.workload.name,
          "workload_seed": p.workload.seed if p.workload.generator else None,
          **dict(p.params),
        }
        for p in self.points
      ],
    }


def load_spec(path, *, full: bool = False) -> SweepSpec:
  """Reads, validates and expands the spec file at ``path``.

  Args:
    path: a TOML file.
    full: apply its ``[full]`` table (the accelerator scale).

  Raises:
    SpecError: an unreadable file, bad TOML (with its line), or a broken
      rule (file, field, rule).
  """
  p = pathlib.Path(path)
  if p.is_dir():
    raise SpecError(f"{p}: is a folder, not a spec file")
  if not p.is_file():
    raise SpecError(f"{p}: no such spec file")
  try:
    data = tomllib.loads(p.read_text(encoding="utf-8"))
  except tomllib.TOMLDecodeError as err:
    raise SpecError(f"{p}: not valid TOML: {err}") from None
  except UnicodeDecodeError as err:
    raise SpecError(f"{p}: not UTF-8 text: {err}") from None
  return parse_spec(data, source=str(p), full=full)


def _merge(base: dict, over: Mapping, where: str) -> dict:
  out = dict(base)
  for k, v in over.items():
    if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
      out[k] = _merge(out[k], v, f"{where}.{k}")
    else:
      out[k] = v
  return out


def parse_spec(
  data: Mapping[str, Any], *, source: str | None = None, full: bool = False
) -> SweepSpec:
  """Validates and expands a spec already read into a mapping.

  ``source`` names the file in errors and anchors relative trace paths
  (default: the working directory).
  """
  label = source or "<spec>"
  base = pathlib.Path(source).parent if source else pathlib.Path(".")
  if not isinstance(data, Mapping):
    raise SpecError(f"{label}: a spec is a table of tables")
  for k in data:
    if k not in _TOP:
      try:
        _unknown(label, k, _TOP)
      except SpecError as err:
        msg = str(err).replace(f"{label}.", f"{label}: ", 1)
        raise SpecError(msg) from None
  full_table = data.get("full", {})
  if not isinstance(full_table, Mapping):
    raise SpecError(f"{label}: full: must be a table")
  _check_full(full_table, data, label)
  if full:
    data = _merge(dict(data), full_table, "full")
  elif full_table:
    # The accelerator scale is checked on every read, so that a mistake in
    # [full] shows before the run that applies it.
    try:
      parse_spec(data, source=source, full=True)
    except SpecError as err:
      raise SpecError(f"{err} (with [full] applied)") from None
  sweep = _table(data, "sweep", label)
  for k in sweep:
    if k not in _SWEEP_KEYS:
      _unknown(f"{label}: sweep", k, _SWEEP_KEYS)
  name = sweep.get("name", pathlib.Path(source).stem if source else "sweep")
  description = sweep.get("description", "")
  for key, v in (("name", name), ("description", description)):
    if not isinstance(v, str):
      raise SpecError(f"{label}: sweep.{key}: must be a string, got {v!r}")
  # The name is the default results folder, results/<name>: a plain name.
  if "name" in sweep and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
    raise SpecError(
      f"{label}: sweep.name: {name!r} must be a plain name (letters, "
      "digits, '_', '.', '-'; it names the folder results/<name>)"
    )
  vectorize = sweep.get("vectorize", "auto")
  if vectorize not in (True, False, "auto"):
    raise SpecError(
      f'{label}: sweep.vectorize: must be true, false or "auto", got '
      f"{vectorize!r}"
    )
  workloads = _workloads(_table(data, "workloads", label), label, base)
  modes = [m for m in MODES if m in data]
  explicit = data.get("points", [])
  if not isinstance(explicit, list):
    raise SpecError(f"{label}: points: must be an array of tables [[points]]")
  if not modes and not explicit:
    raise SpecError(
      f"{label}: nothing to run: add a [replay] or [simulate] table or "
      "[[points]]"
    )
  points: list[tuple[str, WorkloadSpec, dict]] = []
  left_out: dict[tuple[str, str], int] = {}
  left_out_params: dict[tuple[str, str], int] = {}
  for mode in modes:
    section = _table(data, mode, label)
    grid = _grid(section, mode, label, workloads)
    points += _expand(grid, mode, label, workloads, left_out, left_out_params)
  for i, point in enumerate(explicit):
    where = f"{label}: points[{i}]"
    if not isinstance(point, Mapping):
      raise SpecError(f"{where}: must be a table")
    mode = point.get("mode")
    if mode not in MODES:
      raise SpecError(f"{where}.mode: must be one of {', '.join(MODES)}")
    section = data.get(mode, {})
    grid = _grid(section, mode, label, workloads) if section else {}
    fields = _FIELDS[mode]
    values = {}
    for k, v in point.items():
      if k == "mode":
        continue
      if k not in fields:
        _unknown(where, k, tuple(fields))
      values[k] = [_check(fields, k, v, f"{where}.{k}", workloads)]
    for k, vs in grid.items():
      if k in values:
        continue
      if len(vs) > 1:
        raise SpecError(
          f"{where}.{k}: [{mode}] lists {len(vs)} values; an explicit point "
          "must set it"
        )
      values[k] = vs
    if "workload" not in values:
      if len(workloads) > 1:
        raise SpecError(
          f"{where}.workload: the spec has {len(workloads)} workloads; name one"
        )
      values["workload"] = list(workloads)
    for k, f in fields.items():
      if k not in values:
        if f.required:
          raise SpecError(f"{where}.{k}: required")
        values[k] = [f.default]
    got = _expand(values, mode, where, workloads, {}, strict=True)
    points += got
  expanded = tuple(
    Point(
      index=i,
      mode=mode,
      workload=w,
      params=tuple(sorted(params.items())),
    )
    for i, (mode, w, params) in enumerate(points)
  )
  keys = {}
  for p in expanded:
    same = _value_key(p)
    if same in keys:
      raise SpecError(
        f"{label}: point {p.index} repeats point {keys[same]} (same mode, "
        "workload and fields)"
      )
    keys[same] = p.index
  return SweepSpec(
    name=name,
    description=description,
    path=source,
    workloads=workloads,
    points=expanded,
    left_out=tuple((s, p, n) for (s, p), n in left_out.items()),
    left_out_params=tuple((p, t, n) for (p, t), n in left_out_params.items()),
    vectorize=None if vectorize == "auto" else vectorize,
    full=full,
  )


def _check_full(full_table: Mapping, data: Mapping, label: str) -> None:
  """``[full]``'s keys: the tables it may change, their known fields, and
  only workloads the spec defines (a misspelt name would add one)."""
  for k, v in full_table.items():
    if k not in _TOP or k in ("full", "points"):
      raise SpecError(
        f"{label}: full.{k}: [full] may change sweep, workloads, replay "
        "or simulate"
      )
    if not isinstance(v, Mapping):
      raise SpecError(f"{label}: full.{k}: must be a table")
  for k, known in (
    ("sweep", _SWEEP_KEYS),
    ("replay", tuple(REPLAY_FIELDS)),
    ("simulate", tuple(SIMULATE_FIELDS)),
  ):
    for field in full_table.get(k, {}):
      if field not in known:
        _unknown(f"{label}: full.{k}", field, known)
  defined = data.get("workloads", {})
  defined = defined if isinstance(defined, Mapping) else {}
  for name, w in full_table.get("workloads", {}).items():
    if name not in defined:
      raise SpecError(
        f"{label}: full.workloads.{name}: [full] may change only the "
        f"workloads the spec defines ({', '.join(defined) or 'none'})"
      )
    if not isinstance(w, Mapping):
      raise SpecError(f"{label}: full.workloads.{name}: must be a table")
    base = defined[name]
    known = (
      _TRACE_KEYS
      if isinstance(base, Mapping) and "trace" in base
      else _WORKLOAD_KEYS
    )
    for field in w:
      if field not in known:
        _unknown(f"{label}: full.workloads.{name}", field, known)


def _table(data, key, label) -> Mapping:
  v = data.get(key, {})
  if not isinstance(v, Mapping):
    raise SpecError(f"{label}: {key}: must be a table [{key}]")
  return v


def _workloads(table, label, base) -> dict[str, WorkloadSpec]:
  if not table:
    return {
      "default": WorkloadSpec(
        name="default", generator="default", requests=300, seed=0
      )
    }
  out = {}
  for name, w in table.items():
    where = f"{label}: workloads.{name}"
    if not isinstance(w, Mapping):
      raise SpecError(f"{where}: must be a table [workloads.{name}]")
    if "trace" in w:
      for k in w:
        if k not in _TRACE_KEYS:
          _unknown(where, k, _TRACE_KEYS)
      trace = w["trace"]
      if not isinstance(trace, str) or not trace:
        raise SpecError(f"{where}.trace: must be a file path")
      fmt = w.get("format", "auto")
      formats = ("auto", "mooncake", "tokens", "csv")
      if fmt not in formats:
        raise SpecError(
          f"{where}.format: {fmt!r} is not one of {', '.join(formats)}"
        )
      limit = w.get("limit")
      if limit is not None:
        _int(1)(f"{where}.limit", limit)
      path = pathlib.Path(trace).expanduser()
      if not path.is_absolute():
        path = (base / path).resolve()
      optional = w.get("optional", False)
      if not isinstance(optional, bool):
        raise SpecError(
          f"{where}.optional: must be true or false, got {optional!r}"
        )
      if path.exists() and not path.is_file():
        raise SpecError(f"{where}.trace: {path} is a folder, not a trace file")
      if not optional and not path.exists():
        raise SpecError(
          f"{where}.trace: {path} does not exist (a path is read relative "
          "to the spec's folder; set optional = true to skip this "
          "workload's points when the file is absent)"
        )
      out[name] = WorkloadSpec(
        name=name, trace=str(path), format=fmt, limit=limit, optional=optional
      )
      continue
    for k in w:
      if k not in _WORKLOAD_KEYS:
        _unknown(where, k, _WORKLOAD_KEYS)
    gen = _choice(_workload_kinds)(
      f"{where}.generator", w.get("generator", "default")
    )
    requests = _int(1)(f"{where}.requests", w.get("requests", 300))
    seeds = _seeds(f"{where}.seed", w.get("seed", 0))
    seed = seeds[0]
    params = w.get("params", {})
    if not isinstance(params, Mapping):
      raise SpecError(f"{where}.params: must be a table")
    spec = WorkloadSpec(
      name=name,
      generator=gen,
      requests=requests,
      seed=seed,
      params=tuple(sorted(params.items())),
      seeds=seeds,
    )
    try:  # the generator validates its parameters; a tiny draw checks them
      from prefixjax import workloads as wl

      wl.generate_workload(gen, num_requests=1, seed=seed, **dict(params))
    except (TypeError, ValueError) as err:
      raise SpecError(f"{where}.params: {err}") from None
    out[name] = spec
  return out


def _seeds(where, v) -> tuple[int, ...]:
  """A generator's ``seed``: one integer, or a list of distinct ones."""
  if not isinstance(v, list):
    return (_int(0)(where, v),)
  if not v:
    _fail(where, "an empty list (give one seed or several)")
  seeds = tuple(_int(0)(f"{where}[{i}]", s) for i, s in enumerate(v))
  if len(set(seeds)) != len(seeds):
    _fail(where, f"lists a seed twice: {list(seeds)}")
  return seeds


def _check(fields, k, v, where, workloads):
  if k == "workload":
    if not isinstance(v, str) or v not in workloads:
      raise SpecError(
        f"{where}: {v!r} is not a workload of the spec ({', '.join(workloads)})"
      )
    return v
  return fields[k].check(where, v)


def _grid(section, mode, label, workloads) -> dict[str, list]:
  if not isinstance(section, Mapping):
    raise SpecError(f"{label}: {mode}: must be a table [{mode}]")
  fields = _FIELDS[mode]
  grid = {}
  for k, v in section.items():
    if k not in fields:
      _unknown(f"{label}: {mode}", k, tuple(fields))
    vs = v if isinstance(v, list) else [v]
    if not vs:
      raise SpecError(f"{label}: {mode}.{k}: an empty list")
    where = f"{label}: {mode}.{k}"
    grid[k] = [
      _check(
        fields,
        k,
        x,
        f"{where}[{i}]" if isinstance(v, list) else where,
        workloads,
      )
      for i, x in enumerate(vs)
    ]
    if len(set(map(_by_value, grid[k]))) != len(grid[k]):
      raise SpecError(f"{where}: lists a value twice")
  if "workload" not in grid:  # outermost unless written
    grid = {"workload": list(workloads), **grid}
  for k, f in fields.items():
    if k not in grid:
      if f.required:
        raise SpecError(f"{label}: {mode}.{k}: required")
      grid[k] = [f.default]
  return grid


def _expand(
  grid, mode, where, workloads, left_out, left_out_params=None, *, strict=False
):
  # A workload of several seeds is several values of the workload field,
  # in its place in the grid's order.
  grid = {
    **grid,
    "workload": [w for n in grid["workload"] for w in workloads[n].each_seed()],
  }
  names = list(grid)
  out = []
  served_any: set[str] = set()
  # Per policy_params text: why a policy left out did not take it (kept
  # until some listed policy does).
  params_taken: dict[str, str | None] = {}
  for combo in itertools.product(*(grid[n] for n in names)):
    params = dict(zip(names, combo, strict=True))
    if mode == "replay":
      from prefixjax.replay import SEMANTICS_POLICY, served_policies

      sem, policy = params["semantics"], params["policy"]
      serves = served_policies(sem)
      if policy is None:
        params["policy"] = policy = SEMANTICS_POLICY.get(sem, "lru_leaf")
      if policy not in serves:
        if strict:
          raise SpecError(
            f"{where}.policy: semantics {sem} serves {', '.join(serves)}, "
            f"not {policy}"
          )
        left_out[(sem, policy)] = left_out.get((sem, policy), 0) + 1
        continue
      served_any.add(policy)
      text = params["policy_params"]
      why = _check_policy_params(params, where)
      if why is not None:  # the policy takes no such keyword
        if strict:
          raise SpecError(f"{where}: replay.policy_params={text}: {why}")
        params_taken.setdefault(text, why)
        if left_out_params is not None:
          pair = (policy, text)
          left_out_params[pair] = left_out_params.get(pair, 0) + 1
        continue
      params_taken[text] = None
      tokens = params["capacity_tokens"]
      if (params["capacity"] is None) == (tokens is None):
        raise SpecError(
          f"{where}: replay: set one of capacity (blocks) and capacity_tokens"
        )
      if tokens is not None:
        params["capacity"] = tokens // params["block_size"]
        if params["capacity"] < 1:
          raise SpecError(
            f"{where}: replay.capacity_tokens={tokens} holds no block of "
            f"block_size={params['block_size']}"
          )
    else:
      from prefixjax.serving.config import SGLANG_POLICIES

      sem, sched = params["semantics"], params["scheduler"]
      if sem == "sglang" and sched not in SGLANG_POLICIES:
        if strict:
          raise SpecError(
            f"{where}.scheduler: semantics sglang serves "
            f"{', '.join(SGLANG_POLICIES)}, not {sched}"
          )
        left_out[(sem, sched)] = left_out.get((sem, sched), 0) + 1
        continue
      _check_simulate(params, where)
    w = params.pop("workload")
    out.append((mode, w, params))
  if mode == "replay" and not strict:
    for policy in grid["policy"]:
      if policy is not None and policy not in served_any:
        vllm = "" if "vllm" in grid["semantics"] else " (semantics vllm does)"
        raise SpecError(
          f"{where}: replay.policy: no listed semantics serves {policy}{vllm}"
        )
    for text, why in params_taken.items():
      if why is not None:
        raise SpecError(
          f"{where}: replay.policy_params={text}: no listed policy takes "
          f"it ({why})"
        )
  return out


def _check_policy_params(params, where) -> str | None:
  """``policy_params`` build the point's policy, one its semantics runs
  with them (only vllm's runs parameters other than a policy's defaults).
  Returns why the policy takes no such keyword (the point is then left out
  of a grid), or None; raises :class:`SpecError` on any other rule."""
  from prefixjax.cache import policies

  policy, text = params["policy"], params["policy_params"]
  keywords = json.loads(text)
  field = f"{where}: replay.policy_params={text}"
  try:
    built = policies.get_policy(policy, **keywords)
  except TypeError as err:
    return (
      f"policy {policy} takes no parameter "
      f"{', '.join(map(repr, keywords))} ({err})"
    )
  except ValueError as err:
    raise SpecError(f"{field}: policy {policy}: {err}") from None
  semantics = params["semantics"]
  if (
    semantics != "vllm"
    and keywords
    and built is not policies.get_policy(policy)
  ):
    raise SpecError(
      f"{field}: the {semantics} replay engines run {policy} with its "
      'default parameters only; parameterised policies need semantics = "vllm"'
    )
  return None


def serving_config(params: Mapping[str, Any]):
  """The :class:`prefixjax.serving.ServingConfig` of a simulate point's
  fields (``num_blocks`` usable blocks: the null block is added)."""
  from prefixjax.serving import ServingConfig

  return ServingConfig(
    num_gpu_blocks=params["num_blocks"] + 1,
    block_size=params["block_size"],
    max_num_seqs=params["max_num_seqs"],
    max_num_batched_tokens=params["max_num_batched_tokens"],
    max_model_len=params["max_model_len"],
    chunked_prefill=params["chunked_prefill"],
    scheduler=params["scheduler"],
    semantics=params.get("semantics", "vllm"),
  )


def _check_simulate(params, where):
  """The simulate rules that join fields (ServingConfig and the clock)."""
  try:
    serving_config(params)
  except ValueError as err:
    msg = str(err).removeprefix("ServingConfig.")
    msg = msg.replace("num_gpu_blocks=", "num_blocks+1=", 1)
    raise SpecError(f"{where}: simulate: {msg}") from None
  shown = {k: v for k, v in params.items() if k != "workload"}
  if params["router"] is None and params["replicas"] != 1:
    raise SpecError(
      f"{where}: simulate.replicas={params['replicas']} needs a router "
      f"(point {shown})"
    )
  if params["router"] is not None and params["semantics"] != "vllm":
    raise SpecError(
      f"{where}: simulate.router: routed replicas run vLLM semantics only "
      f"(point {shown})"
    )
  if params["router"] is not None and params["clock"] != "steps":
    raise SpecError(
      f"{where}: simulate.router: routed replicas run on clock=steps only "
      f"(point {shown})"
    )
  if params["clock"] == "steps":
    if params["arrivals"] != "zero" and params["step_time_ms"] is None:
      raise SpecError(
        f"{where}: simulate.arrivals={params['arrivals']} with clock=steps "
        f"needs step_time_ms (point {shown})"
      )
    for k in ("model", "hardware"):
      if params[k] is not None:
        raise SpecError(f"{where}: simulate.{k}: is for clock=roofline")
  else:
    if params["step_time_ms"] is not None:
      raise SpecError(
        f"{where}: simulate.step_time_ms: is for clock=steps, not roofline"
      )
    params["model"] = params["model"] or "llama3_8b"
    params["hardware"] = params["hardware"] or "h100"
  if params["arrivals"] == "poisson" and params["rate"] is None:
    raise SpecError(f"{where}: simulate.arrivals=poisson needs rate")
  if params["rate"] is not None and params["arrivals"] != "poisson":
    raise SpecError(
      f"{where}: simulate.rate: is for arrivals=poisson, not "
      f"{params['arrivals']}"
    )
