"""Test configuration shared by the whole suite.

Strict numerics: implicit rank promotion raises and dtype promotion is strict,
so a test fails when library code relies on silent broadcasting or upcasting.
Warnings are errors (see ``filterwarnings`` in ``pyproject.toml``).
"""

import os

import xla_flags  # tests/xla_flags.py

# PREFIXJAX_TEST_OPTIMIZED=1 runs the suite on fully optimised programs.
_ON = ("1", "true", "yes")
_OPTIMIZED = os.environ.get("PREFIXJAX_TEST_OPTIMIZED", "") in _ON
# The controller decides the suite's extra XLA flags once (a probe process);
# workers and subprocesses inherit the decision.
if xla_flags.ENV not in os.environ:
  fast = xla_flags.FAST_COMPILE
  os.environ[xla_flags.ENV] = (
    fast if not _OPTIMIZED and xla_flags.accepted(fast) else ""
  )
# Several fake CPU devices for sharding tests; must be set before jax imports.
os.environ.setdefault("XLA_FLAGS", xla_flags.with_devices(8))
# Compiling is most of the suite's time on a 2-core CI machine, and the
# tests check results, not speed: XLA's backend optimisations off
# (jax_disable_most_optimizations; inherited by the subprocesses and the
# notebooks' kernels) cut a measured 19% of the wall time (test_routing,
# test_engine_checkpoint and test_serving_batch: 352 s -> 286 s, 2026-12-02).
if not _OPTIMIZED:
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Tests that call the CLI in this process must not fill the user's cache
# folders; the compile- and trace-cache tests pass their own explicitly.
os.environ.setdefault("PREFIXJAX_TRACE_CACHE", "off")
# One compilation cache for this run only, in a fresh temporary folder that
# the pytest-xdist workers and the CLI subprocesses inherit (the controller
# imports this file first and sets the variables; workers see them set).
# The same programs are compiled again and again across modules (jax's
# in-memory caches are dropped after each module, below) and across
# workers; the persistent cache gives back the executable XLA built for
# the same program, so the results are those of a fresh compile.
# PREFIXJAX_TEST_COMPILE_CACHE=off compiles everything afresh.
_RUN_CACHE = "PREFIXJAX_TEST_RUN_CACHE"
_OWN_RUN_CACHE = None  # the folder this process made, removed at its end
if os.environ.get("PREFIXJAX_TEST_COMPILE_CACHE", "") in ("0", "off", "no"):
  os.environ.setdefault("PREFIXJAX_COMPILE_CACHE", "off")
elif _RUN_CACHE not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
  import tempfile

  os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="prefixjax-test-jax-")
  _OWN_RUN_CACHE = os.environ[_RUN_CACHE]
if os.environ.get(_RUN_CACHE):
  os.environ.setdefault("PREFIXJAX_COMPILE_CACHE", os.environ[_RUN_CACHE])
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_RUN_CACHE])
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
else:
  os.environ.setdefault("PREFIXJAX_COMPILE_CACHE", "off")

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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module.

  The whole suite compiles thousands of XLA:CPU programs in one process; on
  the 2-core CI machine (2026-11-30, jax 0.10.2) a compile late in the run
  crashed (segfault, then abort, twice at the same test) while every module
  passed in smaller runs. Releasing the programs between modules keeps the
  process's JIT memory bounded. (The likely cause, session 33: XLA:CPU holds
  about a thousand memory mappings per compiled program, and Linux's
  ``vm.max_map_count`` limit of 65,530 is reached after about 50 serving
  programs; the run functions now also drop the programs themselves past
  half the limit, ``prefixjax._host.release_compiled_near_map_limit``.)
  """
  yield
  jax.clear_caches()


def pytest_unconfigure(config):
  """The controller removes this run's compilation cache at the end."""
  if _OWN_RUN_CACHE:
    import shutil

    shutil.rmtree(_OWN_RUN_CACHE, ignore_errors=True)
