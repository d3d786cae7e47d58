"""The replay frame: one shape for every replay engine, timing returned.

An engine is a :class:`ReplayEngine`, a ``NamedTuple`` of three functions
and two declarations (the style of :class:`prefixjax.cache.policies.
EvictionPolicy`):

* ``prepare(source, capacities, **options) -> Prepared``: host side, once
  per call. Validates what the engine needs, lays the trace out as arrays
  and fixes the static sizes of the compiled program.
* ``run(arrays, capacity, **static) -> outputs``: pure, jittable and
  vmappable, no timing and no host work inside. What ``capacity`` is
  depends on the engine's :class:`Batching`.
* ``points(prepared, capacities, outputs) -> list[ReplayPoint]``: host
  side, the results of the requested capacities.

:func:`execute` is the only place that compiles and times an engine: it
lowers ``run`` for the prepared shapes (kept in a small in-process cache,
so a second call with the same shapes does not compile again), runs it
and returns the points with a :class:`Timing`. A sweep runner can group
points by ``(engine, Prepared.shape_key)`` and choose how to spread them
from :attr:`ReplayEngine.batching` without knowing any engine.

Bucketed shapes: every engine's ``prepare`` takes ``bucketed``. With
``bucketed=True`` (what :func:`prefixjax.replay.replay` and the serving
semantics' entry points pass) it pads its trace-sized arrays (events,
nodes, scan steps, keys, requests, table columns) and the static sizes
derived from them to a power of two (:func:`padded`), so two traces whose
sizes fall in one bucket share one compiled program, in this process and
in JAX's persistent compilation cache. The padding is never read: an
engine's scans run through :func:`scan_prefix`, whose trip count is the
real number of steps (a run-time scalar), and the padded rows of the
other arrays are indices no real step reaches (past every real node,
event or key); padded steps hold no-op values all the same (no block, no
warm-up). ``points`` cuts the outputs back to the real lengths. The
default, ``False``, keeps the trace's own sizes, so a caller of ``run``
reads outputs of the real lengths.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import keeps_compiled, to_device
from prefixjax.cache import policies

__all__ = [
  "Batching",
  "Prepared",
  "ReplayEngine",
  "ReplayPoint",
  "ReplayResult",
  "Timing",
  "bucket",
  "check_capacities",
  "check_warmup_fraction",
  "compile_and_run",
  "execute",
  "pad_rows",
  "padded",
  "points_of_requests",
  "resolve_policy",
  "scan_prefix",
  "warmup_requests",
]


class Batching(enum.Enum):
  """How one compiled run of an engine serves several capacities."""

  ONE_PASS = "one_pass"
  """``run(arrays)``: one pass gives the answer for every capacity (a stack
  algorithm); ``points`` reads each capacity off the outputs."""
  COLUMNS = "columns"
  """``run(arrays, capacities)`` with ``capacities`` ``[C]`` int32: every
  capacity is a column of the state, one program for all of them."""
  PER_CAPACITY = "per_capacity"
  """``run(arrays, capacity)`` with ``capacity`` an int32 scalar: one
  capacity per run (the frame runs them one after another; ``jax.vmap``
  over ``capacity`` also works)."""


@dataclasses.dataclass(frozen=True)
class ReplayPoint:
  """One (policy, capacity) result.

  Attributes:
    policy: our policy name.
    capacity_blocks: cache capacity in blocks.
    block_size: tokens per block.
    hit_tokens: hit tokens over the measured requests (0 if underfilled).
    total_tokens: tokens of the measured requests.
    measured_requests: requests in the measured window.
    underfilled: the cache never became full during warm-up.
    per_request_hit_tokens: ``[R]`` int64 hit tokens of every request of the
      original trace (warm-up included, computed even when underfilled).
  """

  policy: str
  capacity_blocks: int
  block_size: int
  hit_tokens: int
  total_tokens: int
  measured_requests: int
  underfilled: bool
  per_request_hit_tokens: np.ndarray

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds spent compiling and running (compile is 0 on a cache hit)."""

  compile_s: float = 0.0
  run_s: float = 0.0

  def __add__(self, other: Timing) -> Timing:
    return Timing(self.compile_s + other.compile_s, self.run_s + other.run_s)


