"""Plain-Python model of kvcache-simulator 0.1.3's hit-rate semantics.

kvcache-simulator (PyPI, KVCache.AI; modules `kvcache_sim.trace`, `.plan`,
`.policies`, and the C++ core `resources/kv-cache-lab-native-sim.cc`, which
implements the same rules) replays a trace of per-block hash ids through a
cache of `capacity` blocks. This module re-implements those rules in our
own code (sets, a deque, one lazy heap), for use as a test oracle and as
the specification of the on-device `kvcache-sim` replay semantics.

Semantics, as read from its source (the `[name]` tags are cited in the code):

- [parse] Requests whose `hash_ids` is empty are dropped by its parser: they
  count neither as warm-up nor as measured requests. A request with blocks
  must have `input_length > 0`. Hash ids are interned (int 5 and string "5"
  are the same id).
- [tokens] Block `j` of a request weighs `min(block_size, input_length -
  j * block_size)` tokens, at least 1 (so the last block may be partial; a
  block past `input_length` weighs 1 token).
- [trie] A block's identity is its whole prefix: trie node = (parent node,
  hash id), numbered 1, 2, ... in order of first appearance in the file
  (root = 0). Equal hash ids after different prefixes are different blocks.
  The number of distinct nodes is the trace's `uniqueBlocks`.
- [next] Belady keys: for a block of request `r`, the index of the next
  request (after `r`) containing the same node, or `R + 1` if none, where R
  counts the kept requests.
- [order] Requests are replayed one at a time, in file order. Each request
  first looks up, then inserts.
- [hit] Lookup: a request's hit is the longest run of cached blocks from its
  start, summing each block's token weight; a block after the first miss
  never counts, even if cached. Total tokens are all its blocks' weights.
- [warmup] `warmup = floor(R * warmup_fraction)` requests warm the cache;
  hits and totals are summed over requests `warmup .. R-1` only.
- [capacity] The capacity counts cached blocks only (no running request
  holds blocks); at most one block is evicted per inserted block.
- [fifo] `fifo`: a flat set of nodes plus an insertion queue. Lookup changes
  nothing. Then every block of the request not cached (in order) is
  inserted, first evicting the oldest inserted block when full -- which can
  be a block this very request hit or inserted. No trie constraint: a block
  can be cached while its parent is not.
- [leaf] `lru` and `optimal` cache a rooted subtree of the trie: only
  leaves (cached nodes with no cached child) are evicted, and a block is
  inserted only if its parent is cached. Each request's insertion stops at
  its first block that cannot be inserted (`break`): evicting its parent
  or finding no evictable leaf ends the request's insertions.
- [protect] Blocks the request hit (its cached prefix) cannot be evicted
  while it inserts; blocks it inserted itself can (they are not protected).
  Only the deepest hit block can be a leaf, so this only keeps the first
  insertion from evicting its own parent. It changes results for `lru`
  only (for `optimal` that parent's key is <= the newcomer's, so the
  bypass below fires first; checked on random traces).
- [lru] `lru` key: a global clock, incremented on every touch. Lookup
  touches each hit block from the root down (so deeper = more recent);
  an inserted block is touched when added. Victim: the unprotected leaf
  with the smallest key.
- [optimal] `optimal` key: the block's next use ([next]) from the event
  that last touched it (a hit or its insertion). Victim: the unprotected
  leaf with the largest key; but if that key is <= the next use of the
  block being inserted, nothing is evicted and the request's insertions
  stop (Belady bypass: the newcomer is needed no sooner than the victim).
- [tie] Equal keys evict the larger node id (the later-created block)
  first. Ties cannot change any hit: `lru` keys are unique, and two
  `optimal` leaves with the same finite next use would both lie on that
  request's path (one the other's ancestor, so not both leaves); only
  never-used-again leaves tie, and none of them is ever hit again.
- [full] "Full" means: the number of cached blocks reached the capacity
  right after an insertion made during a warm-up request.
- [underfilled] If the cache was not full by the end of warm-up (or no
  tokens are measured), the point is "underfilled_at_window": hit tokens
  are reported as 0 (its simulation stops at the first measured request,
  and its CLI omits that budget and every larger one; the CLI also drops
  budgets of more than `uniqueBlocks` blocks).
  With `warmup_fraction = 0` every point with capacity > 0 is underfilled.
- [nocache] Capacity <= 0 is a valid point with 0 hit tokens, not
  underfilled. (A trace with no blocks at all is refused by its parser.)
- [ceiling] The unbounded cache ("ceiling"): every block ever seen stays
  cached; measured the same way.

Driving the package itself (for comparisons and benchmarks): its Python
backend is `kvcache_sim.trace.parse_trace_file(path, block_size=512)` ->
`kvcache_sim.plan.build_execution_plan(trace, warmup_fraction)` ->
`kvcache_sim.policies.simulate_policy(plan, policy, capacity)`; its C++
backend is `kvcache_sim.cpp_backend.run_cpp_sweep(trace, capacities=[...],
policies=[...], warmup_requests=plan.warmup_requests)` (compiles the core
with `c++ -O3` into the temp dir on first use). The CLI sizes capacities
from GiB budgets and a model: `--model llama-3.1-8b --kv-precision
bf16_fp16` makes a 512-token block exactly 1/16 GiB, so
`--budgets-gib 114.1875,571.1875,1142.4375,2284.875` gives capacities
1827, 9139, 18279, 36558 blocks (1%, 5%, 10%, 20% of the Mooncake
conversation trace's 182,790 unique blocks, rounded down).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence

POLICIES = ("fifo", "lru", "optimal")


def block_tokens(input_length: int, block_size: int, index: int) -> int:
  """Token weight of block `index` of a request ([tokens])."""
  remaining = input_length - index * block_size
  return min(block_size, remaining) if remaining > 0 else 1


@dataclasses.dataclass(frozen=True)
class Plan:
  """A trace prepared for replay: trie nodes, weights and next uses.

  Attributes:
    kept: original index of each kept request (those with >= 1 block).
    nodes: per kept request, the trie node of each block.
    tokens: per kept request, the token weight of each block.
    next_use: per kept request, each block's next use (a kept-request
      index, or `len(kept) + 1` for never).
    parent: parent node of every node (`parent[0] = 0` is the root).
    warmup_requests: kept requests before the measured window.
    num_requests: number of requests in the original trace.
  """

  kept: list[int]
  nodes: list[list[int]]
  tokens: list[list[int]]
  next_use: list[list[int]]
  parent: list[int]
  warmup_requests: int
  num_requests: int

  @property
  def unique_blocks(self) -> int:
    """Number of distinct trie nodes (kvcache-simulator's uniqueBlocks)."""
    return len(self.parent) - 1

  @property
  def measured_tokens(self) -> int:
    return sum(sum(row) for row in self.tokens[self.warmup_requests :])


def prepare(
  trace_hash_ids: Sequence[Sequence[int]],
  input_lengths: Sequence[int],
  block_size: int,
  warmup_fraction: float = 0.5,
) -> Plan:
  """Builds the trie, the token weights and the next uses of a trace."""
  if len(trace_hash_ids) != len(input_lengths):
    raise ValueError(
      f"{len(trace_hash_ids)} hash-id rows but {len(input_lengths)} input "
      "lengths"
    )
  if block_size < 1:
    raise ValueError(f"block_size={block_size} must be positive")
  if not 0.0 <= warmup_fraction <= 1.0:
    raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1]")
  edges: dict[tuple[int, int], int] = {}
  parent = [0]
  kept, nodes, tokens = [], [], []
  for index, (ids, length) in enumerate(
    zip(trace_hash_ids, input_lengths, strict=True)
  ):
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    length = int(length)
    if not ids:
      continue  # [parse] no blocks: dropped
    if length <= 0:
      raise ValueError(  # [parse] positive input_length required
        f"request {index} has {len(ids)} blocks but input_length={length}"
      )
    row, node = [], 0
    for hash_id in ids:
      key = (node, int(hash_id))  # [trie] identity = (parent, hash id)
      node = edges.get(key, 0)
      if not node:
        node = len(parent)
        edges[key] = node
        parent.append(key[0])
      row.append(node)
    kept.append(index)
    nodes.append(row)
    tokens.append(
      [block_tokens(length, block_size, j) for j in range(len(row))]
    )
  if not kept:
    raise ValueError("no request has any block (kvcache-simulator refuses it)")
  never = len(kept) + 1  # [next]
  upcoming: dict[int, int] = {}
  next_use: list[list[int]] = [[] for _ in kept]
  for r in range(len(kept) - 1, -1, -1):
    next_use[r] = [upcoming.get(node, never) for node in nodes[r]]
    for node in nodes[r]:
      upcoming[node] = r
  return Plan(
    kept=kept,
    nodes=nodes,
    tokens=tokens,
    next_use=next_use,
    parent=parent,
    warmup_requests=math.floor(len(kept) * warmup_fraction),  # [warmup]
    num_requests=len(trace_hash_ids),
  )


