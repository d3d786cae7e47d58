"""Backend choice for every kernel in one place.

Every public kernel takes ``backend`` and ``interpret`` and calls
:func:`resolve_backend` once, outside ``jax.jit``. The rule:

* ``backend="reference"``: the plain-``jnp`` reference, on any platform.
* ``backend="pallas_tpu"``: the TPU-style Pallas variant (scalar-prefetched
  block tables, BlockSpec pipelining, DMAs). Needs a TPU, or
  ``interpret=True`` (then it runs in JAX's TPU interpret mode, which simulates
  VMEM/SMEM, DMAs and semaphores on the CPU).
* ``backend="pallas_gpu"``: the GPU Pallas variant. Needs a GPU, or
  ``interpret=True`` (then it runs in Pallas's generic HLO interpreter).
* ``backend=None``: chosen from ``jax.default_backend()``: ``tpu`` ->
  ``pallas_tpu``, ``gpu`` -> ``pallas_gpu``, anything else -> the reference,
  with a logged message saying so (once per kernel and reason). With
  ``interpret=True`` (or inside ``pltpu.force_tpu_interpret_mode()``) on a
  platform without a Pallas compiler, ``None`` picks ``pallas_tpu`` in
  interpret mode, the most faithful CPU simulation.

``interpret=True`` for ``pallas_tpu`` means ``pltpu.InterpretParams()`` (JAX's
TPU interpret mode); an ``InterpretParams`` instance is passed through as is.
``pallas_tpu`` with ``interpret=False`` also runs on CPU inside
``pltpu.force_tpu_interpret_mode()``. For ``pallas_gpu`` any truthy
``interpret`` means Pallas's HLO interpreter.

JAX versions. What is available where:

* jax 0.10.2 (this project's floor, CPU CI): ``reference`` everywhere;
  ``pallas_tpu`` compiled on TPU and in TPU interpret mode on CPU
  (``pltpu.InterpretParams`` / ``pltpu.force_tpu_interpret_mode`` exist);
  ``pallas_gpu`` compiled through the Triton-style lowering on GPU and in the
  generic HLO interpreter (``interpret=True``) on CPU. Tests run every
  variant in interpret mode, and lower both compiled variants for their
  hardware with ``jax.export`` (``tests/test_kernels_lowering.py``).
* jax 0.11.2 and 0.12.0.1 (checked on CPU with ``jax.export`` for
  ``cuda``): JAX deprecates the Pallas Triton backend
  (``jax._src.deprecations`` id ``jax-pallas-triton``): lowering a Triton
  ``pallas_call`` emits a ``DeprecationWarning`` (:data:`TRITON_DEPRECATION`
  matches it) and still produces the Triton custom call. The GPU variants
  therefore live in their own subpackage, :mod:`pallas_kernels.gpu`, import
  nothing Triton-specific at module import time (``interpret=True`` never
  touches Triton), and are reached only through this module.
  Choosing the compiled ``pallas_gpu`` logs the deprecation once per kernel.
  If importing the Triton lowering fails or warns, or JAX accelerates the
  deprecation into an error (:func:`triton_available`), ``backend=None`` on
  a GPU falls back to the reference with a logged message instead of
  failing (the attention kernels keep ``pallas_gpu`` when the Mosaic GPU
  variant is chosen); ``backend="pallas_gpu"`` is still honoured.

GPU variants. ``backend="pallas_gpu"`` is served by one of
:data:`GPU_VARIANTS`: ``"triton"`` (the default, every kernel, in
:mod:`pallas_kernels.gpu`) or ``"mosaic"`` (:mod:`pallas_kernels.gpu_mosaic`:
the attention kernels through Mosaic GPU, TMA page gathers and WGMMA, for
float16 / bfloat16; the other kernels, and inputs the port does not
support, stay on the Triton-style variants). Chosen with
:func:`set_gpu_variant` or the environment variable
``PALLAS_KERNELS_GPU_VARIANT``. The Mosaic GPU port is checked on CPU only:
in JAX's GPU interpret mode (``interpret=True``) and by lowering for
``cuda`` with the CUDA plugin installed; it has not run on a GPU yet.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import warnings
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common

logger = logging.getLogger("pallas_kernels")

Backend = Literal["reference", "pallas_tpu", "pallas_gpu"]
BACKENDS: tuple[str, ...] = ("reference", "pallas_tpu", "pallas_gpu")

# Implementations of ``backend="pallas_gpu"``: the Triton-style variants
# (pallas_kernels/gpu) and the Mosaic GPU port (pallas_kernels/gpu_mosaic).
GPU_VARIANTS: tuple[str, ...] = ("triton", "mosaic")
GPU_VARIANT_ENV = "PALLAS_KERNELS_GPU_VARIANT"
# Public kernels the Mosaic GPU port serves (all three run the paged flash
# kernel of pallas_kernels.paged_attention.paged_flash).
MOSAIC_KERNELS = frozenset(
  {"paged_attention", "prefill_attention", "shared_prefix_attention"}
)
# Their modules in pallas_kernels/gpu_mosaic.
_MOSAIC_MODULES = frozenset({"paged_attention"})
_gpu_variant_choice: str | None = None


def _check_gpu_variant(name: Any, where: str) -> str:
  if name not in GPU_VARIANTS:
    raise ValueError(f"{where}={name!r} must be one of {GPU_VARIANTS}.")
  return name


def current_gpu_variant() -> str:
  """The GPU variant in force: :func:`set_gpu_variant`'s choice, else the
  environment variable ``PALLAS_KERNELS_GPU_VARIANT``, else ``"triton"``."""
  if _gpu_variant_choice is not None:
    return _gpu_variant_choice
  return _check_gpu_variant(
    os.environ.get(GPU_VARIANT_ENV, "triton"), GPU_VARIANT_ENV
  )


def set_gpu_variant(name: str) -> str:
  """Chooses the implementation of ``backend="pallas_gpu"``; returns the
  previous choice.

  ``"mosaic"`` serves the attention kernels through Mosaic GPU;
  ``"triton"`` everything through the Triton-style variants. The choice is
  read when a kernel is traced, so a change clears JAX's tracing caches
  (``jax.clear_caches()``): functions jitted before it, the caller's own
  included, are traced again with the new variant.
  """
  global _gpu_variant_choice
  _check_gpu_variant(name, "set_gpu_variant(name)")
  previous = current_gpu_variant()
  _gpu_variant_choice = name
  if name != previous:
    jax.clear_caches()
  return previous


def served_by_mosaic(kernel: str) -> bool:
  """Whether ``backend="pallas_gpu"`` runs ``kernel`` through Mosaic GPU."""
  return current_gpu_variant() == "mosaic" and kernel in MOSAIC_KERNELS


def gpu_variant(kernel: str) -> Any:
  """The module that implements ``kernel`` for ``backend="pallas_gpu"``.

  Every kernel reaches its GPU variant through here. The module exposes
  ``*_unbatched`` functions with the TPU variant's signature. Kernels
  without a Mosaic GPU port use the Triton-style module whatever the
  variant.
  """
  if current_gpu_variant() == "mosaic" and kernel in _MOSAIC_MODULES:
    return importlib.import_module(f"pallas_kernels.gpu_mosaic.{kernel}")
  return importlib.import_module(f"pallas_kernels.gpu.{kernel}")


@functools.cache
def _log_once(kernel: str, message: str) -> None:
  logger.warning("pallas_kernels.%s: %s", kernel, message)


def log_once(kernel: str, message: str) -> None:
  """Logs a kernel's message (a fallback, a deprecation) once a process."""
  _log_once(kernel, message)


