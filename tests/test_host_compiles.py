"""Host preparation compiles only the engines' own programs.

Outside ``jit``, ``jnp.asarray(numpy_array)`` and every eager array
constructor (``jnp.zeros``, ``.at[].set``, ``jnp.stack``) compile a
one-operation program per new shape in jax 0.10 (10-20 ms each, and too
small for the persistent cache); a warm ``prefixjax replay`` of the 12
Mooncake points compiled ten of them (1.83 s before, 1.69 s after, medians
of 10 whole processes, benchmarks/RESULTS.md). These tests
watch JAX's own compile log (``jax.log_compiles``) during one call on a
trace of a random size, after ``jax.clear_caches()`` (bucketed shapes
make a program an earlier test compiled likely; the replay frame's
own executables are dropped too), and fail on any
compiled program that is not one of ours.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import prefixjax
import prefixjax as pj
from prefixjax import _host
from prefixjax import replay as rp
from prefixjax.routing import simulate_cluster
from prefixjax.serving import ServingConfig, simulate

# Every program JAX compiles is logged as ``Compiling jit(<name>) ...``.
_COMPILING = re.compile(r"Compiling jit\((\w+)\)")


def _compiled(caplog, fn) -> list[str]:
  # Bucketed shapes (powers of two) make a program compiled by an earlier
  # test in this worker likely; drop every in-process cache (JAX's and the
  # replay frame's compiled executables) so the call compiles (and logs)
  # all of its programs again.
  _host.release_compiled()
  caplog.clear()
  with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
    fn()
  return _COMPILING.findall(caplog.text)


@functools.cache
def _our_names() -> frozenset[str]:
  """Names of the functions defined in prefixjax's sources, less those
  that are also jax.numpy / jax.lax names (``scatter``, ``add``, ...)."""
  root = pathlib.Path(prefixjax.__file__).parent
  defs = set()
  for path in root.rglob("*.py"):
    defs |= set(re.findall(r"^\s*def (\w+)\(", path.read_text(), re.M))
  return frozenset(defs - set(dir(jnp)) - set(dir(jax.lax)))


def _one_op(names: list[str]) -> list[str]:
  """The compiled names that are not prefixjax functions (a primitive or
  a jnp function compiled alone)."""
  return [n for n in names if n not in _our_names()]


@pytest.fixture
def fresh(rng):
  """A workload of a random size, so its shapes are most likely new to
  this process (a program compiled for them earlier would hide a
  regression here, never fail a correct build)."""
  n = int(rng.integers(41, 97))
  return pj.default_workload(num_requests=n, seed=int(rng.integers(1000)))


def _config(**kw):
  base = dict(
    num_gpu_blocks=257,
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    max_model_len=4096,
  )
  return ServingConfig(**{**base, **kw})


def test_simulate_vllm_compiles_only_its_programs(caplog, fresh):
  names = _compiled(caplog, lambda: simulate(fresh, _config()))
  assert names, "the compile log was not captured"
  assert _one_op(names) == [], names


def test_simulate_sglang_compiles_only_its_programs(caplog, fresh):
  names = _compiled(
    caplog,
    lambda: simulate(fresh, _config(semantics="sglang", max_model_len=2048)),
  )
  assert names, "the compile log was not captured"
  assert _one_op(names) == [], names


@pytest.mark.parametrize(
  "semantics, policy",
  [
    ("kvcache-sim", "fifo"),
    ("kvcache-sim", "lru_leaf"),
    ("kvcache-sim", "belady_leaf"),
    ("vllm", None),
    ("sglang", None),
  ],
)
def test_replay_compiles_only_its_programs(
  caplog, fresh, semantics, policy, rng
):
  caps = sorted(int(c) for c in rng.choice(np.arange(512, 2048), 3, False))
  kw = {} if policy is None else dict(policy=policy)
  names = _compiled(
    caplog,
    lambda: rp.replay(fresh, semantics=semantics, capacities=caps, **kw),
  )
  assert names, "the compile log was not captured"
  assert _one_op(names) == [], names


def test_cluster_compiles_only_its_programs(caplog, fresh):
  names = _compiled(
    caplog,
    lambda: simulate_cluster(
      fresh, _config(), replicas=2, router="round_robin", step_time_ms=25.0
    ),
  )
  assert names, "the compile log was not captured"
  assert _one_op(names) == [], names
