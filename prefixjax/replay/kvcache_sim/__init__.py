"""Replay engines with kvcache-simulator 0.1.3's semantics.

Three engines give equal hits (see each module): :mod:`.event` (one scan
step per block event; it models the cache itself and is the reference the
others are tested against), :mod:`.chunked` (a request's blocks per scan
step) and :mod:`.stack` (only the keys that order the nodes: ``lru_leaf`` as
stack distances, one pass for every capacity, and ``belady_leaf`` as counts
per next-use key). :func:`prefixjax.replay.replay` picks among them.

The rules (read from kvcache-simulator 0.1.3's source, modelled in plain
Python in ``tests/reference_models/kvcache_sim.py``):

* A block's identity is its whole prefix: trie node ``(parent, hash id)``.
  Block ``j`` of a request weighs ``min(K, input_length - j * K)`` tokens,
  at least 1. Requests without blocks are dropped.
* Requests are replayed in order; a request's hit is the run of cached
  blocks from its start; then its missing blocks are inserted. The capacity
  counts cached blocks only. Hits are summed over the requests after the
  first ``floor(R * warmup_fraction)``; a cache that never became full
  during warm-up is *underfilled* and reports 0 hit tokens, as the
  simulator does.
* ``fifo`` (its ``fifo``): a flat set and an insertion queue; every missing
  block is inserted, evicting the oldest insertion when full.
* ``lru_leaf`` (its ``lru``) and ``belady_leaf`` (its ``optimal``): the
  cache is a rooted subtree of the trie; only leaves are evicted; a block is
  inserted only if its parent is cached, and a request stops inserting at
  its first failure. The request's hit blocks are protected while it
  inserts. ``lru_leaf`` evicts the least recently touched leaf (hits touch
  root first); ``belady_leaf`` evicts the leaf whose next use is furthest
  away, unless the block being inserted is needed no later (then nothing
  is evicted and the request stops inserting).

Policy names are the cache's (:mod:`prefixjax.cache.policies`): ``lru``
there is vLLM's free-queue order, so kvcache-simulator's ``lru`` is our
``lru_leaf`` (a radix-tree order), and its ``optimal`` our ``belady_leaf``.
"""

POLICIES = ("fifo", "lru_leaf", "belady_leaf")
"""Policies of the kvcache-simulator replay semantics."""

KVCACHE_SIM_POLICY_NAMES = {
  "fifo": "fifo",
  "lru_leaf": "lru",
  "belady_leaf": "optimal",
}
"""Our policy name -> kvcache-simulator's name for the same rule."""

__all__ = ["KVCACHE_SIM_POLICY_NAMES", "POLICIES"]
