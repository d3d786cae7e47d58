"""Host-side inspection of a prefix cache: counters and invariant checks.

For tests, debugging and reports; nothing here is traceable. The cache and
its semantics are described in :mod:`prefixjax.cache.prefix_cache`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from prefixjax._masked import NO_BLOCK, NULL_BLOCK
from prefixjax.cache import index as index_lib
from prefixjax.cache import paging, victim_tree
from prefixjax.cache.eviction import rank
from prefixjax.cache.prefix_state import (
  CacheStats,
  PrefixCacheState,
  check_state,
  uses_tree,
)

__all__ = ["check_invariants", "stats_dict"]


def stats_dict(state: PrefixCacheState) -> dict[str, int]:
  """The counters as Python ints, plus ``pinned_blocks`` (refcount > 0) and
  ``cached_pinned`` (cached blocks held by running sequences)."""
  out = {
    k: int(getattr(state.stats, k)) for k in CacheStats.__dataclass_fields__
  }
  out["pinned_blocks"] = state.num_blocks - 1 - int(state.paging.num_free)
  out["cached_pinned"] = out["num_cached"] - out["num_cached_free"]
  return out


def _check_policy_invariants(state, hashed) -> list[str]:
  """Scoring policies: free blocks without a hash lead the queue; leaf
  policies: parent links only on cached blocks, child counts exact."""
  errors = []
  if state.policy.score is None:
    return errors
  order = paging.free_queue_order(state.paging)
  flags = [bool(hashed[b]) for b in order]
  if flags != sorted(flags):
    errors.append("a free block without a hash follows a hashed one")
  if uses_tree(state.policy):
    want = victim_tree.build(state.num_blocks, rank(state))
    for level, (got, exp) in enumerate(
      zip(state.victim_tree, want, strict=True)
    ):
      if not np.array_equal(np.asarray(got), np.asarray(exp)):
        errors.append(f"victim tree level {level} is stale")
  if state.policy.leaf_only:
    parent = np.asarray(state.block_parent)
    children = np.asarray(state.num_children)
    if (parent[~hashed] != NO_BLOCK).any():
      errors.append("an unhashed block has a parent link")
    linked = parent[hashed & (parent != NO_BLOCK)]
    want = np.bincount(linked, minlength=state.num_blocks)
    if (want != children).any():
      errors.append(f"num_children {children.tolist()} != {want.tolist()}")
  return errors


def check_invariants(state: PrefixCacheState) -> list[str]:
  """Host-side checks of the whole cache; returns violations (or ``[]``).

  Paging and index invariants, plus: a block is hashed iff ``published``
  iff it is on a key list; lists are consistent circular lists of blocks
  with equal ``block_hash``; the index holds exactly one entry per distinct
  key, pointing into its list; no live sequence's partially filled last
  block is published (it would be written); counters match; for scoring
  policies, free blocks without a hash lead the free queue, and for leaf
  policies the parent links and child counts agree, and a victim tree
  equals one rebuilt from scratch.
  """
  check_state(state)
  errors = list(paging.check_invariants(state.paging))
  errors += [f"index: {e}" for e in index_lib.check_invariants(state.index)]
  published = np.asarray(state.paging.published)
  nxt = np.asarray(state.dup_next)
  prv = np.asarray(state.dup_prev)
  hashes = np.asarray(state.block_hash)
  refcounts = np.asarray(state.paging.refcounts)
  hashed = nxt != NO_BLOCK
  if (hashed != published).any():
    errors.append(
      f"hashed != published at blocks {np.nonzero(hashed != published)[0]}"
    )
  if hashed[NULL_BLOCK]:
    errors.append("null block is hashed")
  if (hashes[~hashed] != 0).any():
    errors.append("an unhashed block has a nonzero block_hash")
  groups: dict[tuple[int, int], list[int]] = {}
  for b in np.nonzero(hashed)[0].tolist():
    groups.setdefault((int(hashes[b, 0]), int(hashes[b, 1])), []).append(b)
    if prv[nxt[b]] != b:
      errors.append(f"dup list broken at block {b}")
  keys = np.asarray(list(groups), np.uint32).reshape(-1, 2)
  heads = (
    np.asarray(index_lib.lookup(state.index, jnp.asarray(keys)))
    if len(keys)
    else np.zeros(0, np.int32)
  )
  for (key, blocks), head in zip(groups.items(), heads.tolist(), strict=True):
    if head not in blocks:
      errors.append(f"index maps {key} to {head}, not one of {blocks}")
      continue
    ring, cur = [], head
    while len(ring) <= len(blocks):
      ring.append(cur)
      cur = int(nxt[cur])
      if cur == head:
        break
    if sorted(ring) != sorted(blocks):
      errors.append(f"key {key}: list {ring} != blocks {blocks}")
  if int(state.index.count) != len(groups):
    errors.append(f"index count {int(state.index.count)} != {len(groups)}")
  tables = np.asarray(state.paging.block_tables)
  tokens = np.asarray(state.paging.num_tokens)
  k = state.block_size
  for s in np.nonzero(np.asarray(state.paging.active))[0].tolist():
    if tokens[s] % k:
      last = tables[s, tokens[s] // k]
      if published[last]:
        errors.append(f"sequence {s} partial last block {last} is published")
  errors += _check_policy_invariants(state, hashed)
  stats = state.stats
  if int(stats.num_cached) != int(hashed.sum()):
    errors.append(f"num_cached {int(stats.num_cached)} != {hashed.sum()}")
  free_cached = int((hashed & (refcounts == 0)).sum())
  if int(stats.num_cached_free) != free_cached:
    errors.append(
      f"num_cached_free {int(stats.num_cached_free)} != {free_cached}"
    )
  return errors
