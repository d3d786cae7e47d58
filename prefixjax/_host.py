"""Host arrays onto the device, without compiling anything.

``jnp.asarray(numpy_array)`` outside ``jit`` is not a plain copy in jax
0.10: it binds ``lax.stage`` (``jax/_src/numpy/array_constructors.py``,
jax 0.10.2), and a dtype argument binds ``convert_element_type``; each is
a one-operation program, traced, lowered and compiled for every new shape
(10-20 ms each on a 2-core CPU, too small for the persistent compilation
cache to keep). Host preparation moves a dozen trace-sized arrays per
call, so the engines' host sides use :func:`to_device` instead.

:func:`shard_lanes` and :func:`replicate` place a batch of configurations
(its leading axis) and what they share on several devices;
:func:`as_done_on_threads` and :func:`thread_map` run compiled calls side
by side on a CPU's cores. :func:`release_compiled_near_map_limit` keeps a
long-lived process under the kernel's memory-map limit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np


def to_device(x, dtype=None) -> jax.Array:
  """``x`` (a numpy array, list or scalar) as an uncommitted device array
  on the default device, cast to ``dtype`` on the host first; the same
  value and dtype as ``jnp.asarray(x, dtype)`` (64-bit types narrowed
  unless x64 is on)."""
  return jax.device_put(np.asarray(x, dtype=dtype))


@functools.partial(jax.jit, static_argnums=1)
def _pad_lanes(tree, pad: int):
  """Each leaf's leading axis extended by ``pad`` copies of its last row,
  in one program."""
  return jax.tree.map(
    lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), tree
  )


def shard_lanes(tree, devices, axis_name: str = "configs"):
  """``tree``'s leaves (equal leading axes, the lanes) padded to a
  multiple of ``len(devices)`` with copies of the last lane and split
  over a one-axis :class:`jax.sharding.Mesh` named ``axis_name``. The
  caller drops the padded lanes from the results."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  n = {x.shape[0] for x in jax.tree.leaves(tree)}
  if len(n) != 1:
    raise ValueError(f"lanes of different lengths {sorted(n)}")
  pad = -n.pop() % len(devices)
  if pad:
    tree = _pad_lanes(tree, pad)
  mesh = Mesh(np.asarray(list(devices)), (axis_name,))
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(axis_name)))


def replicate(tree, devices):
  """``tree`` whole on every device of ``devices``."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.asarray(list(devices)), ("all",))
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def cores() -> int:
  """The cores this process may run on (its affinity mask where the
  system has one: a container's share, not the host's count)."""
  if hasattr(os, "sched_getaffinity"):
    return max(1, len(os.sched_getaffinity(0)))
  return os.cpu_count() or 1


XLA_THREADS_ENV = ("PJRT_NPROC", "NPROC")
"""The environment variables XLA:CPU's client sizes its thread pools by
(the first one set wins; ``DefaultThreadPoolSize`` in
``xla/pjrt/cpu/cpu_client.cc``), else one thread per core."""


def one_xla_thread(environ=None) -> bool:
  """Asks XLA:CPU for one thread in its pools (``PJRT_NPROC=1`` in
  ``environ``, default ``os.environ``) unless a count is named there
  already (:data:`XLA_THREADS_ENV`); returns whether it set it. XLA reads
  the variable when JAX creates its CPU client (the first array or device
  query of the process): call it before that, later it changes nothing.

  For a process that runs one configuration's serving loop at a time (the
  ``prefixjax simulate`` command, :func:`prefixjax.serving.simulate` in a
  script of your own). XLA's thunk executor hands the independent
  operations of a loop body to its pool's threads, one per core, and in
  SGLang's loop the hand-offs cost more than the overlap gains: 10,000
  requests of the built-in workload at 16 running, 2-core CPU, 5.7-6.6 s
  with two threads against 3.9-4.7 s with one (vLLM's loop the same
  either way). Not for sweeps and batches, which run several programs side
  by side on threads of their own (the 256-point sweep benchmark took 32x
  its largest point with one thread against 17x)."""
  environ = os.environ if environ is None else environ
  if any(name in environ for name in XLA_THREADS_ENV):
    return False
  environ[XLA_THREADS_ENV[0]] = "1"
  return True


def xla_threads(environ=None) -> str:
  """XLA:CPU's pool size as the environment sets it, in words."""
  environ = os.environ if environ is None else environ
  for name in XLA_THREADS_ENV:
    if name in environ:
      return f"{name}={environ[name]}"
  return "a thread per core"


