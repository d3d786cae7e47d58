"""Paging core: block tables, refcounts and a free queue as one pytree.

The whole block manager is a :class:`PagingState`, a frozen pytree of
fixed-shape arrays. Every verb is a pure function ``state -> new state``,
jitted once, that returns the new state first and a small result (with a
``status`` code) second. Nothing is ever half-applied: when a verb fails
(out of blocks, unknown sequence, table overflow) the returned state equals
the input state and the status says why.

Dimensions used in shape comments throughout this module:

* ``N``: ``num_blocks``, blocks in the pool including the null block 0.
* ``S``: ``max_seqs``, sequence slots.
* ``M``: ``max_blocks_per_seq``, columns of a block table.
* ``K``: ``block_size``, token slots per block.

Semantics (see ``DESIGN.md``):

* Token ``t`` of a sequence lives in logical block ``t // K`` at offset
  ``t % K``; its slot in the KV pool is ``block_id * K + offset``. A sequence
  of ``n`` tokens holds ``ceil(n / K)`` blocks.
* Block 0 is the reserved null block: it pads block tables, is never handed
  out and is never on the free queue.
* ``refcounts[b]`` is the number of block-table entries referencing ``b``.
  A block with refcount 0 is on the free queue, an array-linked doubly linked
  list (``free_next`` / ``free_prev`` with ``free_head`` / ``free_tail``).
  Allocation pops from the head. Release appends the blocks that reach
  refcount 0 at the tail in reverse table order (the sequence's last block
  first), as vLLM v1's ``KVCacheManager.free`` does up to vLLM 0.22, so a
  released sequence's deepest blocks are reused first. With
  ``release(..., unpublished_first=True)`` (vLLM >= 0.23's order, see
  :func:`release`) the unpublished ones go to the head instead.
* A block may be written only while its refcount is 1 and it is not
  ``published`` (carries a hash in a prefix index). Otherwise the writer gets
  a fresh block first (copy on write) and the verb returns the ``(src, dst)``
  pair the block-copy kernel must copy.

Cost: every verb touches ``O(M)`` array lanes plus a walk of the free queue
as long as the number of blocks it pops; none scans the pool. Updates are
written as masked gathers and scatters (a failed verb scatters to an
out-of-range index with ``mode="drop"``) rather than ``lax.cond`` over the
state, because under ``jax.vmap`` a ``cond`` becomes a ``select`` over every
array of the state, which costs ``O(N)`` per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._masked import (
  NO_BLOCK,
  NULL_BLOCK,
  barrier,
  compact,
  gather,
  get_row,
  scatter,
  scatter_add,
  set_row,
)
from prefixjax.cache.paging_state import (
  DEFAULT_VLLM_VERSION,
  AllocateResult,
  AppendResult,
  BatchView,
  CopyResult,
  PagingState,
  ReleaseResult,
  Status,
  check_state,
  init,
  status_name,
  vllm_free_order,
)

__all__ = [
  "NO_BLOCK",
  "NULL_BLOCK",
  "AllocateResult",
  "AppendResult",
  "BatchView",
  "CopyResult",
  "PagingState",
  "ReleaseResult",
  "Status",
  "allocate",
  "append",
  "batch_view",
  "check_invariants",
  "check_state",
  "copy_on_write",
  "fork",
  "init",
  "release",
  "slot_mapping",
  "status_name",
  "vllm_free_order",
]


def settle(state: PagingState, *values):
  """:func:`barrier` anchored on the state's free-queue head.

  Pass values read from the state through this before writing the state.
  """
  return barrier(state.free_head, *values)


def integer_scalars(what: str, *values) -> None:
  """Refuses, when traced, ids or counts that are not integers: a bool
  would be read as 0 or 1, a float fails deep inside an index."""
  for value in values:
    dtype = jnp.result_type(value)
    if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"{what} must be integers, got dtype {dtype}")


def blocks_for(num_tokens: jax.Array, block_size: int) -> jax.Array:
  """``ceil(num_tokens / block_size)``, without the int32 overflow of
  ``(n + K - 1) // K`` for ``n`` near ``2**31``."""
  integer_scalars("token counts", num_tokens)
  return num_tokens // block_size + jnp.where(num_tokens % block_size, 1, 0)


