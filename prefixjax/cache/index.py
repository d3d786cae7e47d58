"""Fixed-capacity on-device hash map: 64-bit key (two uint32) -> int32 value.

Design: open addressing with linear probing over ``C`` slots (``C`` a power
of two), tombstones for deletion, and a hard probe bound ``P``
(``max_probes``).

* A key's home slot is ``key[0] & (C - 1)`` (lane 0 of a
  :mod:`prefixjax.cache.hashing` key is already well mixed); probe ``i``
  looks at ``(home + i) & (C - 1)`` for ``i < P``.
* ``values[s]`` is the slot's value (``>= 0``), ``EMPTY`` (-1) or
  ``TOMBSTONE`` (-2); ``keys[s]`` is meaningful only for a live slot.
* Invariant: every live key sits within ``P`` probes of its home and no slot
  on its probe path is ``EMPTY``. Insert keeps it by writing into the first
  tombstone or empty slot of the path (after checking the key is absent
  within the ``P`` probes); if the path holds neither, insert returns
  ``Status.PROBE_LIMIT`` and changes nothing: never a corruption. Lookup and
  delete stop at the key, at an ``EMPTY`` slot, or after ``P`` probes.
* Delete writes a tombstone; if the next slot is ``EMPTY`` no probe path can
  run through the deleted slot, so it becomes ``EMPTY`` instead and the
  tombstones right before it are cleared too (at most ``P`` of them). This
  keeps tombstones from piling up under insert/delete churn, so a table that
  is never more than ``max_load`` full keeps short probe paths.

Expected cost per key is O(1) (about ``(1 + 1 / (1 - a)**2) / 2`` probes for
a miss at load ``a``: 2.5 at 0.5, 8.5 at 0.75) and never more than ``P``.
Every function is jittable and vmappable; the loops are ``while_loop``s that
exit as soon as the probe sequence is decided.

Key collisions: the key is the whole 64-bit hash, so two different blocks
with equal keys are indistinguishable (a false hit). With ``n`` distinct
blocks the chance of any such pair is about ``n**2 / 2**65``: 2.7e-8 for
10^6 blocks. Bucket (home slot) collisions are normal and handled by probing.

Dimensions: ``C`` slots, ``L`` keys in a batch.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import _struct as struct
from prefixjax._masked import barrier

__all__ = [
  "EMPTY",
  "MAX_LOAD_LIMIT",
  "NO_VALUE",
  "TOMBSTONE",
  "IndexState",
  "IndexStatus",
  "check_invariants",
  "delete",
  "init",
  "insert",
  "lookup",
  "lookup_run",
  "unlink",
  "unlink_settling",
  "update",
]

EMPTY = -1
"""``values`` of a slot that never held a key (ends every probe path)."""

TOMBSTONE = -2
"""``values`` of a slot whose key was deleted (probing continues past it)."""

NO_VALUE = -1
"""What :func:`lookup` returns for an absent key."""

MAX_LOAD_LIMIT = 0.75
"""The largest ``max_load`` :func:`init` accepts."""


class IndexStatus(enum.IntEnum):
  """Status codes of the index operations (int32 scalars)."""

  OK = 0
  PRESENT = 1
  """Insert: the key is already present; nothing changed."""
  ABSENT = 2
  """Delete / update: the key is not present; nothing changed."""
  PROBE_LIMIT = 3
  """Insert: no free slot within ``max_probes``; nothing changed."""
  SKIPPED = 4
  """The operation was masked off (``ok`` false); nothing changed."""


@struct.dataclass
class IndexState:
  """An open-addressing map; arrays allocated at full size up front.

  Attributes:
    keys: ``[C, 2]`` uint32 key of each live slot (stale elsewhere).
    values: ``[C]`` int32 value ``>= 0``, or ``EMPTY`` / ``TOMBSTONE``.
    count: ``[]`` int32 live keys.
    num_tombstones: ``[]`` int32 tombstone slots.
    max_probes: static, the probe bound ``P`` (``<= C``).
  """

  keys: jax.Array  # [C, 2] uint32
  values: jax.Array  # [C] int32
  count: jax.Array  # [] int32
  num_tombstones: jax.Array  # [] int32
  max_probes: int = struct.field(pytree_node=False, default=64)

  @property
  def capacity(self) -> int:
    """``C``: slots."""
    return self.values.shape[-1]


class InsertResult(NamedTuple):
  """Result of :func:`insert` / :func:`delete` / :func:`update`.

  Attributes:
    status: ``[]`` int32 :class:`IndexStatus`.
    value: ``[]`` int32 the value stored for the key before the call
      (``NO_VALUE`` if absent).
  """

  status: jax.Array  # [] int32
  value: jax.Array  # [] int32


def capacity_for(num_keys: int, max_load: float) -> int:
  """Smallest power of two ``C`` with ``num_keys <= C * max_load``."""
  need = max(1, int(np.ceil(num_keys / max_load)))
  return 1 << (need - 1).bit_length()


def init(
  *,
  num_keys: int,
  max_load: float = 0.5,
  capacity: int | None = None,
  max_probes: int = 64,
) -> IndexState:
  """Creates an empty index for up to ``num_keys`` live keys.

  Args:
    num_keys: the most keys ever live at once (for a prefix cache: the
      number of blocks); at least 1.
    max_load: the highest fraction of slots that may be live, in
      ``(0, 0.75]``.
    capacity: ``C`` slots, a power of two with ``num_keys <= C * max_load``;
      default the smallest such.
    max_probes: the probe bound ``P`` (clipped to ``C``); at least 1.

  Returns:
    An :class:`IndexState`.

  Raises:
    ValueError: a value out of range, ``capacity`` not a power of two, or a
      capacity whose load would exceed ``max_load``.

  Example:
    >>> from prefixjax.cache import index
    >>> idx = index.init(num_keys=100, max_load=0.5)
    >>> idx.capacity
    256
  """
  for name, value in (("num_keys", num_keys), ("max_probes", max_probes)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
      raise ValueError(f"{name}={value} must be >= 1")
  if not 0 < max_load <= MAX_LOAD_LIMIT:
    raise ValueError(f"{max_load=} must be in (0, {MAX_LOAD_LIMIT}]")
  if capacity is None:
    capacity = capacity_for(int(num_keys), max_load)
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise TypeError(f"{capacity=!r} must be an int")
  if capacity < 1 or capacity & (capacity - 1):
    raise ValueError(f"{capacity=} must be a power of two")
  if capacity >= 2**30:
    raise ValueError(f"{capacity=} is too large for int32 slot ids")
  if num_keys > capacity * max_load:
    raise ValueError(
      f"{capacity=} too small: {num_keys=} / {max_load=} needs "
      f"{num_keys / max_load:.1f} slots"
    )
  return _empty(int(capacity), int(min(max_probes, capacity)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty(capacity: int, max_probes: int) -> IndexState:
  """The empty index of :func:`init`, in one compiled program (outside
  ``jit`` each array constructor would compile one of its own)."""
  return IndexState(
    keys=jnp.zeros((capacity, 2), jnp.uint32),
    values=jnp.full((capacity,), EMPTY, jnp.int32),
    count=jnp.zeros((), jnp.int32),
    num_tombstones=jnp.zeros((), jnp.int32),
    max_probes=max_probes,
  )


def _home(index: IndexState, key: jax.Array) -> jax.Array:
  mask = np.uint32(index.capacity - 1)
  return jax.lax.bitcast_convert_type(key[..., 0] & mask, jnp.int32)


def _probe(index: IndexState, key: jax.Array, ok=True):
  """Probes for one ``key`` ``[2]`` (no probe at all where not ``ok``).

  Returns ``(found, free)``: the slot holding the key or -1, and the first
  tombstone-or-empty slot on the path or -1 (the insert position).
  """
  cap = index.capacity
  home = _home(index, key)
  keys, values = index.keys, index.values

  def cond(c):
    i, found, _, done = c
    return ok & (i < index.max_probes) & ~done

  def body(c):
    i, found, free, _ = c
    slot = (home + i) & (cap - 1)
    v = values.at[slot].get(mode="clip")
    k = keys.at[slot].get(mode="clip")
    hit = (v >= 0) & jnp.all(k == key)
    found = jnp.where(hit, slot, found)
    free = jnp.where((v < 0) & (free < 0), slot, free)
    done = hit | (v == EMPTY)
    return i + 1, found, free, done

  _, found, free, _ = jax.lax.while_loop(
    cond, body, (jnp.int32(0), jnp.int32(-1), jnp.int32(-1), jnp.bool_(False))
  )
  return found, free


@jax.jit
def lookup(index: IndexState, keys: jax.Array, mask=None) -> jax.Array:
  """Values of ``keys`` (``[L, 2]`` uint32); ``NO_VALUE`` where absent.

  All ``L`` lanes probe together until decided. Lanes where ``mask``
  (``[L]`` bool) is false do not probe and read ``NO_VALUE``.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import index
    >>> idx = index.init(num_keys=4)
    >>> idx, r = index.insert(idx, jnp.array([7, 9], jnp.uint32), 3)
    >>> index.lookup(idx, jnp.array([[7, 9], [7, 8]], jnp.uint32)).tolist()
    [3, -1]
  """
  cap = index.capacity
  home = _home(index, keys)  # [L]
  lanes = keys.shape[0]

  def cond(c):
    i, _, done = c
    return (i < index.max_probes) & ~jnp.all(done)

  def body(c):
    i, out, done = c
    slot = (home + i) & (cap - 1)
    v = index.values.at[slot].get(mode="clip")
    k = index.keys.at[slot].get(mode="clip")
    hit = ~done & (v >= 0) & jnp.all(k == keys, axis=-1)
    out = jnp.where(hit, v, out)
    done = done | hit | (v == EMPTY)
    return i + 1, out, done

  _, out, _ = jax.lax.while_loop(
    cond,
    body,
    (
      jnp.int32(0),
      jnp.full((lanes,), NO_VALUE, jnp.int32),
      jnp.zeros((lanes,), jnp.bool_) if mask is None else ~mask,
    ),
  )
  return out


def lookup_run(index: IndexState, keys: jax.Array, limit):
  """:func:`lookup` of ``keys[0], keys[1], ...`` in order, up to the
  first absent key or ``limit`` keys: ``(values, run)``.

  ``values`` ``[L]`` int32 holds the values of the first ``run`` keys (all
  present) and ``NO_VALUE`` after; they equal :func:`lookup`'s for those
  lanes (the same probe paths). One scalar loop, a probe an iteration, so
  its cost is the probes of the run and of the first miss, where
  :func:`lookup` probes all ``L`` lanes until the slowest is decided; XLA:CPU
  compiles it into one kernel. For one prompt; under ``jax.vmap`` prefer
  :func:`lookup`. Traceable (not jitted).
  """
  lanes = keys.shape[0]
  cap = index.capacity
  limit = jnp.minimum(jnp.asarray(limit, jnp.int32), lanes)

  def body(c):
    j, i, out, _ = c
    key = jax.lax.dynamic_slice(keys, (j, 0), (1, 2))[0]
    slot = (_home(index, key) + i) & (cap - 1)
    v = jax.lax.dynamic_slice(index.values, (slot,), (1,))[0]
    k = jax.lax.dynamic_slice(index.keys, (slot, 0), (1, 2))[0]
    hit = (v >= 0) & jnp.all(k == key)
    out = jax.lax.dynamic_update_slice(
      out, jnp.where(hit, v, NO_VALUE)[None], (j,)
    )
    miss = ~hit & ((v == EMPTY) | (i + 1 >= index.max_probes))
    j = j + hit.astype(jnp.int32)
    i = jnp.where(hit, 0, i + 1)
    return j, i, out, ~miss & (j < limit)

  run, _, out, _ = jax.lax.while_loop(
    lambda c: c[3],
    body,
    (
      jnp.int32(0),
      jnp.int32(0),
      jnp.full((lanes,), NO_VALUE, jnp.int32),
      (limit > 0) & (index.max_probes > 0),
    ),
  )
  return out, run


@jax.jit
def insert(index: IndexState, key, value, ok=True):
  """Inserts ``key -> value`` if the key is absent.

  Args:
    index: the map.
    key: ``[2]`` uint32.
    value: int32 scalar ``>= 0`` (a negative value is ``SKIPPED``).
    ok: bool scalar; when false nothing happens (status ``SKIPPED``).

  Returns:
    ``(new_index, InsertResult)``: status ``OK``, ``PRESENT`` (the stored
    value is returned, nothing changes) or ``PROBE_LIMIT`` (no free slot
    within ``max_probes``, nothing changes).
  """
  value = jnp.asarray(value, jnp.int32)
  ok = jnp.asarray(ok, jnp.bool_) & (value >= 0)
  found, free = _probe(index, key, ok)
  old = index.values.at[jnp.maximum(found, 0)].get(mode="clip")
  was_tomb = index.values.at[jnp.maximum(free, 0)].get(mode="clip") == TOMBSTONE
  # barrier's anchor: count is >= 0, never -7, at run time.
  found, free, old, was_tomb = barrier(index.count, found, free, old, was_tomb)
  status = jnp.where(
    ~ok,
    IndexStatus.SKIPPED,
    jnp.where(
      found >= 0,
      IndexStatus.PRESENT,
      jnp.where(free < 0, IndexStatus.PROBE_LIMIT, IndexStatus.OK),
    ),
  ).astype(jnp.int32)
  do = status == IndexStatus.OK
  slot = jnp.where(do, free, index.capacity)
  index = index.replace(
    keys=index.keys.at[slot].set(key, mode="drop"),
    values=index.values.at[slot].set(value, mode="drop"),
    count=index.count + do.astype(jnp.int32),
    num_tombstones=index.num_tombstones - (do & was_tomb).astype(jnp.int32),
  )
  return index, InsertResult(status, jnp.where(found >= 0, old, NO_VALUE))


@jax.jit
def update(index: IndexState, key, value, ok=True):
  """Replaces the value of a present ``key``; status ``ABSENT`` otherwise
  (``SKIPPED`` when not ``ok`` or ``value < 0``)."""
  value = jnp.asarray(value, jnp.int32)
  ok = jnp.asarray(ok, jnp.bool_) & (value >= 0)
  found, _ = _probe(index, key, ok)
  old = index.values.at[jnp.maximum(found, 0)].get(mode="clip")
  found, old = barrier(index.count, found, old)
  status = jnp.where(
    ~ok,
    IndexStatus.SKIPPED,
    jnp.where(found >= 0, IndexStatus.OK, IndexStatus.ABSENT),
  ).astype(jnp.int32)
  slot = jnp.where(status == IndexStatus.OK, found, index.capacity)
  index = index.replace(values=index.values.at[slot].set(value, mode="drop"))
  return index, InsertResult(status, jnp.where(found >= 0, old, NO_VALUE))


@jax.jit
def delete(index: IndexState, key, ok=True):
  """Removes ``key``; returns its old value, status ``ABSENT`` if missing."""
  ok = jnp.asarray(ok, jnp.bool_)
  found, _ = _probe(index, key, ok)
  old = index.values.at[jnp.maximum(found, 0)].get(mode="clip")
  found, old, next_empty = barrier(
    index.count, found, old, _next_empty(index, found)
  )
  status = jnp.where(
    ~ok,
    IndexStatus.SKIPPED,
    jnp.where(found >= 0, IndexStatus.OK, IndexStatus.ABSENT),
  ).astype(jnp.int32)
  index = _delete_at(index, found, status == IndexStatus.OK, next_empty)
  return index, InsertResult(status, jnp.where(found >= 0, old, NO_VALUE))


@jax.jit
def unlink(index: IndexState, key, value, successor, ok=True):
  """Drops ``key``'s pointer to ``value``, with one probe.

  Where ``key`` maps to ``value``: deleted if ``successor < 0``, else
  repointed to ``successor``. A key that maps to another value, or is
  absent, is left alone (status ``ABSENT``). The same as :func:`lookup`,
  then :func:`delete` or :func:`update` on what it found, probing once
  (the prefix cache's identity eviction: the block leaving a key's list of
  blocks was its head).

  Args:
    index: the map.
    key: ``[2]`` uint32.
    value: int32 scalar, the value the key must map to.
    successor: int32 scalar, its new value, or negative to delete the key.
    ok: bool scalar; when false nothing happens (status ``SKIPPED``).

  Returns:
    ``(new_index, InsertResult)``: status ``OK``, ``ABSENT`` or
    ``SKIPPED``; the value stored before the call (``NO_VALUE`` if absent).

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import index
    >>> idx = index.init(num_keys=4)
    >>> key = jnp.array([7, 9], jnp.uint32)
    >>> idx, _ = index.insert(idx, key, 3)
    >>> idx, r = index.unlink(idx, key, 3, 5)  # 3 -> 5
    >>> idx, r = index.unlink(idx, key, 3, -1)  # maps to 5, not 3: kept
    >>> int(r.status), index.lookup(idx, key[None]).tolist()
    (2, [5])
  """
  index, result, _ = unlink_settling(index, key, value, successor, ok)
  return index, result


def unlink_settling(index: IndexState, key, value, successor, ok=True, *more):
  """:func:`unlink`, passing ``more`` (int or bool arrays) through the
  barrier that orders its reads before its writes: ``(new_index,
  InsertResult, more)``.

  For a caller that read ``more`` (and the arguments) from its own arrays
  and writes them after the call: one barrier serves both (see
  :func:`prefixjax._masked.barrier`). ``value``, ``successor`` and ``ok``
  pass through it too.
  """
  ok = jnp.asarray(ok, jnp.bool_)
  value = jnp.asarray(value, jnp.int32)
  successor = jnp.asarray(successor, jnp.int32)
  found, _ = _probe(index, key, ok)
  old = index.values.at[jnp.maximum(found, 0)].get(mode="clip")
  found, old, next_empty, ok, value, successor, more = barrier(
    index.count,
    found,
    old,
    _next_empty(index, found),
    ok,
    value,
    successor,
    more,
  )
  old = jnp.where(found >= 0, old, NO_VALUE)
  status = jnp.where(
    ~ok,
    IndexStatus.SKIPPED,
    jnp.where(
      (old == value) & (value >= 0), IndexStatus.OK, IndexStatus.ABSENT
    ),
  ).astype(jnp.int32)
  do = status == IndexStatus.OK
  slot = jnp.where(do & (successor >= 0), found, index.capacity)
  index = _delete_at(index, found, do & (successor < 0), next_empty)
  index = index.replace(
    values=index.values.at[slot].set(successor, mode="drop")
  )
  return index, InsertResult(status, old), more


def _next_empty(index: IndexState, found) -> jax.Array:
  """Whether the slot after ``found`` is ``EMPTY`` (read before any write:
  the callers pass it through their barrier with the probe's result)."""
  cap = index.capacity
  return index.values.at[(found + 1) & (cap - 1)].get(mode="clip") == EMPTY


def _delete_at(index: IndexState, found, do, next_empty):
  """Deletes the live slot ``found`` where ``do`` (a tombstone, or EMPTY
  with the tombstones right before it when the next slot, ``next_empty``,
  is EMPTY)."""
  cap = index.capacity
  # If the next slot is EMPTY no probe path runs through this one: it (and
  # the run of tombstones right before it) can become EMPTY.
  clear = do & next_empty

  # Clear the run of tombstones right before the slot, one in-place write
  # each: a loop of reads and dynamic-update-slices (no scatter) that XLA
  # can compile into one kernel with its caller's loop.
  def cond(c):
    i, values = c
    slot = (found - 1 - i) & (cap - 1)
    v = values.at[slot].get(mode="clip")
    return clear & (i < index.max_probes - 1) & (v == TOMBSTONE) & (i < cap)

  def body(c):
    i, values = c
    slot = (found - 1 - i) & (cap - 1)
    return i + 1, jax.lax.dynamic_update_slice(
      values, jnp.full((1,), EMPTY, jnp.int32), (slot,)
    )

  num_cleared, values = jax.lax.while_loop(
    cond, body, (jnp.int32(0), index.values)
  )
  # The loop never reaches ``found`` (fewer than ``max_probes <= C`` steps
  # back), so writing it last is the same as writing it first.
  values = values.at[jnp.where(do, found, cap)].set(
    jnp.where(clear, EMPTY, TOMBSTONE).astype(jnp.int32), mode="drop"
  )
  return index.replace(
    values=values,
    count=index.count - do.astype(jnp.int32),
    num_tombstones=index.num_tombstones
    + (do & ~clear).astype(jnp.int32)
    - num_cleared,
  )


def check_invariants(index: IndexState) -> list[str]:
  """Host-side checks; returns violations (or ``[]``).

  * ``count`` / ``num_tombstones`` match the slots;
  * every live key is found by probing from its home within ``max_probes``
    with no ``EMPTY`` slot before it, and appears once.
  """
  errors = []
  keys = np.asarray(index.keys)
  values = np.asarray(index.values)
  cap = values.shape[0]
  live = values >= 0
  if int(index.count) != int(live.sum()):
    errors.append(f"count={int(index.count)} but {int(live.sum())} live")
  tombs = int((values == TOMBSTONE).sum())
  if int(index.num_tombstones) != tombs:
    errors.append(f"num_tombstones={int(index.num_tombstones)} but {tombs}")
  if ((values < 0) & (values != EMPTY) & (values != TOMBSTONE)).any():
    errors.append("a slot holds an unknown negative value")
  seen = set()
  for s in np.nonzero(live)[0].tolist():
    key = (int(keys[s, 0]), int(keys[s, 1]))
    if key in seen:
      errors.append(f"key {key} stored twice")
    seen.add(key)
    home = key[0] & (cap - 1)
    dist = (s - home) % cap
    if dist >= index.max_probes:
      errors.append(f"key {key} at slot {s} is {dist} probes from home")
    path = [(home + i) % cap for i in range(dist)]
    if any(values[p] == EMPTY for p in path):
      errors.append(f"key {key} at slot {s} has an EMPTY slot on its path")
  return errors
