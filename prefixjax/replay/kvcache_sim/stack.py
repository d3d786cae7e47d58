"""kvcache-simulator replay of the leaf policies as keys and counts.

A third engine for :func:`prefixjax.replay.replay` (same
:class:`~prefixjax.replay.ReplayPlan` in, same
:class:`~prefixjax.replay.ReplayPoint` list out, hits equal request for
request). :mod:`prefixjax.replay.kvcache_sim.chunked` keeps the trie (cached
children, leaf keys, chain walks); under these two policies the hits need much
less, because both order nodes by a key that never puts a node after its own
parent:

``lru_leaf`` (kvcache-simulator's ``lru``): the Mattson stack distance
  (Mattson, Gecsei, Slutz and Traiger, "Evaluation techniques for storage
  hierarchies", IBM Systems Journal 9(2), 1970). Rank every node seen so
  far by (last request that touched it, then shallower first): a node's
  parent is touched whenever it is, and in the same request, so it always
  ranks above it. Evicting the least recently used leaf therefore evicts
  the lowest-ranked node, and as long as a request's blocks fit the cache
  (capacity >= its blocks) the cache after every request is the top
  ``capacity`` of that ranking, whatever the capacity. So one pass gives
  every node's rank when each request starts, and a block is cached at
  capacity ``C`` iff its rank is below ``C``: every capacity at once.

  The rank is counted in linear time: request ``r`` occupies positions
  ``start(r) ..`` with its deepest block first, so a node's last position
  orders it; a node's rank is the number of nodes whose last position lies
  between its own and the request's start. Every position is filled once
  and emptied at most once (when its node is touched again), so that count
  is the positions in between minus the emptied ones, a Fenwick tree (a
  binary indexed tree) over emptied positions: per block one ``[log E]``
  gather and one ``[log E]`` scatter-add. A request longer than a step
  (``W`` blocks) empties its ancestors' positions in an earlier step;
  they all lay in the counted range, so the step adds them back (their
  number is carried).

  Capacities below the longest request break the "top ``C``" argument
  (the request evicts its own blocks); :func:`replay_keys` leaves those to
  the chain engine.

``belady_leaf`` (kvcache-simulator's ``optimal``): a node's key is the
  request of its next use, and a parent's is never later than its
  child's. So the largest key among cached nodes is always a leaf's, the
  victim's key is the cache's largest, and the hits of request ``r`` are
  exactly the cached nodes with key ``r`` (its blocks seen before that are
  still cached: a prefix of the request, since ties are evicted deepest
  first). The cache is then a multiset of keys: a count per key.
  Sequentially, request ``r`` moves its hits to their next uses and
  inserts its missing blocks in order, each evicting one largest key when
  the cache is full as long as that key is later than the block's own
  (else the Belady bypass stops the request). The missing blocks' keys
  never decrease along the request and its hits' are no later than
  theirs, so the cache after the request is simply the ``capacity``
  smallest keys of (the cache less bucket ``r``) plus all the request's
  keys: empty bucket ``r`` (its count is the hits), add the keys, drop
  the largest while over capacity. Which of several equal keys stays
  changes no count, and "add, then drop the largest" composes, so a
  request with many distinct keys may take several steps (``U`` distinct
  keys each).

  Only the dropping depends on the capacity, so every capacity lives in
  one array, capacity-minor: ``[K, C]`` counts, where a request's bucket
  and its keys are whole-row writes. A capacity over its size gives up
  its never-used count first, then its largest finite buckets, one bucket
  per loop round (0.4 rounds per step on the Mooncake trace's first 1,500
  requests at 256 capacities). Each capacity's largest nonempty key is
  kept, and the next one below found through a bitmap per capacity (a bit
  per key, per 32 keys, ...: a word read per level). The cache holds
  every node seen until it first fills, so it filled in warm-up iff the
  warm-up requests saw at least ``capacity`` nodes.

Dimensions: ``S`` steps, ``W`` blocks per step (``lru_leaf``), ``U``
distinct keys per step (``belady_leaf``), ``C`` capacities, ``E`` block
events, ``K`` keys (kept requests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax._masked import NONE, barrier, gather, scatter, scatter_add
from prefixjax.replay import frame
from prefixjax.replay.frame import (
  Batching,
  Prepared,
  ReplayEngine,
  ReplayPoint,
)
from prefixjax.replay.kvcache_sim.chunked import (
  check_width,
  chunk_points,
  chunks,
  column,
)
from prefixjax.replay.plan import ReplayPlan, clip_capacities, points_of_kept

__all__ = [
  "BELADY_ENGINE",
  "LRU_ENGINE",
  "lru_hit_capacities",
  "lru_stack_minimum",
]

_UNSEEN = np.iinfo(np.int32).max  # the rank of a node never seen before
_WIDTH = 32  # blocks per scan step (16 to 64 measure alike on Mooncake)
_KEYS_PER_STEP = 4  # belady_leaf: distinct next uses per scan step
_FAN = 32  # bits per bitmap word (the belady_leaf top search)


# ---------------------------------------------------------------------------
# lru_leaf: stack ranks.


def _rank_step(s, x, *, num_events):
  """One chunk: every block's rank when its request started, then the
  chunk's positions move to the request's."""
  nodes, pos, first, start = x
  i32 = jnp.int32
  levels = jnp.arange(max(num_events.bit_length(), 1), dtype=i32)[None, :]

  def reads():
    last = gather(s["last"], nodes, NONE)  # [W] last position, -1 unseen
    # Emptied positions <= last: the Fenwick prefix over 1-based last + 1
    # sums the nodes (i >> k) << k for every set bit k of i.
    i = jnp.where(last >= 0, last + 1, 0)[:, None]
    on = ((i >> levels) & 1) == 1
    terms = gather(s["tree"], jnp.where(on, (i >> levels) << levels, -1))
    return last, jnp.sum(terms, axis=1), nodes >= 0

  last, emptied_below, valid = barrier(start, *reads())
  ancestors = jnp.where(first, 0, s["ancestors"])
  seen = valid & (last >= 0)
  # Nodes last touched strictly between `last` and `start`: the positions
  # in between, less the emptied ones there, plus the ancestors emptied by
  # this request's earlier steps.
  between = (start - 1 - last) - (s["emptied"] - emptied_below)
  rank = jnp.where(seen, between + ancestors, _UNSEEN)
  # Empty the old positions: add 1 at every node covering 1-based last + 1,
  # ((m + 1) << k) for each k where bit k of m = last is clear.
  m = last[:, None] >> levels
  covers = (m + 1) << levels
  ok = seen[:, None] & ((m & 1) == 0) & (covers <= num_events)
  n_seen = jnp.sum(seen.astype(i32))
  # The running maximum over the request so far: a block is in its
  # request's hit run at capacity C iff this is below C.
  run_max = jnp.maximum(
    jax.lax.cummax(rank), jnp.where(first, i32(-1), s["run_max"])
  )
  s = {
    "tree": scatter_add(s["tree"], covers.reshape(-1), i32(1), ok.reshape(-1)),
    "last": scatter(s["last"], nodes, pos, valid),
    "ancestors": ancestors + n_seen,
    "emptied": s["emptied"] + n_seen,
    "run_max": run_max[-1],
  }
  return s, run_max


@functools.partial(jax.jit, static_argnames=("num_nodes", "num_events"))
def _ranks(arrays, *, num_nodes, num_events):
  """``[S, W]`` the running maximum rank of each block's request prefix
  (``arrays``: the scan inputs and the real steps; ``num_nodes`` and
  ``num_events`` at least the trace's: a larger Fenwick tree sums the
  same prefixes)."""
  xs, num_steps = arrays
  i32 = jnp.int32
  s = {
    "tree": jnp.zeros((num_events + 1,), i32),
    "last": jnp.full((num_nodes,), NONE, i32),
    "ancestors": i32(0),
    "emptied": i32(0),
    "run_max": i32(-1),
  }
  step = functools.partial(_rank_step, num_events=num_events)
  width = xs[0].shape[1]
  like = jax.ShapeDtypeStruct((width,), i32)
  return frame.scan_prefix(step, s, xs, num_steps, like)[1]


# ---------------------------------------------------------------------------
# belady_leaf: a count per next-use key, every capacity in one array.


def _words_per_level(num_keys):
  """Words of each bitmap level: a bit per key, a bit per word below, ...,
  one word on top."""
  sizes = [-(-max(num_keys, 1) // _FAN)]
  while sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // _FAN))
  return sizes


def _bit(b):
  return jnp.left_shift(jnp.uint32(1), b.astype(jnp.uint32))


def _high_bit(w):
  """The highest set bit of each word (0 for an empty word)."""
  w = jnp.where(w != 0, w, jnp.uint32(1))
  return 31 - jax.lax.clz(w).astype(jnp.int32)


def _cells(x, rows, fill=0):
  """``x[rows[c], c]`` for every capacity ``c`` (``[C]``)."""
  n = x.shape[0]
  safe = jnp.where((rows >= 0) & (rows < n), rows, n)
  col = jnp.arange(x.shape[1], dtype=jnp.int32)
  return x.at[safe, col].get(mode="fill", fill_value=fill)


def _set_cells(x, rows, values, mask):
  n = x.shape[0]
  safe = jnp.where(mask & (rows >= 0) & (rows < n), rows, n)
  col = jnp.arange(x.shape[1], dtype=jnp.int32)
  return x.at[safe, col].set(values, mode="drop")


def _trim_round(carry):
  """Takes victims from every capacity's largest finite key (one bucket);
  an emptied bucket's bit is cleared and the next largest key found.

  The next key is the largest set bit below the old one: the old key's
  path words (read anyway, to clear it) masked below it say at which level
  that key branches off; one word read per level below finds it.
  """
  counts, bm, top, rem = carry
  levels = len(bm)
  i32 = jnp.int32

  def reads():
    path = [_cells(bm[lv], top >> (5 * (lv + 1))) for lv in range(levels)]
    return _cells(counts, top), path, top

  count, path, top = barrier(top[0], *reads())
  active = (rem > 0) & (top >= 0)
  take = jnp.where(active, jnp.minimum(count, rem), 0)
  emptied = active & (take == count)
  counts = _set_cells(counts, top, count - take, active)
  # Clear the emptied key's bit (and each word above that empties), and
  # mask every path word below the key's own branch.
  cleared, below = [], []
  going = emptied
  for lv in range(levels):
    bit = _bit((top >> (5 * lv)) & 31)
    word = jnp.where(going, path[lv] & ~bit, path[lv])
    cleared.append(word)
    below.append(path[lv] & (bit - 1))
    going = going & (word == 0)
  branch = jnp.full(top.shape, levels, i32)  # the lowest nonzero `below`
  for lv in reversed(range(levels)):
    branch = jnp.where(below[lv] != 0, lv, branch)
  # Down from the branch: its highest bit below the path, then each word's
  # highest bit (words left of the path: no write of this round touches
  # them).
  nxt = jnp.full(top.shape, -1, i32)
  for lv in reversed(range(levels)):
    here = (top >> (5 * (lv + 1))) * _FAN + _high_bit(below[lv])
    if lv < levels - 1:
      down = nxt * _FAN + _high_bit(_cells(bm[lv], nxt))
    else:
      down = nxt
    nxt = jnp.where(branch == lv, here, jnp.where(branch > lv, down, nxt))
  nxt = jnp.where(branch < levels, nxt, -1)
  bm = tuple(
    _set_cells(bm[lv], top >> (5 * (lv + 1)), cleared[lv], emptied)
    for lv in range(levels)
  )
  return counts, bm, jnp.where(emptied, nxt, top), rem - take


def _belady_step(s, x, *, capacities):
  """One step of a request at every capacity; returns its hit blocks.

  The request's bucket is its hits (read at its first step, then never
  again: every later key is a later request, so the bucket and its bit
  are simply left behind; a search from a live key never reaches them).
  The step's keys join every capacity, and each capacity over its size
  gives up its largest keys: the never-used count first, then finite
  buckets (:func:`_trim_round`).
  """
  request, first, keys, mult, never = x  # [], [], [U], [U], []
  counts, bm = s["counts"], list(s["bm"])
  levels = len(bm)

  def reads():
    own = gather(counts, request[None])[0]
    path = [gather(bm[lv], keys >> (5 * (lv + 1)), 0) for lv in range(levels)]
    return own, path, keys

  own, path, keys = barrier(request, *reads())
  own = jnp.where(first, own, 0)
  on = keys >= 0
  counts = scatter_add(counts, keys, mult[:, None], on)
  # Set the keys' bits on every level (distinct keys sharing a word write
  # one merged value).
  for lv in range(levels):
    word = keys >> (5 * (lv + 1))
    same = (word[:, None] == word[None, :]) & on[None, :]
    bits = jnp.where(same, _bit((keys >> (5 * lv)) & 31)[None, :], 0)
    merged = jax.lax.reduce(bits, jnp.uint32(0), jax.lax.bitwise_or, (1,))
    bm[lv] = scatter(bm[lv], word, path[lv] | merged[:, None], on)
  top = jnp.maximum(s["top"], jnp.max(keys))
  size = s["size"] - own + jnp.sum(mult) + never
  excess = jnp.maximum(size - capacities, 0)
  from_never = jnp.minimum(s["never"] + never, excess)
  # Each round empties a bucket or ends a capacity's excess; a capacity
  # with excess left and no key (never, unless the counts are wrong) stops
  # the loop and is reported.
  counts, bm, top, rem = jax.lax.while_loop(
    lambda carry: jnp.any((carry[3] > 0) & (carry[2] >= 0)),
    _trim_round,
    (counts, tuple(bm), top, excess - from_never),
  )
  s = {
    "counts": counts,
    "bm": bm,
    "top": top,
    "size": size - excess,
    "never": s["never"] + never - from_never,
    "lost": s["lost"] | (rem > 0),
  }
  return s, own


@functools.partial(jax.jit, static_argnames=("num_keys",))
def _belady_scan(arrays, capacities, *, num_keys):
  """``[S, C]`` hit blocks of each step (nonzero only at a request's
  first) and ``[C]`` whether a capacity lost count of its cache
  (``arrays``: the scan inputs and the real steps; ``num_keys`` at least
  the kept requests)."""
  xs, num_steps = arrays
  i32 = jnp.int32
  n = capacities.shape[0]
  s = {
    "counts": jnp.zeros((num_keys, n), i32),  # [K, C]
    "bm": tuple(
      jnp.zeros((words, n), jnp.uint32) for words in _words_per_level(num_keys)
    ),
    # At least every nonempty finite key (a live one when a trim needs it).
    "top": jnp.full((n,), -1, i32),
    "size": jnp.zeros((n,), i32),
    "never": jnp.zeros((n,), i32),  # cached nodes never used again
    "lost": jnp.zeros((n,), bool),  # excess left with no key to drop
  }
  step = functools.partial(_belady_step, capacities=capacities)
  like = jax.ShapeDtypeStruct((n,), i32)
  s, hits = frame.scan_prefix(step, s, xs, num_steps, like)
  return hits, s["lost"]


# ---------------------------------------------------------------------------
# Host side.


def _lru_prepare(
  plan: ReplayPlan,
  capacities,
  *,
  policy="lru_leaf",
  width=_WIDTH,
  bucketed=False,
) -> Prepared:
  """Scan inputs; ``bucketed``: steps, nodes and events padded to powers
  of two (:func:`prefixjax.replay.frame.padded`; the padded steps are
  never run)."""
  _check_policy(policy, "lru_leaf")
  check_width(width)
  rows, first, request, _ = chunks(plan, width)
  starts = np.flatnonzero(plan.first)
  lengths = np.diff(np.r_[starts, plan.num_events])
  # Linear time: request r fills positions start(r) .. start(r) + n - 1,
  # its deepest block first.
  ends = np.repeat(2 * starts + lengths - 1, lengths)
  position = (ends - np.arange(plan.num_events)).astype(np.int32)
  steps = frame.padded(rows.shape[0], bucketed)
  xs = (
    frame.pad_rows(column(rows, plan.node), steps, NONE),
    frame.pad_rows(column(rows, position), steps, NONE),
    frame.pad_rows(first, steps, False),
    frame.pad_rows(starts[request].astype(np.int32), steps, 0),
  )
  return Prepared(
    arrays=(tuple(map(to_device, xs)), to_device(np.int32(rows.shape[0]))),
    capacities=np.asarray(capacities, np.int32),
    static=dict(
      num_nodes=frame.padded(plan.unique_blocks + 1, bucketed),
      num_events=frame.padded(plan.num_events, bucketed),
    ),
    context=(plan, rows),
  )


def _hit_capacities(prepared: Prepared, run_max) -> np.ndarray:
  rows = prepared.context[1]
  run_max = np.asarray(run_max)[: rows.shape[0]][rows >= 0].astype(np.int64)
  return np.where(run_max == _UNSEEN, _UNSEEN, run_max + 1)


def _lru_engine_points(prepared: Prepared, capacities, run_max):
  plan = prepared.context[0]
  return _lru_points(plan, capacities, _hit_capacities(prepared, run_max))


def _check_policy(policy: str, served: str) -> None:
  if policy != served:
    raise ValueError(f"policy={policy!r}: this engine serves {served!r} only")


def lru_stack_minimum(plan: ReplayPlan) -> int:
  """The smallest capacity :data:`LRU_ENGINE` serves: the longest
  request's blocks (see the module docstring)."""
  starts = np.flatnonzero(plan.first)
  return int(np.diff(np.r_[starts, plan.num_events]).max())


