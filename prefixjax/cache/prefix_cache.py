"""Prefix cache: the paging core plus an on-device index of block hashes.

A :class:`PrefixCacheState` is a
:class:`prefixjax.cache.paging.PagingState`, an
:class:`prefixjax.cache.index.IndexState` mapping 64-bit block keys to
blocks, the key each block carries, and statistics: one frozen pytree. Every
verb is a pure jitted function that takes the state first and returns
``(new_state, result)``; a failed verb returns the state unchanged with a
status, as in the paging core. Semantics are vLLM v1's automatic prefix
caching (see ``tests/reference_models/vllm_apc.py``, the test oracle):

* Keys are chained block hashes (:mod:`prefixjax.cache.hashing`), given to the
  verbs as ``block_keys [L, 2]`` uint32 (content keys). The state mixes its
  ``version`` word into every key at lookup and insert; :func:`invalidate`
  bumps it, so every earlier block becomes unmatchable in O(1). Old blocks
  keep their (old-version) identity until the allocator reuses them. A
  sequence publishes under the version it started with (``seq_version``),
  so KV computed before a bump never becomes matchable after it.
* :func:`match` finds the longest run of cached full blocks from the start
  of a prompt, capped at ``prompt_len - 1`` tokens rounded down to whole
  blocks (the last token is recomputed to get logits).
* :func:`allocate_with_prefix` matches, *touches* the hit blocks (a block
  with refcount 0 is first unlinked from the free queue, then counted) and
  pops fresh blocks for the rest from the free-queue head. A popped block
  that still carries a hash loses that identity first (identity eviction:
  removed from the index, ``published`` cleared, one eviction counted).
  The budget counts touched refcount-0 hits as vLLM's
  ``get_num_blocks_to_allocate`` does: ``new + evictable_hits > num_free``
  is ``OUT_OF_BLOCKS`` with the state unchanged.
* :func:`publish` gives the sequence's full blocks their keys (``published``
  set: they are read-only from then on; writes go through copy on write). A
  key may name several blocks, as in vLLM (the same prompt computed twice,
  or the recomputed last block of a fully cached prompt): the index maps the
  key to the earliest-published block still present, and the others wait in
  a per-key circular list (``dup_next`` / ``dup_prev``) in publication
  order, so when that block is evicted the next one takes its place.
  Call it when a block fills (early publishing, lets a concurrent wave
  share) or once when the request finishes (late); the verb is the same.
* :func:`append`, :func:`copy_on_write` and :func:`fork` wrap the paging
  verbs; every block they pop loses its old identity first. Call these, not
  the :mod:`prefixjax.cache.paging` verbs, on a cache's ``paging`` field.
* :func:`release`: blocks reaching refcount 0 join the free queue in
  reverse table order (the sequence's last block first). ``free_order``
  (static, set at :func:`init` directly or by ``vllm_version``) picks
  vLLM's version: ``"prepend_unhashed"`` (the default: unhashed blocks at
  the head for LIFO reuse, hashed ones at the tail, vLLM >= 0.23, read from
  0.33.0's ``vllm/v1/core/block_pool.py BlockPool.free_blocks``) or
  ``"append"`` (all at the tail: vLLM 0.8 .. 0.22, the paging core's default
  release); see :data:`prefixjax.cache.prefix_state.VLLM_FREE_ORDERS`.
  Hashed blocks stay findable on the free queue until reused.

Eviction policy (static, :mod:`prefixjax.cache.policies`, set at :func:`init`).
The default ``lru`` is vLLM's: the free queue *is* the eviction order (head
= next victim), maintained incrementally, O(blocks touched). Every other
policy scores blocks from per-block metadata in ``policy_state`` (``[N]``
arrays), which the verbs update through the policy's hooks: ``on_touch``
for the hit blocks in :func:`allocate_with_prefix`, ``on_publish`` for the
blocks :func:`publish` gives a key, both at the request step ``clock`` and
with the caller's optional ``next_use`` per block (``belady``). Blocks are
then taken as follows: free blocks without a hash first, in queue order
(such policies require ``free_order="prepend_unhashed"``, which keeps them
at the queue head), and for the rest, one victim at a time, the free cached
block with the lowest score (ties: the deepest block, i.e. the largest
table column at publish, then the lowest id; found at the root of a
tournament tree or by a masked reduction, see Cost); it loses its
identity and leaves the queue (:func:`prefixjax.cache.paging.unlink_free`)
before the ordinary pops take it.
:func:`append` and :func:`copy_on_write` take blocks the same way. For
``leaf_only`` policies (``lru_leaf``, ``belady_leaf``) the cache also keeps
each cached block's parent (the block before it in the publishing table)
and its number of cached children; only blocks without one are eligible
(all free cached blocks if none is: a child pinned by a running sequence
under a free parent).

Cost: with ``lru`` every verb is O(M) lanes plus O(1) expected index probes
per block touched, published or evicted; nothing scans the pool. ``fifo``
and ``belady`` (``static_score``, not ``leaf_only``) add ``ceil(log32 N)``
32-lane reductions per block hit, released or evicted (a tournament tree of
the free cached blocks, :mod:`prefixjax.cache.victim_tree`; the victim is its
root); the other scoring policies add an O(N) reduction per victim.
Values read from the state pass through :func:`prefixjax.cache.paging.settle`
before it is written (see there why).

Dimensions: ``N`` blocks (including the null block 0), ``S`` sequence
slots, ``M`` block-table columns, ``K`` block size, ``C`` index slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixjax._masked import (
  NO_BLOCK,
  NULL_BLOCK,
  gather,
  get_row,
  kernel,
  scatter,
  set_row,
)
from prefixjax.cache import index as index_lib
from prefixjax.cache import paging
from prefixjax.cache import policies as policies_lib
from prefixjax.cache.eviction import (
  evict_block,
  evict_popped,
  link_parents,
  promote_victims,
  refresh_tree,
  touch,
)
from prefixjax.cache.paging import Status
from prefixjax.cache.prefix_inspect import check_invariants, stats_dict
from prefixjax.cache.prefix_state import (
  DEFAULT_VLLM_VERSION,
  FREE_ORDERS,
  VLLM_FREE_ORDERS,
  CacheStats,
  MatchResult,
  PrefixAllocateResult,
  PrefixCacheState,
  PublishResult,
  add_stats,
  identity_of,
  init,
  settle,
  versioned,
  vllm_free_order,
  with_identity,
)
from prefixjax.cache.prefix_state import check_state as check_state

__all__ = [
  "DEFAULT_VLLM_VERSION",
  "FREE_ORDERS",
  "VLLM_FREE_ORDERS",
  "CacheStats",
  "MatchResult",
  "PrefixAllocateResult",
  "PrefixCacheState",
  "PublishResult",
  "allocate_with_prefix",
  "append",
  "append_block",
  "check_invariants",
  "copy_on_write",
  "fork",
  "init",
  "invalidate",
  "match",
  "match_in_order",
  "num_pinned",
  "publish",
  "publish_block",
  "queue_order",
  "release",
  "stats_dict",
  "vllm_free_order",
]


# ---------------------------------------------------------------------------
# Verbs (jitted; they take int32 scalars and ``[M, 2]`` keys).


def _match_versioned(
  state: PrefixCacheState, vkeys: jax.Array, num_prompt_tokens
):
  k, m = state.block_size, state.max_blocks_per_seq
  max_hits = jnp.clip((num_prompt_tokens - 1) // k, 0, m)
  lanes = jnp.arange(m) < max_hits
  values = index_lib.lookup(state.index, vkeys, lanes)
  run = jnp.cumprod((lanes & (values >= 0)).astype(jnp.int32)) > 0
  num_hits = jnp.sum(run.astype(jnp.int32))
  hits = jnp.where(run, values, NO_BLOCK)
  return MatchResult(hits, num_hits, num_hits * k)


def _match_in_order(
  state: PrefixCacheState, vkeys: jax.Array, num_prompt_tokens
):
  """:func:`_match_versioned` through :func:`index.lookup_run` (the same
  result: only the run of hits from the first block counts)."""
  k, m = state.block_size, state.max_blocks_per_seq
  max_hits = jnp.clip((num_prompt_tokens - 1) // k, 0, m)
  hits, num_hits = index_lib.lookup_run(state.index, vkeys, max_hits)
  return MatchResult(hits, num_hits, num_hits * k)


def _cap_match(state: PrefixCacheState, hit: MatchResult, num_prompt_tokens):
  """``hit`` (a match over at least ``num_prompt_tokens`` tokens) capped
  to ``num_prompt_tokens``: the match over that many (its lookups are a
  prefix of ``hit``'s)."""
  k, m = state.block_size, state.max_blocks_per_seq
  max_hits = jnp.clip((num_prompt_tokens - 1) // k, 0, m)
  num_hits = jnp.minimum(hit.num_hit_blocks, max_hits)
  hits = jnp.where(jnp.arange(m) < num_hits, hit.hit_blocks, NO_BLOCK)
  return MatchResult(hits, num_hits, num_hits * k)


def _check_keys(state: PrefixCacheState, block_keys) -> None:
  """Static shape check (at trace time): a verb's keys are ``[M, 2]``."""
  want = (state.max_blocks_per_seq, 2)
  if tuple(jnp.shape(block_keys)) != want:
    raise ValueError(
      f"block_keys has shape {tuple(jnp.shape(block_keys))}; the prefix "
      f"cache's verbs take [max_blocks_per_seq, 2] = {list(want)} "
      "(prefixjax.cache.checked.prefix_cache pads a prompt's [L, 2] keys "
      "to that and refuses too few for its full blocks)"
    )


def _seq_checks(state: PrefixCacheState, seq_id, want_active: bool):
  return paging.seq_status(state.paging, seq_id, want_active)


@jax.jit
def match(state, block_keys, num_prompt_tokens):
  """The longest run of cached full blocks from the start of a prompt.

  Read only. The hit is capped at ``num_prompt_tokens - 1`` tokens rounded
  down to whole blocks, so it never covers the whole prompt.

  Args:
    state: the cache.
    block_keys: ``[M, 2]`` uint32 content keys of the prompt's blocks (from
      :func:`prefixjax.cache.hashing.block_hashes`; the checked layer pads
      or cuts ``[L, 2]`` to ``M`` rows).
    num_prompt_tokens: int32 scalar ``P``.

  Returns:
    A :class:`MatchResult`.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import hashing, prefix_cache as pc
    >>> s = pc.init(16, 4, max_seqs=2, max_blocks_per_seq=4)
    >>> tokens = jnp.arange(16, dtype=jnp.int32)
    >>> keys, _ = hashing.block_hashes(tokens, 16, block_size=4)
    >>> s, _ = pc.allocate_with_prefix(s, 0, keys, 16)
    >>> s, _ = pc.publish(s, 0, keys, 16)
    >>> int(pc.match(s, keys, 16).hit_tokens)  # capped at 15 -> 3 blocks
    12
  """
  _check_keys(state, block_keys)
  return _match_versioned(
    state, versioned(state, block_keys), num_prompt_tokens
  )


@jax.jit
def match_in_order(state, block_keys, num_prompt_tokens):
  """:func:`match` for one prompt, probing its blocks in order.

  The same result as :func:`match`, through
  :func:`prefixjax.cache.index.lookup_run`: it stops at the first block
  that misses, in one loop that XLA:CPU compiles into one kernel, where
  :func:`match` probes every block until the slowest is decided. Prefer
  :func:`match` under ``jax.vmap``.

  Returns:
    A :class:`MatchResult`.
  """
  _check_keys(state, block_keys)
  return _match_in_order(state, versioned(state, block_keys), num_prompt_tokens)


@jax.jit
def allocate_with_prefix(
  state, seq_id, block_keys, num_prompt_tokens, next_use=None, hit=None
):
  """Starts ``seq_id`` on a prompt, reusing its cached prefix.

  Matches (as :func:`match`), touches the hit blocks, then pops fresh blocks
  for the remaining ``ceil(P / K) - hits`` blocks, evicting the identity of
  any popped block that carries one. The sequence then holds ``P`` tokens.
  Advances the request clock (``state.clock``) and runs the policy's
  ``on_touch`` hook on the hit blocks. With a scoring policy (not ``lru``)
  free blocks without a hash are used first and the rest are the policy's
  victims (see :mod:`prefixjax.cache.policies`).

  Args:
    state: the cache.
    seq_id: int32 scalar, a free sequence slot.
    block_keys: ``[M, 2]`` uint32 content keys of the prompt's full blocks.
    num_prompt_tokens: int32 scalar ``P >= 0``.
    next_use: optional ``[M]`` int32 per block, passed to the policy hook
      (``belady``: the step the block's key is next used; default
      :data:`prefixjax.cache.policies.NEVER`).
    hit: optional, the :class:`MatchResult` of :func:`match` (or
      :func:`match_in_order`) of these keys on this state for at least
      ``num_prompt_tokens`` tokens; the verb then caps it instead of
      matching again (the same result).

  Returns:
    ``(new_state, PrefixAllocateResult)``. ``OUT_OF_BLOCKS`` when the fresh
    blocks plus the refcount-0 hits exceed the free queue; on any non-OK
    status the state is unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import hashing, prefix_cache as pc
    >>> s = pc.init(16, 4, max_seqs=2, max_blocks_per_seq=4)
    >>> keys, _ = hashing.block_hashes(
    ...     jnp.arange(16, dtype=jnp.int32), 16, block_size=4)
    >>> s, r = pc.allocate_with_prefix(s, 0, keys, 14)
    >>> r.new_blocks.tolist(), int(r.num_hit_blocks)
    ([1, 2, 3, 4], 0)
  """
  _check_keys(state, block_keys)
  k, m = state.block_size, state.max_blocks_per_seq
  policy = state.policy
  if next_use is None:
    next_use = jnp.full((m,), policies_lib.NEVER, jnp.int32)
  pstate = state.paging
  if hit is None:
    hit = _match_versioned(
      state, versioned(state, block_keys), num_prompt_tokens
    )
  else:
    hit = _cap_match(state, MatchResult(*hit), num_prompt_tokens)
  total = paging.blocks_for(num_prompt_tokens, k)
  num_new = jnp.maximum(total - hit.num_hit_blocks, 0)
  lanes = jnp.arange(m)
  evictable = jnp.sum(
    (
      (lanes < hit.num_hit_blocks)
      & (gather(pstate.refcounts, hit.hit_blocks) == 0)
    ).astype(jnp.int32)
  )
  status = paging.first_error(
    *_seq_checks(state, seq_id, want_active=False),
    (num_prompt_tokens < 0, Status.BAD_COUNT),
    (total > m, Status.TABLE_OVERFLOW),
    (num_new + evictable > pstate.num_free, Status.OUT_OF_BLOCKS),
  )
  status, hit, num_new = settle(state, status, hit, num_new)
  ok = status == Status.OK
  num_hits = jnp.where(ok, hit.num_hit_blocks, 0)
  now = state.clock + ok.astype(jnp.int32)
  policy_state = policy.on_touch(
    state.policy_state, hit.hit_blocks, lanes < num_hits, now, next_use
  )
  state = state.replace(clock=now, policy_state=policy_state)
  state = touch(state, hit.hit_blocks, num_hits)
  num_victims = jnp.int32(0)
  if policy.score is not None:
    state, num_victims = promote_victims(state, num_new, ok)
  pstate, new = paging.pop_free(state.paging, num_new, ok)
  state = state.replace(paging=pstate)
  state, num_evicted = evict_popped(state, new, jnp.where(ok, num_new, 0))
  num_evicted = num_evicted + num_victims
  row = jnp.where(
    lanes < num_hits, hit.hit_blocks, gather(new, lanes - num_hits, NO_BLOCK)
  )
  row = jnp.where(row == NO_BLOCK, NULL_BLOCK, row)
  pstate = state.paging
  pstate = pstate.replace(
    block_tables=set_row(pstate.block_tables, seq_id, row, ok),
    num_tokens=scatter(pstate.num_tokens, seq_id[None], num_prompt_tokens, ok),
    active=scatter(pstate.active, seq_id[None], True, ok),
  )
  state = state.replace(
    seq_version=scatter(state.seq_version, seq_id[None], state.version, ok)
  )
  hit_tokens = num_hits * k
  zero = jnp.int32(0)
  stats = add_stats(
    state.stats,
    requests=ok.astype(jnp.int32),
    hit_blocks=num_hits,
    hit_tokens=hit_tokens,
    miss_blocks=jnp.where(ok, num_new, zero),
    miss_tokens=jnp.where(ok, num_prompt_tokens - hit_tokens, zero),
  )
  state = state.replace(paging=pstate, stats=stats)
  hit_blocks = jnp.where(lanes < num_hits, hit.hit_blocks, NO_BLOCK)
  return state, PrefixAllocateResult(
    status,
    hit_blocks,
    num_hits,
    hit_tokens,
    new,
    jnp.where(ok, num_new, 0),
    num_evicted,
  )


def _append_need(state: PrefixCacheState, seq_id, num_new_tokens):
  """Blocks :func:`prefixjax.cache.paging.append` will pop, and whether it will
  succeed (its checks, repeated)."""
  k, pstate = state.block_size, state.paging
  tokens = gather(pstate.num_tokens, seq_id[None])[0]
  total = tokens + num_new_tokens
  count = paging.blocks_for(total, k) - paging.blocks_for(tokens, k)
  copy = paging.last_block(pstate, seq_id)[-1] & (num_new_tokens > 0)
  need = count + copy.astype(jnp.int32)
  status = paging.first_error(
    *_seq_checks(state, seq_id, want_active=True),
    (num_new_tokens < 0, Status.BAD_COUNT),
    (paging.exceeds_int32(tokens, num_new_tokens), Status.TABLE_OVERFLOW),
    (
      paging.blocks_for(total, k) > state.max_blocks_per_seq,
      Status.TABLE_OVERFLOW,
    ),
    (need > pstate.num_free, Status.OUT_OF_BLOCKS),
  )
  return settle(state, need, status == Status.OK)


@jax.jit
def append(state, seq_id, num_new_tokens):
  """:func:`prefixjax.cache.paging.append` with identity eviction of new blocks.

  Returns:
    ``(new_state, prefixjax.cache.paging.AppendResult)``.
  """
  if state.policy.score is not None:
    need, ok = _append_need(state, seq_id, num_new_tokens)
    state, _ = promote_victims(state, need, ok)
  pstate, r = paging.append(state.paging, seq_id, num_new_tokens)
  state = state.replace(paging=pstate)
  state, _ = evict_popped(state, r.dst, r.num_copies)
  state, _ = evict_popped(state, r.new_blocks, r.num_new_blocks)
  return state, r


def queue_order(state: PrefixCacheState) -> bool:
  """Static: whether the cache's policy is ``lru`` (victims in free-queue
  order, no metadata, no hooks), the policy :func:`append_block` and
  :func:`publish_block` serve."""
  return state.policy == policies_lib.lru()


def append_block(state, seq_id):
  """:func:`append` of one token to ``seq_id`` whose last block is full.

  The token starts block column ``num_tokens // K``: the free queue's head
  becomes that block (losing any identity it carries) and nothing is
  copied (the full last block is never written). The state and status are
  those of ``append(state, seq_id, 1)`` for such a sequence, in ``O(1)``
  lanes instead of ``O(M)``: a decode step's block crossing. Traceable
  (not jitted), ``lru`` caches only (:func:`queue_order`).

  Returns:
    ``(new_state, status)``; ``BAD_COUNT`` (nothing changed) when the last
    block is partly filled.
  """
  if not queue_order(state):
    raise ValueError(f"append_block serves lru caches, not {state.policy}")
  k, m = state.block_size, state.max_blocks_per_seq
  block = state.paging.free_head

  def pop(c, seq_id, block):
    pstate, _ = c
    tokens = gather(pstate.num_tokens, seq_id[None])[0]
    col = tokens // k
    nxt = gather(pstate.free_next, block[None], NO_BLOCK)[0]
    status = paging.first_error(
      *_seq_checks(state, seq_id, want_active=True),
      (tokens % k != 0, Status.BAD_COUNT),
      (col >= m, Status.TABLE_OVERFLOW),
      (pstate.num_free < 1, Status.OUT_OF_BLOCKS),
    )
    status, tokens, nxt = settle(state, status, tokens, nxt)
    ok = status == Status.OK
    # pop_free of one block, then the table's new column.
    free_prev = scatter(pstate.free_prev, block[None], NO_BLOCK, ok)
    pstate = pstate.replace(
      free_next=scatter(pstate.free_next, block[None], NO_BLOCK, ok),
      free_prev=scatter(free_prev, nxt[None], NO_BLOCK, ok),
      refcounts=scatter(pstate.refcounts, block[None], 1, ok),
      published=scatter(pstate.published, block[None], False, ok),
      free_head=jnp.where(ok, nxt, block),
      free_tail=jnp.where(ok & (nxt == NO_BLOCK), NO_BLOCK, pstate.free_tail),
      num_free=pstate.num_free - ok.astype(jnp.int32),
      block_tables=pstate.block_tables.at[
        jnp.where(ok, seq_id, pstate.max_seqs), col
      ].set(block, mode="drop"),
      num_tokens=scatter(pstate.num_tokens, seq_id[None], tokens + 1, ok),
    )
    return pstate, status

  # One kernel (see prefixjax._masked.kernel), then the eviction's two.
  pstate, status = kernel(
    pop, (state.paging, jnp.int32(Status.OK)), seq_id, block
  )
  state, _ = evict_block(
    state.replace(paging=pstate), block, status == Status.OK
  )
  return state, status


def publish_block(state, seq_id, col, block_key):
  """:func:`publish` of the block at column ``col`` of ``seq_id`` alone.

  Gives that block (full: the sequence holds at least ``(col + 1) * K``
  tokens) its key ``block_key`` ``[2]`` (content, as a row of
  :func:`publish`'s keys) unless it is published. The same as ``publish(
  state, seq_id, keys, (col + 1) * K)`` when every earlier column is
  published (a decode step filling a block, when the index never refused
  a key), in ``O(1)`` lanes. Traceable (not jitted), ``lru`` caches only.

  Returns:
    ``(new_state, PublishResult)``; ``BAD_COUNT`` (nothing published) when
    the block at ``col`` is not full.
  """
  if not queue_order(state):
    raise ValueError(f"publish_block serves lru caches, not {state.policy}")
  k, m = state.block_size, state.max_blocks_per_seq

  def find(c, seq_id, col, block_key):
    pstate = state.paging
    version = gather(state.seq_version, seq_id[None], 0)[0]
    key = versioned(state, block_key[None], version)[0]
    held = gather(pstate.num_tokens, seq_id[None])[0]
    status = paging.first_error(
      *_seq_checks(state, seq_id, want_active=True),
      ((col < 0) | (col >= m) | ((col + 1) * k > held), Status.BAD_COUNT),
    )
    block = pstate.block_tables.at[
      jnp.clip(seq_id, 0, pstate.max_seqs - 1), jnp.clip(col, 0, m - 1)
    ].get()
    return key, block, status

  key, block, status = kernel(
    find,
    (jnp.zeros((2,), jnp.uint32), jnp.int32(0), jnp.int32(Status.OK)),
    seq_id,
    col,
    block_key,
  )
  ok = status == Status.OK
  state, got, dropped = _publish_one(state, block, key, ok)
  return state, PublishResult(
    status, got.astype(jnp.int32), dropped.astype(jnp.int32)
  )


@jax.jit
def copy_on_write(state, seq_id):
  """:func:`prefixjax.cache.paging.copy_on_write` with identity eviction.

  Returns:
    ``(new_state, prefixjax.cache.paging.CopyResult)``.
  """
  if state.policy.score is not None:
    needed = paging.last_block(state.paging, seq_id)[-1]
    status = paging.first_error(
      *_seq_checks(state, seq_id, want_active=True),
      (needed & (state.paging.num_free < 1), Status.OUT_OF_BLOCKS),
    )
    needed, ok = settle(state, needed, status == Status.OK)
    state, _ = promote_victims(state, needed.astype(jnp.int32), ok)
  pstate, r = paging.copy_on_write(state.paging, seq_id)
  state, _ = evict_popped(state.replace(paging=pstate), r.dst, r.num_copies)
  return state, r


@jax.jit
def fork(state, parent_id, child_id):
  """:func:`prefixjax.cache.paging.fork`; the child inherits the parent's
  version.

  Returns:
    ``(new_state, status)``.
  """
  pstate, status = paging.fork(state.paging, parent_id, child_id)
  parent_version = gather(state.seq_version, parent_id[None], 0)[0]
  seq_version = scatter(
    state.seq_version, child_id[None], parent_version, status == Status.OK
  )
  return state.replace(paging=pstate, seq_version=seq_version), status


def _outcome(status):
  """``(inserted, present, dropped)`` of an index insert's status."""
  return (
    status == index_lib.IndexStatus.OK,
    status == index_lib.IndexStatus.PRESENT,
    status == index_lib.IndexStatus.PROBE_LIMIT,
  )


def _append_identity(
  identity, block, key, head, tail, status, num_blocks, *, in_kernel
):
  """The identity fields (:func:`~prefixjax.cache.prefix_state.identity_of`)
  after the index insert of ``key`` for ``block`` answered ``status``:
  ``block`` joins the key's circular list behind ``tail`` (present: ``head``
  is the key's first block) or starts one (inserted), gets the key and its
  published bit; the counters count it (or the dropped insert).

  ``in_kernel``: the list is linked one element a write, as a kernel
  (:func:`prefixjax._masked.kernel`) needs (an XLA scatter keeps its loop
  from becoming one kernel); else two two-element scatters, what
  :func:`publish`'s loop runs fastest (one element a write there: the
  10,000-request serving run 1.77 s -> 3.0 s). ``tail`` and ``block``
  differ (the block is new to the list), so both orders write the same.
  """
  dup_next, dup_prev, block_hash, published, stats = identity
  inserted, present, dropped = _outcome(status)
  got = inserted | present
  if in_kernel:
    dup_next = scatter(dup_next, tail[None], block, present)
    dup_next = scatter(dup_next, block[None], head, present)
    dup_prev = scatter(dup_prev, block[None], tail, present)
    dup_prev = scatter(dup_prev, head[None], block, present)
  else:
    pair = jnp.stack([tail, block]), jnp.stack([block, head])
    dup_next = scatter(dup_next, pair[0], pair[1], present)
    dup_prev = scatter(dup_prev, pair[1], pair[0], present)
  dup_next = scatter(dup_next, block[None], block, inserted)
  dup_prev = scatter(dup_prev, block[None], block, inserted)
  block_hash = block_hash.at[jnp.where(got, block, num_blocks)].set(
    key, mode="drop"
  )
  published = scatter(published, block[None], True, got)
  stats = stats.replace(num_cached=stats.num_cached + got.astype(jnp.int32))
  stats = add_stats(stats, publish_dropped=dropped.astype(jnp.int32))
  return dup_next, dup_prev, block_hash, published, stats


def _publish_one(state: PrefixCacheState, block, key, ok):
  """:func:`_publish_at` as two kernels (:func:`prefixjax._masked.kernel`):
  the index insert, then the key's list of blocks; the first one's outputs
  order every read before the writes of the second.

  For :func:`publish_block` only: as the step of :func:`publish`'s loop
  it made the serving loop slower (2,000 requests: 0.50 s -> 0.79 s; that
  loop's body, a few thunks around two kernels, runs them on XLA's thread
  pool), so the loop keeps :func:`_publish_at`.
  """

  def insert(c, block, key, ok):
    idx = c[0]
    skip = ~ok | gather(state.paging.published, block[None], False)[0]
    idx, r = index_lib.insert(idx, key, block, ~skip)
    tail = gather(state.dup_prev, r.value[None], NO_BLOCK)[0]
    return idx, r.status, r.value, tail

  none = jnp.int32(NO_BLOCK)
  idx, status, head, tail = kernel(
    insert,
    (state.index, none, none, none),
    block,
    key,
    ok,
  )

  def link(identity, *args):
    return _append_identity(identity, *args, state.num_blocks, in_kernel=True)

  identity = kernel(link, identity_of(state), block, key, head, tail, status)
  inserted, present, dropped = _outcome(status)
  return with_identity(state, identity, idx), inserted | present, dropped


def _publish_at(state: PrefixCacheState, block, key, ok):
  """Gives ``block`` the versioned ``key`` unless it is published (or not
  ``ok``); ``(state, got, dropped)``: one step of :func:`publish`."""
  skip = ~ok | gather(state.paging.published, block[None], False)[0]
  skip = settle(state, skip)[0]
  idx, r = index_lib.insert(state.index, key, block, ~skip)
  head = r.value
  tail = gather(state.dup_prev, head[None], NO_BLOCK)[0]
  tail = settle(state, tail)[0]
  identity = _append_identity(
    identity_of(state),
    block,
    key,
    head,
    tail,
    r.status,
    state.num_blocks,
    in_kernel=False,
  )
  inserted, present, dropped = _outcome(r.status)
  return with_identity(state, identity, idx), inserted | present, dropped


@jax.jit
def publish(state, seq_id, block_keys, num_tokens, next_use=None):
  """Gives the sequence's full blocks their keys and indexes them.

  Blocks of columns ``0 .. min(num_tokens, held) // K - 1`` that are not
  yet published get ``block_keys[i]`` (with the version the sequence
  started under mixed in). A key
  already in the index keeps pointing at its earliest-published block; the
  new block joins that key's list behind it (as vLLM's
  ``BlockHashToBlockMap``, no de-duplication).

  Args:
    state: the cache.
    seq_id: int32 scalar, a live sequence.
    block_keys: ``[M, 2]`` uint32 content keys of the sequence's blocks.
    num_tokens: int32 scalar, tokens whose full blocks to publish, at most
      the tokens the sequence holds.
    next_use: optional ``[M]`` int32 per block, passed to the policy's
      ``on_publish`` hook with the newly published blocks (see
      :func:`allocate_with_prefix`).

  Returns:
    ``(new_state, PublishResult)``. ``BAD_COUNT`` (nothing published) when
    ``num_tokens`` is negative or more than the sequence holds.
  """
  _check_keys(state, block_keys)
  k, m = state.block_size, state.max_blocks_per_seq
  if next_use is None:
    next_use = jnp.full((m,), policies_lib.NEVER, jnp.int32)
  version = gather(state.seq_version, seq_id[None], 0)[0]
  vkeys = versioned(state, block_keys, version)
  pstate = state.paging
  held = gather(pstate.num_tokens, seq_id[None])[0]
  row = get_row(pstate.block_tables, seq_id)
  status = paging.first_error(
    *_seq_checks(state, seq_id, want_active=True),
    # Beyond what the sequence holds is an error, never a silent clip.
    ((num_tokens < 0) | (num_tokens > held), Status.BAD_COUNT),
  )
  full = jnp.clip(jnp.minimum(num_tokens, held) // k, 0, m)
  full = jnp.where(status == Status.OK, full, 0)
  done = gather(pstate.published, row, False)
  # Published blocks form a prefix of the table unless the index refused
  # one; start at the first unpublished column and skip published ones.
  blocked = done | (jnp.arange(m) >= full)
  first = jnp.argmin(blocked.astype(jnp.int32)).astype(jnp.int32)
  first = jnp.where(blocked[first], full, first)
  status, row, full, first = settle(state, status, row, full, first)

  def body(c):
    i, state, n_pub, n_drop, fresh = c
    state, got, dropped = _publish_at(state, row[i], vkeys[i], jnp.bool_(True))
    return (
      i + 1,
      state,
      n_pub + got.astype(jnp.int32),
      n_drop + dropped.astype(jnp.int32),
      fresh.at[i].set(got),
    )

  _, state, n_pub, n_drop, fresh = jax.lax.while_loop(
    lambda c: c[0] < full,
    body,
    (first, state, jnp.int32(0), jnp.int32(0), jnp.zeros((m,), jnp.bool_)),
  )
  if state.policy.leaf_only:
    state = link_parents(state, row, fresh)
  if state.policy.score is not None:
    state = state.replace(
      block_depth=scatter(
        state.block_depth, row, jnp.arange(m, dtype=jnp.int32), fresh
      )
    )
  policy_state = state.policy.on_publish(
    state.policy_state, row, fresh, state.clock, next_use
  )
  state = state.replace(policy_state=policy_state)
  return state, PublishResult(status, n_pub, n_drop)


@jax.jit
def release(state, seq_id):
  """Ends a sequence; blocks reaching refcount 0 join the free queue.

  :func:`prefixjax.cache.paging.release` in reverse table order (the last
  block first): with ``free_order="append"`` all at the tail (vLLM <= 0.22),
  with ``"prepend_unhashed"`` (vLLM >= 0.23, the default) the unhashed ones
  at the head and the hashed ones at the tail (the paging release of
  ``vllm_version="0.33"``: a block is ``published`` exactly while it
  carries a hash; vLLM 0.33.0
  ``vllm/v1/core/block_pool.py BlockPool.free_blocks``, lines 816-847).
  Hashed blocks stay findable until reused.

  Returns:
    ``(new_state, prefixjax.cache.paging.ReleaseResult)``.
  """
  pstate, r = paging.release(
    state.paging,
    seq_id,
    vllm_version="0.33" if state.free_order == "prepend_unhashed" else "0.22",
  )
  lanes = jnp.arange(r.freed_blocks.shape[0]) < r.num_freed
  hashed = lanes & (gather(state.dup_next, r.freed_blocks, NO_BLOCK) >= 0)
  stats = state.stats.replace(
    num_cached_free=state.stats.num_cached_free
    + jnp.sum(hashed.astype(jnp.int32))
  )
  state = state.replace(paging=pstate, stats=stats)
  return refresh_tree(state, r.freed_blocks, hashed), r


@jax.jit
def invalidate(state):
  """Bumps the version word: every earlier block becomes unmatchable, O(1).

  Old blocks keep their old-version identity (and their place in the free
  queue) until the allocator reuses them.

  Returns:
    ``(new_state, version)`` with ``version`` the new ``[]`` uint32.
  """
  version = state.version + jnp.uint32(1)
  return state.replace(version=version), version


# ---------------------------------------------------------------------------
# Counters.


def num_pinned(state: PrefixCacheState) -> jax.Array:
  """``[]`` int32 blocks held by running sequences (refcount > 0), O(1).

  Jittable and vmappable; with ``stats.num_cached`` and
  ``stats.num_cached_free`` it gives SGLang's protected / evictable sizes.
  """
  return jnp.int32(state.num_blocks - 1) - state.paging.num_free
