"""Trace replay: hit counts of a trace through caches of many capacities.

:func:`replay` is the one entry point. It takes a trace (or a prepared
:class:`ReplayPlan`), a policy and capacities, picks the engines that serve
them and returns a :class:`ReplayResult` (a sequence of :class:`ReplayPoint`,
one per capacity, with the compile and run time). Three semantics:

* ``"kvcache-sim"``: kvcache-simulator 0.1.3, the published hit-rate
  anchor; the cache holds only cached blocks (policies ``fifo``,
  ``lru_leaf``, ``belady_leaf``; see :mod:`prefixjax.replay.kvcache_sim`).
* ``"vllm"``: vLLM v1's ``KVCacheManager`` with prefix caching, one request
  at a time (policy ``lru``; :mod:`prefixjax.replay.vllm`).
* ``"sglang"``: SGLang's paged ``RadixCache`` (policy ``lru_leaf``;
  :mod:`prefixjax.replay.sglang`).

Every engine is a :class:`~prefixjax.replay.frame.ReplayEngine` (prepare on
the host, a pure run, a declared batching mode); :data:`ENGINES` lists
them. Importing this package imports no engine: each is loaded when first
picked.

Example:
  >>> from prefixjax import replay as rp
  >>> plan = rp.prepare_replay([[1, 2], [1, 2, 3], [1, 4]], [20, 30, 17],
  ...                          block_size=10, warmup_fraction=0.0)
  >>> result = rp.replay(plan, policy="lru_leaf", capacities=[3, 8])
  >>> [p.per_request_hit_tokens.tolist() for p in result]
  [[0, 20, 10], [0, 20, 10]]
  >>> result.engines
  ('kvcache_sim.stack', 'kvcache_sim.stack')
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from prefixjax.cache import policies
from prefixjax.replay.frame import (
  Batching,
  Prepared,
  ReplayEngine,
  ReplayPoint,
  ReplayResult,
  Timing,
  check_capacities,
  execute,
)
from prefixjax.replay.kvcache_sim import KVCACHE_SIM_POLICY_NAMES
from prefixjax.replay.kvcache_sim import POLICIES as REPLAY_POLICIES
from prefixjax.replay.plan import (
  ReplayPlan,
  plan_trace,
  prepare_replay,
  replay_ceiling,
)
from prefixjax.workloads import Trace

__all__ = [
  "ENGINES",
  "ENGINE_CHOICES",
  "KVCACHE_SIM_POLICY_NAMES",
  "REPLAY_POLICIES",
  "SEMANTICS",
  "SEMANTICS_POLICY",
  "Batching",
  "Prepared",
  "ReplayEngine",
  "ReplayPlan",
  "ReplayPoint",
  "ReplayResult",
  "Timing",
  "default_block_size",
  "get_engine",
  "plan_trace",
  "prepare_replay",
  "replay",
  "replay_ceiling",
]

SEMANTICS = ("kvcache-sim", "vllm", "sglang")
"""Replay semantics (see the module docstring)."""

SEMANTICS_POLICY = {"vllm": "lru", "sglang": "lru_leaf"}
"""The one policy of each serving semantics."""

ENGINES = {
  "kvcache_sim.event": "prefixjax.replay.kvcache_sim.event:ENGINE",
  "kvcache_sim.chunked": "prefixjax.replay.kvcache_sim.chunked:ENGINE",
  "kvcache_sim.stack": "prefixjax.replay.kvcache_sim.stack:LRU_ENGINE",
  "kvcache_sim.keys": "prefixjax.replay.kvcache_sim.stack:BELADY_ENGINE",
  "vllm": "prefixjax.replay.vllm_engine:ENGINE",
  "sglang": "prefixjax.replay.sglang:ENGINE",
}
"""Every replay engine by name, as ``module:attribute`` (see
:func:`get_engine`)."""

ENGINE_CHOICES = ("auto", "event", "request", "keys")
"""``replay(engine=...)`` for the kvcache-sim semantics: ``"event"`` (one
scan step per block event, the reference), ``"request"`` (a request's
blocks per step), ``"keys"`` (``lru_leaf`` as stack distances,
``belady_leaf`` as counts per next-use key) or ``"auto"`` (``"keys"`` for
the leaf policies, ``"request"`` for ``fifo``). All give equal hits."""


def get_engine(name: str) -> ReplayEngine:
  """The engine registered as ``name`` in :data:`ENGINES` (imported now)."""
  if name not in ENGINES:
    raise ValueError(f"unknown replay engine {name!r}; known: {list(ENGINES)}")
  module, attribute = ENGINES[name].split(":")
  return getattr(importlib.import_module(module), attribute)


def default_block_size(trace: Trace, block_size: int | None) -> int:
  """``block_size``, or the trace's own: a hash-id trace without token ids
  is cut at its hash block size, anything else at 16 tokens."""
  if block_size is not None:
    return block_size
  if trace.has_hash_ids and not trace.has_token_ids:
    return trace.hash_block_size
  return 16


def _policy_name(policy, semantics: str) -> str:
  """A policy given by name or as an :class:`EvictionPolicy`, by name."""
  served = (
    REPLAY_POLICIES
    if semantics == "kvcache-sim"
    else (SEMANTICS_POLICY[semantics],)
  )
  if isinstance(policy, policies.EvictionPolicy):
    for name in served:
      if policies.get_policy(name) is policy:
        return name
    raise ValueError(
      f"{semantics} replay serves the policies {served}; this "
      "EvictionPolicy is none of them"
    )
  if policy not in served:
    known = policy in policies.policy_names()
    raise ValueError(
      f"policy={policy!r} is not one of {served} (the {semantics} "
      f"semantics' policies)"
      + ("; it is a prefix-cache policy with no replay engine" if known else "")
    )
  return policy


def _kvcache_sim_pieces(plan, policy, capacities, choice):
  """``[(engine name, capacity indices)]`` serving every capacity."""
  everything = list(range(len(capacities)))
  if choice == "event":
    return [("kvcache_sim.event", everything)]
  if choice == "keys" and policy == "fifo":
    raise ValueError(
      "engine='keys' serves ('lru_leaf', 'belady_leaf'), not policy='fifo'"
    )
  if choice == "request" or policy == "fifo":
    return [("kvcache_sim.chunked", everything)]
  if policy == "belady_leaf":
    return [("kvcache_sim.keys", everything)]
  # lru_leaf stack distances hold from the longest request's blocks up;
  # smaller capacities go to the chunked engine.
  from prefixjax.replay.kvcache_sim.stack import lru_stack_minimum

  minimum = lru_stack_minimum(plan)
  stack = [i for i, c in enumerate(capacities) if c >= minimum]
  rest = [i for i, c in enumerate(capacities) if c < minimum]
  return [
    (name, lanes)
    for name, lanes in (
      ("kvcache_sim.stack", stack),
      ("kvcache_sim.chunked", rest),
    )
    if lanes
  ]


def _options_for(name: str, width, keys_per_step) -> dict:
  if name in ("kvcache_sim.chunked", "kvcache_sim.stack") and width is not None:
    return {"width": width}
  if name == "kvcache_sim.keys" and keys_per_step is not None:
    return {"keys_per_step": keys_per_step}
  return {}


def replay(
  source: Trace | ReplayPlan,
  *,
  policy=None,
  capacities: Sequence[int],
  semantics: str = "kvcache-sim",
  engine: str = "auto",
  block_size: int | None = None,
  warmup_fraction: float = 0.5,
  publish: str = "early",
  vllm_version: str | None = None,
  waiting_refresh_interval: int | None = 32,
  width: int | None = None,
  keys_per_step: int | None = None,
  devices: Sequence[Any] | None = None,
) -> ReplayResult:
  """Replays a trace at every capacity; the one replay entry point.

  Args:
    source: a :class:`~prefixjax.workloads.Trace`, or (kvcache-sim
      semantics) a :class:`ReplayPlan` from :func:`prepare_replay` /
      :func:`plan_trace`.
    policy: a name or an :class:`~prefixjax.cache.policies.EvictionPolicy`
      the semantics serves (kvcache-sim: one of :data:`REPLAY_POLICIES`;
      vllm: ``lru``, sglang: ``lru_leaf``, the default for those two).
    capacities: cache sizes in blocks.
    semantics: one of :data:`SEMANTICS`.
    engine: one of :data:`ENGINE_CHOICES` (kvcache-sim; the serving
      semantics have one engine each, ``"auto"``).
    block_size: tokens per block (default: see :func:`default_block_size`).
    warmup_fraction: share of requests before hits are counted.
    publish: vllm semantics, ``"early"`` or ``"late"`` (see
      :func:`prefixjax.replay.vllm.replay_vllm`).
    vllm_version: vllm semantics, the vLLM release whose rules to follow
      (default the current one, 0.33: freed blocks without a hash go to
      the head of the free queue; ``"0.22"`` for the older tail order; see
      :func:`prefixjax.cache.prefix_state.vllm_free_order`).
    waiting_refresh_interval: sglang semantics, SGLang's waiting-prefix
      refresh (``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``, on by default in
      0.5.23): every ``n``-th priority computation touches the request's
      whole prompt; 32 as SGLang, ``None`` off (see
      :func:`prefixjax.replay.sglang.replay_sglang`).
    width: blocks per scan step of the chunked and stack engines.
    keys_per_step: next-use keys per scan step of the ``belady_leaf`` keys
      engine.
    devices: vllm and sglang semantics (one program per capacity): with
      more than one device the capacities run as one vmapped program,
      sharded over them (:func:`prefixjax.replay.frame.execute`); the
      kvcache-sim engines serve every capacity in one program already.

  Returns:
    A :class:`ReplayResult`, its points in the order of ``capacities``;
    its :meth:`~ReplayResult.frame` is a :class:`pandas.DataFrame` of them
    with the call's parameters (``trace``: the trace's name, ``None`` for
    a plan; ``warmup_fraction``, ``None`` for a plan, which carries its
    own window; vllm: ``publish`` and ``vllm_version``; sglang:
    ``waiting_refresh_interval``).

  Raises:
    ValueError / TypeError: a bad argument, named with its value.
  """
  result = _replay(
    source,
    policy=policy,
    capacities=capacities,
    semantics=semantics,
    engine=engine,
    block_size=block_size,
    warmup_fraction=warmup_fraction,
    publish=publish,
    vllm_version=vllm_version,
    waiting_refresh_interval=waiting_refresh_interval,
    width=width,
    keys_per_step=keys_per_step,
    devices=devices,
  )
  is_trace = isinstance(source, Trace)
  parameters = {
    "trace": source.name if is_trace else None,
    "warmup_fraction": float(warmup_fraction) if is_trace else None,
  }
  if semantics == "vllm":
    from prefixjax.cache.prefix_state import DEFAULT_VLLM_VERSION

    parameters["publish"] = publish
    parameters["vllm_version"] = vllm_version or DEFAULT_VLLM_VERSION
  if semantics == "sglang":
    parameters["waiting_refresh_interval"] = waiting_refresh_interval
  return dataclasses.replace(result, parameters=tuple(parameters.items()))


def _replay(
  source,
  *,
  policy,
  capacities,
  semantics,
  engine,
  block_size,
  warmup_fraction,
  publish,
  vllm_version,
  waiting_refresh_interval,
  width,
  keys_per_step,
  devices,
) -> ReplayResult:
  """:func:`replay` less the parameters it records."""
  if semantics not in SEMANTICS:
    raise ValueError(f"semantics={semantics!r} is not one of {SEMANTICS}")
  if engine not in ENGINE_CHOICES:
    raise ValueError(f"engine={engine!r} is not one of {ENGINE_CHOICES}")
  if policy is None and semantics in SEMANTICS_POLICY:
    policy = SEMANTICS_POLICY[semantics]
  if policy is None:
    raise ValueError(f"{semantics} replay needs a policy: {REPLAY_POLICIES}")
  policy = _policy_name(policy, semantics)
  if vllm_version is not None and semantics != "vllm":
    raise ValueError(
      f"vllm_version={vllm_version!r} is a vllm-semantics rule; "
      f"semantics={semantics!r} has none"
    )
  if waiting_refresh_interval != 32 and semantics != "sglang":
    raise ValueError(
      f"waiting_refresh_interval={waiting_refresh_interval!r} is an "
      f"sglang-semantics rule; semantics={semantics!r} has none"
    )
  if semantics != "kvcache-sim":
    if engine != "auto":
      raise ValueError(f"{semantics} replay has one engine; pass engine='auto'")
    if not isinstance(source, Trace):
      raise TypeError(
        f"{semantics} replay needs a Trace, got {type(source).__name__}"
      )
    block_size = default_block_size(source, block_size)
    if semantics == "vllm":
      from prefixjax.replay.vllm import replay_vllm

      version = {} if vllm_version is None else {"vllm_version": vllm_version}
      return replay_vllm(
        source,
        block_size=block_size,
        capacities=capacities,
        warmup_fraction=warmup_fraction,
        publish=publish,
        devices=devices,
        **version,
      )
    from prefixjax.replay.sglang import replay_sglang

    return replay_sglang(
      source,
      block_size=block_size,
      capacities=capacities,
      warmup_fraction=warmup_fraction,
      waiting_refresh_interval=waiting_refresh_interval,
      devices=devices,
    )
  if isinstance(source, Trace):
    plan = plan_trace(
      source, block_size=block_size, warmup_fraction=warmup_fraction
    )
  elif isinstance(source, ReplayPlan):
    plan = source
  else:
    raise TypeError(
      f"source must be a Trace or a ReplayPlan, got {type(source).__name__}"
    )
  capacities = check_capacities(capacities)
  for name, value in (("width", width), ("keys_per_step", keys_per_step)):
    if value is not None and (
      isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
      raise ValueError(f"{name}={value!r} must be an int >= 1")
  points: list = [None] * len(capacities)
  names: list = [None] * len(capacities)
  timing = Timing()
  for name, lanes in _kvcache_sim_pieces(plan, policy, capacities, engine):
    chosen = get_engine(name)
    caps = [capacities[i] for i in lanes]
    prepared = chosen.prepare(
      plan,
      caps,
      policy=policy,
      bucketed=True,
      **_options_for(name, width, keys_per_step),
    )
    part = execute(chosen, prepared, caps)
    timing = timing + part.timing
    for i, point in zip(lanes, part, strict=True):
      points[i], names[i] = point, name
  return ReplayResult(tuple(points), timing, tuple(names))