def lru_hit_capacities(
  plan: ReplayPlan, *, width: int = _WIDTH, bucketed: bool = True
) -> np.ndarray:
  """Per block event, the smallest ``lru_leaf`` capacity at which it hits.

  A block is in its request's hit run at capacity ``C`` iff ``C`` is at
  least this (``np.iinfo(np.int32).max`` for a block never seen before),
  for every ``C`` of at least the longest request's blocks (see the module
  docstring): one pass gives the whole capacity curve.

  Args:
    plan: from :func:`prefixjax.replay.prepare_replay`.
    width: blocks per scan step.
    bucketed: shapes padded to powers of two (the default; ``False``
      compiles for the trace's own sizes).

  Returns:
    ``[E]`` int64.
  """
  prepared = _lru_prepare(plan, [], width=width, bucketed=bucketed)
  run_max, _ = frame.compile_and_run(LRU_ENGINE, prepared)
  return _hit_capacities(prepared, run_max)


def _lru_points(plan, capacities, hit_capacity) -> list[ReplayPoint]:
  """Points from :func:`lru_hit_capacities` (capacities >= the longest
  request's blocks)."""
  caps = np.asarray(capacities, np.int64)
  order = np.argsort(caps, kind="stable")
  # Event e hits at the sorted capacities from `first_hit[e]` on.
  first_hit = np.searchsorted(caps[order], hit_capacity, side="left")
  # bincount over flat (request, column) cells (np.add.at is ~20x slower;
  # float64 sums of token counts are exact below 2**53).
  cols = len(caps) + 1
  flat = np.bincount(
    plan.request.astype(np.int64) * cols + first_hit,
    weights=np.asarray(plan.weight, np.float64),
    minlength=plan.num_kept * cols,
  )
  per_kept = np.rint(flat).astype(np.int64).reshape(plan.num_kept, cols)
  per_kept = np.cumsum(per_kept, axis=1)[:, :-1]
  # The cache fills in warm-up at C iff a warm request ends with at least
  # C nodes seen and misses at C (its last block's hit capacity > C).
  seen = _nodes_seen(plan)
  ends = np.r_[np.flatnonzero(plan.first)[1:], plan.num_events] - 1
  warm = slice(0, plan.warmup_requests)
  fills_up_to = np.minimum(seen[warm], hit_capacity[ends][warm] - 1)
  fills_up_to = int(fills_up_to.max()) if fills_up_to.size else -1
  points = [None] * len(caps)
  for j, i in enumerate(order):
    points[i] = points_of_kept(
      plan, "lru_leaf", int(caps[i]), per_kept[:, j], caps[i] <= fills_up_to
    )
  return points