def exceeds_int32(tokens: jax.Array, num_new_tokens: jax.Array) -> jax.Array:
  """Whether ``tokens + num_new_tokens`` (``tokens >= 0``) passes int32."""
  return num_new_tokens > jnp.iinfo(jnp.int32).max - tokens


def first_error(*pairs) -> jax.Array:
  """The status of the first failing ``(condition, status)`` pair, else OK."""
  status = jnp.asarray(Status.OK, jnp.int32)
  for failed, code in reversed(pairs):
    status = jnp.where(failed, jnp.int32(code), status)
  return status


def seq_status(state: PagingState, seq_id: jax.Array, want_active: bool):
  integer_scalars("sequence ids", seq_id)
  in_range = (seq_id >= 0) & (seq_id < state.max_seqs)
  active = gather(state.active, seq_id[None], False)[0]
  if want_active:
    return (~in_range, Status.BAD_SEQUENCE), (~active, Status.SEQUENCE_INACTIVE)
  return (~in_range, Status.BAD_SEQUENCE), (active, Status.SEQUENCE_ACTIVE)


# ---------------------------------------------------------------------------
# Free-queue primitives, O(blocks moved).


def pop_free(state: PagingState, count: jax.Array, ok: jax.Array):
  """Pops ``count`` blocks from the free-queue head when ``ok``.

  The caller has checked ``count <= num_free`` and ``count <= M``. Popped
  blocks get refcount 1.

  Returns:
    ``(state, blocks)`` with ``blocks`` ``[M]`` int32 in queue order,
    ``NO_BLOCK`` beyond ``count`` (all ``NO_BLOCK`` when not ``ok``).
  """
  m = state.max_blocks_per_seq
  count = jnp.where(ok, count, 0)
  free_next = state.free_next

  # Walk the list reading ``free_next`` only; the writes happen afterwards
  # as one scatter, so XLA never copies the pool-sized arrays in the loop.
  def body(carry):
    i, cur, blocks = carry
    blocks = blocks.at[i].set(cur)
    return i + 1, gather(free_next, cur[None], NO_BLOCK)[0], blocks

  _, new_head, blocks = jax.lax.while_loop(
    lambda c: c[0] < count,
    body,
    (jnp.int32(0), state.free_head, jnp.full((m,), NO_BLOCK, jnp.int32)),
  )
  blocks, new_head = settle(state, blocks, new_head)
  lanes = jnp.arange(m) < count
  empty = new_head == NO_BLOCK
  state = state.replace(
    free_next=scatter(state.free_next, blocks, NO_BLOCK, lanes),
    free_prev=scatter(
      scatter(state.free_prev, blocks, NO_BLOCK, lanes),
      new_head[None],
      NO_BLOCK,
      count > 0,
    ),
    refcounts=scatter(state.refcounts, blocks, 1, lanes),
    # Reuse drops the block's old identity; the prefix index removes the
    # popped blocks' hashes using the returned ids.
    published=scatter(state.published, blocks, False, lanes),
    free_head=new_head,
    free_tail=jnp.where(empty, NO_BLOCK, state.free_tail),
    num_free=state.num_free - count,
  )
  return state, blocks


