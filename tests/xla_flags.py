"""XLA flags for the test suite's processes (conftest, subprocesses, kernels).

The suite is compile-bound: on the 2-core machine three quarters of
``tests/test_routing.py``'s time was XLA:CPU's backend compile (a
``jax.monitoring`` listener on ``backend_compile_duration``, 2026-12-06,
jax 0.10.2). XLA:CPU's MLIR fusion emitters were a fifth of that compile
(``perf``: ``xla::cpu::FusionCompiler``); its older elemental emitters
build the same programs faster (``xla_cpu_use_fusion_emitters=false``: a
cluster program 6.3-6.5 s -> 4.9-5.1 s, test_routing 235 s -> 180 s) and
the tests check results, not speed. XLA aborts the process on a flag it does
not know, so the flag is used only where a probe process accepts it (a jax
whose XLA dropped it then compiles as before).
"""

from __future__ import annotations

import os
import subprocess
import sys

# The flags the suite's processes add to XLA_FLAGS ("" when the probe
# refused them, or when the suite runs optimised programs); set once by the
# controller and inherited by the workers and every subprocess.
ENV = "PREFIXJAX_TEST_XLA_FLAGS"
FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"
_DEVICES = "--xla_force_host_platform_device_count"


def accepted(flags: str) -> bool:
  """Whether a fresh process with these XLA_FLAGS starts a CPU backend."""
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  probe = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"],
    env=env,
    capture_output=True,
    timeout=120,
  )
  return probe.returncode == 0


def extra() -> str:
  """The suite's extra XLA flags (see :data:`ENV`)."""
  return os.environ.get(ENV, "")


def with_devices(count: int | None) -> str:
  """XLA_FLAGS for a subprocess: ``count`` fake CPU devices (none when
  ``None``: jax's default of one) plus the suite's extra flags."""
  parts = [] if count is None else [f"{_DEVICES}={count}"]
  if extra():
    parts.append(extra())
  return " ".join(parts)
