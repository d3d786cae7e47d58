"""Prefix-cache eviction machinery (traceable; the verbs jit).

The bookkeeping behind identity eviction and the eviction policies of
:mod:`prefixjax.cache.prefix_cache` (see its docstring): dropping a block's
identity (index entry, duplicate-key list, ``published`` flag), the
leaf/parent links of ``leaf_only`` policies, the victim tree of
``static_score`` policies, touching hit blocks, and promoting a scoring
policy's victims to the free-queue head before the paging pops.

Each function takes the cache state (``push_free_head``, which lives in
:mod:`prefixjax.cache.paging`: its paging state) and returns the new one;
``ok`` / ``lanes`` / ``count`` arguments mask the work, so a failed verb
changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixjax._masked import (
  NO_BLOCK,
  NULL_BLOCK,
  compact,
  gather,
  kernel,
  scatter,
  scatter_add,
)
from prefixjax.cache import index as index_lib
from prefixjax.cache import paging, victim_tree
from prefixjax.cache import policies as policies_lib
from prefixjax.cache.paging import push_free_head
from prefixjax.cache.prefix_state import (
  PrefixCacheState,
  add_stats,
  identity_of,
  settle,
  uses_tree,
  with_identity,
)

__all__ = [
  "evict_block",
  "evict_popped",
  "link_parents",
  "promote_victims",
  "push_free_head",
  "rank",
  "refresh_tree",
  "touch",
]


def rank(state: PrefixCacheState):
  """``ids -> (evictable, score, depth)`` for :mod:`prefixjax.cache.victim_tree`
  (the policy's score on the ``[N]`` metadata entries of ``ids``)."""
  n = state.num_blocks

  def rank(ids):
    valid = (
      (ids > NULL_BLOCK)
      & (ids < n)
      & (gather(state.paging.refcounts, ids, 1) == 0)
      & (gather(state.dup_next, ids, NO_BLOCK) != NO_BLOCK)
    )
    meta = jax.tree.map(
      lambda x: gather(x, ids) if x.ndim and x.shape[0] == n else x,
      state.policy_state,
    )
    score = state.policy.score(meta, state.clock)
    return valid, score, gather(state.block_depth, ids, -1)

  return rank


def refresh_tree(state: PrefixCacheState, blocks: jax.Array, lanes):
  """Re-ranks ``blocks[lanes]`` in the victim tree (if the policy has
  one) after their eligibility may have changed. The state rides through
  the loop so later writes are ordered after its reads."""
  if not uses_tree(state.policy):
    return state
  todo, count = compact(blocks, lanes)

  def body(c):
    i, state = c
    tree = victim_tree.refresh(
      state.victim_tree, todo[i], jnp.bool_(True), rank(state)
    )
    return i + 1, state.replace(victim_tree=tree)

  _, state = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state)
  )
  return state


def evict_block(state: PrefixCacheState, block, ok):
  """Drops ``block``'s identity if it has one (``ok`` masks the call);
  ``(state, 1 if it had one else 0)``."""

  def unlink(c):
    idx = c[0]
    nxt = gather(state.dup_next, block[None], NO_BLOCK)[0]
    prv = gather(state.dup_prev, block[None], NO_BLOCK)[0]
    key = state.block_hash.at[jnp.clip(block, 0, state.num_blocks - 1)].get()
    has = ok & (nxt != NO_BLOCK)
    sole = nxt == block
    # The key's head is the block (its list's earliest member): the key
    # goes (the block was its only one) or points at its successor.
    idx, _, (nxt, prv, has) = index_lib.unlink_settling(
      idx, key, block, jnp.where(sole, NO_BLOCK, nxt), has, nxt, prv, has
    )
    return idx, nxt, prv, has

  # One kernel (the loop's outputs also order the reads before the writes
  # below, as a barrier would).
  none = jnp.int32(NO_BLOCK)
  idx, nxt, prv, has = kernel(
    unlink,
    (state.index, none, none, jnp.bool_(False)),
  )

  def forget(c, block, nxt, prv, has):
    dup_next, dup_prev, block_hash, published, stats = c
    one = has.astype(jnp.int32)
    relink = has & ~(nxt == block)
    dup_next = scatter(dup_next, prv[None], nxt, relink)
    dup_prev = scatter(dup_prev, nxt[None], prv, relink)
    dup_next = scatter(dup_next, block[None], NO_BLOCK, has)
    dup_prev = scatter(dup_prev, block[None], NO_BLOCK, has)
    block_hash = block_hash.at[jnp.where(has, block, state.num_blocks)].set(
      jnp.zeros((2,), jnp.uint32), mode="drop"
    )
    published = scatter(published, block[None], False, has)
    stats = add_stats(stats, evictions=one)
    stats = stats.replace(
      num_cached=stats.num_cached - one,
      num_cached_free=stats.num_cached_free - one,
    )
    return dup_next, dup_prev, block_hash, published, stats

  identity = kernel(forget, identity_of(state), block, nxt, prv, has)
  one = has.astype(jnp.int32)
  state = with_identity(state, identity, idx)
  if state.policy.leaf_only:
    state = _unlink_parent(state, block, has)
  state = refresh_tree(state, block[None], has[None])
  return state, one