def push_free_tail(state: PagingState, blocks: jax.Array, count: jax.Array):
  """Appends ``blocks[:count]`` (``[L]`` int32, in order) at the queue tail.

  The caller guarantees the blocks have refcount 0 and are not queued.
  """
  lanes = jnp.arange(blocks.shape[0]) < count
  prev_of = jnp.concatenate([state.free_tail[None], blocks[:-1]])
  next_of = jnp.concatenate([blocks[1:], jnp.full((1,), NO_BLOCK, jnp.int32)])
  next_of = jnp.where(
    jnp.arange(blocks.shape[0]) + 1 < count, next_of, NO_BLOCK
  )
  any_new = count > 0
  first = blocks[0]
  last = gather(blocks, (count - 1)[None], NO_BLOCK)[0]
  old_tail = state.free_tail
  free_next = scatter(state.free_next, blocks, next_of, lanes)
  free_next = scatter(free_next, old_tail[None], first, any_new)
  return state.replace(
    free_next=free_next,
    free_prev=scatter(state.free_prev, blocks, prev_of, lanes),
    free_head=jnp.where(
      any_new & (old_tail == NO_BLOCK), first, state.free_head
    ),
    free_tail=jnp.where(any_new, last, old_tail),
    num_free=state.num_free + count,
  )


def push_free_head(
  state: PagingState, blocks: jax.Array, count: jax.Array, after=None
):
  """Puts ``blocks[:count]`` (``[L]`` int32) at the queue head, keeping
  their order (``blocks[0]`` becomes the head), as vLLM's
  ``FreeKVCacheBlockQueue.prepend_n`` (``vllm/v1/core/kv_cache_utils.py``,
  0.33.0).

  ``after``: optional ``[]`` int32, a queued block; the blocks then go
  right behind it instead (at the head when it is ``NO_BLOCK``).

  The caller guarantees the blocks have refcount 0 and are not queued.
  """
  n = blocks.shape[0]
  lanes = jnp.arange(n) < count
  none = jnp.int32(NO_BLOCK)
  at_head = True if after is None else after == NO_BLOCK
  anchor = none if after is None else after
  # The block the new run ends before (the old head when at the head).
  follower = state.free_head
  if after is not None:
    behind = gather(state.free_next, anchor[None], NO_BLOCK)[0]
    follower = settle(state, jnp.where(at_head, state.free_head, behind))[0]
  next_of = jnp.concatenate([blocks[1:], none[None]])
  next_of = jnp.where(jnp.arange(n) + 1 < count, next_of, follower)
  prev_of = jnp.concatenate([anchor[None], blocks[:-1]])
  any_new = count > 0
  first = blocks[0]
  last = gather(blocks, (count - 1)[None], NO_BLOCK)[0]
  free_next = scatter(state.free_next, blocks, next_of, lanes)
  if after is not None:
    free_next = scatter(free_next, anchor[None], first, any_new & ~at_head)
  free_prev = scatter(state.free_prev, blocks, prev_of, lanes)
  return state.replace(
    free_next=free_next,
    free_prev=scatter(free_prev, follower[None], last, any_new),
    free_head=jnp.where(any_new & at_head, first, state.free_head),
    free_tail=jnp.where(
      any_new & (follower == NO_BLOCK), last, state.free_tail
    ),
    num_free=state.num_free + count,
  )


def unlink_free(state: PagingState, block: jax.Array, ok: jax.Array):
  """Removes one queued ``block`` from anywhere in the free queue when ``ok``.

  O(1): used when a cached free block is touched by a prefix hit.
  """
  prev = gather(state.free_prev, block[None], NO_BLOCK)[0]
  nxt = gather(state.free_next, block[None], NO_BLOCK)[0]
  prev, nxt = settle(state, prev, nxt)
  free_next = scatter(state.free_next, prev[None], nxt, ok)
  free_next = scatter(free_next, block[None], NO_BLOCK, ok)
  free_prev = scatter(state.free_prev, nxt[None], prev, ok)
  free_prev = scatter(free_prev, block[None], NO_BLOCK, ok)
  return state.replace(
    free_next=free_next,
    free_prev=free_prev,
    free_head=jnp.where(ok & (prev == NO_BLOCK), nxt, state.free_head),
    free_tail=jnp.where(ok & (nxt == NO_BLOCK), prev, state.free_tail),
    num_free=state.num_free - ok.astype(jnp.int32),
  )


