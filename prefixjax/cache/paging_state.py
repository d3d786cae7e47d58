"""The paging core's state, result types and constructor.

:class:`PagingState` (the block manager as one frozen pytree), the
:class:`Status` codes and the verbs' result tuples, and :func:`init`; the
verbs themselves are in :mod:`prefixjax.cache.paging`, which re-exports
everything here. Dimensions: ``N`` blocks (the null block 0 included),
``S`` sequence slots, ``M`` block-table columns, ``K`` tokens per block.
"""

from __future__ import annotations

import enum
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import _struct as struct
from prefixjax._masked import NO_BLOCK

__all__ = [
  "DEFAULT_VLLM_VERSION",
  "FREE_ORDERS",
  "VLLM_FREE_ORDERS",
  "AllocateResult",
  "AppendResult",
  "BatchView",
  "CopyResult",
  "PagingState",
  "ReleaseResult",
  "Status",
  "check_state",
  "init",
  "status_name",
  "vllm_free_order",
]


class Status(enum.IntEnum):
  """Status codes returned by the verbs (as an int32 scalar ``status``).

  A non-``OK`` status always comes with the state unchanged.
  """

  OK = 0
  OUT_OF_BLOCKS = 1
  """Not enough free blocks for the request."""
  BAD_SEQUENCE = 2
  """Sequence id outside ``[0, max_seqs)``."""
  SEQUENCE_INACTIVE = 3
  """The verb needs a live sequence but the slot is free."""
  SEQUENCE_ACTIVE = 4
  """The verb needs a free slot but the sequence is live."""
  TABLE_OVERFLOW = 5
  """The sequence would need more than ``max_blocks_per_seq`` blocks."""
  BAD_COUNT = 6
  """A negative token count."""


@struct.dataclass
class PagingState:
  """Block manager state; all arrays are allocated at full size up front.

  Attributes:
    block_tables: ``[S, M]`` int32 block ids per sequence, padded with
      ``NULL_BLOCK``.
    num_tokens: ``[S]`` int32 tokens held by each sequence.
    active: ``[S]`` bool, whether the sequence slot is live.
    refcounts: ``[N]`` int32 block-table entries referencing each block.
    published: ``[N]`` bool, the block carries a hash in a prefix index and
      is therefore read-only (writes go through copy on write).
    free_next: ``[N]`` int32 next block on the free queue, ``NO_BLOCK`` at the
      tail and for blocks not on the queue.
    free_prev: ``[N]`` int32 previous block on the free queue, ``NO_BLOCK`` at
      the head and for blocks not on the queue.
    free_head: ``[]`` int32 first block of the free queue (``NO_BLOCK`` if
      empty); the next block handed out.
    free_tail: ``[]`` int32 last block of the free queue (``NO_BLOCK`` if
      empty).
    num_free: ``[]`` int32 blocks on the free queue.
    block_size: static, token slots per block ``K``.
  """

  block_tables: jax.Array  # [S, M] int32
  num_tokens: jax.Array  # [S] int32
  active: jax.Array  # [S] bool
  refcounts: jax.Array  # [N] int32
  published: jax.Array  # [N] bool
  free_next: jax.Array  # [N] int32
  free_prev: jax.Array  # [N] int32
  free_head: jax.Array  # [] int32
  free_tail: jax.Array  # [] int32
  num_free: jax.Array  # [] int32
  block_size: int = struct.field(pytree_node=False, default=16)

  @property
  def num_blocks(self) -> int:
    """``N``: blocks in the pool, including the null block."""
    return self.refcounts.shape[-1]

  @property
  def max_seqs(self) -> int:
    """``S``: sequence slots."""
    return self.block_tables.shape[-2]

  @property
  def max_blocks_per_seq(self) -> int:
    """``M``: columns of a block table."""
    return self.block_tables.shape[-1]

  @property
  def max_tokens_per_seq(self) -> int:
    """Tokens one sequence can hold: ``M * K``."""
    return self.max_blocks_per_seq * self.block_size


class AllocateResult(NamedTuple):
  """Result of :func:`allocate`.

  Attributes:
    status: ``[]`` int32 :class:`Status`.
    new_blocks: ``[M]`` int32 blocks popped from the free queue, in table
      order, ``NO_BLOCK`` beyond ``num_new_blocks``.
    num_new_blocks: ``[]`` int32.
  """

  status: jax.Array  # [] int32
  new_blocks: jax.Array  # [M] int32
  num_new_blocks: jax.Array  # [] int32


class CopyResult(NamedTuple):
  """Result of :func:`copy_on_write`.

  Attributes:
    status: ``[]`` int32 :class:`Status`.
    src: ``[1]`` int32 block to copy from, ``NO_BLOCK`` if no copy.
    dst: ``[1]`` int32 block to copy into, ``NO_BLOCK`` if no copy.
    num_copies: ``[]`` int32, 0 or 1.
  """

  status: jax.Array  # [] int32
  src: jax.Array  # [1] int32
  dst: jax.Array  # [1] int32
  num_copies: jax.Array  # [] int32


