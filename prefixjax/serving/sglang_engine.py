"""SGLang 0.5.23's scheduler loop over its paged radix cache, one jitted loop.

The rules, each with its source in SGLang 0.5.23 (``sglang/srt/``), are in
``tests/reference_models/sglang_scheduler.py``, the plain-Python model this
engine reproduces step for step: the normal (non-overlap) event loop, a step
running either a prefill batch or a decode batch; ``PrefillAdder``'s
admission (``rem_total = available + evictable - reserved``, each running
request reserving ``min(max_new_tokens - outputs, 4096) * new_token_ratio``
tokens, each admitted one ``ceil_page(extend) + page + min(max_new_tokens,
4096)``), ``max_prefill_tokens``, ``chunked_prefill_size`` (one chunked
request at a time), ``max_running_requests`` and ``batch_is_full``; the
prompt published after its prefill (``checkpoint``) and the whole sequence
at finish; decode-time eviction and retraction (fewest outputs first, the
request re-prefills prompt + outputs later) with ``new_token_ratio``'s
retraction estimate and decay; ``fcfs`` (with the waiting-prefix refresh of
every 32nd ``calc_priority``), ``lpm`` (with in-batch prefix
deprioritisation, FCFS over 128 waiting) and ``dfs`` (``dfs-weight``: every
waiting request matched, the queue in DFS order of the tree weighted by
waiting requests, :func:`prefixjax.serving.sglang_tree.dfs_order_key`); and
``fair``, this project's VTC over SGLang's loop (not an SGLang policy; its
rules are the model's, ``SglangScheduler``): FCFS order and refresh, the
PrefillAdder's next candidate the waiting request of the client with the
lowest counter, re-chosen after each admission, counters charged ``1`` per
prefill token scheduled and ``2`` per token sampled, a returning client
lifted to the lowest queued counter. ``priority`` is SGLang's
``--enable-priority-scheduling`` over ``fcfs``: the queue sorted by
``(priority, entry time)`` (``Consts.pv``: higher first) every step a
request waits, and, with ``Config.preempt``, ``preempt_to_schedule`` once
the running slots are full: the least preferred running requests, while
the candidate beats them by more than ``Knobs.threshold``, are released
as a retraction is until the candidate's tokens fit.

Data structures (``V`` pages, page 0 the root; ``R`` requests; ``M`` most
pages of one request; ``S`` = ``max_running_requests``): pages are trie nodes
of whole page prefixes (a request's page ``j`` is the page holding its
tokens ``[jK, (j + 1)K)`` under its whole prefix), so the radix tree is the
set of cached pages; a radix node is a run of pages, named by its first
page (``nstart[v]``: the node holding page ``v``), whose last-access time
and lock count live at that page. A request's lock is a root path of
``lock_len`` pages (SGLang locks a node and its ancestors; a split copies
the count, so the locked nodes are those starting on that path). The tree
verbs (:mod:`prefixjax.serving.sglang_tree`) touch one request's path
(``O(M)``), and choosing the LRU leaf at an eviction reads the smallest of
``G`` group bounds and one group of ``B`` pages (``O(sqrt V)``, where a
scan of every page cost half the run at 10,000 requests). Most of a
step's cost on large traces is now its ``O(R)`` passes over the request
arrays and the fixed cost of the loop's many small operations
(``benchmarks/RESULTS.md``, "SGLang's loop at 10,000 requests" and
"SGLang's LRU victim without a scan").
Branches are while loops of 0 or 1 trips (``lax.cond``
copied pool-sized arrays), and the step buffers are written once per step,
outside them.

Runs of quiet decode steps (the batch full or nothing waiting, nobody
finishing, arriving or retracted) are taken up to :data:`JUMP_MAX` at a
time by :func:`_jump`, with ``O(S)`` work a step instead of the loop's
``O(R)`` passes, and with them the decode step in which the next requests
finish, whose releases run before the next step's batch in the same
iteration: one iteration per admission instead of two at 10,000 requests
(``Config.jump``; exact: ``tests/test_sglang_jump.py`` compares every
final array with the step-by-step loop's).

``new_token_ratio`` is float32 here (SGLang: float64): an admission can
differ where the reserved total is within float32 rounding of the free
space.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._masked import barrier, count, some
from prefixjax.serving import roofline
from prefixjax.serving.engine_state import LANE_FIELDS
from prefixjax.serving.sglang_tree import (
  IN_BATCH,
  Consts,
  Tree,
  dfs_order_key,
  evict_for,
  evictable_tokens,
  i32,
  insert,
  lock_path,
  locked_path_evictable,
  lru_groups,
  page_trie,
  prepare,
  walk,
)

__all__ = [
  "CLIP_MAX_NEW_TOKENS",
  "Config",
  "Consts",
  "Knobs",
  "Status",
  "knobs",
  "page_trie",
  "prepare",
  "resume",
  "run",
  "run_batched",
  "start",
  "start_batched",
]

CLIP_MAX_NEW_TOKENS = 4096  # schedule_policy.py
RETRACT_DECODE_STEPS = 20  # environ.py SGLANG_RETRACT_DECODE_STEPS
INIT_RATIO = 0.7  # environ.py SGLANG_INIT_NEW_TOKEN_RATIO
MIN_RATIO = INIT_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
RATIO_DECAY = (INIT_RATIO - MIN_RATIO) / 600  # ..._DECAY_STEPS
MATCH_MAX = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX
REFRESH_INTERVAL = 32  # WAITING_PREFIX_REFRESH_INTERVAL
FAIR_W_IN, FAIR_W_OUT = 1, 2  # prefixjax.serving.schedulers.fair's defaults
_BIG = np.iinfo(np.int32).max


class Status:
  """``status`` bits of a run (0: it ended normally)."""

  OK = 0
  OUT_OF_MEMORY = 1  # a prefill or decode allocation did not fit
  STUCK = 2  # nothing runs and a waiting request never fits
  STEP_ROWS = 4  # more steps than the step buffer has rows
  BAD_STEP_TIME = 8  # the clock gave a step time not finite or negative


class Config(NamedTuple):
  """Static shapes and rules (hashable: a ``jax.jit`` static argument)."""

  page_size: int
  num_pages: int
  max_running: int
  policy: str  # "fcfs" | "lpm" | "dfs" | "fair" | "priority"
  refresh: bool  # SGLANG_ENABLE_WAITING_PREFIX_REFRESH
  steps: int  # step-buffer rows T
  preempt: bool = True  # priority: not --disable-priority-preemption
  jump: bool = True  # take quiet decode runs at once (:func:`_jump`)
  lru_index: bool = True  # keep ``Tree.gmin`` (``sglang_tree._evict``)


class Knobs(NamedTuple):
  """The budgets, traced (``[]`` int32 each), so that configurations that
  differ only in them share one program and can be ``vmap``-ed."""

  chunk: jax.Array  # chunked_prefill_size; 0: no chunking
  max_prefill: jax.Array  # max_prefill_tokens
  threshold: jax.Array  # --priority-scheduling-preemption-threshold


def knobs(chunk: int, max_prefill: int, threshold: int = 10) -> Knobs:
  """:class:`Knobs` from host ints."""
  return Knobs(*(np.int32(v) for v in (chunk, max_prefill, threshold)))


# ------------------------------------------------------------ request state
class Reqs(NamedTuple):
  n_out: jax.Array
  prefix: jax.Array
  extend_end: jax.Array
  row: jax.Array
  prot: jax.Array
  lock_len: jax.Array
  retr: jax.Array
  hit: jax.Array
  first_tok: jax.Array
  finish: jax.Array
  arrived: jax.Array
  waiting: jax.Array
  running: jax.Array
  qpos: jax.Array
  rseq: jax.Array
  in_batch: jax.Array
  matched: jax.Array
  slot: jax.Array  # lane in the current / last prefill batch
  kv: jax.Array  # KV tokens its row holds (after the step's writes)
  first_sched: jax.Array
  resume_hit: jax.Array
  sched_steps: jax.Array
  prefill_steps: jax.Array
  entry: jax.Array  # wait_queue_entry_time's order (last queue entry)


class State(NamedTuple):
  tree: Tree
  q: Reqs
  step: jax.Array
  row: jax.Array  # next step-buffer row
  qnext: jax.Array
  seq: jax.Array
  chunked: jax.Array  # rid or -1
  full: jax.Array  # batch_is_full
  ratio: jax.Array  # float32
  refresh_calls: jax.Array
  status: jax.Array
  done: jax.Array
  time_ms: jax.Array
  time_frac: jax.Array
  idle: jax.Array
  vtc: jax.Array  # [R] int32 fair: each client's counter
  vtc_floor: jax.Array  # [] int32 fair: the counter that emptied the queue
  by_rank: jax.Array  # [R] int32 requests by arrival rank, rejected last
  ranks_in: jax.Array  # [] int32 how many of them arrived (a prefix)
  cur: dict  # this step's lanes [S] and scalars
  out: dict  # step buffers [T, ...]


def _set(a, r, v):
  return a.at[r].set(v)


def _checkpoint(t: Tree, q: Reqs, c: Consts, K, r, up_to, keep=True):
  """``RadixCache.checkpoint(req, up_to)``: the pages up to ``up_to``
  inserted (the prompt's end a node boundary), walked, and locked in place
  of the request's old lock. ``keep`` (traced) False: the request
  finishes and :func:`_free_row` releases it next, which would unlock the
  new path at once, so it is not locked (the same lock counts and
  evictable pages; the skipped pair of passes only lowered LRU bounds)."""
  r, prot, lock_len = _read(r, q.prot, q.lock_len)
  n = up_to // K
  h, t = insert(t, c, r, n)
  dup = h - prot
  t = t._replace(private=t.private - dup - (n - h), free=t.free + dup)
  pp = c.prompt[r] // K
  t = _when((pp > 0) & (pp < n), lambda t: insert(t, c, r, pp)[1], t)
  _, t = walk(t, c, r, n)
  t = lock_path(t, c, r, lock_len, -1)
  t = _when(keep, lambda t: lock_path(t, c, r, n, 1), t)
  q = q._replace(
    lock_len=_set(q.lock_len, r, jnp.where(keep, n, 0)),
    prot=_set(q.prot, r, n),
  )
  return t, q


def _read(r, *arrays):
  """``(r, a[r] for each array)``, materialised before any write at ``r``
  (:func:`prefixjax._masked.barrier`; the writes index with the returned
  ``r``): else XLA:CPU fuses each read into consumers that its copy
  insertion cannot order before the in-place write, and copies the whole
  request array, twice, at every call."""
  return barrier(r, r, *(a[r] for a in arrays))


def _free_row(t: Tree, q: Reqs, c: Consts, r):
  r, row, prot, lock_len = _read(r, q.row, q.prot, q.lock_len)
  private = row - prot
  t = t._replace(private=t.private - private, free=t.free + private)
  t = _when(lock_len > 0, lambda t: lock_path(t, c, r, lock_len, -1), t)
  zero = i32(0)
  q = q._replace(
    lock_len=_set(q.lock_len, r, zero),
    row=_set(q.row, r, zero),
    prot=_set(q.prot, r, zero),
  )
  return t, q


def _retract_one(t, q, c, K, cur, v, left):
  """``release_req`` of running request ``v`` (a decode retraction or a
  priority preemption): its row freed without a checkpoint, ``left * 20``
  tokens evicted, ``reset_for_retract``, and ``v`` in the step's list."""
  t, q = _free_row(t, q, c, v)
  t = evict_for(t, c, K, left * RETRACT_DECODE_STEPS)
  q = q._replace(
    prefix=_set(q.prefix, v, 0),
    kv=_set(q.kv, v, 0),
    retr=_set(q.retr, v, q.retr[v] + 1),
    running=_set(q.running, v, False),
  )
  n = cur["num_preempted"]
  cur = dict(
    cur,
    preempted=cur["preempted"].at[n].set(v, mode="drop"),
    num_preempted=n + 1,
  )
  return t, q, cur


def _when(pred, fn, x, trip: bool = False):
  """``fn(x)`` if ``pred`` else ``x``, as a while loop of 0 or 1 trips.

  ``lax.cond`` copies every array of its operand that a branch returns
  unchanged (on XLA:CPU: each pool- and request-sized array, every step); a
  while loop updates its carry in place.

  XLA's loop-invariant code motion hoists out of the loop whatever ``fn``
  computes from parts of ``x`` it returns unchanged, so that runs at every
  call, taken or not. ``trip``: ``fn(x, trip)`` with ``trip`` the loop's
  counter (1, opaque to XLA): ``fn`` passes such inputs through
  :func:`prefixjax._masked.barrier` anchored on it to keep their work in
  the loop."""
  # the trip count counts down from the predicate, a computed value: a
  # constant start would be copied into the loop's buffer at every call
  go = jnp.asarray(pred).astype(jnp.int32)

  def body(s):
    return s[0] - 1, fn(s[1], s[0]) if trip else fn(s[1])

  return jax.lax.while_loop(lambda s: s[0] > 0, body, (go, x))[1]


def _cond(pred, f, g, x):
  """``f(x)`` if ``pred`` else ``g(x)`` (both return ``x``'s structure)."""
  pred = jnp.asarray(pred)
  return _when(~pred, g, _when(pred, f, x))


def _smallest(mask, key, k: int, few: bool = False):
  """The (at most ``k``) requests in ``mask`` with the smallest ``key``
  (unique among them), in increasing order, and how many there are (``n``;
  the lanes from ``n`` on hold no request of ``mask``, callers read only
  the first ``n``). On XLA:CPU ``jax.lax.top_k`` sorts its whole input,
  ``O(R log R)`` (1.5 ms at ``R`` = 10,000 on a 2-core CPU), so it sorts
  only ``k`` requests: ``few``: ``mask`` holds at most ``k`` (the running
  ones, a batch), gathered first (:func:`_first_set`, ``O(R)``); else, for a
  small ``k``, the ``k`` smallest found first by :func:`_k_smallest`."""
  r_len = mask.shape[0]
  k = min(k, r_len)
  if few and k < r_len:
    idx, have = _first_set(mask, k)
    n = jnp.minimum(have, k)
  elif 4 * k <= r_len:
    n = jnp.minimum(count(mask), k)
    idx = _k_smallest(mask, key, k, n)
  else:
    n = jnp.minimum(count(mask), k)
    _, idx = jax.lax.top_k(jnp.where(mask, -key, -_BIG), k)
    return i32(idx), n
  lanes = jnp.arange(k) < n
  _, pos = jax.lax.top_k(jnp.where(lanes, -key[idx], -_BIG), k)
  return i32(idx[pos]), n


_WORD = 32  # requests a block of :func:`_first_set`


def _first_set(mask, k: int):
  """``(jnp.nonzero(mask, size=k, fill_value=0)[0], mask.sum())``: the
  first ``k`` requests of ``mask`` in request order, then zeros, and how
  many ``mask`` holds. ``jnp.nonzero`` takes a ``cumsum`` over all ``R``
  (0.1 ms at ``R`` = 10,000 on XLA:CPU, several calls a step). Here each
  block of 32 requests is one uint32 word: its population count, a scan
  over the ``R / 32`` counts, the block of each of the ``k`` answers, and
  the answer's bit in its word by a 5-round bisection on population counts
  (8 us at ``k`` = 16 and ``R`` = 10,000, against 17 us with a ``cumsum``
  within the blocks, jax 0.10.2 on a 2-core CPU)."""
  r_len = mask.shape[0]
  nb = -(-r_len // _WORD)
  blocks = jnp.pad(mask, (0, nb * _WORD - r_len)).reshape(nb, _WORD)
  bit = jnp.uint32(1) << jnp.arange(_WORD, dtype=jnp.uint32)
  words = jnp.sum(
    jnp.where(blocks, bit, jnp.uint32(0)), axis=1, dtype=jnp.uint32
  )
  cum = jax.lax.associative_scan(jnp.add, i32(jax.lax.population_count(words)))
  j = jnp.arange(k, dtype=jnp.int32)
  # the block of the j-th: how many blocks end at or before it
  b = jnp.minimum(count(cum[None, :] <= j[:, None]), nb - 1)
  rank = j - jnp.where(b > 0, cum[jnp.maximum(b - 1, 0)], 0)  # in its block
  word = words[b]
  pos = jnp.zeros((k,), jnp.int32)
  for width in (16, 8, 4, 2, 1):  # skip the low half while it is too few
    low = (word >> pos.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1)
    have = i32(jax.lax.population_count(low))
    skip = have <= rank
    pos = pos + jnp.where(skip, width, 0)
    rank = rank - jnp.where(skip, have, 0)
  return jnp.where(j < cum[-1], b * _WORD + pos, 0), cum[-1]


def _k_smallest(mask, key, k: int, n):
  """The ``n`` (``<= k``) requests of ``mask`` with the smallest ``key``,
  in request order, then zeros (``[k]``): a bisection on the key for the
  ``n``-th smallest, one count over ``R`` a round (``log2`` of the keys'
  range rounds), then ties at it in request order, as ``top_k`` takes
  them. The first probe is ``min + n - 1``, and a probe with exactly
  ``n`` keys at or below it ends the search (those ``n`` are the answer,
  no tie to break): a queue's distinct, contiguous positions take one
  round."""
  n = jnp.asarray(n, jnp.int32)
  lo = jnp.min(jnp.where(mask, key, _BIG))
  hi = jnp.max(jnp.where(mask, key, -_BIG))

  def halve(s):
    lo, hi, i, _ = s
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2)
    # the first probe: lo + n - 1, at most hi (the distance as uint32:
    # hi - lo overflows int32 over the whole range; n >= 1 when it runs)
    dist = hi.astype(jnp.uint32) - lo.astype(jnp.uint32)
    first = jnp.where((n - 1).astype(jnp.uint32) <= dist, lo + (n - 1), hi)
    mid = jnp.where(i == 0, first, mid)
    have = count(mask & (key <= mid))
    exact = have == n
    enough = have >= n
    return (
      jnp.where(exact, mid, jnp.where(enough, lo, mid + 1)),
      jnp.where(enough, mid, hi),
      i + 1,
      exact,
    )

  # At most 33 rounds for int32 keys (the bound only guards termination).
  th, _, _, exact = jax.lax.while_loop(
    lambda s: (s[0] < s[1]) & (s[2] < 34) & ~s[3],
    halve,
    (lo, hi, i32(0), jnp.bool_(False)),
  )

  def ties(th):
    below = mask & (key < th)
    tie = mask & (key == th)
    more = n - count(below)
    return below | (tie & (jnp.cumsum(tie, dtype=jnp.int32) <= more))

  take = jax.lax.cond(exact, lambda: mask & (key <= th), lambda: ties(th))
  return _first_set(take, k)[0]


def _in_order(mask, key, fn, carry, k: int, few: bool = False):
  """``fn(carry, r)`` for every ``r`` in ``mask`` (at most ``k`` of them),
  by increasing ``key`` (``few``: see :func:`_smallest`)."""
  rids, n = _smallest(mask, key, k, few)

  def body(s):
    carry, i = s
    return fn(carry, rids[i]), i + 1

  carry, _ = jax.lax.while_loop(lambda s: s[1] < n, body, (carry, i32(0)))
  return carry


# ------------------------------------------------------------------ phases
def _calc_priority(s: State, c: Consts, cfg: Config) -> State:
  q = s.q
  K = cfg.page_size
  nwait = count(q.waiting)
  fill = c.prompt + q.n_out
  if cfg.policy == "lpm":
    G = max(int(c.g32.shape[0]), 1)

    def match_one(x, r):
      t, q, seen, dep = x
      h, t = walk(t, c, r, fill[r] // K)
      plen = h * K
      q = q._replace(matched=_set(q.matched, r, jnp.minimum(plen, fill[r] - 1)))
      g = c.g32[r]
      long = (g >= 0) & (fill[r] >= IN_BATCH)
      low = plen <= IN_BATCH
      hit = low & long & seen[jnp.maximum(g, 0)]
      dep = dep.at[r].set(hit)
      seen = jnp.where(
        low & long & ~hit, seen.at[jnp.maximum(g, 0)].set(True), seen
      )
      return t, q, seen, dep

    def lpm(s):
      t, q = s.tree, s.q
      R = q.waiting.shape[0]
      x = (t, q, jnp.zeros((G,), bool), jnp.zeros((R,), bool))
      t, q, _, dep = _in_order(q.waiting, q.qpos, match_one, x, MATCH_MAX)
      q = _requeue(q, jnp.where(dep, _BIG - 1, -q.matched))
      return s._replace(tree=t, q=q)

    use_lpm = nwait <= MATCH_MAX
  else:
    use_lpm = jnp.bool_(False)

  def fcfs(s):
    if not cfg.refresh:
      return s
    calls = s.refresh_calls + (nwait > 0).astype(jnp.int32)
    go = (nwait > 0) & ((calls - 1) % REFRESH_INTERVAL == 0)

    def touch(s, trip):
      t, q = s.tree, s.q
      R = q.waiting.shape[0]
      W = min(MATCH_MAX, R)
      # in the loop: else XLA computes the order at every call (one in 32)
      waiting, qpos = barrier(trip, q.waiting, q.qpos)
      order, _ = _smallest(waiting, qpos, W)
      cnt = jnp.minimum(nwait, W)

      def body(i, t):
        k = cnt - 1 - i
        r = order[jnp.maximum(k, 0)]
        return walk(t, c, r, fill[r] // K, k >= 0)[1]

      t = jax.lax.fori_loop(0, W, body, t)
      return s._replace(tree=t)

    s = s._replace(refresh_calls=calls)
    return _when(go, touch, s, trip=True)

  if cfg.policy == "lpm":
    return _cond(use_lpm, lpm, fcfs, s)
  if cfg.policy == "dfs":
    return _dfs(s, c, cfg)
  if cfg.policy == "priority":  # _sort_by_priority_and_fcfs, then refresh
    s = s._replace(q=_requeue(q, -c.pv, tie=q.entry))
  return fcfs(s)


def _dfs(s: State, c: Consts, cfg: Config) -> State:
  """``CacheAwarePolicy.DFS_WEIGHT``: every waiting request is matched in
  queue order (however many wait: only LPM and HRRN fall back to FCFS over
  128), then the queue takes :func:`dfs_order_key`'s order; no
  waiting-prefix refresh (a cache-aware policy)."""
  K = cfg.page_size
  q = s.q
  R = q.waiting.shape[0]
  fill = c.prompt + q.n_out

  def match_one(x, r):
    t, node = x
    h, t = walk(t, c, r, fill[r] // K)
    last = jnp.where(h > 0, c.pages[r, jnp.maximum(h - 1, 0)], 0)
    return t, node.at[r].set(last)

  t, node = _in_order(
    q.waiting, q.qpos, match_one, (s.tree, jnp.zeros((R,), jnp.int32)), R
  )
  q = _requeue(q, dfs_order_key(t, c, q.waiting, node))
  return s._replace(tree=t, q=q)


def _requeue(q: Reqs, key, tie=None) -> Reqs:
  """The waiting queue sorted by ``key``, ties by ``tie`` (default the queue
  order: a stable ``waiting_queue.sort(key=...)``): each waiting request's
  ``qpos`` becomes its rank."""
  r_len = q.waiting.shape[0]
  tie = q.qpos if tie is None else tie
  order = jnp.lexsort((tie, jnp.where(q.waiting, key, _BIG)))
  rank = (
    jnp.zeros((r_len,), jnp.int32)
    .at[order]
    .set(jnp.arange(r_len, dtype=jnp.int32))
  )
  return q._replace(qpos=jnp.where(q.waiting, rank, q.qpos))


def _record(cur, i, rid, tok, kind, ctx):
  def put(name, v):
    return cur[name].at[i].set(v, mode="drop")

  return dict(
    cur,
    sched_rid=put("sched_rid", rid),
    sched_n=put("sched_n", tok),
    sched_kind=put("sched_kind", kind),
    ctx=put("ctx", ctx),
  )


def _gate(s: State, cfg: Config):
  """The head of ``_get_new_batch_prefill_raw``: ``(running, waiting,
  batch_is_full after it, whether a prefill batch is attempted)``. Not
  attempted while the batch is full or nothing waits (unless a request is
  being chunked), nor when the running slots are gone (which sets
  ``batch_is_full``); with priority preemption ``batch_is_full`` is reset
  first and only an empty queue skips."""
  preempt = cfg.policy == "priority" and cfg.preempt
  nrun = count(s.q.running)
  nwait = count(s.q.waiting)
  no_chunk = s.chunked < 0
  full = jnp.bool_(False) if preempt else s.full
  skip = (full | (nwait == 0)) & no_chunk
  slots_gone = (cfg.max_running - nrun <= 0) & no_chunk
  if preempt:
    slots_gone = jnp.bool_(False)
  full = jnp.where(~skip & slots_gone, True, full)
  return nrun, nwait, full, ~skip & ~slots_gone


def _prefill(s: State, c: Consts, cfg: Config, kn: Knobs):
  """``_get_new_batch_prefill_raw`` + ``prepare_for_extend``: (state, n)."""
  K = cfg.page_size
  fair = cfg.policy == "fair"
  preempt = cfg.policy == "priority" and cfg.preempt
  nrun, nwait, full, go = _gate(s, cfg)
  s = s._replace(full=full)

  def attempt(s):
    s = _calc_priority(s, c, cfg)
    t, q = s.tree, s.q
    left = jnp.minimum(c.max_new - q.n_out, CLIP_MAX_NEW_TOKENS)
    run_new = jnp.sum(jnp.where(q.running, left, 0), dtype=jnp.int32)
    total_off = run_new.astype(jnp.float32) * s.ratio
    chunking = kn.chunk > 0
    chunk = jnp.where(chunking, kn.chunk, _BIG // 2)
    b = dict(
      total_off=total_off,
      cur_off=i32(0),
      rem_input=i32(kn.max_prefill),
      rem_chunk=i32(chunk),
      nb=i32(0),
      ext_sum=i32(0),
    )
    out = s.cur

    def avail_ev(t):
      return t.free * K + evictable_tokens(t, K)

    def reserve(b, extend, max_new):
      ext = -(-extend // K) * K
      return dict(
        b,
        total_off=b["total_off"] + (ext + K + max_new).astype(jnp.float32),
        cur_off=b["cur_off"] + ext + K,
        rem_input=b["rem_input"] - ext,
        rem_chunk=b["rem_chunk"] - jnp.where(chunking, ext, 0),
      )

    def budget(t, b):
      ae = avail_ev(t)
      no_token = ~(
        (ae.astype(jnp.float32) - b["total_off"] > 0) & (ae - b["cur_off"] > 0)
      )
      other = (b["rem_input"] <= 0) | (b["rem_chunk"] <= 0)
      return no_token, other

    chunked = s.chunked

    # add_chunked_req
    def add_chunked(x):
      t, q, b, out, chunked = x
      r = chunked
      rt = jnp.floor(avail_ev(t).astype(jnp.float32) - b["total_off"]).astype(
        jnp.int32
      )
      avail = jnp.minimum(b["rem_chunk"], rt)
      rem = jnp.where(avail > 0, avail, b["rem_chunk"])
      cand = c.prompt[r] + q.n_out[r] - q.prefix[r]
      trunc = cand > rem
      new_len = jnp.minimum(cand, rem)
      q = q._replace(
        extend_end=_set(q.extend_end, r, q.prefix[r] + new_len),
        in_batch=_set(q.in_batch, r, True),
        slot=_set(q.slot, r, b["nb"]),
        kv=_set(q.kv, r, q.prefix[r] + new_len),
      )
      out = _record(out, b["nb"], r, new_len, 0, q.prefix[r])
      b = reserve(
        b,
        new_len,
        jnp.where(trunc, 0, jnp.minimum(c.max_new[r], CLIP_MAX_NEW_TOKENS)),
      )
      b = dict(b, nb=b["nb"] + 1, ext_sum=b["ext_sum"] + new_len)
      return t, q, b, out, jnp.where(trunc, r, -1)

    t, q, b, out, chunked = _when(
      chunked >= 0, add_chunked, (t, q, b, out, chunked)
    )

    # the waiting queue, in order
    def cond(x):
      return x[8]

    cand, ncand = _smallest(q.waiting, q.qpos, cfg.max_running + 1)

    def preempt_for(y, r):
      """``PrefillAdder.preempt_to_schedule(r)``: (carry, done)."""
      t, q, b, out, nrun, npre = y
      S = out["sched_rid"].shape[0]
      fill = c.prompt[r] + q.n_out[r]
      rem_total = avail_ev(t).astype(jnp.float32) - b["total_off"]
      need = (
        fill - q.prefix[r] + jnp.minimum(c.max_new[r], CLIP_MAX_NEW_TOKENS)
      ).astype(jnp.float32) - rem_total
      idx, _ = _first_set(q.running, S)
      lanes = jnp.arange(S) < nrun
      # least preferred first, ties: the latest entry first
      perm = jnp.lexsort((-q.entry[idx], jnp.where(lanes, c.pv[idx], _BIG)))
      v = idx[perm]
      lanes = lanes[perm]
      left = jnp.minimum(c.max_new - q.n_out, CLIP_MAX_NEW_TOKENS)
      off = left.astype(jnp.float32) * s.ratio  # [R] each one's offset
      elig = lanes & (c.pv[r] - c.pv[v] > kn.threshold)
      cum = jnp.cumsum(jnp.where(elig, off[v], 0.0))
      enough = elig & (need - cum <= 0)
      done = jnp.any(enough)
      k = i32(jnp.argmax(enough)) + 1
      r_len = q.running.shape[0]
      chosen = (  # the padding lanes (all request 0) write nothing
        jnp.zeros((r_len,), bool)
        .at[jnp.where(lanes, v, r_len)]
        .set(done & (jnp.arange(S) < k), mode="drop")
      )
      n_before = nrun

      def release(z, u):
        t, q, b, out, cnt, npre = z
        b = dict(b, total_off=b["total_off"] - off[u])
        cnt = cnt + 1
        t, q, out = _retract_one(t, q, c, K, out, u, n_before - cnt)
        # its order of re-entry, for now
        q = q._replace(qpos=_set(q.qpos, u, npre))
        return t, q, b, out, cnt, npre + 1

      t, q, b, out, cnt, npre = _in_order(
        chosen, q.rseq, release, (t, q, b, out, i32(0), npre), S, True
      )
      return (t, q, b, out, nrun - cnt, npre), done

    def body(x):
      t, q, b, out, chunked, full, err, i, _ = x[:9]
      vtc = x[9] if fair else None
      if preempt:
        nrun_now, npre = x[9], x[10]
      else:
        nrun_now = nrun
      if fair:  # the lowest counter's earliest request, chosen again
        key = jnp.where(q.waiting, vtc[c.client], _BIG)
        best = jnp.min(key)
        pos = jnp.where(q.waiting & (key == best), q.qpos, _BIG)
        r = i32(jnp.argmin(pos))
        have = some(q.waiting)
      else:
        r = cand[jnp.minimum(i, cand.shape[0] - 1)]
        have = i < ncand
      no_token, other = budget(t, b)
      other = other & ~no_token
      slots = b["nb"] >= cfg.max_running - nrun_now
      full = jnp.where(have & ~other & slots, True, full)
      if preempt:
        ask = have & ~other & full
        (t, q, b, out, nrun_now, npre), won = _when(
          ask,
          lambda y: preempt_for(y[0], r),
          ((t, q, b, out, nrun_now, npre), jnp.bool_(False)),
        )
        proceed = have & ~other & (~full | won)
      else:
        proceed = have & ~other & ~slots

      def try_one(x):
        t, q, b, out, chunked, full, err = x
        fill = c.prompt[r] + q.n_out[r]
        h, t = walk(t, c, r, (fill - 1) // K)
        plen = h * K
        max_new = jnp.clip(c.max_new[r] - q.n_out[r], 0, CLIP_MAX_NEW_TOKENS)
        if preempt:  # init_next_round_input: the match is the req's prefix
          q = q._replace(prefix=_set(q.prefix, r, plen))
        extend = fill - plen
        total = extend + max_new + K
        ae = t.free * K + K * locked_path_evictable(t, c, r, h)
        ok = total.astype(jnp.float32) + b["total_off"] < ae.astype(jnp.float32)
        ext_tok = -(-extend // K) * K
        reserved_new = jnp.minimum(c.max_new[r], CLIP_MAX_NEW_TOKENS)
        is_chunk = chunking & (ext_tok > b["rem_chunk"])
        cut = b["rem_chunk"] // K * K
        cut = (plen + cut) // K * K - plen
        other = is_chunk & (cut <= 0)
        other = other | (
          ~chunking & (b["nb"] > 0) & (ext_tok >= b["rem_input"])
        )
        err = err | (ok & ~other & is_chunk & (chunked >= 0))
        admit = ok & ~other
        extend = jnp.where(is_chunk, cut, extend)
        reserved_new = jnp.where(is_chunk, 0, reserved_new)
        full = jnp.where(~ok, (b["nb"] > 0) | (nrun > 0), full)

        def do_admit(x):
          t, q, b, out, chunked, full = x
          r_, hit, first_sched, resume_hit, retr = _read(
            r, q.hit, q.first_sched, q.resume_hit, q.retr
          )
          t = lock_path(t, c, r_, h, 1)
          q = q._replace(
            lock_len=_set(q.lock_len, r_, h),
            row=_set(q.row, r_, h),
            prot=_set(q.prot, r_, h),
            prefix=_set(q.prefix, r_, plen),
            extend_end=_set(q.extend_end, r_, plen + extend),
            hit=_set(q.hit, r_, jnp.where(hit < 0, plen, hit)),
            in_batch=_set(q.in_batch, r_, True),
            waiting=_set(q.waiting, r_, False),
            slot=_set(q.slot, r_, b["nb"]),
            kv=_set(q.kv, r_, plen + extend),
            first_sched=_set(
              q.first_sched,
              r_,
              jnp.where(first_sched < 0, s.step, first_sched),
            ),
            resume_hit=_set(
              q.resume_hit, r_, resume_hit + jnp.where(hit < 0, 0, plen)
            ),
          )
          out = _record(
            out, b["nb"], r_, extend, jnp.where(retr > 0, 2, 1), plen
          )
          b = reserve(b, extend, reserved_new)
          b = dict(b, nb=b["nb"] + 1, ext_sum=b["ext_sum"] + extend)
          chunked = jnp.where(is_chunk, r, chunked)
          no_token, oth = budget(t, b)
          full = jnp.where(no_token, True, full)
          return (t, q, b, out, chunked, full), ~no_token & ~oth

        (t, q, b, out, chunked, full), more = _when(
          admit,
          lambda y: do_admit(y[0]),
          ((t, q, b, out, chunked, full), jnp.bool_(False)),
        )
        return (t, q, b, out, chunked, full, err), more

      was_waiting = q.waiting[r]
      (t, q, b, out, chunked, full, err), more = _when(
        proceed,
        lambda y: try_one(y[0]),
        ((t, q, b, out, chunked, full, err), jnp.bool_(False)),
      )
      y = (t, q, b, out, chunked, full, err, i + 1, more)
      if preempt:
        return (*y, nrun_now, npre)
      if not fair:
        return y
      # fair: the admission's tokens, seen by the next choice; the client
      # that empties the queue sets the floor
      floor = x[10]
      admitted = was_waiting & ~q.waiting[r]
      ext = out["sched_n"][jnp.maximum(b["nb"] - 1, 0)]
      u = c.client[r]
      vtc = vtc.at[u].add(jnp.where(admitted, FAIR_W_IN * ext, 0))
      floor = jnp.where(admitted & ~some(q.waiting), vtc[u], floor)
      return (*y, vtc, floor)

    x = (t, q, b, out, chunked, s.full, jnp.bool_(False), i32(0), True)
    if fair:
      x = (*x, s.vtc, s.vtc_floor)
    if preempt:
      x = (*x, nrun, i32(0))
    x = jax.lax.while_loop(cond, body, x)
    t, q, b, out, chunked, full, err = x[:7]
    if fair:
      s = s._replace(vtc=x[9], vtc_floor=x[10])
    if preempt:  # the preempted re-enter the queue after the pass
      pre = q.retr > s.q.retr
      q = q._replace(
        waiting=q.waiting | pre,
        qpos=jnp.where(pre, s.qnext + q.qpos, q.qpos),
        entry=jnp.where(pre, s.qnext + q.qpos, q.entry),
      )
      s = s._replace(qnext=s.qnext + x[10])
    # prepare_for_extend
    nb = b["nb"]
    demand = b["ext_sum"] + (nb * K if K > 1 else 0)
    t = evict_for(t, c, K, jnp.where(nb > 0, demand, 0))
    need = jnp.where(q.in_batch, -(-q.extend_end // K) - (-(-q.prefix // K)), 0)
    total_need = jnp.sum(need, dtype=jnp.int32)
    oom = total_need > t.free
    t = t._replace(free=t.free - total_need, private=t.private + total_need)
    q = q._replace(row=q.row + need)
    status = (
      s.status
      | jnp.where(oom, Status.OUT_OF_MEMORY, 0)
      | jnp.where(err, Status.OUT_OF_MEMORY, 0)
    )
    s = s._replace(
      tree=t, q=q, cur=out, chunked=chunked, full=full, status=status
    )
    return s, nb

  return _when(go, lambda y: attempt(y[0]), (s, i32(0)))


def _publish(s: State, c: Consts, cfg: Config, mode) -> State:
  """The step's one loop of checkpoints, after its batch ran (``mode``: 1
  a prefill step, 2 a decode step, 0 idle: nothing). A prefill step is
  ``process_batch_result_prefill``: each request of the batch but the
  chunked one samples a token, then finishes (``cache_finished_req``) or
  publishes its prompt (``cache_unfinished_req``), in batch order. A
  decode step is ``process_batch_result_decode``'s finished requests, in
  running order (their tokens are counted by :func:`_decode`). One loop
  for both, so that the engine's program holds one copy of
  :func:`_checkpoint` here (the largest verb; each copy made a fifth of a
  program's operations, and XLA:CPU's compile time grows with them)."""
  K = cfg.page_size
  q = s.q
  pre = mode == 1
  mask = jnp.where(
    pre, q.in_batch, (mode == 2) & q.running & (q.finish == s.step)
  )
  key = jnp.where(pre, q.slot, q.rseq)

  def one(x, r):
    t, q, cur = x
    skip = pre & (r == s.chunked)

    def go(x):
      t, q, cur = x
      r_, n_out, first, ext = _read(r, q.n_out, q.first_tok, q.extend_end)
      n_out = n_out + pre.astype(jnp.int32)
      first = jnp.where(pre & (first < 0), s.step, first)
      q = q._replace(
        n_out=_set(q.n_out, r_, n_out), first_tok=_set(q.first_tok, r_, first)
      )
      done = ~pre | (n_out >= c.max_new[r_])
      # finish or publish: the checkpoint up to the last committed token,
      # or to the prefilled end
      end = jnp.where(done, c.prompt[r_] + n_out - 1, ext)
      t, q = _checkpoint(t, q, c, K, r_, end, ~done)

      def fin(x):
        t, q, cur = x
        q = q._replace(finish=_set(q.finish, r_, s.step))
        t, q = _free_row(t, q, c, r_)
        return t, q, _finished(cur, r_)

      def pub(x):
        t, q, cur = x
        return t, q._replace(prefix=_set(q.prefix, r_, ext)), cur

      return _cond(done, fin, pub, (t, q, cur))

    return _when(~skip, go, (t, q, cur))

  S = s.cur["sched_rid"].shape[0]
  t, q, cur = _in_order(mask, key, one, (s.tree, q, s.cur), S, True)
  return s._replace(tree=t, q=q, cur=cur)


def _finished(cur, r):
  n = cur["num_finished"]
  return dict(
    cur,
    finished=cur["finished"].at[n].set(r, mode="drop"),
    num_finished=n + 1,
  )


def _retraction_order(q: Reqs, c: Consts, kept, S: int) -> Reqs:
  """The kept batch in retraction-preference order: SGLang 0.5.23's
  ``retract_decode`` sorts the batch by ``(len(output_ids),
  -len(origin_input_ids))``, descending and stable, pops its victims off
  the end and keeps the rest in that order (``filter_batch(keep_indices=
  sorted_indices)``; ``srt/managers/schedule_batch.py``, lines 3451-3580
  and 3873). The kept requests trade their ``rseq`` (the batch order)
  among themselves, so they stay ahead of any later admission."""
  R = q.rseq.shape[0]
  idx, n_kept = _first_set(kept, S)
  lanes = jnp.arange(S) < n_kept
  seq = q.rseq[idx]
  pos = jnp.lexsort((seq, c.prompt[idx], -q.n_out[idx], i32(~lanes)))
  old = jnp.sort(jnp.where(lanes, seq, _BIG))
  rseq = q.rseq.at[jnp.where(lanes, idx[pos], R)].set(old, mode="drop")
  return q._replace(rseq=rseq)


def _decode(s: State, c: Consts, cfg: Config) -> State:
  """``update_running_batch`` (retraction), ``prepare_for_decode``, and
  ``process_batch_result_decode``'s token counts and finishes (the
  finished requests are released by :func:`_publish`)."""
  K = cfg.page_size
  t, q = s.tree, s.q
  committed = c.prompt + q.n_out - 1

  def need_of(kept):
    return K * count(kept & (committed % K == 0))

  def fits(t, kept):
    need = need_of(kept)
    t = evict_for(t, c, K, need)
    return t, t.free * K >= need

  t, ok = fits(t, q.running)

  def retract(x):
    t, q, status, _, qnext, cur = x

    def cond(y):
      return y[-1]

    def body(y):
      t, q, kept, qnext, cur, first, _ = y
      t, ok = _when(~first, lambda y: fits(y[0], kept), (t, jnp.bool_(False)))
      nk = count(kept)
      go = ~ok & (nk > 1)
      # victim: fewest outputs, then longest prompt, then latest in batch
      k1 = jnp.where(kept, q.n_out, _BIG)
      m1 = kept & (q.n_out == jnp.min(k1))
      k2 = jnp.where(m1, c.prompt, -1)
      m2 = m1 & (c.prompt == jnp.max(k2))
      v = i32(jnp.argmax(jnp.where(m2, q.rseq, -1)))

      def do(z):
        t, q, kept, qnext, cur = z
        t, q, cur = _retract_one(t, q, c, K, cur, v, nk - 1)
        kept = kept.at[v].set(False)
        q = q._replace(
          waiting=_set(q.waiting, v, True),
          qpos=_set(q.qpos, v, qnext),
          entry=_set(q.entry, v, qnext),
        )
        return t, q, kept, qnext + 1, cur

      t, q, kept, qnext, cur = _when(go, do, (t, q, kept, qnext, cur))
      return t, q, kept, qnext, cur, jnp.bool_(False), go

    t, q, kept, qnext, cur, _, _ = jax.lax.while_loop(
      cond,
      body,
      (t, q, q.running, qnext, cur, jnp.bool_(True), jnp.bool_(True)),
    )
    q = _retraction_order(q, c, kept, cur["sched_rid"].shape[0])
    nk = count(kept)
    t, ok = _when(nk <= 1, lambda y: fits(y[0], kept), (t, jnp.bool_(True)))
    status = status | jnp.where(ok, 0, Status.OUT_OF_MEMORY)
    outs = jnp.sum(jnp.where(kept, q.n_out, 0), dtype=jnp.int32)
    maxs = jnp.sum(jnp.where(kept, c.max_new, 0), dtype=jnp.int32)
    ratio = jnp.minimum(
      1.0,
      (outs + RETRACT_DECODE_STEPS * nk).astype(jnp.float32)
      / (maxs + 1).astype(jnp.float32),
    )
    return t, q, status, ratio, qnext, cur

  def keep(x):
    t, q, status, _, qnext, cur = x
    ratio = jnp.maximum(s.ratio - RATIO_DECAY, MIN_RATIO).astype(jnp.float32)
    return t, q, status, ratio, qnext, cur

  t, q, status, ratio, qnext, cur = _cond(
    ok, keep, retract, (t, q, s.status, s.ratio, s.qnext, s.cur)
  )
  nret = count(s.q.running & ~q.running)
  full = jnp.where(nret > 0, False, s.full)
  # prepare_for_decode
  nrun = count(q.running)
  t = evict_for(t, c, K, nrun * K)
  page = q.running & (committed % K == 0)
  newp = count(page)
  status = status | jnp.where(newp > t.free, Status.OUT_OF_MEMORY, 0)
  t = t._replace(free=t.free - newp, private=t.private + newp)
  run_i = q.running.astype(jnp.int32)
  q = q._replace(
    row=q.row + page.astype(jnp.int32),
    kv=q.kv + run_i,
    sched_steps=q.sched_steps + run_i,
  )
  # the batch in running order
  S = cur["sched_rid"].shape[0]
  order, _ = _smallest(q.running, q.rseq, S, True)
  lanes = jnp.arange(S) < nrun
  cur = dict(
    cur,
    sched_rid=jnp.where(lanes, order, -1),
    sched_n=lanes.astype(jnp.int32),
    sched_kind=jnp.zeros((S,), jnp.int32),
    ctx=jnp.where(lanes, committed[order], 0),
    free_sched=t.free,
  )
  cur = _sched_frag(cur, t, q, K)
  n_out = q.n_out + run_i
  done = q.running & (n_out >= c.max_new)
  # the finished ones are released by _publish, in running order
  q = q._replace(n_out=n_out, finish=jnp.where(done, s.step, q.finish))
  return s._replace(
    tree=t, q=q, ratio=ratio, status=status, cur=cur, qnext=qnext, full=full
  )


JUMP_MAX = 32
"""Most quiet decode steps :func:`_jump` takes in one iteration of the loop."""


def _jump(
  s: State, c: Consts, cfg: Config, clock, T: int, W: int, evict=True,
  finish=False,
):  # fmt: skip
  """Quiet decode steps, up to ``W`` of them at once, from a state after
  the step's arrivals and merge: ``(state, records [W], rows [W], taken,
  finishing, ends)`` (the rows of steps not taken are ``T``, nothing
  written; ``ends`` [S] the requests that finish in the last step taken,
  ``R`` in the other lanes).

  A step is quiet when no prefill batch is attempted (:func:`_gate`: the
  batch is full or nothing waits, no request is being chunked), requests
  run, none of them finishes in it, it needs no retraction, no arrival is
  due at its start (after the first) and its clock time is valid. Such
  steps change only each running request's counts (``n_out``, ``kv``,
  ``sched_steps``, a page at each page boundary), the free pages,
  ``new_token_ratio``'s decay, the clock and the step's record (issue
  14's hint: between events every decode step is the same). The per-step
  work here is ``O(S)`` on the running lanes, where a step of the loop
  makes ``O(R)`` passes over the requests.

  ``prepare_for_decode`` evicts until a page per running request is free
  (:func:`_decode`; ``fits`` first evicts for the boundary pages alone,
  the same LRU leaves in the same order, so one eviction toward the
  larger demand equals the two). A step whose boundary pages do not fit
  after it is left to the loop, which retracts: its eviction has already
  taken every evictable leaf, as the loop's would. The first step that is
  not quiet is left to :func:`_advance`'s step. On the steps clock the
  steps are taken all at once (:func:`_quiet_prefix`, their evictions in
  one call); on a timed clock a step a trip.

  ``finish`` (static): the first step in which requests finish may be
  taken too when it is quiet otherwise (``finishing``: it was). Its
  tokens, pages and clock are a quiet step's; :func:`_advance` then runs
  its releases (:func:`_finishing`, :func:`_publish`,
  :func:`_finished_jump`) before the next step's batch, in the same
  iteration of the loop.

  ``evict`` (static): False stops a run at a step that would evict, so
  the run carries two scalars of the tree instead of the tree
  (:func:`run_batched`: a vmapped loop selects its whole carry for every
  lane at every trip).
  """
  K = cfg.page_size
  S = s.cur["sched_rid"].shape[0]
  R = c.prompt.shape[0]
  timed = clock is not None
  q = s.q
  nrun, nwait, full, go = _gate(s, cfg)
  quiet = ~go & (nrun > 0) & (s.status == 0) & ~s.done
  order, _ = _smallest(q.running, q.rseq, S, True)
  lanes = jnp.arange(S) < nrun
  rid = jnp.where(lanes, order, 0)
  n_out, kv, row = q.n_out[rid], q.kv[rid], q.row[rid]
  base = c.prompt[rid] + n_out - 1  # the committed tokens at the first step
  # steps before the first finish (n_out reaches max_new after the step)
  room = jnp.min(jnp.where(lanes, c.max_new[rid] - n_out - 1, W))
  # finish: the first step in which requests finish may be taken too
  limit = jnp.minimum(jnp.minimum(room + int(finish), W), T - 1 - s.row)
  nxt, more = _next_arrival(s, c)
  if timed:
    ms_next, frac_next = c.arr_ms[nxt], c.arr_frac[nxt]
  else:  # an arrival due at the start of step `step + j` (its first)
    limit = jnp.minimum(limit, jnp.where(more, c.arrival[nxt], _BIG) - s.step)
  limit = jnp.where(quiet, jnp.maximum(limit, 0), 0)
  # the reserved but unused slots of the rows outside the running lanes
  frag_all = jnp.sum(jnp.where(q.row > 0, q.row * K - q.kv, 0), dtype=jnp.int32)
  frag_other = frag_all - jnp.sum(
    jnp.where(lanes & (row > 0), row * K - kv, 0), dtype=jnp.int32
  )
  new = lanes.astype(jnp.int32)
  js = jnp.arange(W, dtype=jnp.int32)
  zw = jnp.zeros((W,), jnp.int32)

  def cond(x):
    return (x[0] < limit) & ~x[1]

  def body(x):  # a timed step (an engine that evicts: not vmapped)
    j, _, tc, row, ratio, ms, frac, recs = x
    free_rec, frag_rec, ms_rec, frac_rec, dts = recs
    committed = base + j
    due = (j > 0) & more & _at_or_before(ms_next, frac_next, ms, frac)
    dt = roofline.clock_seconds(clock, new, jnp.where(lanes, committed, 0))
    later_ms, later_frac, bad = _tick(ms, frac, dt)
    stop = due | bad
    page = lanes & (committed % K == 0)
    newp = jnp.sum(page, dtype=jnp.int32)
    tc = _when(
      ~stop & (tc.free < nrun), lambda t: evict_for(t, c, K, nrun * K), tc
    )
    free, evictable = tc.free, tc.evictable
    ok = ~stop & (free >= newp)
    got = jnp.where(ok, newp, 0)
    tc = tc._replace(free=free - got, private=tc.private + got)
    row = row + (page & ok).astype(jnp.int32)
    frag = frag_other + jnp.sum(
      jnp.where(lanes & (row > 0), row * K - (kv + j + 1), 0), dtype=jnp.int32
    )
    free_rec = free_rec.at[j].set(free - got + evictable)
    frag_rec = frag_rec.at[j].set(frag)
    ms_rec, frac_rec = ms_rec.at[j].set(ms), frac_rec.at[j].set(frac)
    dts = dts.at[j].set(dt)
    ms = jnp.where(ok, later_ms, ms)
    frac = jnp.where(ok, later_frac, frac)
    ratio = jnp.where(
      ok, jnp.maximum(ratio - RATIO_DECAY, MIN_RATIO), ratio
    ).astype(jnp.float32)
    return (
      j + ok.astype(jnp.int32), ~ok, tc, row, ratio, ms, frac,
      (free_rec, frag_rec, ms_rec, frac_rec, dts),
    )  # fmt: skip

  tc = s.tree if evict else (s.tree.free, s.tree.evictable)
  zf = jnp.zeros((W,), jnp.float32)
  recs = (zw, zw, zw, zf, zf)
  x = (i32(0), jnp.bool_(False), tc, row, s.ratio, s.time_ms, s.time_frac, recs)
  if timed:  # a step a trip
    x = jax.lax.while_loop(cond, body, x)
  else:  # every step at once (evict: their evictions in one call)
    x = _quiet_prefix(x, c, base, lanes, kv, frag_other, limit, nrun, K, evict)
  taken, _, t, row, ratio, ms, frac, recs = x
  free_rec, frag_rec, ms_rec, frac_rec, dts = recs
  if not evict:  # the pages taken left the free list for the rows
    free = t[0]
    t = s.tree._replace(free=free, private=s.tree.private + s.tree.free - free)
  at = jnp.where(lanes, order, R)
  q = q._replace(
    n_out=q.n_out.at[at].add(taken, mode="drop"),
    kv=q.kv.at[at].add(taken, mode="drop"),
    sched_steps=q.sched_steps.at[at].add(taken, mode="drop"),
    row=q.row.at[at].set(row, mode="drop"),
  )
  vtc = s.vtc
  if cfg.policy == "fair":  # every sampled token (_fair_charge)
    vtc = vtc.at[jnp.where(lanes, c.client[rid], R)].add(
      FAIR_W_OUT * taken, mode="drop"
    )
  some = taken > 0
  s = s._replace(
    tree=t,
    q=q,
    vtc=vtc,
    ratio=ratio,
    full=jnp.where(some, full, s.full),
    step=s.step + taken,
    row=s.row + taken,
    seq=s.seq + S * taken,  # each jumped step's merge, and the next one's
    time_ms=ms,
    time_frac=frac,
  )
  run_rid = jnp.where(lanes, order, -1)
  none = jnp.full((W, S), -1, jnp.int32)
  rec = dict(
    step=s.step - taken + js,
    sched_rid=jnp.broadcast_to(run_rid, (W, S)),
    sched_n=jnp.broadcast_to(new, (W, S)),
    sched_kind=jnp.zeros((W, S), jnp.int32),
    preempted=none,
    finished=none,
    num_running=zw + nrun,
    num_waiting=zw + nwait,
    free_blocks=free_rec,
    free_blocks_end=free_rec,
    prefill_tokens=zw,
    decode_tokens=zw + nrun,
    pc_hits=zw,
    pc_queries=zw,
    frag_tokens=frag_rec,
    time_ms=ms_rec,
    time_frac=frac_rec,
    dt_s=dts,
  )
  rows = jnp.where(js < taken, s.row - taken + js, T)
  # the requests finishing in the last step taken, if it was their last
  ends = jnp.where(lanes & (n_out + taken >= c.max_new[rid]), order, R)
  return s, rec, rows, taken, taken > room, ends


def _quiet_prefix(x, c, base, lanes, kv, frag_other, limit, nrun, K, evict):
  """:func:`_jump`'s loop on the steps clock, all ``W`` steps at once:
  each step's boundary pages and free pages from running sums, its record,
  ``new_token_ratio``'s decay as the loop rounds it (an unrolled chain of
  float32 steps).

  ``evict``: the loop's evictions in one call. A step evicts LRU leaves
  until a page per running request is free (or none is left), then takes
  its boundary pages if they are free. Decode steps touch no node's time,
  so the victims come in one order, and the victims through a step are
  the shortest run of that order that frees ``nrun`` pages plus the pages
  taken before it: :func:`sglang_tree.evict_for` of that demand for the
  last step the loop would run evicts them, trip for trip as the loop's
  calls did. Eviction moves pages from evictable to free, so a step can
  take its pages when the free plus evictable pages at its start cover
  them, and its record (free plus evictable pages after it) does not
  depend on the victims. Like the loop, the first step that cannot take
  its pages still evicts (every leaf) and ends the run.

  Not ``evict`` (vmapped engines): the steps up to the first that would
  evict."""
  j0, stop, tc, row, ratio, ms, frac, recs = x
  free_rec, frag_rec, ms_rec, frac_rec, dts = recs
  W = free_rec.shape[0]
  js = jnp.arange(W, dtype=jnp.int32)
  free0, evictable = (tc.free, tc.evictable) if evict else tc
  page = lanes[None, :] & ((base[None, :] + js[:, None]) % K == 0)  # [W, S]
  newp = jnp.sum(page, axis=1, dtype=jnp.int32)
  got = jnp.cumsum(newp, dtype=jnp.int32)  # pages taken through step j
  free = free0 - (got - newp)  # free at step j's start
  if evict:
    ok = (js < limit) & (free0 + evictable >= got)
  else:
    ok = (js < limit) & (free >= nrun)
  n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)
  if evict:  # the last step run: the first that failed, or the last taken
    last = jnp.clip(jnp.minimum(n, limit - 1), 0, W - 1)
    demand = jnp.where(limit > 0, nrun + got[last] - newp[last], 0)
    tc = evict_for(tc, c, K, demand * K)
  rows = row[None, :] + jnp.cumsum(page, axis=0, dtype=jnp.int32)
  unused = rows * K - (kv[None, :] + js[:, None] + 1)
  frag = frag_other + jnp.sum(
    jnp.where(lanes[None, :] & (rows > 0), unused, 0), axis=1, dtype=jnp.int32
  )
  ratios = [ratio]
  for _ in range(W):
    ratios.append(jnp.maximum(ratios[-1] - RATIO_DECAY, MIN_RATIO))
  ratio = jnp.stack(ratios).astype(jnp.float32)[n]
  took = jnp.where(n > 0, got[jnp.maximum(n - 1, 0)], 0)
  if evict:
    tc = tc._replace(free=tc.free - took, private=tc.private + took)
  else:
    tc = (free0 - took, evictable)
  row = jnp.where(n > 0, rows[jnp.maximum(n - 1, 0)], row)
  recs = (
    free - newp + evictable, frag, ms_rec + ms, frac_rec + frac, dts,
  )  # fmt: skip
  return j0 + n, stop, tc, row, ratio, ms, frac, recs


def _finishing(s: State, ends) -> State:
  """Before :func:`_publish` releases the requests that finish in the
  decode step :func:`_jump` took last (``ends`` [S], ``R`` for none): the
  state at that step (``step`` back by one, its finishes marked, an empty
  step list)."""
  step = s.step - 1
  q = s.q
  S = s.cur["sched_rid"].shape[0]
  return s._replace(
    q=q._replace(finish=q.finish.at[ends].set(step, mode="drop")),
    step=step,
    cur=_fresh_cur(S),
  )


def _finished_jump(s: State, cfg: Config, jrec: dict, j, ends):
  """After those releases: the step's record ``j`` gets its finished lanes,
  its running count and its free pages at the end (the rest was written by
  :func:`_jump`), then the next step's :func:`_merge` takes the finished
  ones out of the running set (and resets ``batch_is_full``)."""
  t, q, cur = s.tree, s.q, s.cur
  end = t.free + evictable_tokens(t, cfg.page_size) // cfg.page_size
  nrun = jrec["num_running"][j] - cur["num_finished"]
  jrec = dict(
    jrec,
    finished=jrec["finished"].at[j].set(cur["finished"]),
    num_running=jrec["num_running"].at[j].set(nrun),
    free_blocks_end=jrec["free_blocks_end"].at[j].set(end),
  )
  s = s._replace(
    q=q._replace(running=q.running.at[ends].set(False, mode="drop")),
    full=jnp.bool_(False), step=s.step + 1,
  )  # fmt: skip
  return s, jrec


def _sched_frag(cur, t: Tree, q: Reqs, K):
  """Free pages (plus evictable ones) and empty reserved slots, after
  scheduling."""
  frag = jnp.sum(jnp.where(q.row > 0, q.row * K - q.kv, 0), dtype=jnp.int32)
  return dict(cur, free_sched=t.free + evictable_tokens(t, K) // K, frag=frag)


def _fair_arrivals(s: State, c: Consts, new) -> State:
  """``fair``: each new arrival, in arrival order, joins the queue; its
  client, if it had nothing queued, is lifted to the lowest counter of the
  clients with queued requests (the floor if none)."""
  order = jnp.argsort(jnp.where(new, c.arr_rank, _BIG))
  n_new = count(new)

  def body(x):
    i, waiting, vtc = x
    r = order[i]
    u = c.client[r]
    present = some(waiting & (c.client == u))
    low = jnp.min(jnp.where(waiting, vtc[c.client], _BIG))
    lift = jnp.where(some(waiting), low, s.vtc_floor)
    vtc = vtc.at[u].set(jnp.where(present, vtc[u], jnp.maximum(vtc[u], lift)))
    return i + 1, waiting.at[r].set(True), vtc

  _, waiting, vtc = jax.lax.while_loop(
    lambda x: x[0] < n_new, body, (i32(0), s.q.waiting, s.vtc)
  )
  return s._replace(q=s.q._replace(waiting=waiting), vtc=vtc)


def _fair_charge(s: State, c: Consts, n_out_before, chunked_before, nb):
  """``fair``'s end-of-step charges: the continued chunk of the chunked
  request (lane 0 of a prefill batch) and every sampled token."""
  q = s.q
  sampled = q.n_out - n_out_before
  vtc = s.vtc.at[c.client].add(FAIR_W_OUT * jnp.maximum(sampled, 0))
  chunk = (nb > 0) & (chunked_before >= 0)
  u = c.client[jnp.maximum(chunked_before, 0)]
  vtc = vtc.at[u].add(jnp.where(chunk, FAIR_W_IN * s.cur["sched_n"][0], 0))
  return s._replace(vtc=vtc)


def _arrive(s: State, c: Consts, timed: bool, fair: bool = False) -> State:
  """The requests due by the step's start (the clock's time) join the
  queue. The due ones are the next of the requests in arrival-rank order
  (rejected ones never arrive), so the first not in yet decides whether
  any is due, in ``O(1)``; the ``O(R)`` update runs only then."""
  nxt, more = _next_arrival(s, c)
  if timed:
    due = _at_or_before(c.arr_ms[nxt], c.arr_frac[nxt], s.time_ms, s.time_frac)
  else:
    due = c.arrival[nxt] <= s.step
  due = due & more

  def arrive(s, trip):
    return _arrive_all(s, c, timed, fair, trip)

  return _when(due, arrive, s, trip=True)


def _at_or_before(ms_a, frac_a, ms, frac):
  """Whether the clock time ``(ms_a, frac_a)`` is at or before ``(ms,
  frac)`` (milliseconds, then the fraction of one)."""
  return (ms_a < ms) | ((ms_a == ms) & (frac_a <= frac))


def _next_arrival(s: State, c: Consts):
  """``(the next request to arrive, whether one is left)``, ``O(1)``."""
  R = c.arrival.shape[0]
  nxt = s.by_rank[jnp.minimum(s.ranks_in, R - 1)]
  return nxt, (s.ranks_in < R) & (c.arrival[nxt] < _BIG)


def _arrive_all(
  s: State, c: Consts, timed: bool, fair: bool, trip=None
) -> State:
  """:func:`_arrive`'s update, ``O(R)``. In :func:`_when`'s loop the clock
  is read through ``trip``, else XLA compares all ``R`` at every call."""
  q = s.q
  step, time_ms, time_frac = s.step, s.time_ms, s.time_frac
  if trip is not None:
    step, time_ms, time_frac = barrier(trip, step, time_ms, time_frac)
  if timed:
    due = _at_or_before(c.arr_ms, c.arr_frac, time_ms, time_frac)
    due = due & (c.arrival < _BIG)
  else:
    due = c.arrival <= step
  new = ~q.arrived & due
  any_new = some(new)
  if fair:  # only in steps with arrivals (it sorts [R])
    s = _when(any_new, lambda s: _fair_arrivals(s, c, new), s)
    q = s.q
  # entry order: the new ones' arrival ranks, from qnext on (their ranks
  # are one run, with gaps only for rejected requests)
  lo = jnp.min(jnp.where(new, c.arr_rank, _BIG))
  hi = jnp.max(jnp.where(new, c.arr_rank, -1))
  pos = s.qnext + c.arr_rank - lo
  q = q._replace(
    arrived=q.arrived | new,
    waiting=q.waiting | new,
    qpos=jnp.where(new, pos, q.qpos),
    entry=jnp.where(new, pos, q.entry),
  )
  return s._replace(
    q=q,
    qnext=s.qnext + jnp.where(any_new, hi - lo + 1, 0),
    ranks_in=s.ranks_in + count(new),
  )


def _merge(s: State, c: Consts, cfg: Config) -> State:
  """``get_next_batch_to_run``'s stash, merge and filter."""
  K = cfg.page_size
  t, q = s.tree, s.q
  ch = s.chunked
  chv = jnp.maximum(ch, 0)

  def stash(x):
    t, q = x
    t, q = _checkpoint(t, q, c, K, ch, q.extend_end[ch])
    return t, q._replace(prefix=_set(q.prefix, ch, q.extend_end[ch]))

  go = (ch >= 0) & (q.extend_end[chv] > q.prefix[chv])
  t, q = _when(go, stash, (t, q))
  R = q.waiting.shape[0]
  is_ch = jnp.arange(R) == ch
  finished = q.finish >= 0
  batch = q.in_batch
  left = some(batch & (is_ch | finished))
  join = batch & ~is_ch & ~finished
  rseq = jnp.where(join, s.seq + q.slot, q.rseq)
  gone = q.running & finished
  running = (q.running & ~finished) | join
  full = jnp.where(left | some(gone) | ~some(running), False, s.full)
  q = q._replace(
    running=running,
    rseq=rseq,
    in_batch=jnp.zeros_like(batch),
  )
  S = s.cur["sched_rid"].shape[0]
  return s._replace(tree=t, q=q, full=full, seq=s.seq + S)


def _fresh_cur(S: int) -> dict:
  z = jnp.zeros((S,), jnp.int32)
  m1 = jnp.full((S,), -1, jnp.int32)
  return dict(
    sched_rid=m1, sched_n=z, sched_kind=z, ctx=z, preempted=m1, finished=m1,
    num_preempted=i32(0), num_finished=i32(0), free_sched=i32(0),
    frag=i32(0), rec=_empty_rec(S),
  )  # fmt: skip


def _step(s: State, c: Consts, cfg: Config, kn: Knobs, clock) -> State:
  """One loop iteration. The step buffers stay out of every ``cond`` (a
  branch would copy them): the branches leave the step's record in
  ``cur["rec"]`` and it is written once, here."""
  out = s.out
  T = out["step"].shape[0]
  s, rec, at = _advance(s._replace(out=None), c, cfg, kn, clock, T)
  return s._replace(out=_write(out, rec, at))


def _write(out: dict, rec: dict, at) -> dict:
  """The step buffers with ``rec`` in row ``at`` (``T``: nothing; ``at``
  ``[n]`` with ``rec`` fields ``[n, ...]``: the ``n`` records). A one-row
  field of ``T > 1`` rows of buffers (lanes not recorded, :func:`_buffers`)
  is a scratch row: it keeps the last record written."""
  T = out["step"].shape[0]

  def put(buf, v):
    v = v.astype(buf.dtype)
    if buf.shape[0] == 1 < T:
      if jnp.ndim(at):
        return buf.at[jnp.where(at[-1] < T, 0, 1)].set(v[-1], mode="drop")
      return buf.at[jnp.where(at < T, 0, 1)].set(v, mode="drop")
    return buf.at[at].set(v, mode="drop")

  return {k: put(out[k], v) for k, v in rec.items()}


def _advance(
  s: State, c: Consts, cfg: Config, kn: Knobs, clock, T: int, vmapped=False
):
  """:func:`_step` on a state without its step buffers: ``(state, the
  step's record, the row to write it in or T)``."""
  timed = clock is not None
  fair = cfg.policy == "fair"
  # vmapped, a 0-or-1-trip loop would select the whole state per lane
  arrive = _arrive_all if vmapped else _arrive
  s = arrive(s, c, timed, fair)
  s = _merge(s, c, cfg)
  S = s.cur["sched_rid"].shape[0]
  # Vmapped, only on the steps clock: the roofline's float32 sum over the
  # lanes, fused differently in the jump and in the step, may round apart
  # (as vllm_v1's vmapped jump found).
  jump = cfg.jump and not (vmapped and timed)
  # the jump may take a step in which requests finish too: their releases
  # run first in this iteration's loop over _publish (two trips), so that
  # one iteration takes both the finishing step and the next step's batch
  # (halving the iterations; vmapped, lanes would trip apart)
  finish = jump and not vmapped
  fin = jnp.bool_(False)
  if jump:
    s, jrec, jrows, taken, fin, ends = _jump(
      s, c, cfg, clock, T, JUMP_MAX, evict=not vmapped, finish=finish
    )
    fin = fin & finish
    # the next step's arrivals (its merge changes only seq, counted)
    s = arrive(s, c, timed, fair)

  def prefill_step(x):
    s = x[0]
    cur = _sched_frag(
      dict(s.cur, free_sched=s.tree.free), s.tree, s.q, cfg.page_size
    )
    batch = s.q.in_batch.astype(jnp.int32)
    q = s.q._replace(
      sched_steps=s.q.sched_steps + batch,
      prefill_steps=s.q.prefill_steps + batch,
    )
    return s._replace(cur=cur, q=q), i32(1)

  def other(x):
    s = x[0]
    nrun = count(s.q.running)

    def decode_step(x):
      return _decode(x[0], c, cfg), i32(2)

    def idle(x):
      s = x[0]
      q = s.q
      s = s._replace(cur=dict(s.cur, rec=_empty_rec(S)))
      stuck = some(q.waiting)
      nxt, more = _next_arrival(s, c)
      done = stuck | ~more
      if timed:
        later = ~done & ~_at_or_before(
          c.arr_ms[nxt], c.arr_frac[nxt], s.time_ms, s.time_frac
        )
        s = s._replace(
          time_ms=jnp.where(later, c.arr_ms[nxt], s.time_ms),
          time_frac=jnp.where(later, c.arr_frac[nxt], s.time_frac),
        )
        step = s.step
      else:
        step = jnp.where(done, s.step, jnp.maximum(s.step, c.arrival[nxt]))
      s = s._replace(
        ratio=jnp.float32(INIT_RATIO),
        status=s.status | jnp.where(stuck, Status.STUCK, 0),
        done=done,
        idle=s.idle + step - s.step,
        step=step,
      )
      return s, i32(0)

    return _cond(nrun > 0, decode_step, idle, x)

  def batch(x):
    """The step's batch: ``(state, mode, nb, n_out and chunked before)``
    (mode 1: prefill, 2: decode, 0: idle)."""
    s = x[0]._replace(cur=_fresh_cur(S))
    n_out_before, chunked_before = s.q.n_out, s.chunked
    s, nb = _prefill(s, c, cfg, kn)
    s, mode = _cond(nb > 0, prefill_step, other, (s, i32(0)))
    return s, mode, nb, n_out_before, chunked_before

  def trip(x):
    """The batch, or (first trip when ``fin``) the jump's finishing step,
    then its checkpoints and releases in one loop (:func:`_publish`)."""
    s, i, mode, nb, n_out_before, chunked_before, jrec = x
    y = (s, mode, nb, n_out_before, chunked_before)
    if finish:
      rel = (i == 0) & fin
      s, mode, nb, n_out_before, chunked_before = _when(~rel, batch, y)
      s = _when(rel, lambda s: _finishing(s, ends), s)
    else:
      s, mode, nb, n_out_before, chunked_before = batch(y)
    s = _publish(s, c, cfg, mode)
    if finish:
      s, jrec = _when(
        rel,
        lambda y: _finished_jump(y[0], cfg, y[1], taken - 1, ends),
        (s, jrec),
      )
    return s, i + 1, mode, nb, n_out_before, chunked_before, jrec

  row = s.row
  x = (s, i32(0), i32(2), i32(0), s.q.n_out, s.chunked, jrec if jump else {})
  if finish:
    x = jax.lax.while_loop(lambda x: x[1] <= fin.astype(jnp.int32), trip, x)
  else:
    x = trip(x)
  s, _, mode, nb, n_out_before, chunked_before, jrec = x
  s = _close(s, c, cfg, clock, mode)
  if fair:
    s = _fair_charge(s, c, n_out_before, chunked_before, nb)
  rec = s.cur["rec"]
  at = jnp.where(s.row > row, row, T)  # idle: nothing written
  over = s.row >= T
  s = s._replace(
    status=s.status | jnp.where(over & ~s.done, Status.STEP_ROWS, 0),
    done=s.done | over,
  )
  if jump:
    rec = {k: jnp.concatenate([jrec[k], v[None]]) for k, v in rec.items()}
    at = jnp.concatenate([jrows, at[None]])
  return s, rec, at


def _empty_rec(S: int) -> dict:
  rec = {}
  for k in RECORD_FIELDS:
    dtype = jnp.float32 if k in ("time_frac", "dt_s") else jnp.int32
    rec[k] = jnp.zeros((S,) if k in _LANES else (), dtype)
  return rec


def _close(s: State, c: Consts, cfg: Config, clock, mode) -> State:
  """Writes the step's record into row ``s.row`` and advances the clock,
  after a prefill (``mode`` 1) or decode (2) step; an idle step (0) keeps
  its empty record, row, step and clock. Traced ``mode``, and selects on
  the few fields set here, not a 0-or-1-trip loop over the state
  (vmapped, such a loop selects every array of the state per lane)."""
  ran, prefill = mode > 0, mode == 1
  cur, q = s.cur, s.q
  lanes = cur["sched_rid"] >= 0
  new = jnp.where(lanes, cur["sched_n"], 0)
  if clock is None:
    dt_s = jnp.float32(0)
  else:
    ctx = jnp.where(lanes, cur["ctx"], 0)
    dt_s = roofline.clock_seconds(clock, new, ctx)
  tokens = jnp.sum(new, dtype=jnp.int32)
  # running after the step: a request that finished in it has left
  holding = (q.running | q.in_batch) & (q.finish < 0)
  rec = dict(
    step=s.step,
    sched_rid=cur["sched_rid"],
    sched_n=cur["sched_n"],
    sched_kind=cur["sched_kind"],
    preempted=cur["preempted"],
    finished=cur["finished"],
    num_running=count(holding),
    num_waiting=count(q.waiting),
    free_blocks=cur["free_sched"],
    free_blocks_end=s.tree.free
    + evictable_tokens(s.tree, cfg.page_size) // cfg.page_size,
    prefill_tokens=jnp.where(prefill, tokens, 0),
    decode_tokens=jnp.where(prefill, 0, tokens),
    pc_hits=i32(0),
    pc_queries=i32(0),
    frag_tokens=cur["frag"],
    time_ms=s.time_ms,
    time_frac=s.time_frac,
    dt_s=dt_s,
  )
  rec = {
    k: jnp.where(ran, jnp.asarray(v).astype(cur["rec"][k].dtype), cur["rec"][k])
    for k, v in rec.items()
  }
  one = ran.astype(jnp.int32)
  s = s._replace(cur=dict(cur, rec=rec), row=s.row + one, step=s.step + one)
  if clock is not None:
    ms, frac, bad = _tick(s.time_ms, s.time_frac, dt_s)
    s = s._replace(
      time_ms=jnp.where(ran, ms, s.time_ms),
      time_frac=jnp.where(ran, frac, s.time_frac),
      status=s.status | jnp.where(ran & bad, Status.BAD_STEP_TIME, 0),
    )
  return s


def _tick(ms, frac, dt_s):
  """The clock ``(ms, frac)`` after a step of ``dt_s`` seconds, and whether
  the step time is bad: NaN, infinite or negative stops the run with a
  status and the clock does not move (a NaN cast to int32 is garbage).
  One expression for :func:`_close` and :func:`_jump`, so that their
  float32 times agree bit for bit (the select keeps XLA from fusing the
  multiply and add into one rounding in one program and not the other)."""
  bad = ~(jnp.isfinite(dt_s) & (dt_s >= 0))
  f = frac + jnp.where(bad, 0.0, dt_s * 1e3)
  carry = jnp.floor(f)
  return ms + carry.astype(jnp.int32), f - carry, bad


RECORD_FIELDS = (
  "step", "sched_rid", "sched_n", "sched_kind", "preempted", "finished",
  "num_running", "num_waiting", "free_blocks", "free_blocks_end",
  "prefill_tokens", "decode_tokens", "pc_hits", "pc_queries", "frag_tokens",
  "time_ms", "time_frac", "dt_s",
)  # fmt: skip
_LANES = LANE_FIELDS


def init(
  c: Consts, cfg: Config, buffers: bool = True, lanes: bool = True
) -> State:
  """The state before the first step; ``buffers=False``: ``out`` None
  (:func:`start`, for :func:`resume` to give it fresh buffers);
  ``lanes=False``: the ``[S]`` fields get a scratch row (:func:`_buffers`)."""
  R = c.prompt.shape[0]
  V = c.parent.shape[0]
  T, S = cfg.steps, min(cfg.max_running, R)
  z = jnp.zeros((R,), jnp.int32)
  f = jnp.zeros((R,), bool)
  m1 = jnp.full((R,), -1, jnp.int32)
  tree = Tree(
    cached=jnp.zeros((V,), bool).at[0].set(True),
    nstart=jnp.zeros((V,), jnp.int32),
    ts=jnp.zeros((V,), jnp.int32),
    lock=jnp.zeros((V,), jnp.int32).at[0].set(1),
    nend=jnp.zeros((V,), jnp.int32),
    rep=jnp.zeros((V,), jnp.int32),
    kids=jnp.zeros((V,), jnp.int32),
    born=jnp.zeros((V,), jnp.int32),
    evictable=i32(0),
    clock=i32(0),
    free=i32(cfg.num_pages),
    private=i32(0),
    evicted=i32(0),
    gmin=jnp.full((lru_groups(V)[1] if cfg.lru_index else 0,), _BIG, jnp.int32),
  )
  q = Reqs(
    n_out=z, prefix=z, extend_end=z, row=z, prot=z, lock_len=z, retr=z,
    hit=m1, first_tok=m1, finish=m1, arrived=f, waiting=f, running=f,
    qpos=z, rseq=z, in_batch=f, matched=z, slot=z, kv=z,
    first_sched=m1, resume_hit=z, sched_steps=z, prefill_steps=z, entry=z,
  )  # fmt: skip
  return State(
    tree=tree, q=q, step=i32(0), row=i32(0), qnext=i32(0), seq=i32(0),
    chunked=i32(-1), full=jnp.bool_(False), ratio=jnp.float32(INIT_RATIO),
    refresh_calls=i32(0), status=i32(0), done=jnp.bool_(False),
    time_ms=i32(0), time_frac=jnp.float32(0), cur=_fresh_cur(S),
    out=_buffers(T, S, lanes) if buffers else None,
    idle=i32(0), vtc=z, vtc_floor=i32(0),
    by_rank=i32(jnp.argsort(jnp.where(c.arrival < _BIG, 0, R) + c.arr_rank)),
    ranks_in=i32(0),
  )  # fmt: skip


def _buffers(T: int, S: int, lanes: bool = True) -> dict:
  """Empty step buffers: ``T`` rows of every :data:`RECORD_FIELDS`; with
  ``lanes=False`` one scratch row of each ``[S]`` field (``[1, S]``: a
  batch's results do not record them, and at 16 running they are 86% of
  a row's bytes)."""
  out = {}
  for k in RECORD_FIELDS:
    dtype = jnp.float32 if k in ("time_frac", "dt_s") else jnp.int32
    shape = ((T if lanes else 1), S) if k in _LANES else (T,)
    fill = -1 if k in ("sched_rid", "preempted", "finished") else 0
    out[k] = jnp.full(shape, fill, dtype)
  return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def start(c: Consts, cfg: Config) -> State:
  """:func:`init` without step buffers, for :func:`resume`."""
  return init(c, cfg, buffers=False)


@functools.partial(jax.jit, static_argnames=("cfg", "clock", "progress"))
def resume(
  c: Consts, cfg: Config, kn: Knobs, s: State, base, clock=None,
  progress: bool = False,
) -> State:  # fmt: skip
  """:func:`run`'s loop from ``s`` (``out`` None: from :func:`start`, or
  a ``resume`` that filled its buffers, ``status`` then only
  ``STEP_ROWS``) into fresh step buffers of ``cfg.steps`` rows, written
  from row 0. The host keeps each segment's rows and calls again while
  the buffers fill, so that ``T`` need not hold the whole run: sized for
  the slowest order of events it was ``2**21`` rows (2.8 GB) at 10,000
  requests and 64 running against 29,753 steps, and allocating and
  filling them cost about 1 s of a 3.6 s run (2026-12-07, this 2-core
  CPU). Exact: a full segment stops after the step that wrote its last
  row (:func:`_jump` stops short of the end), and the state goes on
  unchanged. ``base``: the rows of the earlier segments (progress
  reports count from it).
  """
  S = min(cfg.max_running, c.prompt.shape[0])
  return _loop(_segment(s, cfg.steps, S), c, cfg, kn, clock, progress, base)


def _segment(s: State, T: int, S: int, lanes: bool = True) -> State:
  """``s`` (``out`` None) going on into fresh buffers from row 0: a
  ``STEP_ROWS`` stop (full buffers) cleared."""
  full = (s.status & Status.STEP_ROWS) != 0
  return s._replace(
    out=_buffers(T, S, lanes),
    row=i32(0),
    status=s.status & ~Status.STEP_ROWS,
    done=s.done & ~full,
  )


@functools.partial(jax.jit, static_argnames=("cfg", "clock", "progress"))
def run(
  c: Consts, cfg: Config, kn: Knobs, clock=None, progress: bool = False
) -> State:
  """The whole loop: arrivals, prefill or decode steps, until all finish.

  ``cfg`` is static, ``c`` (the trace) and ``kn`` (the budgets) traced.

  ``clock``: ``None`` (steps: ``c.arrival`` are steps) or an object with
  ``step_time_s(new_tokens [S], context_tokens [S])`` (``c.arr_ms`` /
  ``c.arr_frac`` are the arrival times; step numbers count executed
  steps). ``progress``: every ``PROGRESS_EVERY`` executed steps, report
  ``(requests finished, steps)`` to the sink of
  :func:`prefixjax.serving.vllm_v1.set_progress_sink`.
  """
  return _loop(init(c, cfg), c, cfg, kn, clock, progress, 0)


def _loop(s: State, c: Consts, cfg: Config, kn: Knobs, clock, progress, base):
  """Steps ``s`` until it is done or stops on a status."""
  from prefixjax.serving import vllm_v1

  def body(s):
    before = base + s.row
    s = _step(s, c, cfg, kn, clock)
    if progress:
      every = vllm_v1.PROGRESS_EVERY
      done = count(s.q.finish >= 0)
      steps = base + s.row
      jax.lax.cond(
        steps // every > before // every,
        lambda: jax.debug.callback(vllm_v1.report_progress, done, steps),
        lambda: None,
      )
    return s

  return jax.lax.while_loop(_going, body, s)


def _going(s: State):
  return ~s.done & (s.status == 0)


def run_batched(
  shared: Consts, per: dict, kn: Knobs, cfg: Config, clock, s=None,
  until_full: bool = False,
):  # fmt: skip
  """:func:`run` for a leading configuration axis: ``per`` holds the
  batched ``Consts`` fields ``[n, ...]``, ``kn`` the batched knobs,
  ``shared`` the rest. Each lane's final state equals :func:`run`'s, but
  for the ``[S]`` fields of the step buffers, not recorded (a scratch
  row, :func:`_buffers`).

  Not ``jax.vmap(run)``: a vmapped ``while_loop`` with a per-lane
  predicate selects every carry between its old and new value each
  iteration, the ``[n, T, S]`` step buffers included (a full copy per
  step: 52% of the time in ``memmove``, measured). Here the loop runs
  while any lane goes, the steps are vmapped, a lane that has stopped
  keeps its state (a select over the state without the buffers), and the
  buffers are written in place at the row of each lane that stepped.

  ``s``: a batched state without buffers (:func:`start_batched`, or a
  ``run_batched`` whose ``out`` was taken off) to go on from into fresh
  buffers (:func:`resume`'s segments, lane by lane). ``until_full``
  (static): stop every lane once one lane's buffers are full, so that the
  next segment resumes them together (else that lane would wait out the
  others and then run alone).
  """

  cfg = cfg._replace(lru_index=False)  # the scan (sglang_tree._evict)

  def lane_consts(p):
    return shared._replace(**p)

  if s is None:
    s = jax.vmap(lambda p: init(lane_consts(p), cfg, lanes=False))(per)
  else:
    S = min(cfg.max_running, shared.prompt.shape[0])
    s = jax.vmap(lambda s: _segment(s, cfg.steps, S, lanes=False))(s)
  out = s.out
  T = out["step"].shape[1]

  def advance(s, p, k):
    return _advance(s, lane_consts(p), cfg, k, clock, T, vmapped=True)

  def body(carry):
    s, out = carry
    going = jax.vmap(_going)(s)
    new, rec, at = jax.vmap(advance)(s, per, kn)
    s = jax.tree.map(
      lambda a, b: jnp.where(going.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      new,
      s,
    )
    at = jnp.where(going.reshape((-1,) + (1,) * (at.ndim - 1)), at, T)
    return s, jax.vmap(_write)(out, rec, at)

  def cond(carry):
    go = jnp.any(jax.vmap(_going)(carry[0]))
    if until_full:
      go = go & ~jnp.any(carry[0].row >= T)
    return go

  s, out = jax.lax.while_loop(cond, body, (s._replace(out=None), out))
  return s._replace(out=out)


def start_batched(shared: Consts, per: dict, cfg: Config) -> State:
  """:func:`run_batched`'s lanes before their first step, without step
  buffers (its ``s``)."""
  cfg = cfg._replace(lru_index=False)
  return jax.vmap(lambda p: init(shared._replace(**p), cfg, buffers=False))(per)