def _unlink_parent(state: PrefixCacheState, block, has):
  """Leaf bookkeeping when ``block`` (``has``) loses its identity."""
  parent = gather(state.block_parent, block[None], NO_BLOCK)[0]
  parent = settle(state, parent)[0]
  num_children = scatter_add(
    state.num_children, parent[None], -1, has & (parent != NO_BLOCK)
  )
  num_children = scatter(num_children, block[None], 0, has)
  # Only the fallback rule evicts a block with cached children: they become
  # first blocks of their chains (O(N), as the scan that chose the block).
  block_parent = jnp.where(
    has & (state.block_parent == block), NO_BLOCK, state.block_parent
  )
  block_parent = scatter(block_parent, block[None], NO_BLOCK, has)
  return state.replace(block_parent=block_parent, num_children=num_children)


def link_parents(state: PrefixCacheState, row, published_now):
  """Leaf bookkeeping for blocks ``row[published_now]`` just published: the
  parent of column ``i`` is column ``i - 1`` when that block is cached."""
  prev = jnp.concatenate([jnp.full((1,), NO_BLOCK, jnp.int32), row[:-1]])
  prev_cached = gather(state.paging.published, prev, False)
  parent = jnp.where(prev_cached, prev, NO_BLOCK)
  parent = settle(state, parent)[0]
  return state.replace(
    block_parent=scatter(state.block_parent, row, parent, published_now),
    num_children=scatter_add(
      state.num_children, parent, 1, published_now & (parent != NO_BLOCK)
    ),
  )


def promote_victims(state: PrefixCacheState, need, ok):
  """Scoring policies: makes the next ``need`` queue pops policy-correct.

  Free blocks without a hash sit at the queue head (``prepend_unhashed``)
  and are used first. For the shortfall, the policy's victims are chosen one
  at a time (each a masked reduction over ``[N]``; an eviction may turn its
  parent into a leaf), lose their identity, and are moved, in that order,
  right behind the blocks without a hash, where the caller's pops take them
  after those: one call for ``need`` blocks hands out the blocks of
  ``need`` one-block calls, in the same order (a decode step's growth
  equals a token at a time).

  Returns:
    ``(state, num_victims)``.
  """
  m = state.max_blocks_per_seq
  unhashed = state.paging.num_free - state.stats.num_cached_free
  count = jnp.where(ok, jnp.clip(need - unhashed, 0, m), 0)

  def body(c):
    i, state, victims = c
    if uses_tree(state.policy):
      victim = victim_tree.victim(state.victim_tree)
    else:
      evictable = (state.paging.refcounts == 0) & (state.dup_next != NO_BLOCK)
      victim = policies_lib.select_victim(
        state.policy,
        state.policy_state,
        state.clock,
        evictable,
        state.num_children == 0,
        state.block_depth,
      )
    victim = settle(state, victim)[0]
    found = victim != NO_BLOCK
    state, _ = evict_block(state, victim, found)
    pstate = paging.unlink_free(state.paging, victim, found)
    return i + 1, state.replace(paging=pstate), victims.at[i].set(victim)

  _, state, victims = jax.lax.while_loop(
    lambda c: c[0] < count,
    body,
    (jnp.int32(0), state, jnp.full((m,), NO_BLOCK, jnp.int32)),
  )
  num = jnp.sum((victims != NO_BLOCK).astype(jnp.int32))
  pstate = state.paging
  # The last block without a hash: ``unhashed - 1`` steps from the head.
  free_next = pstate.free_next

  def walk(c):
    i, block = c
    return i + 1, gather(free_next, block[None], NO_BLOCK)[0]

  _, last = jax.lax.while_loop(
    lambda c: c[0] + 1 < jnp.where(num > 0, unhashed, 0),
    walk,
    (jnp.int32(0), pstate.free_head),
  )
  last = jnp.where((num > 0) & (unhashed > 0), last, NO_BLOCK)
  pstate = push_free_head(pstate, victims, num, after=settle(state, last)[0])
  return state.replace(paging=pstate), num


def evict_popped(state: PrefixCacheState, blocks: jax.Array, count):
  """Identity eviction for freshly popped ``blocks[:count]``, in order."""

  def body(c):
    i, state, n = c
    state, one = evict_block(state, blocks[i], jnp.bool_(True))
    return i + 1, state, n + one

  _, state, n = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state, jnp.int32(0))
  )
  return state, n


def touch(state: PrefixCacheState, blocks: jax.Array, count):
  """Refcount up on ``blocks[:count]``; refcount-0 ones leave the queue."""
  lanes = jnp.arange(blocks.shape[0]) < count
  zero = lanes & (gather(state.paging.refcounts, blocks) == 0)
  # ``lanes`` passes through the same barrier so the refcount scatter below
  # is ordered after the read (else XLA copies ``refcounts``).
  zero, lanes = settle(state, zero, lanes)

  # Remove, then count (never the other way round).
  def body(c):
    i, pstate = c
    pstate = paging.unlink_free(pstate, blocks[i], zero[i])
    return i + 1, pstate

  _, pstate = jax.lax.while_loop(
    lambda c: c[0] < count, body, (jnp.int32(0), state.paging)
  )
  pstate = pstate.replace(
    refcounts=scatter_add(pstate.refcounts, blocks, 1, lanes)
  )
  stats = state.stats
  stats = stats.replace(
    num_cached_free=stats.num_cached_free - jnp.sum(zero.astype(jnp.int32))
  )
  state = state.replace(paging=pstate, stats=stats)
  return refresh_tree(state, blocks, zero)
