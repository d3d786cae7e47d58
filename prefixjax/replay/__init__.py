"""Trace replay: hit counts of a trace through caches of many capacities.

:func:`replay` is the one entry point. It takes a trace (or a prepared
:class:`ReplayPlan`), a policy and capacities, picks the engines that serve
them and returns a :class:`ReplayResult` (a sequence of :class:`ReplayPoint`,
one per capacity, with the compile and run time). Three semantics:

* ``"kvcache-sim"``: kvcache-simulator 0.1.3, the published hit-rate
  anchor; the cache holds only cached blocks (policies ``fifo``,
  ``lru_leaf``, ``belady_leaf``; see :mod:`prefixjax.replay.kvcache_sim`).
* ``"vllm"``: vLLM v1's ``KVCacheManager`` with prefix caching, one request
  at a time (:mod:`prefixjax.replay.vllm`): policy ``lru`` (vLLM's own, the
  default, on a specialised engine) or any other eviction policy the prefix
  cache runs (:mod:`prefixjax.cache.policies`: ``fifo``, ``lfu(decay=...)``,
  ``lru_leaf``, ``belady``, ``belady_leaf`` with next-use steps computed
  from the trace, and user-defined ones), through the general prefix-cache
  verbs, by name with ``policy_params`` or as an object.
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

A parameterised policy under vLLM semantics:

  >>> import numpy as np
  >>> from prefixjax.workloads import Trace
  >>> trace = Trace([0.0, 1.0, 2.0], [9, 5, 9], [1, 1, 1], hash_block_size=4,
  ...               hash_ids=[np.array([1, 2, 3]), np.array([7, 8]),
  ...                         np.array([1, 2, 4])])
  >>> result = rp.replay(trace, semantics="vllm", capacities=[3, 5],
  ...                    policy="lfu", policy_params={"decay": 0.5},
  ...                    warmup_fraction=0.0)
  >>> [p.per_request_hit_tokens.tolist() for p in result]
  [[0, 0, 4], [0, 0, 8]]
  >>> result.engines[0], result[0].policy
  ('vllm.general', 'lfu')
  >>> dict(result.parameters)["policy_params"]
  '{"decay": 0.5}'
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefixjax._host import release_compiled_near_map_limit
from prefixjax.cache import policies
from prefixjax.replay.frame import (
  Batching,
  Prepared,
  ReplayEngine,
  ReplayPoint,
  ReplayResult,
  Timing,
  check_capacities,
  clear_compiled,
  execute,
  resolve_policy,
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
  "clear_compiled",
  "default_block_size",
  "get_engine",
  "plan_trace",
  "prepare_replay",
  "replay",
  "replay_ceiling",
  "resolve_policy",
  "served_policies",
]

SEMANTICS = ("kvcache-sim", "vllm", "sglang")
"""Replay semantics (see the module docstring)."""

SEMANTICS_POLICY = {"vllm": "lru", "sglang": "lru_leaf"}
"""The default policy of each serving semantics (SGLang's is its only one;
see :func:`served_policies`)."""

ENGINES = {
  "kvcache_sim.event": "prefixjax.replay.kvcache_sim.event:ENGINE",
  "kvcache_sim.chunked": "prefixjax.replay.kvcache_sim.chunked:ENGINE",
  "kvcache_sim.stack": "prefixjax.replay.kvcache_sim.stack:LRU_ENGINE",
  "kvcache_sim.keys": "prefixjax.replay.kvcache_sim.stack:BELADY_ENGINE",
  "vllm": "prefixjax.replay.vllm_engine:ENGINE",
  "vllm.general": "prefixjax.replay.vllm:GENERAL_ENGINE",
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


def served_policies(semantics: str) -> tuple[str, ...]:
  """The policy names a semantics replays.

  ``kvcache-sim``: :data:`REPLAY_POLICIES`; ``vllm``: every registered
  policy (:func:`prefixjax.cache.policies.policy_names`, user-registered
  ones included, with any parameters); ``sglang``: ``lru_leaf``. Only
  ``vllm`` takes ``policy_params``: the other engines run their policies
  with default parameters.

  Example:
    >>> from prefixjax import replay as rp
    >>> rp.served_policies("sglang"), "lfu" in rp.served_policies("vllm")
    (('lru_leaf',), True)
  """
  if semantics not in SEMANTICS:
    raise ValueError(f"semantics={semantics!r} is not one of {SEMANTICS}")
  if semantics == "kvcache-sim":
    return tuple(REPLAY_POLICIES)
  if semantics == "vllm":
    return policies.policy_names()
  return (SEMANTICS_POLICY[semantics],)


def _policy_of(policy, policy_params, semantics: str):
  """``(name, params, policy)`` (:func:`resolve_policy`) of a policy the
  semantics serves; ``ValueError`` naming the rule otherwise."""
  name, params, built = resolve_policy(policy, policy_params)
  served = served_policies(semantics)
  # vllm replays any policy object, named or not.
  if name not in served and semantics != "vllm":
    if isinstance(policy, policies.EvictionPolicy):
      shown = "this EvictionPolicy" + ("" if name == "custom" else f" ({name})")
    else:
      shown = f"policy={policy!r}"
    raise ValueError(
      f"{shown} is not one of {served} (the {semantics} semantics' "
      "policies); semantics='vllm' replays every prefix-cache policy"
    )
  if semantics != "vllm" and built is not policies.get_policy(name):
    raise ValueError(
      f"policy_params={params!r}: the {semantics} replay engines run "
      f"{name} with its default parameters only; semantics='vllm' "
      "replays parameterised policies"
    )
  return name, params, built


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
  policy_params: Mapping[str, Any] | None = None,
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
      the semantics serves (:func:`served_policies`; kvcache-sim: one of
      :data:`REPLAY_POLICIES`; vllm: ``lru``, its default, on the
      specialised engine, or any other prefix-cache policy through the
      general verbs, :data:`prefixjax.replay.vllm.GENERAL_ENGINE`, which
      needs ``vllm_version`` 0.23 or later; sglang: ``lru_leaf``, its
      default). ``belady`` and ``belady_leaf`` under vllm get their
      next-use steps from the trace.
    policy_params: keyword parameters of a named policy's factory
      (:func:`resolve_policy`; ``lfu``: ``decay``); only the vllm semantics
      runs policies with parameters other than their defaults.
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
    own window; ``policy_params``: the parameters as JSON text with sorted
    keys, ``"{}"`` for a policy's defaults, ``None`` for a policy given as
    an object that is no registered name's default (its points' ``policy``
    is then ``"custom"``); vllm: ``publish`` and ``vllm_version``; sglang:
    ``waiting_refresh_interval``). Points of one policy with different
    parameters kept in the policy's state (``lfu``'s ``decay``) share one
    compiled program.

  Raises:
    ValueError / TypeError: a bad argument, named with its value.
  """
  if semantics not in SEMANTICS:
    raise ValueError(f"semantics={semantics!r} is not one of {SEMANTICS}")
  if policy is None and semantics in SEMANTICS_POLICY:
    policy = SEMANTICS_POLICY[semantics]
  if policy is None:
    raise ValueError(f"{semantics} replay needs a policy: {REPLAY_POLICIES}")
  name, params, built = _policy_of(policy, policy_params, semantics)
  release_compiled_near_map_limit()
  result = _replay(
    source,
    # A custom object (no name) is passed on as is.
    policy=built if name == "custom" else name,
    policy_params=params or None,
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
    "policy_params": None if params is None else _params_text(params),
  }
  if semantics == "vllm":
    from prefixjax.cache.prefix_state import DEFAULT_VLLM_VERSION

    parameters["publish"] = publish
    parameters["vllm_version"] = vllm_version or DEFAULT_VLLM_VERSION
  if semantics == "sglang":
    parameters["waiting_refresh_interval"] = waiting_refresh_interval
  return dataclasses.replace(result, parameters=tuple(parameters.items()))


def _params_text(params: Mapping[str, Any]) -> str:
  """Canonical JSON text of policy parameters (numpy scalars as Python
  numbers; other values by ``repr``): one hashable cell of a table."""

  def plain(value):
    return value.item() if hasattr(value, "item") else repr(value)

  return json.dumps(dict(params), sort_keys=True, default=plain)


def _replay(
  source,
  *,
  policy,
  policy_params,
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
  """:func:`replay` less the parameters it records, for a policy
  :func:`_policy_of` has checked."""
  if engine not in ENGINE_CHOICES:
    raise ValueError(f"engine={engine!r} is not one of {ENGINE_CHOICES}")
  if vllm_version is not None and semantics != "vllm":
    raise ValueError(
      f"vllm_version={vllm_version!r} is a vllm-semantics rule; "
      f"semantics={semantics!r} has none"
    )
  if publish != "early" and semantics != "vllm":
    raise ValueError(
      f"publish={publish!r} is a vllm-semantics rule; semantics="
      f"{semantics!r} has none"
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
        policy=policy,
        policy_params=policy_params,
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