def drop_refs(
  state: PagingState,
  blocks: jax.Array,
  lanes: jax.Array,
  unpublished_first: bool = False,
):
  """Lowers refcounts of ``blocks[lanes]`` (distinct ids) by one.

  Blocks that reach 0 join the free-queue tail in the order given; with
  ``unpublished_first`` (static) the unpublished ones go to the head
  instead, in the order given (the first becomes the head).

  Returns:
    ``(state, freed, num_freed)``: ``freed`` ``[L]`` in the order given.
  """
  new_counts = settle(state, gather(state.refcounts, blocks) - 1)[0]
  refcounts = scatter(state.refcounts, blocks, new_counts, lanes)
  freed_lanes = lanes & (new_counts == 0)
  freed, num_freed = compact(blocks, freed_lanes)
  state = state.replace(refcounts=refcounts)
  if not unpublished_first:
    return push_free_tail(state, freed, num_freed), freed, num_freed
  published = settle(state, gather(state.published, blocks, False))[0]
  to_tail, num_tail = compact(blocks, freed_lanes & published)
  to_head, num_head = compact(blocks, freed_lanes & ~published)
  state = push_free_tail(state, to_tail, num_tail)
  return push_free_head(state, to_head, num_head), freed, num_freed


# ---------------------------------------------------------------------------
# Verbs (jitted implementations take int32 scalars).


@jax.jit
def allocate(state: PagingState, seq_id, num_tokens):
  """Starts sequence ``seq_id`` holding ``num_tokens`` tokens.

  Pops ``ceil(num_tokens / K)`` blocks from the free-queue head.

  Args:
    state: the pool.
    seq_id: int32 scalar, a free sequence slot.
    num_tokens: int32 scalar, tokens to hold (0 allowed).

  Returns:
    ``(new_state, AllocateResult)``. Status ``SEQUENCE_ACTIVE``,
    ``BAD_SEQUENCE``, ``BAD_COUNT``, ``TABLE_OVERFLOW`` or ``OUT_OF_BLOCKS``
    leaves the state unchanged.

  Example:
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, r = paging.allocate(s, 0, 6)
    >>> s.block_tables[0].tolist(), int(r.status)
    ([1, 2, 0], 0)
  """
  m = state.max_blocks_per_seq
  count = blocks_for(num_tokens, state.block_size)
  status = first_error(
    *seq_status(state, seq_id, want_active=False),
    (num_tokens < 0, Status.BAD_COUNT),
    (count > m, Status.TABLE_OVERFLOW),
    (count > state.num_free, Status.OUT_OF_BLOCKS),
  )
  status, count = settle(state, status, count)
  ok = status == Status.OK
  state, blocks = pop_free(state, count, ok)
  row = jnp.where(blocks == NO_BLOCK, NULL_BLOCK, blocks)
  state = state.replace(
    block_tables=set_row(state.block_tables, seq_id, row, ok),
    num_tokens=scatter(state.num_tokens, seq_id[None], num_tokens, ok),
    active=scatter(state.active, seq_id[None], True, ok),
  )
  return state, AllocateResult(status, blocks, jnp.where(ok, count, 0))


def last_block(state: PagingState, seq_id):
  """The block holding the next write position and whether it needs a copy.

  Returns ``(row, col, src, needed)``: ``needed`` when the sequence's last
  block is partially filled and shared (refcount > 1) or published.
  """
  k = state.block_size
  tokens = gather(state.num_tokens, seq_id[None])[0]
  col = tokens // k
  row = get_row(state.block_tables, seq_id)
  src = gather(row, col[None], NULL_BLOCK)[0]
  shared = gather(state.refcounts, src[None])[0] > 1
  published = gather(state.published, src[None], False)[0]
  needed = (tokens % k != 0) & (shared | published)
  return row, col, src, needed