def _result(plan: Plan, hits: list[int], filled: bool, no_cache: bool):
  per_request = [0] * plan.num_requests
  for r, hit in enumerate(hits):
    per_request[plan.kept[r]] = hit
  total = plan.measured_tokens
  measured_hits = sum(hits[plan.warmup_requests :])
  underfilled = not no_cache and (not filled or total <= 0)  # [underfilled]
  return {
    "hit_tokens": 0 if underfilled or no_cache else measured_hits,
    "total_tokens": total,
    "measured_requests": len(plan.kept) - plan.warmup_requests,
    "underfilled": underfilled,
    "per_request_hit_tokens": per_request,
  }


def _simulate_fifo(plan: Plan, capacity: int) -> tuple[list[int], bool]:
  cached: set[int] = set()
  queue: deque[int] = deque()  # [fifo] insertion order
  hits, filled = [], False
  for r, (nodes, weights) in enumerate(
    zip(plan.nodes, plan.tokens, strict=True)
  ):
    hit = 0
    for node, weight in zip(
      nodes, weights, strict=True
    ):  # [hit] run from the start
      if node not in cached:
        break
      hit += weight
    hits.append(hit)
    for node in nodes:  # [fifo] insert every missing block, in order
      if node in cached:
        continue
      if len(cached) >= capacity:  # [capacity] one eviction per insertion
        cached.remove(queue.popleft())
      cached.add(node)
      queue.append(node)
      if len(cached) >= capacity and r < plan.warmup_requests:
        filled = True  # [full]
  return hits, filled


