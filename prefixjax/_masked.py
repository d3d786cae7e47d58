"""Masked array primitives and sentinels: the ground floor of the package.

Every pure verb in prefixjax is written as masked gathers and scatters
rather than ``lax.cond`` over its state: an index out of range (including
``NO_BLOCK``) reads a fill value and writes nothing, so a failed verb becomes
a no-op, and under ``jax.vmap`` nothing turns into a ``select`` over whole
arrays. :func:`barrier` materialises reads before in-place writes, so that
XLA:CPU never copies a pool-sized array inside a scan step.

Nothing here imports the rest of the package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
  "NONE",
  "NO_BLOCK",
  "NULL_BLOCK",
  "barrier",
  "compact",
  "count",
  "gather",
  "get_row",
  "kernel",
  "scatter",
  "scatter_add",
  "set_row",
  "some",
  "take",
]

NULL_BLOCK = 0
"""Reserved block id that pads block tables; never allocated."""

NO_BLOCK = -1
"""Sentinel for "no block": ends of free-queue links, unused result lanes."""

NONE = -1
"""Sentinel for "no index" in the replay engines' int32 arrays (no node,
no key, no event); the same value as :data:`NO_BLOCK`, named for its use."""


# ---------------------------------------------------------------------------
# Masked gather/scatter helpers. Indices that are out of range (including
# NO_BLOCK) read ``fill`` and write nothing; that is how a failed verb becomes
# a no-op without a cond over the whole state.


def gather(x: jax.Array, idx: jax.Array, fill=0) -> jax.Array:
  """``x[idx]`` with out-of-range (and negative) indices reading ``fill``."""
  n = x.shape[0]
  safe = jnp.where((idx >= 0) & (idx < n), idx, n)
  return x.at[safe].get(mode="fill", fill_value=fill)


def scatter(x: jax.Array, idx: jax.Array, values, mask) -> jax.Array:
  """``x[idx] = values`` on lanes where ``mask``; other lanes write nothing."""
  n = x.shape[0]
  safe = jnp.where(mask & (idx >= 0) & (idx < n), idx, n)
  return x.at[safe].set(values, mode="drop")


def scatter_add(x: jax.Array, idx: jax.Array, values, mask) -> jax.Array:
  """``x[idx] += values`` on lanes where ``mask``."""
  n = x.shape[0]
  safe = jnp.where(mask & (idx >= 0) & (idx < n), idx, n)
  return x.at[safe].add(values, mode="drop")


def get_row(x: jax.Array, i: jax.Array, fill=0) -> jax.Array:
  """Row ``i`` of a 2-D array through a gather (out of range reads ``fill``)."""
  n = x.shape[0]
  safe = jnp.where((i >= 0) & (i < n), i, n)
  return x.at[safe[None]].get(mode="fill", fill_value=fill)[0]


def set_row(x: jax.Array, i: jax.Array, values: jax.Array, ok) -> jax.Array:
  """``x[i] = values`` when ``ok`` and ``i`` is in range; else nothing."""
  n = x.shape[0]
  safe = jnp.where(ok & (i >= 0) & (i < n), i, n)
  return x.at[safe[None]].set(values[None], mode="drop")


TAKE_LOOP_BYTES = 1 << 17
"""Arrays of at least this many bytes are read by :func:`take`'s loop."""


def take(idx: jax.Array, *arrays: jax.Array, loop: bool = True):
  """``tuple(a[idx] for a in arrays)`` (1-D arrays of one length) for a
  short 1-D integer ``idx``; on XLA:CPU, when ``loop`` and an array holds
  at least :data:`TAKE_LOOP_BYTES`, as one loop over ``idx`` of
  one-element dynamic slices.

  XLA:CPU's ``ParallelTaskAssigner`` splits a memory-bound fused operation
  into ``ceil(sqrt(cores))`` tasks on its thread pool once the bytes it
  accesses reach 512 KiB, and a gather counts its whole operand there
  (``HloCostAnalysis::FusionParameterReadBytes``'s default case;
  ``xla/service/cpu/parallel_task_assignment.cc``, openxla/xla as built
  into jax 0.10.2). A gather of a request's path (some hundred pages) from
  an array of the trie's pages thus became two tasks past 131,072 int32
  pages, and the hand-off cost more than the reads (2-core CPU: three
  121-entry gathers from 150,000-entry arrays 8.9 us, against 2.1 us as
  this loop). A dynamic slice counts only what it reads, and the loop,
  whose body accesses a few bytes, is compiled into one kernel. Smaller
  arrays keep the plain gather, which XLA fuses into its consumers.

  ``loop=False`` (vmapped callers: a vmapped dynamic slice is a gather per
  trip) and other backends take the plain gather. Indices are read as
  ``jnp`` indexing reads them either way: negative ones from the end, then
  clamped into range.
  """
  big = any(a.size * a.dtype.itemsize >= TAKE_LOOP_BYTES for a in arrays)
  if not (loop and big and jax.default_backend() == "cpu"):
    return tuple(a[idx] for a in arrays)
  n = idx.shape[0]
  length = arrays[0].shape[0]

  def body(i, outs):
    k = jax.lax.dynamic_index_in_dim(idx, i, keepdims=False)
    k = jnp.clip(jnp.where(k < 0, k + length, k), 0, length - 1)
    return tuple(
      jax.lax.dynamic_update_index_in_dim(
        o, jax.lax.dynamic_index_in_dim(a, k, keepdims=False), i, 0
      )
      for o, a in zip(outs, arrays, strict=True)
    )

  outs = tuple(jnp.zeros((n,), a.dtype) for a in arrays)
  return jax.lax.fori_loop(0, n, body, outs)


