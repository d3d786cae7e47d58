"""Argument checks shared by the public entry points (host side only)."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value, low: int, high: int | None = None) -> int:
  """``value`` as a Python int, refused unless an int in ``[low, high)``.

  Raises:
    TypeError: ``value`` is not an int (bools are refused too).
    ValueError: it is below ``low`` or, with ``high``, not below ``high``;
      the message names ``name`` and the value.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r}")
  if value < low or (high is not None and value >= high):
    rng = f">= {low}" if high is None else f"in [{low}, {high})"
    raise ValueError(f"{name}={value} must be {rng}")
  return int(value)


def check_block_size(value) -> int:
  """``block_size`` as a Python int; refused unless an int in ``[1, 2**31)``
  (token counts and slot ids are int32 on the device).

  Raises:
    TypeError: not an int (bools are refused too).
    ValueError: below 1, or 2**31 or more.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"block_size={value!r} must be an int")
  if value < 1:
    raise ValueError(f"block_size={value} must be >= 1")
  if value >= 2**31:
    raise ValueError(
      f"block_size={value} must be < 2**31 (token counts are int32 on the "
      "device)"
    )
  return int(value)


def memory_limit_bytes() -> tuple[int, str] | None:
  """The default device's memory (an accelerator's ``bytes_limit``), else
  this host's physical memory; ``None`` when neither can be read."""
  import jax

  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - CPU devices may not report at all
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"the {jax.devices()[0].device_kind}"
  try:
    import os

    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return None
  return int(pages) * int(size), "this host"


def check_fits_in_memory(what: str, nbytes: int, copies: int = 1) -> None:
  """Refuses work whose arrays alone would not fit in memory.

  A run that would not fit was killed by the kernel's out-of-memory
  killer (no message at all) or failed with a bare MemoryError; this names
  the argument that sized it before anything is allocated. ``copies``: how
  many copies of the arrays the work holds at once at least (a jitted call
  without donation holds its input and its result: 2).

  Raises:
    ValueError: ``copies * nbytes`` exceeds the memory
      :func:`memory_limit_bytes` reports.
  """
  limit = memory_limit_bytes()
  if limit is not None and copies * nbytes > limit[0]:
    times = "" if copies == 1 else f" (held {copies} times at once)"
    raise ValueError(
      f"{what} needs about {copies * nbytes / 2**30:,.1f} GiB for its arrays "
      f"alone{times}, more than the {limit[0] / 2**30:,.1f} GiB of {limit[1]}"
    )
