"""Plain-Python model of the paging core's semantics (test oracle).

Written from DESIGN.md, independently of ``prefixjax.paging``: dicts and a
Python list as the free queue, no arrays, no masking tricks. Status codes are
the same integers as ``prefixjax.paging.Status`` (checked by the tests).
"""

from __future__ import annotations

import dataclasses

OK, OUT_OF_BLOCKS, BAD_SEQUENCE, INACTIVE, ACTIVE, OVERFLOW, BAD_COUNT = range(
  7
)


def _blocks_for(tokens: int, block_size: int) -> int:
  return -(-tokens // block_size)


@dataclasses.dataclass
class Outcome:
  status: int
  new_blocks: list[int] = dataclasses.field(default_factory=list)
  copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  freed: list[int] = dataclasses.field(default_factory=list)


class PagingModel:
  """The block manager as ordinary Python objects."""

  def __init__(self, num_blocks, block_size, max_seqs, max_blocks_per_seq):
    self.num_blocks = num_blocks
    self.block_size = block_size
    self.max_seqs = max_seqs
    self.max_blocks = max_blocks_per_seq
    self.tables: dict[int, list[int]] = {}
    self.tokens: dict[int, int] = {}
    self.refcounts = [0] * num_blocks
    self.published = [False] * num_blocks
    self.free_queue = list(range(1, num_blocks))

  # -- helpers ---------------------------------------------------------------
  def _seq_error(self, seq, want_active):
    if not 0 <= seq < self.max_seqs:
      return BAD_SEQUENCE
    if want_active and seq not in self.tables:
      return INACTIVE
    if not want_active and seq in self.tables:
      return ACTIVE
    return OK

  def _pop(self, count):
    popped = self.free_queue[:count]
    del self.free_queue[:count]
    for b in popped:
      self.refcounts[b] = 1
      self.published[b] = False  # reuse drops the old identity
    return popped

  def _drop(self, blocks):
    freed = []
    for b in blocks:
      self.refcounts[b] -= 1
      if self.refcounts[b] == 0:
        freed.append(b)
    self.free_queue.extend(freed)
    return freed

  def _needs_copy(self, seq):
    tokens = self.tokens[seq]
    if tokens % self.block_size == 0:
      return False
    last = self.tables[seq][tokens // self.block_size]
    return self.refcounts[last] > 1 or self.published[last]

  def _copy(self, seq):
    col = self.tokens[seq] // self.block_size
    src = self.tables[seq][col]
    (dst,) = self._pop(1)
    self.tables[seq][col] = dst
    self._drop([src])
    return [(src, dst)]

  # -- verbs -----------------------------------------------------------------
  def allocate(self, seq, num_tokens):
    count = _blocks_for(num_tokens, self.block_size)
    status = self._seq_error(seq, want_active=False)
    if status == OK and num_tokens < 0:
      status = BAD_COUNT
    if status == OK and count > self.max_blocks:
      status = OVERFLOW
    if status == OK and count > len(self.free_queue):
      status = OUT_OF_BLOCKS
    if status != OK:
      return Outcome(status)
    blocks = self._pop(count)
    self.tables[seq] = list(blocks)
    self.tokens[seq] = num_tokens
    return Outcome(OK, new_blocks=blocks)

  def append(self, seq, num_new):
    status = self._seq_error(seq, want_active=True)
    if status != OK:
      return Outcome(status)
    if num_new < 0:
      return Outcome(BAD_COUNT)
    tokens = self.tokens[seq]
    total = _blocks_for(tokens + num_new, self.block_size)
    count = total - _blocks_for(tokens, self.block_size)
    copy = num_new > 0 and self._needs_copy(seq)
    if total > self.max_blocks:
      return Outcome(OVERFLOW)
    if count + copy > len(self.free_queue):
      return Outcome(OUT_OF_BLOCKS)
    copies = self._copy(seq) if copy else []
    blocks = self._pop(count)
    self.tables[seq].extend(blocks)
    self.tokens[seq] = tokens + num_new
    return Outcome(OK, new_blocks=blocks, copies=copies)

  def copy_on_write(self, seq):
    status = self._seq_error(seq, want_active=True)
    if status != OK:
      return Outcome(status)
    if not self._needs_copy(seq):
      return Outcome(OK)
    if not self.free_queue:
      return Outcome(OUT_OF_BLOCKS)
    return Outcome(OK, copies=self._copy(seq))

  def fork(self, parent, child):
    status = self._seq_error(parent, want_active=True)
    if status == OK:
      status = self._seq_error(child, want_active=False)
    if status != OK:
      return Outcome(status)
    self.tables[child] = list(self.tables[parent])
    self.tokens[child] = self.tokens[parent]
    for b in self.tables[child]:
      self.refcounts[b] += 1
    return Outcome(OK)

  def release(self, seq, unpublished_first=False):
    """Last block first (vLLM v1 frees a request's blocks in reverse order).

    By default every freed block goes to the tail (vLLM <= 0.22). With
    ``unpublished_first`` (vLLM >= 0.23, ``BlockPool.free_blocks`` in
    ``vllm/v1/core/block_pool.py`` of 0.33.0) the unpublished ones, in that
    order, are put in front of the queue (the first becomes the head) and the
    published ones at the tail.
    """
    status = self._seq_error(seq, want_active=True)
    if status != OK:
      return Outcome(status)
    blocks = self.tables.pop(seq)
    del self.tokens[seq]
    ordered = list(reversed(blocks))
    if not unpublished_first:
      return Outcome(OK, freed=self._drop(ordered))
    freed = []
    for b in ordered:
      self.refcounts[b] -= 1
      if self.refcounts[b] == 0:
        freed.append(b)
    head = [b for b in freed if not self.published[b]]
    tail = [b for b in freed if self.published[b]]
    self.free_queue = head + self.free_queue + tail
    return Outcome(OK, freed=freed)

  def publish(self, block):
    """Marks a block read-only (what a prefix index does on publish)."""
    self.published[block] = True