def _simulate_leaf(
  plan: Plan, capacity: int, optimal: bool
) -> tuple[list[int], bool]:
  parent = plan.parent
  present = bytearray(len(parent))
  present[0] = 1  # the root is always there and never counted
  children = [0] * len(parent)
  key = [0] * len(parent)
  # Lazy heap of (priority, -node, node, key); smallest first. Priority is
  # the key ([lru]) or minus the key ([optimal]); -node breaks ties toward
  # the larger node id ([tie]). An entry is stale unless its node is still
  # a present leaf with the same key.
  heap: list[tuple[int, int, int, int]] = []
  clock = 0
  size = 0

  def offer(node: int) -> None:
    if present[node] and not children[node]:
      k = key[node]
      heapq.heappush(heap, (-k if optimal else k, -node, node, k))

  def touch(node: int, next_use: int) -> None:
    nonlocal clock
    if optimal:
      key[node] = next_use  # [optimal]
    else:
      clock += 1
      key[node] = clock  # [lru]
    offer(node)

  def evict(protected: set[int], incoming_next_use: int) -> bool:
    nonlocal size
    held = []
    evicted = False
    while heap:
      entry = heapq.heappop(heap)
      node, k = entry[2], entry[3]
      if not present[node] or children[node] or key[node] != k:
        continue  # stale
      if node in protected:  # [protect]
        held.append(entry)
        continue
      if optimal and k <= incoming_next_use:  # [optimal] bypass
        held.append(entry)
        break
      present[node] = 0  # [leaf] evict this leaf
      size -= 1
      children[parent[node]] -= 1
      if parent[node]:
        offer(parent[node])  # it may have become a leaf
      evicted = True
      break
    for entry in held:
      heapq.heappush(heap, entry)
    return evicted

  hits, filled = [], False
  for r, (nodes, weights, uses) in enumerate(
    zip(plan.nodes, plan.tokens, plan.next_use, strict=True)
  ):
    hit, protected = 0, set()
    for node, weight, use in zip(nodes, weights, uses, strict=True):
      if not present[node]:
        break  # [hit]; in a rooted subtree nothing deeper is cached either
      hit += weight
      touch(node, use)  # [lru] root first, so deeper is more recent
      protected.add(node)
    hits.append(hit)
    for node, use in zip(nodes, uses, strict=True):
      if present[node]:
        continue
      if size >= capacity and not evict(protected, use):
        break  # [leaf] nothing evictable (or [optimal] bypass)
      if not present[parent[node]]:
        break  # [leaf] its parent was just evicted
      present[node] = 1
      size += 1
      children[parent[node]] += 1
      touch(node, use)  # [lru] / [optimal] key set on insertion
      if size >= capacity and r < plan.warmup_requests:
        filled = True  # [full]
  return hits, filled