def _belady_steps(plan: ReplayPlan, keys_per_step: int):
  """Scan inputs: each request's distinct next-use requests, at most
  ``keys_per_step`` per step (a request takes at least one step).

  Returns ``[S]`` request, ``[S]`` first step of its request, ``[S, U]``
  keys (-1 padded), ``[S, U]`` their block counts, ``[S]`` blocks never
  used again (on the request's first step).
  """
  num_kept = plan.num_kept
  finite = plan.next_use < num_kept
  pair = plan.request[finite].astype(np.int64) * num_kept
  pair, mult = np.unique(pair + plan.next_use[finite], return_counts=True)
  req, key = np.divmod(pair, num_kept)
  distinct = np.bincount(req, minlength=num_kept)
  per_request = np.maximum(-(-distinct // keys_per_step), 1)
  first_step = np.cumsum(per_request) - per_request
  rank = np.arange(pair.size) - np.repeat(
    np.cumsum(distinct) - distinct, distinct
  )
  step = first_step[req] + rank // keys_per_step
  num_steps = int(per_request.sum())
  keys = np.full((num_steps, keys_per_step), NONE, np.int32)
  mults = np.zeros((num_steps, keys_per_step), np.int32)
  keys[step, rank % keys_per_step] = key
  mults[step, rank % keys_per_step] = mult
  request = np.repeat(np.arange(num_kept, dtype=np.int32), per_request)
  first = np.zeros(num_steps, bool)
  first[first_step] = True
  never = np.zeros(num_steps, np.int32)
  never[first_step] = np.bincount(plan.request[~finite], minlength=num_kept)
  return request, first, keys, mults, never


def _nodes_seen(plan: ReplayPlan) -> np.ndarray:
  """``[R_kept]`` distinct nodes seen by the end of each kept request."""
  _, first_seen = np.unique(plan.node, return_index=True)
  return np.cumsum(
    np.bincount(plan.request[first_seen], minlength=plan.num_kept)
  )


def _belady_prepare(
  plan: ReplayPlan,
  capacities,
  *,
  policy="belady_leaf",
  keys_per_step=_KEYS_PER_STEP,
  bucketed=False,
) -> Prepared:
  """Scan inputs; ``bucketed``: steps and keys padded to powers of two
  (the padded steps are never run)."""
  _check_policy(policy, "belady_leaf")
  if (
    isinstance(keys_per_step, bool)
    or not isinstance(keys_per_step, int)
    or keys_per_step < 1
  ):
    raise ValueError(f"keys_per_step={keys_per_step!r} must be an int >= 1")
  request, first, keys, mults, never = _belady_steps(plan, keys_per_step)
  steps = frame.padded(request.shape[0], bucketed)
  xs = (
    frame.pad_rows(request, steps, 0),
    frame.pad_rows(first, steps, False),
    frame.pad_rows(keys, steps, NONE),
    frame.pad_rows(mults, steps, 0),
    frame.pad_rows(never, steps, 0),
  )
  return Prepared(
    arrays=(tuple(map(to_device, xs)), to_device(np.int32(request.shape[0]))),
    capacities=clip_capacities(plan, capacities),
    static=dict(num_keys=frame.padded(plan.num_kept, bucketed)),
    context=(plan, request),
  )


def _belady_engine_points(prepared: Prepared, capacities, outputs):
  plan, request = prepared.context
  hits, lost = outputs
  if np.any(lost):
    bad = [capacities[i] for i in np.flatnonzero(np.asarray(lost))]
    raise RuntimeError(
      f"belady_leaf replay lost count of its cache at capacities {bad} "
      "(a bug: please report it with the trace)"
    )
  # The cache holds every node seen until it first fills, so it filled in
  # warm-up iff the warm-up requests saw at least `capacity` nodes.
  warm = plan.warmup_requests
  seen = int(_nodes_seen(plan)[warm - 1]) if warm > 0 else 0
  clipped = prepared.capacities
  filled = (clipped > 0) & (clipped <= seen)
  hits = np.asarray(hits)[: request.shape[0]].T
  return chunk_points(plan, "belady_leaf", capacities, request, hits, filled)


LRU_ENGINE = ReplayEngine(
  name="kvcache_sim.stack",
  semantics="kvcache-sim",
  policies=("lru_leaf",),
  batching=Batching.ONE_PASS,
  prepare=_lru_prepare,
  run=_ranks,
  points=_lru_engine_points,
)
"""``lru_leaf`` as stack distances: one pass serves every capacity of at
least :func:`lru_stack_minimum` blocks."""

BELADY_ENGINE = ReplayEngine(
  name="kvcache_sim.keys",
  semantics="kvcache-sim",
  policies=("belady_leaf",),
  batching=Batching.COLUMNS,
  prepare=_belady_prepare,
  run=_belady_scan,
  points=_belady_engine_points,
)
"""``belady_leaf`` as counts per next-use key, every capacity a column."""
