"""Model and accelerator descriptions for the serving cost model.

Plain frozen dataclasses of numbers (no JAX): a Llama-style decoder
(:class:`ModelConfig`: RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP, no biases) and an accelerator chip (:class:`HardwareConfig`),
with named presets (``MODELS``, ``HARDWARE``) that
:mod:`prefixjax.serving.roofline` prices engine steps with.

Parameter count of :class:`ModelConfig` (``d`` = ``hidden_size``, ``q`` =
``num_heads * head_dim``, ``kv`` = ``num_kv_heads * head_dim``, ``f`` =
``intermediate_size``, ``V`` = ``vocab_size``, ``N`` = ``num_layers``)::

  per layer  = d*q + 2*d*kv + q*d      (q, k, v, o projections)
             + 3*d*f                   (SwiGLU gate, up, down)
             + 2*d                     (two RMSNorm weights)
  num_params = V*d + N*per_layer + d + (0 if tie_embeddings else V*d)

which gives 6.74e9 (Llama-2-7B), 8.03e9 (Llama-3-8B) and 70.6e9
(Llama-3-70B), the published counts.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
  "DTYPE_BYTES",
  "HARDWARE",
  "MODELS",
  "HardwareConfig",
  "ModelConfig",
  "hardware_config",
  "model_config",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_GIB = float(2**30)


def _int_at_least_1(cls: str, name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{cls}.{name} must be an int, got {value!r}")
  if value < 1:
    raise ValueError(f"{cls}.{name}={value} must be >= 1")


def _positive_float(cls: str, name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{cls}.{name} must be a number, got {value!r}")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{cls}.{name}={value!r} must be finite and > 0")
  # The roofline computes in float32: 1e-50 would become 0 there.
  if not _F32_TINY <= value <= _F32_MAX:
    raise ValueError(
      f"{cls}.{name}={value!r} must be within float32's normal range "
      f"[{_F32_TINY:.3g}, {_F32_MAX:.3g}] (the roofline computes in float32)"
    )


_F32_TINY = 2.0**-126  # numpy.finfo(numpy.float32).tiny
_F32_MAX = (2 - 2.0**-23) * 2.0**127  # numpy.finfo(numpy.float32).max


def _name_field(cls: str, value) -> None:
  if not isinstance(value, str) or not value:
    raise TypeError(f"{cls}.name must be a non-empty str, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-style decoder-only transformer.

  Attributes:
    name: label of the model.
    num_layers: decoder layers ``N``.
    hidden_size: residual width ``d``.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention); divides
      ``num_heads``.
    head_dim: width of one head.
    intermediate_size: SwiGLU hidden width ``f``.
    vocab_size: vocabulary ``V``.
    dtype: weight and KV-cache dtype, one of ``DTYPE_BYTES``.
    tie_embeddings: whether the LM head is the input embedding table.
    rope_theta: rotary base frequency.
    rms_norm_eps: RMSNorm epsilon.

  Raises:
    TypeError: a field of the wrong type.
    ValueError: a rule broken; the message names the field and the rule.

  Example:
    >>> from prefixjax.configs import ModelConfig
    >>> ModelConfig.tiny().kv_bytes_per_token
    512
  """

  name: str
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  vocab_size: int
  dtype: str = "bfloat16"
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5

  def __post_init__(self):
    _name_field("ModelConfig", self.name)
    for name in (
      "num_layers",
      "hidden_size",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
      "vocab_size",
    ):
      _int_at_least_1("ModelConfig", name, getattr(self, name))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
      )
    if not isinstance(self.dtype, str):
      raise TypeError(f"ModelConfig.dtype must be a str, got {self.dtype!r}")
    if self.dtype not in DTYPE_BYTES:
      raise ValueError(
        f"ModelConfig.dtype={self.dtype!r} must be one of {tuple(DTYPE_BYTES)}"
      )
    if not isinstance(self.tie_embeddings, bool):
      raise TypeError(
        "ModelConfig.tie_embeddings must be a bool, got "
        f"{self.tie_embeddings!r}"
      )
    _positive_float("ModelConfig", "rope_theta", self.rope_theta)
    _positive_float("ModelConfig", "rms_norm_eps", self.rms_norm_eps)

  @property
  def dtype_bytes(self) -> int:
    """Bytes of one weight or KV element."""
    return DTYPE_BYTES[self.dtype]

  @property
  def embedding_params(self) -> int:
    """The input embedding table ``V * d``."""
    return self.vocab_size * self.hidden_size

  @property
  def layer_params(self) -> int:
    """One decoder layer: attention projections, SwiGLU, two RMSNorms."""
    d, f = self.hidden_size, self.intermediate_size
    q = self.num_heads * self.head_dim
    kv = self.num_kv_heads * self.head_dim
    return d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d

  @property
  def num_params(self) -> int:
    """All weights: embedding, layers, final norm, LM head unless tied."""
    lm_head = 0 if self.tie_embeddings else self.embedding_params
    return (
      self.embedding_params
      + self.num_layers * self.layer_params
      + self.hidden_size
      + lm_head
    )

  @property
  def num_nonembedding_params(self) -> int:
    """The weights one token's matmuls touch: all but the embedding lookup.

    Layers, final norm and the LM head (``V * d``, counted whether or not
    it is tied to the embedding table, since the head matmul reads it).
    """
    return (
      self.num_layers * self.layer_params
      + self.hidden_size
      + self.embedding_params
    )

  @property
  def kv_bytes_per_token(self) -> int:
    """KV-cache bytes of one token: ``2 * N * num_kv_heads * head_dim * B``."""
    return (
      2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
    )

  @property
  def weight_bytes(self) -> int:
    """Bytes of all weights, ``num_params * dtype_bytes``."""
    return self.num_params * self.dtype_bytes

  @classmethod
  def tiny(cls) -> ModelConfig:
    """A 2-layer float32 toy (about 0.1 M parameters) for CPU tests."""
    return cls(
      name="tiny",
      num_layers=2,
      hidden_size=64,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      intermediate_size=128,
      vocab_size=256,
      dtype="float32",
    )

  @classmethod
  def llama2_7b(cls) -> ModelConfig:
    """Llama-2-7B: 6.74e9 parameters, multi-head attention."""
    # Hugging Face meta-llama/Llama-2-7b-hf, config.json: hidden_size 4096,
    # intermediate_size 11008, num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 32, vocab_size 32000, rms_norm_eps 1e-05,
    # rope_theta 10000 (default), tie_word_embeddings false.
    return cls(
      name="llama2_7b",
      num_layers=32,
      hidden_size=4096,
      num_heads=32,
      num_kv_heads=32,
      head_dim=128,
      intermediate_size=11008,
      vocab_size=32000,
      rope_theta=10000.0,
      rms_norm_eps=1e-5,
    )

  @classmethod
  def llama3_8b(cls) -> ModelConfig:
    """Llama-3-8B: 8.03e9 parameters, 8 KV heads."""
    # Hugging Face meta-llama/Meta-Llama-3-8B, config.json: hidden_size
    # 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, vocab_size 128256,
    # rope_theta 500000.0, rms_norm_eps 1e-05, tie_word_embeddings false.
    return cls(
      name="llama3_8b",
      num_layers=32,
      hidden_size=4096,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      intermediate_size=14336,
      vocab_size=128256,
      rope_theta=500000.0,
      rms_norm_eps=1e-5,
    )

  @classmethod
  def llama3_70b(cls) -> ModelConfig:
    """Llama-3-70B: 70.6e9 parameters, 8 KV heads."""
    # Hugging Face meta-llama/Meta-Llama-3-70B, config.json: hidden_size
    # 8192, intermediate_size 28672, num_hidden_layers 80,
    # num_attention_heads 64, num_key_value_heads 8, vocab_size 128256,
    # rope_theta 500000.0, rms_norm_eps 1e-05, tie_word_embeddings false.
    return cls(
      name="llama3_70b",
      num_layers=80,
      hidden_size=8192,
      num_heads=64,
      num_kv_heads=8,
      head_dim=128,
      intermediate_size=28672,
      vocab_size=128256,
      rope_theta=500000.0,
      rms_norm_eps=1e-5,
    )


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
  """One accelerator chip, as the roofline model sees it.

  Attributes:
    name: label of the chip.
    peak_flops: dense BF16 matmul peak, FLOP/s.
    hbm_bandwidth: HBM bandwidth, bytes/s.
    hbm_bytes: HBM capacity, bytes (informational: the time model does not
      read it).
    step_overhead_s: fixed seconds added to every engine step that runs a
      token. The default 1 ms is an *assumption*, not a measurement: an
      order-of-magnitude allowance for the engine's per-step host work
      (scheduling, input preparation, sampling) and kernel launches.
    matmul_efficiency: fraction of ``peak_flops`` reached, in (0, 1].
    bandwidth_efficiency: fraction of ``hbm_bandwidth`` reached, in (0, 1].

  Raises:
    TypeError: a field of the wrong type.
    ValueError: a rule broken; the message names the field and the rule.

  Example:
    >>> from prefixjax.configs import HardwareConfig
    >>> HardwareConfig.h100().hbm_bandwidth
    3350000000000.0
  """

  name: str
  peak_flops: float
  hbm_bandwidth: float
  hbm_bytes: float
  step_overhead_s: float = 1e-3
  matmul_efficiency: float = 1.0
  bandwidth_efficiency: float = 1.0

  def __post_init__(self):
    _name_field("HardwareConfig", self.name)
    for name in ("peak_flops", "hbm_bandwidth", "hbm_bytes"):
      _positive_float("HardwareConfig", name, getattr(self, name))
    v = self.step_overhead_s
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise TypeError(
        f"HardwareConfig.step_overhead_s must be a number, got {v!r}"
      )
    if not (math.isfinite(v) and v >= 0):
      raise ValueError(
        f"HardwareConfig.step_overhead_s={v!r} must be finite and >= 0"
      )
    for name in ("matmul_efficiency", "bandwidth_efficiency"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"HardwareConfig.{name} must be a number, got {v!r}")
      if not 0 < v <= 1:
        raise ValueError(f"HardwareConfig.{name}={v!r} must be in (0, 1]")

  @classmethod
  def h100(cls) -> HardwareConfig:
    """NVIDIA H100 SXM5 80 GB."""
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 Tensor
    # Core 1,979 TFLOPS *with sparsity*, so 989 TFLOPS dense; GPU memory
    # 80 GB HBM3 (80 GiB of HBM stacks); 3.35 TB/s memory bandwidth.
    return cls(
      name="h100",
      peak_flops=989e12,
      hbm_bandwidth=3.35e12,
      hbm_bytes=80 * _GIB,
    )

  @classmethod
  def h200(cls) -> HardwareConfig:
    """NVIDIA H200 SXM 141 GB."""
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 Tensor
    # Core 1,979 TFLOPS with sparsity (989 dense); 141 GB HBM3e; 4.8 TB/s.
    return cls(
      name="h200",
      peak_flops=989e12,
      hbm_bandwidth=4.8e12,
      hbm_bytes=141e9,
    )

  @classmethod
  def tpu_v5e(cls) -> HardwareConfig:
    """Google Cloud TPU v5e, one chip."""
    # Google Cloud TPU docs, "TPU v5e", system architecture: peak compute
    # per chip (bf16) 197 TFLOPs; HBM2 capacity and bandwidth 16 GB,
    # 819 GBps (capacity taken as 16 GiB, the size of the HBM stacks).
    return cls(
      name="tpu_v5e",
      peak_flops=197e12,
      hbm_bandwidth=819e9,
      hbm_bytes=16 * _GIB,
    )

  @classmethod
  def tpu_v5p(cls) -> HardwareConfig:
    """Google Cloud TPU v5p, one chip."""
    # Google Cloud TPU docs, "TPU v5p", system architecture: peak compute
    # per chip (bf16) 459 TFLOPs; HBM2e capacity and bandwidth 95 GB,
    # 2765 GBps (capacity taken as 95 GiB).
    return cls(
      name="tpu_v5p",
      peak_flops=459e12,
      hbm_bandwidth=2765e9,
      hbm_bytes=95 * _GIB,
    )

  @classmethod
  def tpu_v6e(cls) -> HardwareConfig:
    """Google Cloud TPU v6e (Trillium), one chip."""
    # Google Cloud TPU docs, "TPU v6e" (Trillium), system architecture:
    # peak compute per chip (bf16) 918 TFLOPs; HBM capacity per chip 32 GB
    # (taken as 32 GiB); HBM bandwidth per chip 1640 GBps (later revisions
    # of the page print 1638 GBps; the 0.1 % does not matter here).
    return cls(
      name="tpu_v6e",
      peak_flops=918e12,
      hbm_bandwidth=1640e9,
      hbm_bytes=32 * _GIB,
    )


MODELS: dict[str, ModelConfig] = {
  m.name: m
  for m in (
    ModelConfig.tiny(),
    ModelConfig.llama2_7b(),
    ModelConfig.llama3_8b(),
    ModelConfig.llama3_70b(),
  )
}

HARDWARE: dict[str, HardwareConfig] = {
  h.name: h
  for h in (
    HardwareConfig.h100(),
    HardwareConfig.h200(),
    HardwareConfig.tpu_v5e(),
    HardwareConfig.tpu_v5p(),
    HardwareConfig.tpu_v6e(),
  )
}


def _lookup(kind: str, registry: dict, name):
  if not isinstance(name, str) or name not in registry:
    raise ValueError(
      f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}"
    )
  return registry[name]


def model_config(name: str) -> ModelConfig:
  """The preset model called ``name`` (a key of ``MODELS``).

  Raises:
    ValueError: an unknown name; the message lists the known ones.
  """
  return _lookup("model", MODELS, name)


def hardware_config(name: str) -> HardwareConfig:
  """The preset chip called ``name`` (a key of ``HARDWARE``).

  Raises:
    ValueError: an unknown name; the message lists the known ones.
  """
  return _lookup("hardware", HARDWARE, name)