def _copy_last(state: PagingState, seq_id, last, do):
  """Replaces the last block by a fresh copy when ``do``.

  ``last`` is ``(row, col, src)`` from :func:`last_block`, read before any
  write. Returns ``(state, src [1], dst [1])``, ``NO_BLOCK`` lanes when not
  ``do``.
  """
  row, col, src = last
  state, fresh = pop_free(state, jnp.int32(1), do)
  dst = fresh[0]
  row = scatter(row, col[None], dst, do)
  state = state.replace(
    block_tables=set_row(state.block_tables, seq_id, row, do)
  )
  state, _, _ = drop_refs(state, src[None], do[None])
  no = jnp.full((1,), NO_BLOCK, jnp.int32)
  return state, jnp.where(do, src[None], no), jnp.where(do, dst[None], no)


@jax.jit
def copy_on_write(state: PagingState, seq_id):
  """Makes the block at the sequence's next write position writable.

  If the sequence's last block is partially filled and is shared
  (refcount > 1) or published, the sequence gets a fresh block in its place
  and the pair ``(src, dst)`` is returned for the block-copy kernel. The old
  block loses one reference (joining the free queue if that was the last).

  Args:
    state: the pool.
    seq_id: int32 scalar, a live sequence.

  Returns:
    ``(new_state, CopyResult)``.

  Example:
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, _ = paging.allocate(s, 0, 6)
    >>> s, _ = paging.fork(s, 0, 1)
    >>> s, c = paging.copy_on_write(s, 1)
    >>> c.src.tolist(), c.dst.tolist()
    ([2], [3])
  """
  *last, needed = last_block(state, seq_id)
  status = first_error(
    *seq_status(state, seq_id, want_active=True),
    (needed & (state.num_free < 1), Status.OUT_OF_BLOCKS),
  )
  status, do, last = settle(state, status, (status == Status.OK) & needed, last)
  state, src, dst = _copy_last(state, seq_id, last, do)
  return state, CopyResult(status, src, dst, do.astype(jnp.int32))


@jax.jit
def append(state: PagingState, seq_id, num_new_tokens):
  """Grows a live sequence by ``num_new_tokens`` tokens.

  New blocks are taken only when the tokens cross a block boundary. If the
  first new token lands in a partially filled block that is shared or
  published, that block is copied first (see :func:`copy_on_write`) and the
  pair is returned in the result.

  Args:
    state: the pool.
    seq_id: int32 scalar, a live sequence.
    num_new_tokens: int32 scalar >= 0.

  Returns:
    ``(new_state, AppendResult)``; on a non-OK status the state is unchanged.

  Example:
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, _ = paging.allocate(s, 0, 3)
    >>> s, r = paging.append(s, 0, 2)
    >>> s.block_tables[0].tolist(), int(s.num_tokens[0])
    ([1, 2, 0], 5)
  """
  k = state.block_size
  m = state.max_blocks_per_seq
  tokens = gather(state.num_tokens, seq_id[None])[0]
  have = blocks_for(tokens, k)
  total = tokens + num_new_tokens
  count = blocks_for(total, k) - have
  *last, copy_needed = last_block(state, seq_id)
  copy_needed = copy_needed & (num_new_tokens > 0)
  status = first_error(
    *seq_status(state, seq_id, want_active=True),
    (num_new_tokens < 0, Status.BAD_COUNT),
    # A total past int32 would wrap negative and pass the next check.
    (exceeds_int32(tokens, num_new_tokens), Status.TABLE_OVERFLOW),
    (blocks_for(total, k) > m, Status.TABLE_OVERFLOW),
    (
      count + copy_needed.astype(jnp.int32) > state.num_free,
      Status.OUT_OF_BLOCKS,
    ),
  )
  status, count, total, have, copy_needed, last = settle(
    state, status, count, total, have, copy_needed, last
  )
  ok = status == Status.OK
  state, src, dst = _copy_last(state, seq_id, last, ok & copy_needed)
  state, blocks = pop_free(state, count, ok)
  # New blocks go to columns have, have + 1, ...
  lanes = jnp.arange(m)
  row = settle(state, get_row(state.block_tables, seq_id))[0]
  new_in_row = gather(blocks, lanes - have, NO_BLOCK)
  row = jnp.where(new_in_row != NO_BLOCK, new_in_row, row)
  state = state.replace(
    block_tables=set_row(state.block_tables, seq_id, row, ok),
    num_tokens=scatter(state.num_tokens, seq_id[None], total, ok),
  )
  num_copies = (ok & copy_needed).astype(jnp.int32)
  return state, AppendResult(
    status, blocks, jnp.where(ok, count, 0), src, dst, num_copies
  )


