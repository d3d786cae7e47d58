"""vLLM-semantics replay, one request at a time, in a few wide steps each.

The engine behind :func:`prefixjax.replay.vllm.replay_vllm`. The general
prefix-cache verbs (:func:`prefixjax.replay.vllm.general_hits`, kept as its
reference) walk the free queue and the index block by block; with one
request at a time the state has a simpler shape, which this engine
exploits. Its hits equal the verbs' (and the vLLM v1 oracle's,
``tests/reference_models/vllm_apc.py``, with the same ``free_order``)
request for request. The rules, per request of ``P`` prompt tokens and
``O`` outputs (``B = ceil((P + max(O, 1) - 1) / K)`` blocks with KV, ``F``
of them full):

1. Hits: the longest run of cached keys from block 0, at most
   ``(P - 1) // K`` blocks; a key's block is the earliest-published block
   that still carries it.
2. The hit blocks leave the free queue; ``B - hits`` blocks are popped from
   its head, in order, into table columns ``hits .. B - 1``, and drop the
   keys they carried.
3. Columns ``hits .. F - 1`` are published under their keys, in column
   order (a key may then be carried by several blocks).
4. Release, in reverse column order (``SingleTypeKVCacheManager.free``):
   with ``free_order="prepend_unhashed"`` (vLLM >= 0.23, the default; read
   from ``vllm/v1/core/block_pool.py BlockPool.free_blocks``, lines 816-847
   of 0.33.0) the ``F`` full blocks, which all carry a hash, go to the queue
   tail, column ``F - 1`` first, and the partial last block (``B > F``: no
   hash) to the queue head, where the next pop takes it first; with
   ``"append"`` (vLLM 0.8 .. 0.22) all ``B`` go to the tail, column
   ``B - 1`` first.

Prefill, decode and the ``publish`` mode interleave steps 2 and 3
differently, but a pop never takes a block of the running request, so the
outcome is the same.

Data structures (all fixed-size, built on the host from the trace):

* Keys are dense ids ``0 .. V - 1`` (``-1``: a key no block can ever hit, a
  hash-id trace's fresh key), found on the host: a token block's key is its
  content and its parent's key (the exact relation vLLM's chained hash
  approximates), a hash-id block's key its trace id.
* Publish slots: every full block ``(r, j)`` of the trace owns slot
  ``off_r + j`` (``E`` slots, in publish order). A slot is *live* while the
  block published there still carries the key. ``next_slot`` (a constant)
  chains the slots of one key in order, so a key's block is the block of its
  first live slot before the running request's; ``first_live[v]`` points at
  or before it (every slot before it is dead for good, so lookups skip and
  compress the dead ones: each slot is skipped once over the whole replay).
* The free queue is an ordered set of queue keys ``0 .. Q - 1`` (queue
  order is key order): keys ``0 .. H - 1`` are kept for head insertions
  (``H``: the trace's partial blocks with ``"prepend_unhashed"``, else 0),
  blocks start on keys ``H .. H + C - 1`` in id order, and a release gives
  its tail blocks the next keys from ``tail`` up and its head block the key
  just below ``head``, so the head is always the smallest live key.
  ``queue_block[k]`` is the block on key ``k`` (or -1: touched since),
  ``queue_key[b]`` a block's key, ``head`` the smallest key not yet popped.
  Popping takes the first ``B - hits`` live keys from ``head`` with one
  ``[W]``-wide window per iteration; a touched key is skipped once, so a
  request rarely needs a second window.

Per request: one lookup walk (on the Mooncake trace 0.04 to 0.4
iterations on average), one pop window (rarely two) and six scatters, each
``[M]`` or ``[W]`` wide; nothing depends on the pool size. Every read that
decides a scatter comes out of a while loop (the walk, the pop windows or
:func:`prefixjax._masked.barrier`, which XLA never fuses into their
consumers), so XLA:CPU updates every array in place. All capacities share
one compiled program: arrays are sized for the largest, the capacity is a
run-time scalar.

Dimensions: ``R`` requests, ``M`` table columns, ``V`` keys, ``E`` slots,
``N`` blocks (with the null block), ``Q`` queue keys, ``W`` window lanes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax._masked import NONE, barrier, gather, scatter
from prefixjax.replay import frame
from prefixjax.replay.frame import Batching, Prepared, ReplayEngine
from prefixjax.workloads import PrefixNumbering, Trace

__all__ = ["ENGINE", "POLICY", "replay_hits"]

POLICY = "lru"
"""vLLM's free-queue order (:func:`prefixjax.cache.policies.lru`)."""