class AppendResult(NamedTuple):
  """Result of :func:`append`: new blocks plus any copy on write.

  Attributes:
    status: ``[]`` int32 :class:`Status`.
    new_blocks: ``[M]`` int32 blocks added at the end of the table.
    num_new_blocks: ``[]`` int32.
    src: ``[1]`` int32 copy-on-write source, ``NO_BLOCK`` if none.
    dst: ``[1]`` int32 copy-on-write destination, ``NO_BLOCK`` if none.
    num_copies: ``[]`` int32, 0 or 1.
  """

  status: jax.Array  # [] int32
  new_blocks: jax.Array  # [M] int32
  num_new_blocks: jax.Array  # [] int32
  src: jax.Array  # [1] int32
  dst: jax.Array  # [1] int32
  num_copies: jax.Array  # [] int32


class ReleaseResult(NamedTuple):
  """Result of :func:`release`.

  Attributes:
    status: ``[]`` int32 :class:`Status`.
    freed_blocks: ``[M]`` int32 blocks that reached refcount 0 in reverse
      table order (the order they joined the queue tail; in vLLM 0.23+'s
      order the unpublished ones, in this order, were put at the head
      instead), ``NO_BLOCK`` beyond ``num_freed``.
    num_freed: ``[]`` int32.
  """

  status: jax.Array  # [] int32
  freed_blocks: jax.Array  # [M] int32
  num_freed: jax.Array  # [] int32


class BatchView(NamedTuple):
  """Block tables and lengths in the layout the attention kernels take.

  Attributes:
    block_tables: ``[B, M]`` int32, ``NULL_BLOCK`` padded.
    lengths: ``[B]`` int32 tokens per sequence (0 for inactive slots).
    status: ``[B]`` int32 :class:`Status` of each row: ``OK``,
      ``BAD_SEQUENCE`` (an id outside ``[0, max_seqs)``) or
      ``SEQUENCE_INACTIVE``; the row is then all ``NULL_BLOCK`` and length
      0, which a kernel reads as an empty sequence.
  """

  block_tables: jax.Array  # [B, M] int32
  lengths: jax.Array  # [B] int32
  status: jax.Array  # [B] int32


# ---------------------------------------------------------------------------
# Construction and boundary validation.


def _require_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}={value!r} must be an int")
  if value < minimum:
    raise ValueError(f"{name}={value} must be >= {minimum}")
  return int(value)


def init(
  *,
  num_blocks: int,
  block_size: int,
  max_seqs: int,
  max_blocks_per_seq: int,
) -> PagingState:
  """Creates an empty pool: every block but the null block is free.

  The free queue starts in block-id order ``1, 2, ..., N - 1``.

  Args:
    num_blocks: ``N``, blocks in the pool including the null block 0; at
      least 2.
    block_size: ``K``, token slots per block; at least 1.
    max_seqs: ``S``, sequence slots; at least 1.
    max_blocks_per_seq: ``M``, block-table columns; at least 1.

  Returns:
    A :class:`PagingState`.

  Raises:
    TypeError: a size is not an int.
    ValueError: a size is out of range, or ``N * K`` overflows int32 slots.

  Example:
    >>> from prefixjax.cache import paging
    >>> state = paging.init(num_blocks=8, block_size=4, max_seqs=2,
    ...                     max_blocks_per_seq=3)
    >>> int(state.num_free)
    7
  """
  num_blocks = _require_int("num_blocks", num_blocks, 2)
  block_size = _require_int("block_size", block_size, 1)
  max_seqs = _require_int("max_seqs", max_seqs, 1)
  max_blocks_per_seq = _require_int("max_blocks_per_seq", max_blocks_per_seq, 1)
  if num_blocks * block_size >= 2**31:
    raise ValueError(
      f"{num_blocks=} * {block_size=} token slots overflow int32 slot ids"
    )
  return _empty(num_blocks, block_size, max_seqs, max_blocks_per_seq)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty(num_blocks, block_size, max_seqs, max_blocks_per_seq):
  """The empty pool of :func:`init`, in one compiled program (outside
  ``jit`` each array constructor would compile one of its own)."""
  ids = jnp.arange(num_blocks, dtype=jnp.int32)
  # Free queue 1 -> 2 -> ... -> N-1; the null block 0 is not on it.
  free_next = jnp.where(ids + 1 < num_blocks, ids + 1, NO_BLOCK)
  free_prev = jnp.where(ids - 1 >= 1, ids - 1, NO_BLOCK)
  free_next = free_next.at[0].set(NO_BLOCK)
  return PagingState(
    block_tables=jnp.zeros((max_seqs, max_blocks_per_seq), jnp.int32),
    num_tokens=jnp.zeros((max_seqs,), jnp.int32),
    active=jnp.zeros((max_seqs,), jnp.bool_),
    refcounts=jnp.zeros((num_blocks,), jnp.int32),
    published=jnp.zeros((num_blocks,), jnp.bool_),
    free_next=free_next.astype(jnp.int32),
    free_prev=free_prev.astype(jnp.int32),
    free_head=jnp.asarray(1, jnp.int32),
    free_tail=jnp.asarray(num_blocks - 1, jnp.int32),
    num_free=jnp.asarray(num_blocks - 1, jnp.int32),
    block_size=block_size,
  )