@jax.jit
def fork(state: PagingState, parent_id, child_id):
  """Starts ``child_id`` sharing every block of ``parent_id``.

  Used for parallel sampling and beam search: all shared blocks gain a
  reference; the first write into the shared partial last block goes
  through copy on write.

  Args:
    state: the pool.
    parent_id: int32 scalar, a live sequence.
    child_id: int32 scalar, a free slot.

  Returns:
    ``(new_state, status)`` with ``status`` an int32 :class:`Status`.

  Example:
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, _ = paging.allocate(s, 0, 6)
    >>> s, status = paging.fork(s, 0, 1)
    >>> s.refcounts[1:3].tolist()
    [2, 2]
  """
  parent_checks = seq_status(state, parent_id, want_active=True)
  child_checks = seq_status(state, child_id, want_active=False)
  status = first_error(*parent_checks, *child_checks)
  ok = status == Status.OK
  row = get_row(state.block_tables, parent_id)
  tokens = gather(state.num_tokens, parent_id[None])[0]
  lanes = jnp.arange(state.max_blocks_per_seq) < blocks_for(
    tokens, state.block_size
  )
  status, ok, row, tokens, lanes = settle(state, status, ok, row, tokens, lanes)
  state = state.replace(
    block_tables=set_row(state.block_tables, child_id, row, ok),
    num_tokens=scatter(state.num_tokens, child_id[None], tokens, ok),
    active=scatter(state.active, child_id[None], True, ok),
    refcounts=scatter_add(state.refcounts, row, 1, ok & lanes),
  )
  return state, status


def release(
  state: PagingState, seq_id, vllm_version: str = DEFAULT_VLLM_VERSION
):
  """Ends a live sequence, dropping one reference from each of its blocks.

  Blocks that reach refcount 0 join the free queue in reverse table order
  (the last block first), as vLLM v1's ``SingleTypeKVCacheManager.free``
  passes them to ``BlockPool.free_blocks``, in the order of the vLLM
  release named by ``vllm_version`` (:func:`vllm_free_order`):

  * ``"0.33"`` (the default; every release from 0.23 on): the blocks that
    are not ``published`` (carry no hash) at the head, keeping that order,
    so the sequence's last unpublished block is the next one handed out,
    and the published ones at the tail (``BlockPool.free_blocks``, lines
    816-847 of ``vllm/v1/core/block_pool.py`` in 0.33.0: ``prepend_n`` for
    blocks with ``block_hash is None``, ``append_n`` for the others);
  * ``"0.22"`` (0.8 .. 0.22): all at the tail (``free_blocks`` appends
    every block, ``vllm/v1/core/block_pool.py`` of 0.22.0).

  Args:
    state: the pool.
    seq_id: int32 scalar, a live sequence.
    vllm_version: static, a vLLM release: ``"latest"``, ``"0.8"`` ..
      ``"0.33"`` (a patch number may follow).

  Returns:
    ``(new_state, ReleaseResult)``.

  Raises:
    ValueError: an unknown ``vllm_version`` (the message lists the
      accepted ones).

  Example:
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=4, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, _ = paging.allocate(s, 0, 6)
    >>> s, r = paging.release(s, 0, vllm_version="0.22")
    >>> r.freed_blocks[:2].tolist(), paging.free_queue_order(s)
    ([2, 1], [3, 2, 1])
    >>> s, _ = paging.allocate(s, 0, 6)  # blocks 3, 2
    >>> s = s.replace(published=s.published.at[3].set(True))
    >>> s, r = paging.release(s, 0)  # vLLM 0.33: unpublished to the head
    >>> r.freed_blocks[:2].tolist(), paging.free_queue_order(s)
    ([2, 3], [2, 1, 3])
  """
  head = vllm_free_order(vllm_version) == "prepend_unhashed"
  return _release(state, seq_id, head)


