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