def check_state(state) -> None:
  """Raises ``TypeError`` unless ``state`` is a ``PagingState``."""
  if not isinstance(state, PagingState):
    raise TypeError(f"state must be a PagingState, got {type(state).__name__}")


@functools.cache
def _status_names() -> dict[int, str]:
  return {int(s): s.name for s in Status}


def status_name(status) -> str:
  """Human-readable name of a status code (host side)."""
  return _status_names().get(int(status), f"UNKNOWN({int(status)})")


# ---------------------------------------------------------------------------
# vLLM's release order, by release (the paging core's release and the
# prefix cache's take a version name).

FREE_ORDERS = ("append", "prepend_unhashed")
"""Accepted ``free_order`` values."""

VLLM_FREE_ORDERS = {"0.33": "prepend_unhashed", "0.22": "append"}
"""The release order of each vLLM release line, read from its source.

Both free a request's blocks in reverse table order
(``vllm/v1/core/single_type_kv_cache_manager.py``
``SingleTypeKVCacheManager.free``, line 598 of 0.33.0:
``free_blocks(reversed(...))``) and queue those reaching ``ref_cnt == 0``:

* ``"0.33"`` (every release from 0.23 on): ``vllm/v1/core/block_pool.py``
  ``BlockPool.free_blocks`` (lines 816-847 of 0.33.0) collects, in that
  order, the blocks with ``block_hash is None`` ("LIFO reuse of non-cached
  blocks") and the others, then ``free_block_queue.prepend_n`` puts the
  first list at the queue head keeping its order (so the request's last
  unhashed block becomes the head; ``kv_cache_utils.py``
  ``FreeKVCacheBlockQueue.prepend_n``, line 438) and ``append_n`` puts the
  hashed ones at the tail ("FIFO reuse of cached blocks for LRU eviction
  behavior"): ``free_order="prepend_unhashed"``. 0.22.0 has no
  ``prepend_n``; 0.23.0 has it.
* ``"0.22"`` (0.8 .. 0.22): every freed block is appended at the tail
  (``block_pool.py BlockPool.free_blocks`` of 0.8.0, 0.11.0, 0.16.0, 0.20.0
  and 0.22.0): ``free_order="append"``.
"""

DEFAULT_VLLM_VERSION = "0.33"
"""The vLLM release whose rules are the default (the newest one read)."""

_FIRST_HEAD_ORDER = 23  # 0.23: BlockPool.free_blocks gained prepend_n
_OLDEST_V1 = 8  # 0.8.0: the first release read (v1 engine by default)
_NEWEST_READ = 33


def vllm_free_order(vllm_version: str) -> str:
  """The ``free_order`` of a vLLM release (see :data:`VLLM_FREE_ORDERS`).

  Args:
    vllm_version: ``"latest"`` (= :data:`DEFAULT_VLLM_VERSION`) or
      ``"0.N"`` / ``"0.N.P"`` with ``8 <= N <= 33``: ``N >= 23`` gives
      ``"prepend_unhashed"``, older releases ``"append"``.

  Raises:
    TypeError: not a string.
    ValueError: any other string (the message lists the accepted values).

  Example:
    >>> from prefixjax.cache.paging_state import vllm_free_order
    >>> vllm_free_order("0.33"), vllm_free_order("0.22.0")
    ('prepend_unhashed', 'append')
  """
  if not isinstance(vllm_version, str):
    raise TypeError(
      f"vllm_version must be a string such as '0.33', got {vllm_version!r}"
    )
  version = DEFAULT_VLLM_VERSION if vllm_version == "latest" else vllm_version
  found = re.fullmatch(r"0\.(\d+)(?:\.\d+)?", version)
  minor = int(found[1]) if found else -1
  if not _OLDEST_V1 <= minor <= _NEWEST_READ:
    raise ValueError(
      f"vllm_version={vllm_version!r} is not supported: give 'latest' or "
      f"'0.{_FIRST_HEAD_ORDER}' .. '0.{_NEWEST_READ}' (unhashed freed blocks "
      f"at the queue head; {DEFAULT_VLLM_VERSION!r} is the default), "
      f"or '0.{_OLDEST_V1}' .. '0.{_FIRST_HEAD_ORDER - 1}' (all at the "
      "tail); a patch number ('0.33.0') may follow"
    )
  return "prepend_unhashed" if minor >= _FIRST_HEAD_ORDER else "append"
