"""Roofline cost of one engine step: FLOPs, HBM bytes, seconds.

An engine step runs ``S`` lanes (sequence slots). Lane ``i`` computes
``n_i`` new tokens whose KV context *before* the step is ``c_i`` tokens;
prefix-cache hits are part of ``c_i`` (their KV is read, not recomputed).
Padding lanes have ``n_i == 0`` and cost nothing, whatever their ``c_i``.
With ``P = ModelConfig.num_nonembedding_params``, ``N`` layers, ``H`` query
heads of width ``D``, ``b = ModelConfig.kv_bytes_per_token``::

  linear FLOPs    = sum_i 2 * P * n_i
  attention FLOPs = sum_i 4 * N * H * D * n_i * (c_i + (n_i + 1) / 2)
  bytes           = [any n_i > 0] * W + sum_{i: n_i > 0} b * (c_i + n_i)
                    + sum_i b * n_i
  time            = [any n_i > 0] * (overhead + max(FLOPs / (F * e_F),
                                                   bytes / (B * e_B)))

* Linear FLOPs: the "2 FLOPs per parameter per token" forward-pass rule
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1),
  over every weight a token's matmuls touch, the LM head included. The head
  is charged to every new token, though engines compute logits only for a
  prompt's last token: prefill is over-counted by ``2 * V * d`` per prompt
  token (about 2 % of ``2 * P`` for Llama-2-7B, 7 % for Llama-3-8B).
* Attention FLOPs: new token ``j`` (0-based) attends to ``c_i + j + 1``
  keys (causal); ``Q K^T`` and ``P V`` are ``D`` multiply-adds per key and
  head, 2 FLOPs each, so ``4 * D`` per (query, key, head, layer); summing
  ``c_i + j + 1`` over ``j < n_i`` gives ``n_i * (c_i + (n_i + 1) / 2)``.
  Query heads count (grouped-query attention shares K and V, not the
  products). Softmax, RMSNorm, rotary and SwiGLU element-wise work are left
  out.
* Bytes: the weights ``W = num_nonembedding_params * dtype_bytes`` are read
  once per step when any lane runs (batched matmuls share the read); the
  embedding *table* is left out because a step gathers only its ``n`` rows.
  Each running lane reads its whole KV, the context and the new tokens
  (attention reads the new tokens' KV back from the cache), and writes the
  new tokens' KV. Activations are ignored (they are ``O(n * d)``, small
  beside the weights at serving batch sizes).
* Time: the roofline model (Williams, Waterman and Patterson, "Roofline: an
  insightful visual performance model for multicore architectures", CACM
  52(4), 2009): a step takes the longer of its compute time at peak FLOP/s
  ``F`` and its memory time at HBM bandwidth ``B``, each derated by an
  efficiency ``e`` in (0, 1], plus ``HardwareConfig.step_overhead_s``
  (an assumed fixed per-step cost). A step with no running lane costs 0.

Every function is traceable (``jax.jit``, ``jax.vmap``): the configs are
static Python numbers, ``new_tokens`` and ``context_tokens`` are integer
arrays ``[..., S]`` reduced over the last axis. Products are taken in
float32, not int32 (``P * n`` passes 2**31 at once); float32 is ample for
a time (relative error about ``S * 1e-7``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from prefixjax.configs import HardwareConfig, ModelConfig

__all__ = [
  "FunctionClock",
  "RooflineClock",
  "StepsClock",
  "attention_flops",
  "linear_flops",
  "step_bytes",
  "step_flops",
  "step_time_s",
]


def _lanes(new_tokens, context_tokens) -> tuple[jax.Array, jax.Array]:
  n = jnp.asarray(new_tokens).astype(jnp.float32)
  c = jnp.asarray(context_tokens).astype(jnp.float32)
  return n, c


def _active(new_tokens) -> jax.Array:
  return jnp.any(jnp.asarray(new_tokens) > 0, axis=-1)


def linear_flops(model: ModelConfig, new_tokens) -> jax.Array:
  """Matmul FLOPs of the weights, ``sum_i 2 * P * n_i`` (float32)."""
  n = jnp.asarray(new_tokens).astype(jnp.float32)
  return jnp.float32(2 * model.num_nonembedding_params) * jnp.sum(n, axis=-1)


def attention_flops(
  model: ModelConfig, new_tokens, context_tokens
) -> jax.Array:
  """Causal attention FLOPs, ``sum_i 4*N*H*D * n_i * (c_i + (n_i+1)/2)``."""
  n, c = _lanes(new_tokens, context_tokens)
  per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
  pairs = n * (c + (n + 1.0) * 0.5)
  return jnp.float32(per_pair) * jnp.sum(pairs, axis=-1)


def step_flops(model: ModelConfig, new_tokens, context_tokens) -> jax.Array:
  """FLOPs of one step: linear plus attention, summed over lanes (float32).

  Args:
    model: the model.
    new_tokens: ``[..., S]`` tokens each lane computes this step (0: padding).
    context_tokens: ``[..., S]`` KV tokens each lane holds before the step,
      cached prefix hits included.

  Returns:
    float32 ``[...]``.
  """
  return linear_flops(model, new_tokens) + attention_flops(
    model, new_tokens, context_tokens
  )


def step_bytes(model: ModelConfig, new_tokens, context_tokens) -> jax.Array:
  """HBM bytes of one step: weights once, KV read and KV write (float32).

  Args:
    model: the model.
    new_tokens: ``[..., S]`` tokens each lane computes this step (0: padding).
    context_tokens: ``[..., S]`` KV tokens each lane holds before the step.

  Returns:
    float32 ``[...]``: ``W`` if any lane runs (``W`` the non-embedding
    weights), plus ``b * (c_i + n_i)`` read and ``b * n_i`` written per
    running lane (``b = kv_bytes_per_token``). Activations are ignored.
  """
  n, c = _lanes(new_tokens, context_tokens)
  running = n > 0
  weights = jnp.float32(model.num_nonembedding_params * model.dtype_bytes)
  kv_tokens = jnp.sum(jnp.where(running, c + n, 0.0) + n, axis=-1)
  return (
    jnp.where(_active(new_tokens), weights, jnp.float32(0))
    + jnp.float32(model.kv_bytes_per_token) * kv_tokens
  )


def step_time_s(
  model: ModelConfig, hardware: HardwareConfig, new_tokens, context_tokens
) -> jax.Array:
  """Seconds of one step on ``hardware``: overhead plus the roofline max.

  Args:
    model: the model.
    hardware: the chip.
    new_tokens: ``[..., S]`` tokens each lane computes this step (0: padding).
    context_tokens: ``[..., S]`` KV tokens each lane holds before the step.

  Returns:
    float32 ``[...]``: ``step_overhead_s + max(flops / (peak_flops *
    matmul_efficiency), bytes / (hbm_bandwidth * bandwidth_efficiency))``,
    and 0 for a step in which no lane runs.
  """
  flops = step_flops(model, new_tokens, context_tokens)
  nbytes = step_bytes(model, new_tokens, context_tokens)
  compute = flops / jnp.float32(
    hardware.peak_flops * hardware.matmul_efficiency
  )
  memory = nbytes / jnp.float32(
    hardware.hbm_bandwidth * hardware.bandwidth_efficiency
  )
  t = jnp.float32(hardware.step_overhead_s) + jnp.maximum(compute, memory)
  return jnp.where(_active(new_tokens), t, jnp.float32(0))


@dataclasses.dataclass(frozen=True)
class RooflineClock:
  """Step times from the roofline model (hashable: a jit static argument).

  Attributes:
    model: the model.
    hardware: the chip.

  Raises:
    TypeError: a field of the wrong type.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.configs import HardwareConfig, ModelConfig
    >>> clock = RooflineClock(ModelConfig.tiny(), HardwareConfig.h100())
    >>> idle = jnp.zeros(4, jnp.int32)
    >>> float(clock.step_time_s(idle, idle))
    0.0
  """

  model: ModelConfig
  hardware: HardwareConfig

  def __post_init__(self):
    if not isinstance(self.model, ModelConfig):
      raise TypeError(
        f"RooflineClock.model must be a ModelConfig, got {self.model!r}"
      )
    if not isinstance(self.hardware, HardwareConfig):
      raise TypeError(
        "RooflineClock.hardware must be a HardwareConfig, got "
        f"{self.hardware!r}"
      )

  def step_time_s(self, new_tokens, context_tokens) -> jax.Array:
    """:func:`step_time_s` of this model on this chip."""
    return step_time_s(self.model, self.hardware, new_tokens, context_tokens)


@dataclasses.dataclass(frozen=True)
class StepsClock:
  """A constant time per step, whatever the step runs (hashable).

  Unlike :class:`RooflineClock`, an all-padding step also costs
  ``seconds_per_step``: this clock counts steps.

  Attributes:
    seconds_per_step: seconds of every step, finite and > 0.

  Raises:
    TypeError: a field of the wrong type.
    ValueError: ``seconds_per_step`` not finite and > 0.
  """

  seconds_per_step: float

  def __post_init__(self):
    v = self.seconds_per_step
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise TypeError(
        f"StepsClock.seconds_per_step must be a number, got {v!r}"
      )
    if not (math.isfinite(v) and v > 0):
      raise ValueError(
        f"StepsClock.seconds_per_step={v!r} must be finite and > 0"
      )

  def step_time_s(self, new_tokens, context_tokens) -> jax.Array:
    """``seconds_per_step`` as float32 ``[...]`` (lanes ``[..., S]``)."""
    del context_tokens
    shape = jnp.shape(new_tokens)[:-1]
    return jnp.full(shape, self.seconds_per_step, jnp.float32)


@dataclasses.dataclass(frozen=True)
class FunctionClock:
  """A user-supplied step time: ``fn(new_tokens, context_tokens) -> s``.

  ``fn`` must be traceable (jnp ops on the ``[S]`` int32 lanes, padding
  lanes 0) and return a float32 scalar of seconds; it is a jit static
  argument, hashed by identity (one compile per function object).

  Example:
    >>> import jax.numpy as jnp
    >>> clock = FunctionClock(
    ...     lambda n, c: 1e-3 + 1e-6 * jnp.sum(n).astype(jnp.float32))
    >>> round(float(clock.step_time_s(jnp.array([3, 0]), jnp.zeros(2))), 6)
    0.001003
  """

  fn: object

  def __post_init__(self):
    if not callable(self.fn):
      raise TypeError(f"FunctionClock.fn must be callable, got {self.fn!r}")

  def step_time_s(self, new_tokens, context_tokens) -> jax.Array:
    return jnp.asarray(self.fn(new_tokens, context_tokens), jnp.float32)


def clock_seconds(clock, new_tokens, context_tokens) -> jax.Array:
  """``clock.step_time_s(new, context)`` as a float32 scalar; a clock that
  returns anything but one number is refused when the loop is traced."""
  dt = clock.step_time_s(new_tokens, context_tokens)
  shape = jnp.shape(dt)
  if shape != ():
    raise TypeError(
      f"the clock's step time must be one number of seconds per step, got "
      f"shape {shape} (from {clock!r})"
    )
  return jnp.asarray(dt, jnp.float32)