_FREE_ORDERS = ("append", "prepend_unhashed")

_WIDTH = 128  # most lanes of one pop window


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A trace as dense block keys and publish slots.

  Attributes:
    keys: ``[R, M]`` int32 key of full block ``j`` of request ``r``; -1 for
      fresh keys and past the full blocks.
    next_slot: ``[E]`` int32 next slot of the same key, ``E`` if none.
    first_slot: ``[V]`` int32 first slot of each key.
    prompt_lens: ``[R]`` int32 ``P``.
    num_blocks: ``[R]`` int32 ``B``, blocks with KV.
    num_full: ``[R]`` int32 ``F``, full blocks with KV.
    offsets: ``[R]`` int32 slot of block 0 of each request.
  """

  keys: np.ndarray  # [R, M] int32
  next_slot: np.ndarray  # [E] int32
  first_slot: np.ndarray  # [V] int32
  prompt_lens: np.ndarray  # [R] int32
  num_blocks: np.ndarray  # [R] int32
  num_full: np.ndarray  # [R] int32
  offsets: np.ndarray  # [R] int32


def _token_keys(trace: Trace, block_size: int, totals: np.ndarray):
  """Dense keys of the full blocks of every request's tokens with KV
  (prompt, then outputs; unknown outputs are ``-1 - r``)."""
  numbering = PrefixNumbering()
  rows = []
  outputs = trace.output_token_ids
  for r in range(len(trace)):
    prompt = np.asarray(trace.input_token_ids[r], np.int32)
    out_len = int(totals[r]) - len(prompt)
    if outputs is not None and len(outputs[r]) >= out_len:
      out = np.asarray(outputs[r][:out_len], np.int32)
    else:
      out = np.full(out_len, -1 - r, np.int32)
    tokens = np.concatenate([prompt, out])
    row, node = [], 0
    for j in range(int(totals[r]) // block_size):
      block = tokens[j * block_size : (j + 1) * block_size].tobytes()
      node = numbering.child(node, block)
      row.append(node - 1)
    rows.append(np.asarray(row, np.int64))
  return rows


def _hash_keys(trace: Trace, block_size: int, totals: np.ndarray):
  """Dense keys of the full prompt blocks' trace ids, -1 (fresh) after."""
  full = np.asarray(trace.input_lengths, np.int64) // block_size
  ids = np.concatenate(
    [row[:n] for row, n in zip(trace.hash_ids, full, strict=True)]
    + [np.zeros(0, np.int64)]
  )
  _, dense = np.unique(ids, return_inverse=True)
  ends = np.cumsum(full)
  rows = []
  for r in range(len(trace)):
    row = np.full(int(totals[r]) // block_size, NONE, np.int64)
    row[: full[r]] = dense[ends[r] - full[r] : ends[r]]
    rows.append(row)
  return rows


def _plan(trace: Trace, block_size: int, totals: np.ndarray) -> _Plan:
  """Keys and slots of a trace the caller has validated."""
  if trace.has_token_ids:
    rows = _token_keys(trace, block_size, totals)
  else:
    rows = _hash_keys(trace, block_size, totals)
  num_full = (totals // block_size).astype(np.int64)
  num_blocks = -(-totals.astype(np.int64) // block_size)
  num_slots = int(num_full.sum())
  width = max(int(num_blocks.max()), 1)
  if num_slots >= 2**31 - 1 or len(trace) * width >= 2**31:
    raise ValueError(
      f"trace too large: {len(trace)} requests x {width} blocks overflow "
      "int32 slot ids"
    )
  keys = np.full((len(trace), width), NONE, np.int32)
  for r, row in enumerate(rows):
    keys[r, : len(row)] = row
  flat = np.concatenate(rows + [np.zeros(0, np.int64)])
  num_keys = int(flat.max()) + 1 if flat.size else 0
  # Slots of one key in publish order, chained: sort slots by (key, slot).
  slots = np.flatnonzero(flat >= 0)
  order = slots[np.argsort(flat[slots], kind="stable")]
  next_slot = np.full(num_slots, num_slots, np.int64)
  same = flat[order[1:]] == flat[order[:-1]]
  next_slot[order[:-1][same]] = order[1:][same]
  first_slot = np.full(max(num_keys, 1), num_slots, np.int64)
  starts = np.concatenate([[True], ~same]) if order.size else np.zeros(0, bool)
  first_slot[flat[order[starts]]] = order[starts]
  return _Plan(
    keys=keys,
    next_slot=next_slot.astype(np.int32),
    first_slot=first_slot.astype(np.int32),
    prompt_lens=np.asarray(trace.input_lengths, np.int32),
    num_blocks=num_blocks.astype(np.int32),
    num_full=num_full.astype(np.int32),
    offsets=(np.cumsum(num_full) - num_full).astype(np.int32),
  )


# ---------------------------------------------------------------------------
# Device side. State of one capacity, a dict of:
#   first_live   [V] int32  per key, a slot at or before its first live one
#   slot_block   [E] int32  block published in each slot (-1: never)
#   block_slot   [N] int32  slot of the key each block carries (-1: none)
#   queue_block  [Q] int32  block on each queue key (-1: none or touched)
#   queue_key    [N] int32  queue key of each block (-1: the null block)
#   head         []  int32  smallest queue key not yet popped
#   tail         []  int32  next queue key a tail release hands out


def _init(
  first_slot, num_slots, num_blocks, num_queue_keys, num_head_keys, capacity
):
  blocks = jnp.arange(num_blocks, dtype=jnp.int32)
  # Queue key k holds block k - H + 1 (H = num_head_keys head keys first).
  rank = jnp.arange(num_queue_keys, dtype=jnp.int32) - num_head_keys
  usable = (blocks >= 1) & (blocks <= capacity)
  return {
    "first_live": first_slot,
    "slot_block": jnp.full((num_slots,), NONE, jnp.int32),
    "block_slot": jnp.full((num_blocks,), NONE, jnp.int32),
    "queue_block": jnp.where((rank >= 0) & (rank < capacity), rank + 1, NONE),
    "queue_key": jnp.where(usable, blocks - 1 + num_head_keys, NONE),
    "head": jnp.int32(num_head_keys),
    "tail": capacity + num_head_keys,
  }


def _lookup(s, next_slot, keys, limit, offset):
  """``[M]`` first live slot and its block for each key looked up.

  Lanes with ``limit`` false, or whose key has no live slot before
  ``offset`` (the running request's first), get a slot ``>= offset`` or
  their starting slot, and ``found`` false.
  """
  num_slots = next_slot.shape[0]

  def probe(slot):
    block = gather(s["slot_block"], slot, NONE)
    live = (slot < offset) & (gather(s["block_slot"], block, NONE) == slot)
    return block, live, limit & (slot < offset) & ~live

  slot = gather(s["first_live"], keys, num_slots)
  block, live, go = probe(slot)

  def body(carry):
    slot, _, _, go = carry
    slot = jnp.where(go, gather(next_slot, slot, num_slots), slot)
    return (slot, *probe(slot))

  slot, block, live, _ = jax.lax.while_loop(
    lambda carry: jnp.any(carry[3]), body, (slot, block, live, go)
  )
  return slot, block, limit & live


def _pop(queue_block, head, count, num_lanes: int, width: int):
  """The first ``count`` live queue keys from ``head``.

  Returns ``[M]`` their blocks in queue order (-1 past ``count``), the new
  head, and whether all were found (they are unless an invariant broke).
  """
  lanes = jnp.arange(width, dtype=jnp.int32)
  limit = queue_block.shape[0]

  def body(carry):
    start, taken, blocks, new_head = carry
    keys = start + lanes
    block = gather(queue_block, keys, NONE)
    live = block >= 0
    rank = taken + jnp.cumsum(live.astype(jnp.int32)) - 1
    take = live & (rank < count)
    blocks = scatter(blocks, rank, block, take)
    last = jnp.max(jnp.where(take, keys, NONE))
    new_head = jnp.where(last >= 0, last + 1, new_head)
    taken = taken + jnp.sum(take.astype(jnp.int32))
    return start + width, taken, blocks, new_head

  _, taken, blocks, new_head = jax.lax.while_loop(
    lambda carry: (carry[1] < count) & (carry[0] < limit),
    body,
    (head, jnp.int32(0), jnp.full((num_lanes,), NONE, jnp.int32), head),
  )
  return blocks, new_head, taken == count


def _step(next_slot, s, x, *, block_size: int, width: int, free_order: str):
  """Serves one request alone; returns the state, its hit blocks and
  whether it broke an invariant."""
  keys, prompt_len, num_blocks, num_full, offset = x
  cols = jnp.arange(keys.shape[0], dtype=jnp.int32)
  limit = (cols < (prompt_len - 1) // block_size) & (keys >= 0)
  slot, block, found = _lookup(s, next_slot, keys, limit, offset)
  hits = jnp.argmin(jnp.append(found, False)).astype(jnp.int32)
  hit = cols < hits
  s = dict(s)
  # Touch: the hit blocks leave the free queue.
  (touched,) = barrier(
    offset, gather(s["queue_key"], jnp.where(hit, block, NONE), NONE)
  )
  s["queue_block"] = scatter(
    s["queue_block"], touched, jnp.full_like(cols, NONE), hit
  )
  popped, head, ok = _pop(
    s["queue_block"], s["head"], num_blocks - hits, keys.shape[0], width
  )
  table = jnp.where(hit, block, gather(popped, cols - hits, NONE))
  used = cols < num_blocks
  fresh = used & ~hit
  publish = fresh & (cols < num_full) & (keys >= 0)
  slots = offset + cols
  s["slot_block"] = scatter(s["slot_block"], slots, table, publish)
  s["block_slot"] = scatter(
    s["block_slot"], table, jnp.where(publish, slots, NONE), fresh
  )
  # Release, the last column first (module docstring, rule 4).
  if free_order == "append":
    num_tail = num_blocks
    queue_keys = s["tail"] + num_blocks - 1 - cols
  else:  # full (hashed) blocks to the tail, the partial one to the head
    num_tail = num_full
    num_head = num_blocks - num_full
    queue_keys = jnp.where(
      cols < num_full,
      s["tail"] + num_full - 1 - cols,
      head - num_head + num_blocks - 1 - cols,
    )
    head = head - num_head
  s["queue_block"] = scatter(s["queue_block"], queue_keys, table, used)
  s["queue_key"] = scatter(s["queue_key"], table, queue_keys, used)
  s["first_live"] = scatter(s["first_live"], keys, slot, limit)
  s["head"] = head
  s["tail"] = s["tail"] + num_tail
  return s, (hits, ~ok)


@functools.partial(
  jax.jit,
  static_argnames=(
    "block_size",
    "num_blocks",
    "num_queue_keys",
    "num_head_keys",
    "width",
    "free_order",
  ),
)
def _run(
  consts,
  xs,
  capacity,
  *,
  block_size,
  num_blocks,
  num_queue_keys,
  num_head_keys,
  width,
  free_order,
):
  """``[R]`` hit blocks and broken-invariant flags of one capacity (the
  first ``num_requests`` rows of ``xs`` run)."""
  first_slot, next_slot = consts
  xs, num_requests = xs
  s = _init(
    first_slot,
    next_slot.shape[0],
    num_blocks,
    num_queue_keys,
    num_head_keys,
    capacity,
  )
  step = functools.partial(
    _step,
    next_slot,
    block_size=block_size,
    width=width,
    free_order=free_order,
  )
  like = (
    jax.ShapeDtypeStruct((), jnp.int32),
    jax.ShapeDtypeStruct((), jnp.bool_),
  )
  _, out = frame.scan_prefix(step, s, xs, num_requests, like)
  return out


def _prepare(
  trace: Trace,
  capacities,
  *,
  block_size: int,
  warmup_fraction: float = 0.5,
  width: int | None = None,
  free_order: str = "prepend_unhashed",
  bucketed: bool = False,
) -> Prepared:
  """Scan inputs for arguments
  :func:`prefixjax.replay.vllm.replay_vllm` has validated (``free_order``:
  :func:`prefixjax.cache.prefix_state.vllm_free_order` of its version).

  ``bucketed``: requests, table columns, keys, slots, blocks and queue
  keys padded to powers of two (:func:`prefixjax.replay.frame.padded`):
  padded requests are never run; padded keys, slots and blocks are never
  named by a real request (blocks past the capacity never enter the free
  queue); the head keys start at their padded count, and queue order is
  key order, so shifting every key by the same amount changes no pop."""
  if free_order not in _FREE_ORDERS:
    raise ValueError(f"{free_order=} must be one of {_FREE_ORDERS}")
  totals = trace.kv_tokens
  plan = _plan(trace, block_size, totals)
  largest = max(capacities)
  blocks = plan.num_blocks.astype(np.int64)
  full = plan.num_full.astype(np.int64)
  if free_order == "append":
    num_head_keys, num_tail_keys = 0, int(blocks.sum())
  else:
    num_head_keys, num_tail_keys = int((blocks - full).sum()), int(full.sum())
  if num_head_keys + largest + num_tail_keys >= 2**31 - 1:
    raise ValueError(
      f"capacity {largest} plus {num_head_keys + num_tail_keys} blocks over "
      "the trace overflow int32 queue keys"
    )
  # The head keys and the rest are bucketed apart, so the program depends
  # on the buckets of the two counts alone.
  padded_head = frame.padded(num_head_keys, bucketed) if num_head_keys else 0
  padded_keys = padded_head + frame.padded(largest + num_tail_keys, bucketed)
  if padded_keys < 2**31 - 1:
    num_head_keys, num_queue_keys = padded_head, padded_keys
  else:  # the buckets overflow int32 where the counts fit: no padding
    num_queue_keys = num_head_keys + largest + num_tail_keys
  num_requests, max_blocks = plan.keys.shape
  max_blocks = frame.padded(max_blocks, bucketed)
  if width is None:  # one window per request, mostly (2 * M is no faster)
    width = min(_WIDTH, 1 << max(max_blocks - 1, 31).bit_length())
  # Slot ids past the real ones mean "none" (the plan's own sentinel is
  # its slot count): every real offset is at most the real count.
  num_slots = plan.next_slot.shape[0]
  slots = frame.padded(num_slots, bucketed)

  def sentinel(x):
    return np.where(x == num_slots, slots, x).astype(np.int32)

  consts = (
    frame.pad_rows(
      sentinel(plan.first_slot),
      frame.padded(plan.first_slot.shape[0], bucketed),
      slots,
    ),
    frame.pad_rows(sentinel(plan.next_slot), slots, slots),
  )
  # Padded requests (never run): no prompt, no blocks, no keys.
  rows = frame.padded(num_requests, bucketed)
  keys = np.full((num_requests, max_blocks), NONE, np.int32)
  keys[:, : plan.keys.shape[1]] = plan.keys
  xs = (
    frame.pad_rows(keys, rows, NONE),
    frame.pad_rows(plan.prompt_lens, rows, 0),
    frame.pad_rows(plan.num_blocks, rows, 0),
    frame.pad_rows(plan.num_full, rows, 0),
    frame.pad_rows(plan.offsets, rows, num_slots),
  )
  return Prepared(
    arrays=(
      tuple(map(to_device, consts)),
      (tuple(map(to_device, xs)), to_device(np.int32(num_requests))),
    ),
    capacities=np.asarray(capacities, np.int32),
    static=dict(
      block_size=block_size,
      num_blocks=frame.padded(largest + 1, bucketed),
      num_queue_keys=num_queue_keys,
      num_head_keys=num_head_keys,
      width=width,
      free_order=free_order,
    ),
    context=(trace, warmup_fraction),
  )


def _engine_run(arrays, capacity, **static):
  consts, xs = arrays
  return _run(consts, xs, capacity, **static)


def _hits(capacities, outputs, block_size, num_requests) -> np.ndarray:
  """``[C, R]`` int64 hit tokens of the ``R = num_requests`` real
  requests, after checking their invariant flags."""
  hits, bad = (np.asarray(x)[:, :num_requests] for x in outputs)
  for capacity, flags in zip(capacities, bad, strict=True):
    if flags.any():
      raise RuntimeError(
        f"internal error: request {int(np.flatnonzero(flags)[0])} found the "
        f"free queue short at capacity {capacity}"
      )
  return np.asarray(hits, np.int64) * block_size


def _points(prepared: Prepared, capacities, outputs):
  trace, warmup_fraction = prepared.context
  block_size = prepared.static["block_size"]
  return frame.points_of_requests(
    POLICY,
    capacities,
    block_size,
    _hits(capacities, outputs, block_size, len(trace)),
    trace.input_lengths,
    warmup_fraction,
  )


def replay_hits(
  trace: Trace,
  block_size: int,
  capacities,
  width: int | None = None,
  free_order: str = "prepend_unhashed",
  bucketed: bool = True,
) -> list[np.ndarray]:
  """``[R]`` int64 hit tokens per capacity, for arguments
  :func:`prefixjax.replay.vllm.replay_vllm` has validated; ``free_order``
  as :func:`prefixjax.cache.prefix_cache.init`'s (vLLM 0.33's by default);
  ``bucketed`` as :data:`ENGINE`'s ``prepare``."""
  capacities = [int(c) for c in capacities]
  if not capacities:
    return []
  prepared = ENGINE.prepare(
    trace,
    capacities,
    block_size=block_size,
    width=width,
    free_order=free_order,
    bucketed=bucketed,
  )
  outputs, _ = frame.compile_and_run(ENGINE, prepared)
  return list(_hits(capacities, outputs, block_size, len(trace)))


ENGINE = ReplayEngine(
  name="vllm",
  semantics="vllm",
  policies=(POLICY,),
  batching=Batching.PER_CAPACITY,
  prepare=_prepare,
  run=_engine_run,
  points=_points,
)
"""vLLM v1 ``KVCacheManager`` semantics, one capacity per run."""
