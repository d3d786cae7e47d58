"""Many serving configurations through one compiled program.

:func:`simulate_batch` runs configurations that share static shapes as one
``jax.vmap``-ed loop (sharded over devices) or one after another through the
same compiled program; see its docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import configs as _configs
from prefixjax._host import replicate, shard_lanes
from prefixjax.serving import vllm_v1 as engine
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.results import SimResult
from prefixjax.serving.simulate import (
  Arrivals,
  _build,
  _check_records,
  _collect,
  _run_one,
  _sglang_inputs,
  _simulate_sglang,
)
from prefixjax.workloads import Trace

__all__ = ["simulate_batch"]


_STATIC = (
  "semantics",
  "num_gpu_blocks",
  "block_size",
  "max_num_seqs",
  "max_model_len",
  "parallel_sampling",
)


def _per_config(name: str, value, n: int) -> list:
  """``value`` for each of ``n`` configurations (a scalar or a sequence)."""
  if isinstance(value, (list, tuple, np.ndarray)):
    if len(value) != n:
      raise ValueError(
        f"{name} has {len(value)} entries for {n} configurations"
      )
    return list(value)
  return [value] * n


@jax.jit
def _stack(trees):
  """Equal pytrees stacked leaf by leaf along a new axis 0, in one program
  (``jnp.stack`` outside ``jit`` compiles one per leaf shape)."""
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def simulate_batch(
  trace: Trace | Iterable[Mapping[str, Any]],
  configs: Sequence[ServingConfig],
  *,
  arrivals: Arrivals = "zero",
  step_time_ms: float | Sequence[float] | None = None,
  rate: float | Sequence[float] | None = None,
  seed: int | Sequence[int] = 0,
  max_steps: int | None = None,
  clock: Any = "steps",
  model: str | _configs.ModelConfig | None = None,
  hardware: str | _configs.HardwareConfig | None = None,
  vectorize: bool | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> list[SimResult]:
  """:func:`simulate` for many configurations with one compiled program.

  The configurations must share the static shapes, ``num_gpu_blocks``,
  ``block_size``, ``max_num_seqs``, ``max_model_len``, and the scheduler;
  they may differ in ``max_num_batched_tokens``, ``chunked_prefill`` and
  ``long_prefill_token_threshold`` (under ``semantics="sglang"`` also in
  ``max_prefill_tokens`` and ``priority_preemption_threshold``, and they
  must share ``waiting_prefix_refresh`` and ``priority_preemption``), and
  each may have its own ``step_time_ms``, ``rate`` and ``seed`` (pass a
  sequence; a scalar is shared), so a whole load curve (Poisson rates x
  seeds) is one compiled program. Each result equals :func:`simulate`'s
  for its configuration, except that only the per-step totals are kept
  (``SimResult.lanes_recorded`` is False: :meth:`SimResult.metrics` and
  :meth:`SimResult.requests` work, :meth:`SimResult.steps` does not).

  ``vectorize``: run the configurations as one ``jax.vmap``-ed loop
  (True), or one after another through the same compiled program (False).
  The default, None, vectorizes on accelerators only: on a CPU the
  vmapped loop costs far more than the configurations one by one (its
  branches all run and its scatters become general ones; measured on this
  project's 2-core CPU: 16 configurations of 200 requests 35 s vmapped,
  about 0.3 s each one by one). Both give the same results.

  ``devices``: when vectorized, the configurations' axis is sharded over
  these devices (a one-axis :class:`jax.sharding.Mesh` named
  ``"configs"``; the configurations are padded with copies of the last to
  a multiple of the device count, and the copies dropped). Default: the
  default device only. The results do not depend on the device count.

  Raises:
    ValueError: no configurations, configurations that differ in a static
      field (the message names it), per-configuration sequences of the
      wrong length, and everything :func:`simulate` refuses.
  """
  configs = list(configs)
  if not configs:
    raise ValueError("simulate_batch needs at least one configuration")
  for c in configs:
    if not isinstance(c, ServingConfig):
      raise TypeError(f"configs must be ServingConfigs, got {type(c)}")
  first = configs[0]
  for i, c in enumerate(configs):
    for name in _STATIC:
      if getattr(c, name) != getattr(first, name):
        raise ValueError(
          f"configs[{i}].{name}={getattr(c, name)} differs from "
          f"configs[0].{name}={getattr(first, name)}: a batch shares its "
          f"static shapes ({', '.join(_STATIC)})"
        )
    if c.scheduler_object != first.scheduler_object:
      raise ValueError(
        f"configs[{i}].scheduler differs from configs[0]'s: a batch shares "
        "its scheduler"
      )
  n = len(configs)
  records = _check_records(trace)
  points = list(
    zip(
      configs,
      _per_config("step_time_ms", step_time_ms, n),
      _per_config("rate", rate, n),
      _per_config("seed", seed, n),
      strict=True,
    )
  )
  if vectorize is None:
    vectorize = jax.default_backend() != "cpu"
  if first.semantics == "sglang":
    return _sglang_batch(
      records, points, arrivals, max_steps, clock, model, hardware,
      vectorize, devices,
    )  # fmt: skip
  builds = [
    _build(records, c, arrivals, dt, rt, sd, clock, model, hardware)
    for c, dt, rt, sd in points
  ]
  b0 = builds[0]
  if not vectorize:
    return [_run_one(b, max_steps, record_lanes=False) for b in builds]

  state, params, reqs = _stack(
    [(b.state, b.params, b.reqs.replace(keys=None)) for b in builds]
  )
  shared = b0.reqs.keys  # equal for equal block sizes and records
  if devices is not None and len(devices) > 1:
    state, reqs, params = shard_lanes((state, reqs, params), devices)
    shared = replicate(shared, devices)
  retry = max_steps is None
  steps = max_steps or max(b.rows for b in builds)
  while True:
    final, trace_out = engine.run_batched(
      state,
      reqs,
      params,
      shared,
      max_steps=steps,
      scheduler=b0.scheduler,
      clock=b0.timer,
    )
    errors = np.asarray(final.error)
    if not (retry and np.any(errors == engine.SimStatus.OUT_OF_STEPS)):
      break
    steps *= 2
  final = jax.device_get(final)
  trace_out = jax.device_get(trace_out)
  out = []
  for i, b in enumerate(builds):
    f = jax.tree.map(lambda x, i=i: x[i], final)
    t = jax.tree.map(lambda x, i=i: x[i], trace_out)
    out.append(dataclasses.replace(_collect(b, f, t), lanes_recorded=False))
  return out


def _sglang_batch(
  records, points, arrivals, max_steps, clock, model, hardware, vectorize,
  devices,
) -> list[SimResult]:  # fmt: skip
  """:func:`simulate_batch` under ``semantics="sglang"``: one vmapped loop
  (:func:`~prefixjax.serving.sglang_sim.simulate_sglang_batch`) or the
  configurations one after another."""
  from prefixjax.serving.sglang_sim import BATCH_STATIC, simulate_sglang_batch

  first = points[0][0]
  for i, (c, *_) in enumerate(points):
    for name in BATCH_STATIC:
      if getattr(c, name) != getattr(first, name):
        raise ValueError(
          f"configs[{i}].{name} differs from configs[0]'s: under "
          "semantics='sglang' a batch shares it"
        )
  if not vectorize:
    out = []
    for c, dt, rt, sd in points:
      res = _simulate_sglang(
        records, c, arrivals, dt, rt, sd, max_steps, clock, model, hardware
      )
      out.append(dataclasses.replace(res, lanes_recorded=False))
    return out
  inputs, timer = [], None
  for c, dt, rt, sd in points:
    one, timer = _sglang_inputs(
      records, c, arrivals, dt, rt, sd, clock, model, hardware
    )
    inputs.append(one)
  return simulate_sglang_batch(
    [c for c, *_ in points],
    inputs,
    step_times=[dt for _, dt, _, _ in points],
    max_steps=max_steps,
    timer=timer,
    devices=devices,
  )