# JAX's message when a Triton-lowered pallas_call is compiled (jax 0.11.2,
# 0.12.0.1: jax/_src/pallas/triton/pallas_call_registration.py).
TRITON_DEPRECATION = re.compile(r"Pallas Triton backend is deprecated")
_TRITON_DEPRECATION_ID = "jax-pallas-triton"


def triton_deprecation() -> str | None:
  """How this jax treats the Pallas Triton backend.

  ``None``: not deprecated (jax 0.10.2); ``"warns"``: a
  ``DeprecationWarning`` at lowering (jax 0.11.2, 0.12.0.1);
  ``"error"``: the deprecation is accelerated, lowering raises. Reads
  JAX's private deprecation registry; ``None`` if that moved.
  """
  try:
    from jax._src import deprecations
  except ImportError:
    return None
  registry = getattr(deprecations, "_registered_deprecations", {})
  if _TRITON_DEPRECATION_ID not in registry:
    return None
  try:
    accelerated = deprecations.is_accelerated(_TRITON_DEPRECATION_ID)
  except Exception:  # noqa: BLE001 - private API; assume the mild form.
    accelerated = False
  return "error" if accelerated else "warns"


@functools.cache
def triton_available() -> bool:
  """Whether the Triton-style GPU lowering imports without warnings and its
  deprecation (if any) is not accelerated into an error."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      from jax.experimental.pallas import triton  # noqa: F401
  except Exception:  # noqa: BLE001 - any failure means "not usable".
    return False
  return triton_deprecation() != "error"


def gpu_compiler_params(**kwargs: Any) -> Any:
  """Compiler params for the Triton-style GPU lowering (compiled runs only)."""
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(**kwargs)


def forced_tpu_interpret() -> bool:
  """Whether ``pltpu.force_tpu_interpret_mode()`` is active here.

  Under that context manager every ``pallas_call`` traced runs in TPU
  interpret mode, so ``pallas_tpu`` works on CPU even with
  ``interpret=False``. Reads a private config; ``False`` if it moved.
  """
  try:
    from jax._src import config as jax_config

    state = jax_config.pallas_tpu_interpret_mode_context_manager
    return state.value is not None
  except Exception:  # noqa: BLE001 - private API; absent means "not forced".
    return False


def resolve_backend(
  backend: str | None, interpret: Any, *, kernel: str
) -> tuple[str, Any]:
  """Chooses the variant to run and the value for ``pallas_call(interpret=)``.

  Args:
    backend: ``None``, ``"reference"``, ``"pallas_tpu"`` or ``"pallas_gpu"``.
    interpret: ``False``, ``True``, or a ready-made interpret-params object
      (e.g. ``pltpu.InterpretParams(...)``) passed through to ``pallas_call``.
    kernel: the public kernel's name, for messages.

  Returns:
    ``(backend, interpret_value)``: a concrete backend name and a hashable
    value to pass as ``pallas_call(interpret=...)`` (``False`` when compiled;
    ``None`` for the reference).

  Raises:
    ValueError: an unknown backend, or a Pallas backend on a platform that
      cannot compile it without ``interpret=True``.
    TypeError: ``interpret`` a number or string (``0`` would read as an
      interpret-params object).
  """
  if backend is not None and backend not in BACKENDS:
    raise ValueError(
      f"{kernel}: backend={backend!r} must be None or one of {BACKENDS}."
    )
  if isinstance(interpret, (bool, np.bool_)):
    interpret = bool(interpret)
  elif interpret is not None and isinstance(interpret, (int, float, str)):
    raise TypeError(
      f"{kernel}: interpret={interpret!r} must be a bool, None or an "
      "interpret-params object (e.g. pltpu.InterpretParams())"
    )
  platform = jax.default_backend()
  wants_interpret = interpret is not False and interpret is not None
  forced = forced_tpu_interpret()
  if backend is None:
    if platform == "tpu":
      backend = "pallas_tpu"
    elif platform == "gpu" and (
      wants_interpret or triton_available() or served_by_mosaic(kernel)
    ):
      backend = "pallas_gpu"
    elif wants_interpret or forced:
      backend = "pallas_tpu"
    else:
      reason = (
        "the Triton-style GPU lowering is unavailable on this jax"
        if platform == "gpu"
        else f"no Pallas compiler for platform {platform!r}"
      )
      _log_once(kernel, f"{reason}; falling back to the jnp reference.")
      backend = "reference"
  if backend == "reference":
    return backend, None
  if backend == "pallas_tpu":
    if wants_interpret:
      if interpret is True:
        interpret = pltpu.InterpretParams()
      return backend, interpret
    if platform != "tpu" and not forced:
      raise ValueError(
        f"{kernel}: backend='pallas_tpu' needs a TPU or interpret=True; "
        f"jax.default_backend()={platform!r}."
      )
    return backend, False
  # pallas_gpu
  if wants_interpret:
    return backend, True
  if platform != "gpu":
    raise ValueError(
      f"{kernel}: backend='pallas_gpu' needs a GPU or interpret=True; "
      f"jax.default_backend()={platform!r}."
    )
  if triton_deprecation() is not None and not served_by_mosaic(kernel):
    _log_once(
      kernel,
      f"compiled through the Pallas Triton backend, which jax "
      f"{jax.__version__} deprecates (JAX warns when it compiles); no "
      "Mosaic GPU port of this kernel exists yet (the attention kernels "
      "have one: set_gpu_variant('mosaic')). backend='reference' avoids it.",
    )
  return backend, False


def reference_when_empty(
  chosen: tuple[str, Any], *arrays: Any
) -> tuple[str, Any]:
  """``chosen`` (from :func:`resolve_backend`), or the reference when any of
  ``arrays`` has no elements.

  A Pallas grid over zero rows cannot be launched (its index maps read past
  empty scalar-prefetch buffers); the reference returns the empty or
  unchanged result exactly, at no cost.
  """
  if any(getattr(a, "size", 1) == 0 for a in arrays):
    return "reference", None
  return chosen


_INT32_MAX = int(np.iinfo(np.int32).max)

# Bytes ratio (naive paged decode / shared-prefix) above which the shared
# path is chosen. The shared path costs a second launch, a gather of the
# queries per group and an LSE merge, so it must save a clear margin of
# traffic. 2.0 is a conservative placeholder until `benchmarks/kernels.py`'s
# group-size sweep is run on the target device: set it to the smallest bytes
# ratio at which the sweep shows the shared path faster.
SHARED_PREFIX_MIN_BYTES_RATIO = 2.0


def prefer_shared_prefix(
  group_of: Any,
  prefix_lengths: Any,
  suffix_lengths: Any,
  *,
  page_size: int,
  min_bytes_ratio: float = SHARED_PREFIX_MIN_BYTES_RATIO,
) -> Any:
  """Whether ``shared_prefix_attention`` should replace naive paged decode.

  Compares the pages each path reads (bytes model with unique pages counted
  once): naive decode reads every request's prefix and suffix pages; the
  shared path reads each non-empty group's prefix pages once plus the
  suffixes. Works on numpy or traced ``jnp`` arrays (use the result in
  ``lax.cond`` under ``jit``).

  Args:
    group_of: int32 ``[B]`` group of each request.
    prefix_lengths: int32 ``[G]`` prefix tokens per group (whole pages).
    suffix_lengths: int32 ``[B]`` private tokens per request.
    page_size: tokens per page ``K``.
    min_bytes_ratio: choose the shared path at or above this ratio.

  Returns:
    A boolean scalar (``jnp`` array).

  Raises:
    ValueError: arrays of the wrong rank, shape or dtype (integers are
      required), concrete group ids outside ``[0, G)``, negative lengths, or
      ``min_bytes_ratio`` not a finite positive number.
    TypeError: ``page_size`` not an int.
  """
  import jax.numpy as jnp

  page_size = _common.check_page_size(page_size)
  if isinstance(min_bytes_ratio, (bool, np.bool_)) or not isinstance(
    min_bytes_ratio, (int, float, np.number)
  ):
    raise TypeError(f"min_bytes_ratio={min_bytes_ratio!r} must be a number.")
  if not (np.isfinite(min_bytes_ratio) and min_bytes_ratio > 0):
    raise ValueError(
      f"min_bytes_ratio={min_bytes_ratio!r} must be finite and positive."
    )
  arrays = {}
  for name, value, layout in (
    ("group_of", group_of, "[B]"),
    ("prefix_lengths", prefix_lengths, "[G]"),
    ("suffix_lengths", suffix_lengths, "[B]"),
  ):
    if not hasattr(value, "dtype"):
      value = np.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{name}.dtype={value.dtype} must be an integer type.")
    _common.check_rank(name, value, 1, layout)
    if _common.is_concrete(value):
      host = _common.host(value)
      if host.size and (
        host.min() < np.iinfo(np.int32).min or host.max() > _INT32_MAX
      ):
        raise ValueError(f"{name} has values outside int32.")
      if name != "group_of" and host.size and host.min() < 0:
        raise ValueError(f"{name} has negative values {host.min()}.")
    arrays[name] = value
  group_of, prefix_lengths, suffix_lengths = arrays.values()
  _common.check_shape(
    "suffix_lengths", suffix_lengths, group_of.shape, "one per request"
  )
  _common.check_range("group_of", group_of, 0, prefix_lengths.shape[0])
  group_of = jnp.asarray(group_of, jnp.int32)
  prefix_pages = jnp.asarray(prefix_lengths, jnp.int32) // page_size
  suffix_pages = (jnp.asarray(suffix_lengths, jnp.int32) + page_size - 1) // (
    page_size
  )
  members = jnp.zeros(prefix_pages.shape, jnp.int32).at[group_of].add(1)
  naive = jnp.sum(prefix_pages[group_of]) + jnp.sum(suffix_pages)
  shared = jnp.sum(jnp.where(members > 0, prefix_pages, 0)) + jnp.sum(
    suffix_pages
  )
  shared = jnp.maximum(shared, 1)
  ratio = naive.astype(jnp.float32) / shared.astype(jnp.float32)
  return ratio >= min_bytes_ratio