@functools.partial(jax.jit, static_argnames="unpublished_first")
def _release(state: PagingState, seq_id, unpublished_first: bool):
  status = first_error(*seq_status(state, seq_id, want_active=True))
  ok = status == Status.OK
  row = get_row(state.block_tables, seq_id)
  tokens = gather(state.num_tokens, seq_id[None])[0]
  lanes = ok & (
    jnp.arange(state.max_blocks_per_seq) < blocks_for(tokens, state.block_size)
  )
  status, ok, row, lanes = settle(state, status, ok, row, lanes)
  # vLLM v1 KVCacheManager.free releases blocks in reverse order so that the
  # tail (deepest) blocks reach the free queue first and are reused first.
  state, freed, num_freed = drop_refs(
    state, row[::-1], lanes[::-1], unpublished_first
  )
  state = state.replace(
    block_tables=set_row(state.block_tables, seq_id, jnp.zeros_like(row), ok),
    num_tokens=scatter(state.num_tokens, seq_id[None], 0, ok),
    active=scatter(state.active, seq_id[None], False, ok),
  )
  return state, ReleaseResult(status, freed, num_freed)


@jax.jit
def slot_mapping(state: PagingState, seq_ids, positions):
  """Maps token positions to KV-pool slots ``block_id * K + offset``.

  Args:
    state: the pool.
    seq_ids: ``[T]`` int32 sequence of each token.
    positions: ``[T]`` int32 position of each token within its sequence.

  Returns:
    ``[T]`` int32 slots; ``NO_BLOCK`` (-1) where the position is not held by
    the sequence (negative, ``>= num_tokens``, or an unknown sequence), so a
    KV write can drop it.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import paging
    >>> s = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                 max_blocks_per_seq=3)
    >>> s, _ = paging.allocate(s, 0, 6)
    >>> paging.slot_mapping(s, jnp.zeros(3, jnp.int32),
    ...                     jnp.array([0, 5, 6], jnp.int32)).tolist()
    [4, 9, -1]
  """
  k = state.block_size
  rows = state.block_tables.at[
    jnp.where((seq_ids >= 0) & (seq_ids < state.max_seqs), seq_ids, 0)
  ].get(mode="clip")
  col = positions // k
  block = jnp.take_along_axis(
    rows, jnp.clip(col, 0, state.max_blocks_per_seq - 1)[..., None], axis=-1
  )[..., 0]
  tokens = gather(state.num_tokens, seq_ids, 0)
  valid = (
    (seq_ids >= 0)
    & (seq_ids < state.max_seqs)
    & (positions >= 0)
    & (positions < tokens)
  )
  return jnp.where(valid, block * k + positions % k, NO_BLOCK)


@jax.jit
def batch_view(state: PagingState, seq_ids):
  """Block tables and lengths of ``seq_ids`` for the attention kernels.

  Args:
    state: the pool.
    seq_ids: ``[B]`` int32; inactive or out-of-range ids give a row of
      ``NULL_BLOCK`` and length 0, with a non-OK ``status``.

  Returns:
    A :class:`BatchView` with ``block_tables [B, M]``, ``lengths [B]`` and
    each row's ``status [B]``.
  """
  in_range = (seq_ids >= 0) & (seq_ids < state.max_seqs)
  valid = in_range & gather(state.active, seq_ids, False)
  rows = state.block_tables.at[jnp.where(valid, seq_ids, 0)].get(mode="clip")
  rows = jnp.where(valid[:, None], rows, NULL_BLOCK)
  lengths = jnp.where(valid, gather(state.num_tokens, seq_ids), 0)
  status = jnp.where(
    in_range,
    jnp.where(valid, Status.OK, Status.SEQUENCE_INACTIVE),
    Status.BAD_SEQUENCE,
  ).astype(jnp.int32)
  return BatchView(rows, lengths, status)


