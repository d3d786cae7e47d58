"""Test configuration shared by the whole suite.

Strict numerics: implicit rank promotion raises and dtype promotion is strict,
so a test fails when library code relies on silent broadcasting or upcasting.
Warnings are errors (see ``filterwarnings`` in ``pyproject.toml``).
"""

import os

# Several fake CPU devices for sharding tests; must be set before jax imports.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def rng(request):
  """A numpy Generator seeded freshly per test case (printed on failure)."""
  import numpy as np

  seed = int.from_bytes(os.urandom(4), "little")
  request.node.user_properties.append(("seed", seed))
  print(f"rng seed: {seed}")
  return np.random.default_rng(seed)