def as_done_on_threads(fn, items):
  """Yields ``(i, fn(items[i]))`` as each call finishes, on one thread per
  core (in order on one core).

  For compiled calls run one after another on a CPU (configurations that
  vmapped cost more there): each is a loop on one core, and JAX releases
  the GIL while it runs, so threads run several at once. Each call is its
  own program run on its own inputs, so results do not depend on the
  threads. Calls compiled already: the first call of a new program
  compiles it on every thread that reaches it. On an error the calls not
  started yet are cancelled and the error is raised.
  """
  items = list(items)
  workers = min(len(items), cores())
  if workers <= 1:
    for i, x in enumerate(items):
      yield i, fn(x)
    return
  pool = concurrent.futures.ThreadPoolExecutor(workers)
  try:
    futures = {pool.submit(fn, x): i for i, x in enumerate(items)}
    for future in concurrent.futures.as_completed(futures):
      yield futures[future], future.result()
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def thread_map(fn, items) -> list:
  """``[fn(x) for x in items]``, in order, by :func:`as_done_on_threads`."""
  out = dict(as_done_on_threads(fn, items))
  return [out[i] for i in range(len(out))]


# ------------------------------------------------- the memory-map limit
MAPS_SHARE = 0.5
"""The share of the kernel's per-process memory-map limit past which
:func:`release_compiled_near_map_limit` drops the compiled programs."""

_RELEASERS: list = []


def keeps_compiled(release) -> None:
  """Registers ``release()``, which drops compiled programs a module keeps
  itself (outside JAX's caches), for
  :func:`release_compiled_near_map_limit`."""
  _RELEASERS.append(release)


def memory_maps() -> int | None:
  """How many memory mappings this process holds (Linux: the lines of
  ``/proc/self/maps``), or None where that cannot be read."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


@functools.cache
def max_memory_maps() -> int | None:
  """The kernel's limit on one process's memory mappings
  (``vm.max_map_count``: 65,530 unless raised), or None where unknown."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def release_compiled_near_map_limit() -> bool:
  """Drops this process's compiled programs (``jax.clear_caches()`` and
  the modules' own, :func:`keeps_compiled`) when it holds more than
  :data:`MAPS_SHARE` of the kernel's memory-map limit; returns whether it
  did.

  Linux caps one process's memory mappings (``vm.max_map_count``). XLA:CPU
  maps every compiled program's code and data sections separately and
  keeps them while JAX keeps the program: about 1,100 mappings for one of
  the serving loops of vLLM and 1,300 for SGLang's (jax 0.10.2, measured
  with :func:`memory_maps`), so a process that compiles about 50 of them
  (a loop over pool sizes, a notebook's session) reaches the default limit
  of 65,530, and its next compile aborts the process inside LLVM (``LLVM
  ERROR: Unable to allocate section memory``; no Python exception). The
  public run functions (``serving.simulate``, ``simulate_batch``,
  ``replay``, ``simulate_cluster``, ``run_sweep``, the model ``Engine``'s
  ``start`` and ``generate``) call this before their work; a later call of
  a dropped program's shapes compiles it again (or reads it from the
  persistent compilation cache).

  Acts on the main thread only: another of this process's threads may be
  running a program at that moment (the sweep's points; the sweep calls
  this itself between its waves, with nothing running)."""
  if threading.current_thread() is not threading.main_thread():
    return False
  limit = max_memory_maps()
  if limit is None:
    return False
  held = memory_maps()
  if held is None or held <= MAPS_SHARE * limit:
    return False
  release_compiled()
  return True


def release_compiled() -> None:
  """Drops this process's compiled programs: ``jax.clear_caches()`` and
  what the modules keep themselves (:func:`keeps_compiled`). Call it with
  nothing running."""
  jax.clear_caches()
  for release in _RELEASERS:
    release()
