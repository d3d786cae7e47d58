"""Host arrays onto the device, without compiling anything.

``jnp.asarray(numpy_array)`` outside ``jit`` is not a plain copy in jax
0.10: it binds ``lax.stage`` (``jax/_src/numpy/array_constructors.py``,
jax 0.10.2), and a dtype argument binds ``convert_element_type``; each is
a one-operation program, traced, lowered and compiled for every new shape
(10-20 ms each on a 2-core CPU, too small for the persistent compilation
cache to keep). Host preparation moves a dozen trace-sized arrays per
call, so the engines' host sides use :func:`to_device` instead.
"""

from __future__ import annotations

import jax
import numpy as np


def to_device(x, dtype=None) -> jax.Array:
  """``x`` (a numpy array, list or scalar) as an uncommitted device array
  on the default device, cast to ``dtype`` on the host first; the same
  value and dtype as ``jnp.asarray(x, dtype)`` (64-bit types narrowed
  unless x64 is on)."""
  return jax.device_put(np.asarray(x, dtype=dtype))