def count(mask: jax.Array) -> jax.Array:
  """``jnp.sum(mask, axis=-1, dtype=jnp.int32)``: how many lanes are set.

  XLA:CPU reduces a bool array into int32 one element at a time (7 us for
  10,000 lanes with jax 0.10.2 on a 2-core CPU, and ``jnp.any`` of a
  fused mask as long); summed first in rows of 8 as int8, which it
  vectorises, then over the rows, 1.1 us. The last ``n % 8`` lanes are
  added on their own."""
  mask = jnp.asarray(mask)
  n = mask.shape[-1]
  if n < 64:
    return jnp.sum(mask, axis=-1, dtype=jnp.int32)
  n8 = n - n % 8
  rows = mask[..., :n8].reshape(*mask.shape[:-1], n8 // 8, 8)
  total = jnp.sum(
    jnp.sum(rows.astype(jnp.int8), axis=-1, dtype=jnp.int8),
    axis=-1,
    dtype=jnp.int32,
  )
  if n8 < n:
    total = total + jnp.sum(jnp.where(mask[..., n8:], 1, 0), axis=-1)
  return total


def some(mask: jax.Array) -> jax.Array:
  """``jnp.any(mask, axis=-1)``, through :func:`count` (see there)."""
  return count(mask) > 0


def barrier(anchor: jax.Array, *values):
  """Materialises ``values`` so XLA cannot re-read their sources later.

  XLA may fuse a cheap read (say, the refcount gather that decides a mask)
  into every consumer, including consumers not ordered before an in-place
  scatter to the same array; copy insertion then copies the whole pool-sized
  array to keep the old value alive, an O(N) cost per step (measured with
  jax 0.10.2 on XLA:CPU: 16 us -> 275 us per step at N = 262,144).
  ``lax.optimization_barrier`` does not prevent this on XLA:CPU (it is
  expanded away before fusion), but a while loop is never fused into its
  consumers: the values pass through a loop that runs zero times, with a trip
  count XLA cannot see through.

  Args:
    anchor: an int32 scalar computed at run time that is never -7 (a block
      id, an index); it makes the trip count opaque.
    *values: arrays (or pytrees of integer, bool or float arrays) to
      materialise.

  Returns:
    ``values``, unchanged, as a tuple.
  """
  opaque_zero = (anchor == -7).astype(jnp.int32)

  # The body never runs, but XLA must not see through it: it changes every
  # value (else XLA drops loop invariants and the loop disappears) and mixes
  # each into the next one, in a cycle (else XLA drops the outputs nobody
  # uses, and with them the ordering they were passed in for). A cycle, not
  # a sum of all into each: XLA fuses the sum into every output, and the
  # loop's size (which decides whether XLA:CPU compiles the loops around it
  # into one kernel) would grow with the square of the values.
  def body(carry):
    leaves, tree = jax.tree.flatten(carry[1])
    sums = [jnp.sum(leaf.astype(jnp.int32)) for leaf in leaves]
    mixed = [
      _mix(leaf, sums[(i + 1) % len(leaves)]) for i, leaf in enumerate(leaves)
    ]
    return carry[0] + 1, jax.tree.unflatten(tree, mixed)

  # Scalars travel packed in one int32 vector: the loop's size counts every
  # element of its carry.
  leaves, tree = jax.tree.flatten(values)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  packable = [
    i
    for i, leaf in enumerate(leaves)
    if leaf.ndim == 0 and leaf.dtype in (jnp.int32, jnp.uint32, jnp.bool_)
  ]
  if len(packable) < 2:
    packable = []
  rest = [leaf for i, leaf in enumerate(leaves) if i not in packable]
  carry = (
    [jnp.stack([_to_int32(leaves[i]) for i in packable])] if packable else []
  )
  _, out = jax.lax.while_loop(
    lambda carry: carry[0] < opaque_zero,
    body,
    (jnp.int32(0), (*carry, *rest)),
  )
  if packable:
    packed, *out = out
    rest = iter(out)
    out = [
      _from_int32(packed[packable.index(i)], leaf.dtype)
      if i in packable
      else next(rest)
      for i, leaf in enumerate(leaves)
    ]
  return jax.tree.unflatten(tree, list(out))


def kernel(fn, carry, *args):
  """``fn(carry, *args)``; on a CPU run as the one iteration of a while
  loop (below), elsewhere called as it is.

  XLA:CPU runs each fused operation of a program as a thunk of its own
  (tens of nanoseconds each, more for loops and conditionals), except a
  while loop whose body and condition access few bytes (under 1 kB by its
  ``HloCostAnalysis``; no scatter, sort or custom call inside), which it
  compiles into one kernel. Wrapping a short scalar computation (a cache
  verb's per-block step) this way makes it one thunk. The trip count is
  opaque (an optimization barrier over 1), so XLA cannot unroll the loop
  away, and ``args`` (integer or bool arrays) enter through the loop
  counter, so XLA cannot hoist the work that reads them out of the loop as
  invariant.

  Elsewhere the loop buys nothing (XLA:GPU and XLA:TPU fuse the plain
  call into the kernels around it) and can cost more: a GPU while loop
  whose trip count XLA cannot see may read its predicate back on the host
  on every trip. Not measured (no accelerator has been lent). The form
  follows :func:`jax.default_backend` when ``fn`` is traced (a program
  placed on the host CPU of a GPU machine gets the plain call: the same
  values). :func:`jax.lax.platform_dependent` would choose per lowering
  platform instead, but it traces both forms: the serving loop's first
  compile took 5.9 s -> 6.2 s with it (2,000 requests, 2-core CPU).

  Args:
    fn: ``(carry, *args) -> carry`` (the same structure, shapes and
      dtypes).
    carry: a pytree of arrays: what ``fn`` changes, in place.
    *args: arrays ``fn`` reads (values, not what it writes).

  Returns:
    ``fn(carry, *args)``.
  """
  if jax.default_backend() == "cpu":
    return _one_trip(fn, carry, *args)
  return fn(carry, *args)


def _one_trip(fn, carry, *args):
  """:func:`kernel` on a CPU: ``fn`` as the one iteration of a while loop."""
  # 1, but opaque to XLA (so it keeps the loop), and never batched: under
  # ``vmap`` a trip count read from the inputs made the loop select its
  # whole carry between old and new on every call (16 vmapped engine
  # configurations 15.3 s -> 10.0 s, benchmarks/RESULTS.md).
  opaque_one = jax.lax.optimization_barrier(jnp.int32(1))

  def body(c):
    # ``zero`` is 0 (the only iteration has counter 0), but XLA cannot
    # tell: the counter times a value it does not know.
    zero = c[0] * opaque_one
    tainted = jax.tree.map(
      lambda x: (
        x != (zero != 0) if x.dtype == jnp.bool_ else x + zero.astype(x.dtype)
      ),
      args,
    )
    return c[0] + 1, fn(c[1], *tainted)

  _, out = jax.lax.while_loop(
    lambda c: c[0] < opaque_one, body, (jnp.int32(0), carry)
  )
  return out


def _mix(leaf: jax.Array, other: jax.Array) -> jax.Array:
  """``leaf`` changed and mixed with ``other`` (an int32 scalar), for the
  body of :func:`barrier`'s loop, which never runs."""
  if leaf.dtype == jnp.bool_:
    return jnp.invert(leaf) ^ (other & 1).astype(jnp.bool_)
  if jnp.issubdtype(leaf.dtype, jnp.floating):
    return -leaf + other.astype(leaf.dtype)
  return jnp.invert(leaf) ^ other.astype(leaf.dtype)


def _to_int32(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.uint32:
    return jax.lax.bitcast_convert_type(x, jnp.int32)
  return x.astype(jnp.int32)


def _from_int32(x: jax.Array, dtype) -> jax.Array:
  if dtype == jnp.uint32:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if dtype == jnp.bool_:
    return x != 0
  return x


def compact(values: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Moves ``values[keep]`` to the front, in order; ``NO_BLOCK`` after."""
  pos = jnp.cumsum(keep.astype(jnp.int32)) - 1
  out = jnp.full(values.shape, NO_BLOCK, jnp.int32)
  out = scatter(out, pos, values, keep)
  return out, jnp.sum(keep.astype(jnp.int32))