def simulate_plan(plan: Plan, capacity_blocks: int, policy: str) -> dict:
  """Like `simulate`, on a prepared `Plan` (reuse it across points)."""
  if policy not in POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {POLICIES}")
  if capacity_blocks <= 0:  # [nocache]
    return _result(plan, [0] * len(plan.kept), False, no_cache=True)
  if policy == "fifo":
    hits, filled = _simulate_fifo(plan, capacity_blocks)
  else:
    hits, filled = _simulate_leaf(plan, capacity_blocks, policy == "optimal")
  return _result(plan, hits, filled, no_cache=False)


def simulate(
  trace_hash_ids: Sequence[Sequence[int]],
  input_lengths: Sequence[int],
  block_size: int,
  capacity_blocks: int,
  policy: str,
  warmup_fraction: float = 0.5,
) -> dict:
  """Replays a trace through kvcache-simulator's cache model.

  Args:
    trace_hash_ids: per request, its per-block hash ids, in file order.
    input_lengths: per request, its prompt length in tokens.
    block_size: tokens per block.
    capacity_blocks: cache capacity in blocks.
    policy: "fifo", "lru" or "optimal".
    warmup_fraction: share of (kept) requests before the measured window.

  Returns:
    A dict with `hit_tokens` (over the measured window; 0 when underfilled,
    as kvcache-simulator reports), `total_tokens` (measured),
    `measured_requests`, `underfilled` and `per_request_hit_tokens` (one
    entry per input request, warm-up included, from simulating the whole
    trace even when kvcache-simulator would stop early as underfilled;
    0 for dropped requests).
  """
  plan = prepare(trace_hash_ids, input_lengths, block_size, warmup_fraction)
  return simulate_plan(plan, capacity_blocks, policy)


def ceiling(
  trace_hash_ids: Sequence[Sequence[int]],
  input_lengths: Sequence[int],
  block_size: int,
  warmup_fraction: float = 0.5,
) -> dict:
  """Hit tokens of an unbounded cache ([ceiling]); same keys as `simulate`."""
  plan = prepare(trace_hash_ids, input_lengths, block_size, warmup_fraction)
  seen: set[int] = set()
  hits = []
  for nodes, weights in zip(plan.nodes, plan.tokens, strict=True):
    hit = 0
    for node, weight in zip(nodes, weights, strict=True):
      if node not in seen:
        break
      hit += weight
    hits.append(hit)
    seen.update(nodes)
  result = _result(plan, hits, True, no_cache=False)
  result["underfilled"] = False
  result["hit_tokens"] = sum(hits[plan.warmup_requests :])
  return result
