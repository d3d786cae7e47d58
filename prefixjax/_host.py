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
by side on a CPU's cores.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

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