_POINT_COLUMNS = (
  "policy",
  "capacity_blocks",
  "block_size",
  "hit_tokens",
  "total_tokens",
  "hit_rate",
  "measured_requests",
  "underfilled",
)


@dataclasses.dataclass(frozen=True)
class ReplayResult(Sequence):
  """The points of one replay call, in the order of its capacities, and
  what they cost. Behaves as a sequence of :class:`ReplayPoint`.

  Attributes:
    points: one per requested capacity.
    timing: compile and run time of the engines that produced them.
    engines: the engine of each point (by name).
    parameters: ``(name, value)`` pairs of the call's arguments that hold
      for every point (:func:`prefixjax.replay.replay` records the trace,
      the warm-up fraction and the vLLM rules; empty when unknown).
  """

  points: tuple[ReplayPoint, ...]
  timing: Timing = Timing()
  engines: tuple[str, ...] = ()
  parameters: tuple[tuple[str, Any], ...] = ()

  def __len__(self) -> int:
    return len(self.points)

  def __getitem__(self, i):
    return self.points[i]

  def __iter__(self) -> Iterator[ReplayPoint]:
    return iter(self.points)

  def frame(self):
    """The points as a tidy :class:`pandas.DataFrame`, one row per point
    in the order of the capacities.

    Columns: ``semantics`` and ``engine`` (from :attr:`engines`), the
    call's :attr:`parameters` (``trace``, ``warmup_fraction``, ...), then
    each :class:`ReplayPoint`'s ``policy``, ``capacity_blocks``,
    ``block_size``, ``hit_tokens``, ``total_tokens``, ``hit_rate``,
    ``measured_requests`` and ``underfilled``. Per-request hits stay on
    the points (``per_request_hit_tokens``), the call's cost on
    :attr:`timing`.

    Example:
      >>> from prefixjax import replay as rp
      >>> from prefixjax.workloads import generate_workload
      >>> trace = generate_workload("multi_turn", num_requests=40, seed=0)
      >>> df = rp.replay(trace, policy="lru_leaf", capacities=[8, 64]).frame()
      >>> df[["policy", "capacity_blocks", "hit_tokens"]].shape
      (2, 3)
      >>> df["semantics"].tolist(), df["capacity_blocks"].tolist()
      (['kvcache-sim', 'kvcache-sim'], [8, 64])
      >>> bool((df["hit_rate"] == df["hit_tokens"] / df["total_tokens"]).all())
      True
    """
    import pandas as pd

    # The registry imports this module: imported here, when first needed.
    from prefixjax.replay import get_engine

    engines = self.engines or (None,) * len(self.points)
    shared = dict(self.parameters)
    rows = []
    for point, name in zip(self.points, engines, strict=True):
      row = {
        "semantics": get_engine(name).semantics if name else None,
        "engine": name,
        **shared,
      }
      row.update((c, getattr(point, c)) for c in _POINT_COLUMNS)
      rows.append(row)
    columns = ["semantics", "engine", *shared, *_POINT_COLUMNS]
    return pd.DataFrame(rows, columns=columns)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What an engine's ``prepare`` returns.

  Attributes:
    arrays: pytree of arrays, ``run``'s first argument.
    capacities: ``[C]`` int32 capacities as ``run`` receives them (an
      engine may clip them: a capacity past the trace's distinct blocks
      behaves like it).
    static: ``run``'s static keyword arguments (hashable values); with the
      arrays' shapes they fix the compiled program.
    context: host data that ``points`` needs (a plan, the trace, ...).
  """

  arrays: Any
  capacities: np.ndarray
  static: dict = dataclasses.field(default_factory=dict)
  context: Any = None

  @property
  def shape_key(self) -> tuple:
    """Equal for two preparations that share one compiled program."""
    avals = jax.tree.map(
      lambda a: (tuple(np.shape(a)), str(getattr(a, "dtype", type(a)))),
      self.arrays,
    )
    leaves, tree = jax.tree.flatten(avals, is_leaf=_is_aval)
    return (tree, tuple(leaves), tuple(sorted(self.static.items())))


def _is_aval(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


class ReplayEngine(NamedTuple):
  """A replay engine (see the module docstring for the protocol).

  Attributes:
    name: unique name (``"kvcache_sim.stack"``, ``"vllm"``, ...).
    semantics: ``"kvcache-sim"``, ``"vllm"`` or ``"sglang"``.
    policies: policy names it serves.
    batching: how one run serves several capacities.
    prepare: host side, ``(source, capacities, **options) -> Prepared``.
    run: pure, ``(arrays, capacity, **static) -> outputs``.
    points: host side, ``(prepared, capacities, outputs) -> points``.
  """

  name: str
  semantics: str
  policies: tuple[str, ...]
  batching: Batching
  prepare: Callable[..., Prepared]
  run: Callable[..., Any]
  points: Callable[..., list[ReplayPoint]]


# Compiled programs of this process, by engine and shapes: a second call
# with the same shapes (another policy's capacities, the CLI's per-capacity
# loop) does not compile again. Bounded, least recently used out first.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_MAX_COMPILED = 16


def clear_compiled() -> None:
  """Forgets the compiled replay programs this process keeps. With
  ``jax.clear_caches()`` (JAX's own in-process caches) the next replay
  compiles its programs again: to time a compile, or to watch JAX's
  compile log. The persistent compilation cache on disk is untouched."""
  _COMPILED.clear()


keeps_compiled(clear_compiled)


@functools.cache
def _jitted(run: Callable, static_names: tuple[str, ...]):
  return jax.jit(run, static_argnames=static_names)


def bucket(n: int) -> int:
  """The power of two at or above ``n`` (at least 1): the capacity count a
  ``COLUMNS`` program is compiled for, so 5 to 8 capacities share one
  program (and one entry of the persistent compilation cache)."""
  return 1 << max(int(n) - 1, 0).bit_length()


def padded(n: int, bucketed: bool = True) -> int:
  """The size a trace-sized dimension of ``n`` is compiled for:
  :func:`bucket` (``bucketed``) or ``n`` itself (the unpadded path the
  tests compare with). A bucket past int32 falls back to ``n``: sizes
  name int32 indices."""
  n = int(n)
  size = bucket(n) if bucketed else n
  return size if size < 2**31 - 1 else n


def pad_rows(x, rows: int, fill) -> np.ndarray:
  """``x`` (host) with its leading axis extended to ``rows`` by ``fill``."""
  x = np.asarray(x)
  pad = rows - x.shape[0]
  if pad < 0:
    raise ValueError(f"{rows=} is below the {x.shape[0]} rows of the array")
  if not pad:
    return x
  tail = np.full((pad, *x.shape[1:]), fill, x.dtype)
  return np.concatenate([x, tail])


def scan_prefix(step, carry, xs, length, ys_like):
  """``jax.lax.scan(step, carry, xs)`` over the first ``length`` rows of
  ``xs`` only: the padded rows after them are never read.

  A loop of ``length`` (a traced int32 scalar) iterations, so the padding
  of a bucketed trace costs no steps and cannot change a result: each
  iteration reads row ``i`` of ``xs`` and writes row ``i`` of the
  outputs, exactly as ``scan`` does.

  Args:
    step: ``(carry, x) -> (carry, y)``, as for ``jax.lax.scan``.
    carry: the initial carry.
    xs: pytree of arrays with equal leading axes ``[S_pad, ...]``.
    length: int32 scalar, the real steps (at most ``S_pad``).
    ys_like: pytree of :class:`jax.ShapeDtypeStruct` of one step's ``y``
      (given, not traced, so ``step`` is traced once).

  Returns:
    The final carry and the outputs, ``[S_pad, ...]`` each, zeros past
    ``length``.
  """
  rows = jax.tree.leaves(xs)[0].shape[0]
  ys = jax.tree.map(
    lambda like: jnp.zeros((rows, *like.shape), like.dtype), ys_like
  )

  def body(i, state):
    carry, ys = state
    x = jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs
    )
    carry, y = step(carry, x)
    ys = jax.tree.map(
      lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), ys, y
    )
    return carry, ys

  return jax.lax.fori_loop(0, length, body, (carry, ys))


def _columns(prepared: Prepared) -> np.ndarray:
  """The capacities padded to :func:`bucket` by repeating the last one
  (``points`` reads only the first ``C`` columns)."""
  caps = np.asarray(prepared.capacities, np.int32)
  pad = bucket(caps.shape[0]) - caps.shape[0]
  return np.concatenate([caps, np.repeat(caps[-1:], pad)])


def _capacity_spec(engine: ReplayEngine, prepared: Prepared):
  if engine.batching is Batching.ONE_PASS:
    return ()
  if engine.batching is Batching.COLUMNS:
    return (jax.ShapeDtypeStruct(_columns(prepared).shape, jnp.int32),)
  return (jax.ShapeDtypeStruct((), jnp.int32),)


def _compile(engine: ReplayEngine, prepared: Prepared):
  """The compiled ``run`` for these shapes and the seconds it took."""
  batching_key = (
    _columns(prepared).shape if engine.batching is Batching.COLUMNS else ()
  )
  key = (engine.name, engine.run, prepared.shape_key, batching_key)
  if key in _COMPILED:
    _COMPILED.move_to_end(key)
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  fn = _jitted(engine.run, tuple(sorted(prepared.static)))
  compiled = fn.lower(
    prepared.arrays, *_capacity_spec(engine, prepared), **prepared.static
  ).compile()
  seconds = time.perf_counter() - start
  _COMPILED[key] = compiled
  while len(_COMPILED) > _MAX_COMPILED:
    _COMPILED.popitem(last=False)
  return compiled, seconds


def execute(
  engine: ReplayEngine,
  prepared: Prepared,
  capacities: Sequence[int],
  devices: Sequence[Any] | None = None,
) -> ReplayResult:
  """Compiles (or reuses) and runs ``engine`` on ``prepared``.

  Args:
    engine: the strategy.
    prepared: from ``engine.prepare`` for these ``capacities``.
    capacities: the capacities asked for, in order (``points`` labels the
      results with them).
    devices: for a ``PER_CAPACITY`` engine, more than one device runs the
      capacities as one program, ``vmap``-ed over them with their axis
      sharded over a one-axis :class:`jax.sharding.Mesh` named
      ``"capacities"`` (the trace replicated); the other batchings are one
      program already and ignore it.

  Returns:
    The engine's points with their :class:`Timing`.
  """
  outputs, timing = compile_and_run(engine, prepared, devices)
  points = engine.points(prepared, list(capacities), outputs)
  return ReplayResult(tuple(points), timing, (engine.name,) * len(points))


def compile_and_run(
  engine: ReplayEngine,
  prepared: Prepared,
  devices: Sequence[Any] | None = None,
):
  """``engine.run`` on ``prepared``, compiled (or reused) and run to
  completion; returns its outputs as numpy arrays (a leading ``[C]`` axis
  for ``PER_CAPACITY`` engines; ``COLUMNS`` engines see ``bucket(C)``
  capacities, the first ``C`` the real ones; a ``bucketed`` preparation's
  per-step or per-request outputs run to the padded length, zeros past
  the real one) and the :class:`Timing`. ``devices``: as :func:`execute`."""
  if (
    engine.batching is Batching.PER_CAPACITY
    and devices is not None
    and len(devices) > 1
  ):
    return _sharded_capacities(engine, prepared, list(devices))
  compiled, compile_s = _compile(engine, prepared)
  start = time.perf_counter()
  if engine.batching is Batching.ONE_PASS:
    outputs = compiled(prepared.arrays)
  elif engine.batching is Batching.COLUMNS:
    outputs = compiled(prepared.arrays, to_device(_columns(prepared)))
  else:  # stacked on the host: jnp.stack here would compile a program
    caps = np.asarray(prepared.capacities, np.int32)
    each = jax.block_until_ready([compiled(prepared.arrays, c) for c in caps])
    outputs = jax.tree.map(lambda *x: np.stack(x), *each)
  outputs = jax.tree.map(np.asarray, jax.block_until_ready(outputs))
  return outputs, Timing(compile_s, time.perf_counter() - start)


@functools.cache
def _vmapped(run: Callable, static_items: tuple):
  static = dict(static_items)
  return jax.jit(
    jax.vmap(lambda arrays, c: run(arrays, c, **static), in_axes=(None, 0))
  )


def _sharded_capacities(engine, prepared, devices):
  """A ``PER_CAPACITY`` engine's capacities as one vmapped program, their
  axis sharded over ``devices`` (padded to a multiple of them by repeating
  the last; the padding is cut off the outputs)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  caps = np.asarray(prepared.capacities, np.int32)
  pad = -caps.shape[0] % len(devices)
  lanes = np.concatenate([caps, np.repeat(caps[-1:], pad)])
  mesh = Mesh(np.asarray(devices), ("capacities",))
  arrays = jax.device_put(prepared.arrays, NamedSharding(mesh, PartitionSpec()))
  lanes = jax.device_put(
    to_device(lanes), NamedSharding(mesh, PartitionSpec("capacities"))
  )
  fn = _vmapped(engine.run, tuple(sorted(prepared.static.items())))
  start = time.perf_counter()
  compiled = fn.lower(arrays, lanes).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  outputs = jax.block_until_ready(compiled(arrays, lanes))
  outputs = jax.tree.map(lambda x: np.asarray(x)[: caps.shape[0]], outputs)
  return outputs, Timing(compile_s, time.perf_counter() - start)


# ---------------------------------------------------------------------------
# Shared argument rules and result building.


def check_capacities(capacities, *, minimum: int = 0) -> list[int]:
  """Capacities as Python ints; ``ValueError`` if empty or below
  ``minimum``, ``TypeError`` if not integers."""
  if isinstance(capacities, int | np.integer | str | bytes) or not isinstance(
    capacities, Iterable
  ):
    raise TypeError(f"capacities={capacities!r} must be a sequence of ints")
  capacities = list(capacities)
  if not capacities:
    raise ValueError("capacities must not be empty")
  for c in capacities:
    if isinstance(c, bool) or not isinstance(c, int | np.integer):
      raise TypeError(f"capacity={c!r} must be an int")
  capacities = [int(c) for c in capacities]
  if min(capacities) < minimum:
    raise ValueError(f"capacities={capacities} must be >= {minimum}")
  if max(capacities) >= 2**31 - 1:
    raise ValueError(
      f"capacity={max(capacities)} must be at most {2**31 - 2:_} (the "
      "engines count blocks, and one more, in int32)"
    )
  return capacities


def largest_request_blocks(trace, block_size: int) -> tuple[int, int]:
  """``(blocks, request)``: the most blocks of ``block_size`` tokens one
  request's KV needs (its prompt and output, ``trace.kv_tokens``), and
  which request. The vllm and sglang engines refuse a capacity below it:
  a request that cannot fit would wait forever."""
  totals = np.asarray(trace.kv_tokens)
  biggest = int(np.argmax(totals))
  return int(-(-int(totals[biggest]) // block_size)), biggest


def resolve_policy(
  policy: str | policies.EvictionPolicy = "lru",
  policy_params: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any] | None, policies.EvictionPolicy]:
  """A policy given by name and keyword parameters, or as an object.

  The one rule every replay semantics reads its ``policy`` argument by
  (each then says which of the policies it runs).

  Args:
    policy: a registered name (:func:`prefixjax.cache.policies.
      policy_names`) or an :class:`~prefixjax.cache.policies.EvictionPolicy`.
    policy_params: keyword parameters of the named policy's factory
      (``lfu``: ``decay``); none for a policy given as an object.

  Returns:
    ``(name, params, policy)``: the name (an object's registered name when
    it is that name's default policy, else ``"custom"``), the parameters
    (``None`` for a custom object: unknown) and the policy object.

  Raises:
    ValueError: an unknown name, or parameters the factory refuses.
    TypeError: parameters the factory does not take, parameters beside an
      object, or a policy that is neither a name nor an object.

  Example:
    >>> from prefixjax.cache import policies
    >>> from prefixjax.replay.frame import resolve_policy
    >>> name, params, built = resolve_policy("lfu", {"decay": 0.5})
    >>> name, params, built is policies.lfu(decay=0.5)
    ('lfu', {'decay': 0.5}, True)
    >>> resolve_policy(policies.fifo())[:2]
    ('fifo', {})
  """
  if policy_params is not None and not isinstance(policy_params, Mapping):
    raise TypeError(
      f"policy_params={policy_params!r} must be a mapping of the policy "
      "factory's keyword parameters, e.g. {'decay': 0.5}"
    )
  params = dict(policy_params or {})
  if isinstance(policy, policies.EvictionPolicy):
    if params:
      raise TypeError(
        f"policy_params={params!r} build a policy from its name; this "
        "policy is an EvictionPolicy already (pass its name instead)"
      )
    for name in policies.policy_names():
      try:
        if policies.get_policy(name) is policy:
          return name, {}, policy
      except Exception:  # noqa: BLE001 - a user factory that cannot be
        # called bare (no defaults, or broken since it was registered) is
        # not this policy; it must not stop the search.
        continue
    return "custom", None, policy
  if not isinstance(policy, str):
    raise TypeError(
      f"policy={policy!r} must be a registered name or an EvictionPolicy"
    )
  if policy not in policies.policy_names():
    raise ValueError(
      f"policy={policy!r} is not a registered policy; known: "
      f"{policies.policy_names()}"
    )
  try:
    built = policies.get_policy(policy, **params)
  except TypeError as err:
    raise TypeError(
      f"policy_params={params!r}: policy {policy!r} does not take them ({err})"
    ) from None
  except ValueError as err:
    raise ValueError(
      f"policy_params={params!r}: policy {policy!r}: {err}"
    ) from None
  return policy, params, built


def check_warmup_fraction(warmup_fraction) -> float:
  """A share of requests in ``[0, 1)``: 1 would leave no request to
  measure (every hit rate 0 / 0)."""
  if isinstance(warmup_fraction, bool) or not isinstance(
    warmup_fraction, (int, float, np.number)
  ):
    raise TypeError(f"warmup_fraction={warmup_fraction!r} must be a number")
  if not 0.0 <= warmup_fraction < 1.0:
    raise ValueError(
      f"warmup_fraction={warmup_fraction} must be in [0, 1) (1 leaves no "
      "request in the measured window)"
    )
  return float(warmup_fraction)


def warmup_requests(num_requests: int, warmup_fraction: float) -> int:
  """Requests before the measured window: ``floor(R * warmup_fraction)``
  (kvcache-simulator's rule, used by every semantics)."""
  return math.floor(num_requests * warmup_fraction)


def points_of_requests(
  policy: str,
  capacities: Sequence[int],
  block_size: int,
  per_request_hits: np.ndarray,
  prompt_lens: np.ndarray,
  warmup_fraction: float,
) -> list[ReplayPoint]:
  """Points from ``[C, R]`` hit tokens per request (the serving
  semantics: every request kept, never underfilled)."""
  warmup = warmup_requests(len(prompt_lens), warmup_fraction)
  total_tokens = int(np.asarray(prompt_lens, np.int64)[warmup:].sum())
  hits = np.asarray(per_request_hits, np.int64)
  return [
    ReplayPoint(
      policy=policy,
      capacity_blocks=int(capacity),
      block_size=int(block_size),
      hit_tokens=int(hits[c, warmup:].sum()),
      total_tokens=total_tokens,
      measured_requests=len(prompt_lens) - warmup,
      underfilled=False,
      per_request_hit_tokens=hits[c],
    )
    for c, capacity in enumerate(capacities)
  ]