# ---------------------------------------------------------------------------
# Invariants (host side, for tests and debugging).


def check_invariants(state: PagingState) -> list[str]:
  """Checks the paging invariants on the host; returns violations (or ``[]``).

  * every refcount equals the number of table entries referencing the block;
  * the free queue holds exactly the refcount-0 blocks, each once, with
    consistent links, head, tail and ``num_free``;
  * the null block is never referenced, never queued;
  * table entries past a sequence's ``ceil(num_tokens / K)`` are
    ``NULL_BLOCK``; inactive sequences hold nothing.
  """
  check_state(state)
  errors: list[str] = []
  tables = np.asarray(state.block_tables)
  tokens = np.asarray(state.num_tokens)
  active = np.asarray(state.active)
  refcounts = np.asarray(state.refcounts)
  nxt = np.asarray(state.free_next)
  prv = np.asarray(state.free_prev)
  n = refcounts.shape[0]
  k = state.block_size
  counts = np.zeros(n, np.int64)
  for s in range(tables.shape[0]):
    held = -(-int(tokens[s]) // k)
    if not active[s] and (tokens[s] != 0 or tables[s].any()):
      errors.append(f"inactive sequence {s} holds tokens or blocks")
    if tokens[s] < 0 or held > tables.shape[1]:
      errors.append(f"sequence {s} has bad num_tokens {tokens[s]}")
      continue
    row = tables[s, :held]
    if (row == NULL_BLOCK).any() or (row < 0).any() or (row >= n).any():
      errors.append(f"sequence {s} table {row.tolist()} has a bad block id")
      continue
    if len(set(row.tolist())) != len(row):
      errors.append(f"sequence {s} references a block twice: {row.tolist()}")
    if tables[s, held:].any():
      errors.append(f"sequence {s} has entries past its {held} blocks")
    np.add.at(counts, row, 1)
  if counts[NULL_BLOCK] or refcounts[NULL_BLOCK]:
    errors.append("null block is referenced")
  bad = np.nonzero(counts != refcounts)[0]
  for b in bad[:10]:
    errors.append(f"block {b}: refcount {refcounts[b]} but {counts[b]} refs")
  # Walk the free queue.
  order: list[int] = []
  seen = set()
  cur, prev = int(state.free_head), NO_BLOCK
  while cur != NO_BLOCK:
    if cur in seen or not 0 < cur < n:
      errors.append(f"free queue broken at block {cur} (cycle or bad id)")
      break
    if prv[cur] != prev:
      errors.append(f"free_prev[{cur}]={prv[cur]} but previous is {prev}")
    seen.add(cur)
    order.append(cur)
    prev, cur = cur, int(nxt[cur])
  if prev != int(state.free_tail):
    errors.append(f"free_tail={int(state.free_tail)} but walk ends at {prev}")
  if len(order) != int(state.num_free):
    errors.append(f"num_free={int(state.num_free)} but queue has {len(order)}")
  want = set(np.nonzero(refcounts == 0)[0].tolist()) - {NULL_BLOCK}
  if seen != want:
    extra = sorted(seen - want)[:10]
    missing = sorted(want - seen)[:10]
    errors.append(f"free queue != refcount-0 blocks: +{extra} -{missing}")
  off_queue = np.ones(n, bool)
  off_queue[list(seen)] = False
  if (nxt[off_queue] != NO_BLOCK).any() or (prv[off_queue] != NO_BLOCK).any():
    errors.append("a block off the free queue has links")
  return errors


def free_queue_order(state: PagingState) -> list[int]:
  """The free queue from head to tail, as a Python list (host side)."""
  nxt = np.asarray(state.free_next)
  out, cur = [], int(state.free_head)
  while cur != NO_BLOCK and len(out) <= nxt.shape[0]:
    out.append(cur)
    cur = int(nxt[cur])
  return out
