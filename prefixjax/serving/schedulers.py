"""Waiting-queue schedulers of the serving simulator, registered by name.

A scheduler decides which waiting request the engine tries to admit next;
the engine loop itself (the running requests first, the token budget, the
whole-sequence admission gate, preemption by recompute) is vLLM 0.33's
(:mod:`prefixjax.serving.vllm_v1`). It is a :class:`Scheduler`: a
``NamedTuple`` of pure functions built by a factory with keyword-only
hyperparameters (like :mod:`prefixjax.cache.policies`), with its own state
(a small pytree, e.g. per-client counters) carried in the engine state, so
the whole run stays one jitted loop, ``jax.vmap``-able over configurations.
Factories are cached: the same arguments give the same (hashable) object,
so a scheduler is a static argument of ``jax.jit`` that compiles once.

The protocol (every function is traced; ``view`` is a :class:`WaitingView`):

* ``init(num_requests) -> sched_state``.
* ``order(sched_state, view) -> [R] int32`` or ``None``: each request's
  key, computed once per step when the waiting loop starts (after the
  running requests were scheduled); the loop tries the queued request with
  the lowest ``(key, queue_pos)`` first. ``None``: the queue's own order
  (``queue_pos``: arrivals at the back, preempted requests at the front).
* ``pick(sched_state, key, view) -> []`` int32 or ``None``: overrides the
  choice (a key that changes within a step, as ``fair``'s counters do).
* ``on_arrival(sched_state, view, rid, mask)``: request ``rid`` joined the
  queue by arriving (not by preemption).
* ``on_admit(sched_state, view, rid, num_tokens, mask)``: ``rid`` left the
  queue with ``num_tokens`` scheduled.
* ``on_step(sched_state, view, rids, num_tokens, kind, decode, sampled,
  lanes)``: at the end of a step, its scheduled requests ``[S]`` (where
  ``lanes``), their tokens, their
  :class:`prefixjax.serving.vllm_v1.SchedKind` (0 running, 1 new, 2
  resumed), whether each was a decode (a running request that sampled in
  its previous step) and whether it sampled a token now.
* ``victim``: ``"last"`` (vLLM FCFS: the last running request is
  preempted) or ``"priority"`` (vLLM PRIORITY: the running request with the
  largest ``(priority, arrival_time)``; see :mod:`prefixjax.serving.vllm_v1`).
* ``deque``: the FCFS fast path (a circular deque, O(1) per admission); only
  for schedulers with no ``order`` and no ``pick``.

Built-ins: ``fcfs``, ``priority``, ``lpm``, ``dfs``, ``fair`` (see each
factory for its source). A user-defined scheduler is any
:class:`Scheduler`; :func:`register_scheduler` names it for configs and the
CLI.

Example (shortest prompt first, a user-defined order):

  >>> from prefixjax.serving import schedulers
  >>> spf = schedulers.Scheduler(
  ...     name="spf", order=lambda state, view: view.prompt_len)
  >>> schedulers.register_scheduler("spf", lambda: spf, overwrite=True)
  >>> schedulers.get_scheduler("spf").name
  'spf'

Dimensions: ``R`` requests, ``M`` block-table columns, ``S`` running slots,
``W`` = ``max_sorted`` (the window of queued requests a cache-aware order
matches against the cache).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from prefixjax._masked import gather, scatter
from prefixjax.cache import prefix_cache as pc

__all__ = [
  "Scheduler",
  "WaitingView",
  "dfs",
  "fair",
  "fcfs",
  "get_scheduler",
  "lexicographic_pick",
  "lpm",
  "priority",
  "register_scheduler",
  "scheduler_names",
  "window_hits",
]

_BIG = jnp.iinfo(jnp.int32).max


class WaitingView(NamedTuple):
  """What a scheduler may read (all traced arrays, read only).

  Attributes:
    queued: ``[R]`` bool, requests in the waiting queue.
    queue_pos: ``[R]`` int32 queue position (FCFS order: lower first;
      arrivals get increasing positions, preempted requests decreasing
      negative ones, so they come first). Valid where ``queued``.
    num_waiting: ``[]`` int32.
    running: ``[R]`` bool, requests running.
    num_tokens: ``[R]`` int32 prompt + sampled tokens.
    prompt_len: ``[R]`` int32.
    keys: ``[R, M, 2]`` uint32 block keys of each request's full blocks.
    cache: the engine's :class:`prefixjax.cache.prefix_cache.PrefixCacheState`.
    client: ``[R]`` int32 dense client id (``0 .. R-1``).
    rank: ``[R]`` int32 rank of ``(priority, arrival_time, rid)``.
    step: ``[]`` int32 the clock.
  """

  queued: jax.Array
  queue_pos: jax.Array
  num_waiting: jax.Array
  running: jax.Array
  num_tokens: jax.Array
  prompt_len: jax.Array
  keys: jax.Array
  cache: Any
  client: jax.Array
  rank: jax.Array
  step: jax.Array


def _no_state(num_requests: int):
  del num_requests
  return ()


def _keep(state, view, *args):
  del view, args
  return state


class Scheduler(NamedTuple):
  """A waiting-queue scheduler (see the module docstring for the protocol)."""

  name: str
  order: Callable[[Any, WaitingView], jax.Array] | None = None
  pick: Callable[[Any, jax.Array, WaitingView], jax.Array] | None = None
  init: Callable[[int], Any] = _no_state
  on_arrival: Callable[..., Any] = _keep
  on_admit: Callable[..., Any] = _keep
  on_step: Callable[..., Any] = _keep
  victim: str = "last"
  deque: bool = False


def lexicographic_pick(key: jax.Array, view: WaitingView) -> jax.Array:
  """The queued request with the lowest ``(key, queue_pos)`` (``[]`` int32)."""
  k = jnp.where(view.queued, key, _BIG)
  best = jnp.min(k)
  pos = jnp.where(view.queued & (k == best), view.queue_pos, _BIG)
  return jnp.argmin(pos).astype(jnp.int32)


# ------------------------------------------------------------------ fcfs
@functools.cache
def fcfs() -> Scheduler:
  """First come, first served: vLLM 0.33 ``FCFSRequestQueue``.

  ``vllm/v1/core/sched/request_queue.py``: a deque; new requests at the
  back, preempted ones at the front (``prepend_request``); the victim is the
  last running request (``Scheduler._preempt_request`` via
  ``self.running.pop()``).
  """
  return Scheduler(name="fcfs", deque=True)


# -------------------------------------------------------------- priority
def _rank(state, view):
  del state
  return view.rank


@functools.cache
def priority() -> Scheduler:
  """vLLM 0.33 ``PriorityRequestQueue`` and priority preemption.

  ``request_queue.py``: a heap ordered by ``Request.__lt__``, i.e.
  ``(priority, arrival_time, request_id)``, lower first (a preempted
  request is pushed back with its key); ``scheduler.py``: the victim is
  ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``.
  """
  return Scheduler(name="priority", order=_rank, victim="priority")


# ---------------------------------------------------- cache-aware orders
def window_hits(view: WaitingView, size: int) -> tuple[jax.Array, ...]:
  """The cache hits of up to ``size`` queued requests.

  Returns:
    ``(rids, valid, hit_tokens, hit_blocks)``: ``[W]`` int32 the queued
    request ids in id order (``-1`` past ``num_waiting``), ``[W]`` bool,
    and each one's :func:`prefixjax.cache.prefix_cache.match` over its
    current ``num_tokens`` (``[W]`` int32 tokens and full blocks; 0 where
    not valid). Meaningful only when ``num_waiting <= size``.
  """
  r = view.queued.shape[0]
  w = min(size, r)
  (rids,) = jnp.nonzero(view.queued, size=w, fill_value=-1)
  rids = rids.astype(jnp.int32)
  valid = rids >= 0
  keys = gather(view.keys, rids, 0)
  total = gather(view.num_tokens, rids, 1)
  hit = jax.vmap(lambda k, n: pc.match(view.cache, k, n))(keys, total)
  tokens = jnp.where(valid, hit.hit_tokens, 0)
  blocks = jnp.where(valid, hit.num_hit_blocks, 0)
  return rids, valid, tokens.astype(jnp.int32), blocks.astype(jnp.int32)


def common_blocks(keys: jax.Array, full: jax.Array) -> jax.Array:
  """``[W, W]`` int32 full blocks two rows share from the start.

  Keys are chained (a key names its whole prefix), so two rows that agree
  in column ``d`` agree in every column before it: the shared prefix is
  found by a binary search over ``[0, min(full_i, full_j)]``, ``log2(M)``
  rounds of one ``[W, W]`` comparison (not the ``[W, W, M]`` one).
  """
  w, m = keys.shape[0], keys.shape[1]
  rows = jnp.arange(w)
  lo = jnp.zeros((w, w), jnp.int32)
  hi = jnp.minimum(full[:, None], full[None, :]).astype(jnp.int32)
  for _ in range(max(int(m).bit_length(), 1)):
    mid = (lo + hi + 1) // 2
    col = jnp.clip(mid - 1, 0, m - 1)
    a = keys[rows[:, None], col]  # [W, W, 2]: row i's key at mid - 1
    b = keys[rows[None, :], col]  # row j's
    ok = (mid >= 1) & jnp.all(a == b, axis=-1)
    lo = jnp.where(ok & (mid <= hi), mid, lo)
    hi = jnp.where(ok | (mid > hi), hi, mid - 1)
  return lo


def _ranked(view, rids, valid, sort_keys) -> jax.Array:
  """``[R]`` int32: window request ``rids[i]`` gets its rank in ``sort_keys``
  (``jnp.lexsort`` order, the last key primary), others ``_BIG``."""
  order = jnp.lexsort(sort_keys)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  key = jnp.full(view.queued.shape, _BIG, jnp.int32)
  return scatter(key, rids, rank.astype(jnp.int32), valid)


def in_batch_holds(small, pos, close) -> jax.Array:
  """SGLang's in-batch prefix check: which requests wait this step.

  Walking the queue in ``pos`` order, a ``small`` request (cached prefix
  at most the check threshold) that is ``close`` (shares at least the
  deprioritize threshold) to an earlier *inserted* one is held; the other
  small ones are inserted (``schedule_policy.py _compute_prefix_matches``).
  Decided in rounds, equal to that sequential walk: a request is held once
  an earlier close one is inserted, and inserted once no earlier close one
  is undecided (the earliest undecided one is decided every round).

  Args:
    small: ``[W]`` bool.
    pos: ``[W]`` int32 queue positions (distinct where ``small``).
    close: ``[W, W]`` bool.

  Returns:
    ``[W]`` bool, the held requests.
  """
  conflict = (
    small[:, None] & small[None, :] & (pos[None, :] < pos[:, None]) & close
  )

  def open_left(c):
    return jnp.any(c[0])

  def round_(c):
    open_, inserted, held = c
    hold = open_ & jnp.any(conflict & inserted[None, :], axis=1)
    ready = open_ & ~hold & ~jnp.any(conflict & open_[None, :], axis=1)
    return open_ & ~hold & ~ready, inserted | ready, held | hold

  false = jnp.zeros(small.shape, jnp.bool_)
  return jax.lax.while_loop(open_left, round_, (small, false, false))[2]


def _lpm_order(
  max_sorted: int, check_threshold: int, deprioritize_threshold: int
):
  def order(state, view):
    del state
    rids, valid, hit, _ = window_hits(view, max_sorted)
    w = rids.shape[0]
    k = view.cache.block_size
    pos = gather(view.queue_pos, rids, _BIG)
    full = gather(view.num_tokens, rids, 0) // k
    shared = common_blocks(gather(view.keys, rids, 0), full) * k  # tokens

    if check_threshold >= 0:
      small = valid & (hit <= check_threshold)
      dep = in_batch_holds(small, pos, shared >= deprioritize_threshold)
    else:
      dep = jnp.zeros((w,), jnp.bool_)
    primary = jnp.where(dep, _BIG, -hit)
    fallback = view.num_waiting > max_sorted
    lpm_key = _ranked(view, rids, valid, (pos, primary))
    return jnp.where(fallback, 0, lpm_key)

  return order


def lpm(
  *,
  max_sorted: int = 128,
  in_batch_check_threshold: int = 32,
  in_batch_deprioritize_threshold: int = 32,
) -> Scheduler:
  """Longest prefix match first, as SGLang 0.5.23's ``lpm`` policy.

  ``python/sglang/srt/managers/schedule_policy.py``:
  ``_sort_by_longest_prefix`` sorts the waiting queue by the cached prefix
  length, longest first, stably (ties keep the queue's order);
  ``_determine_active_policy`` falls back to FCFS when more than
  ``WAITING_QUEUE_PREFIX_MATCH_MAX = 128`` requests wait; the in-batch
  prefix check of ``_compute_prefix_matches``: going down the queue, a
  request whose cached prefix is at most
  ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32`` tokens and which shares
  at least ``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32`` tokens
  with an earlier such request (one not itself deprioritized) sorts last
  this step, so the one scheduled first publishes the shared prefix.

  Here the cached prefix is the vLLM cache's hit (whole blocks, capped at
  ``num_tokens - 1``), and the in-batch sharing is counted in whole blocks
  (SGLang's simulated waiting-queue tree matches single tokens); the order
  is computed when the waiting loop starts. ``in_batch_check_threshold=-1``
  turns the in-batch check off (as SGLang's ``-1``).

  Raises:
    ValueError: ``max_sorted < 1``.
  """
  if max_sorted < 1:
    raise ValueError(f"lpm: max_sorted={max_sorted} must be >= 1")
  return _lpm(
    int(max_sorted),
    int(in_batch_check_threshold),
    int(in_batch_deprioritize_threshold),
  )


@functools.cache  # equal arguments, one object: jit compiles once
def _lpm(max_sorted, check_threshold, deprioritize_threshold) -> Scheduler:
  return Scheduler(
    name="lpm",
    order=_lpm_order(max_sorted, check_threshold, deprioritize_threshold),
  )


def _dfs_order(max_sorted: int):
  def order(state, view):
    del state
    rids, valid, _, depth = window_hits(view, max_sorted)
    pos = gather(view.queue_pos, rids, _BIG)
    keys = gather(view.keys, rids, 0)
    m = keys.shape[1]
    # A node is a cached prefix of d + 1 blocks (a chained key); request i
    # passes through its first depth[i] nodes.
    on = valid[:, None] & (jnp.arange(m)[None, :] < depth[:, None])  # [W, M]
    # i and j pass through the same node at depth d iff d < c[i, j], their
    # shared hit prefix (chained keys); a node's weight and first queued
    # request are counts and minima over j, per row by the value of c.
    w = keys.shape[0]
    c = common_blocks(keys, jnp.where(valid, depth, 0))  # [W, W]
    rows = jnp.broadcast_to(jnp.arange(w)[:, None], (w, w))
    valid_j = jnp.broadcast_to(valid[None, :], (w, w))
    count = (
      jnp.zeros((w, m + 1), jnp.int32)
      .at[rows, c]
      .add(valid_j.astype(jnp.int32))
    )
    least = (
      jnp.full((w, m + 1), _BIG, jnp.int32)
      .at[rows, c]
      .min(jnp.where(valid_j, pos[None, :], _BIG))
    )
    above = jnp.cumsum(count[:, ::-1], axis=1)[:, ::-1]  # j with c >= v
    weight = above[:, 1:]  # [W, M]: j with c > d
    first = jax.lax.cummin(least, axis=1, reverse=True)[:, 1:]
    # Lexicographic path: (-weight, first) per depth, then _BIG at the node
    # a request ends on (its own requests follow the children), then the
    # queue position. Two paths agree above depth c[i, j] and differ (or
    # both end) at it, so comparing there decides the pair: a request's
    # rank is the count of requests before it (no sort over 2M keys).
    a = jnp.where(on, -weight, _BIG)
    b = jnp.where(on, first, 0)
    at = jnp.clip(c, 0, m - 1)
    cols = rows.T
    ai, bi, aj, bj = a[rows, at], b[rows, at], a[cols, at], b[cols, at]
    before = (aj < ai) | (
      (aj == ai) & ((bj < bi) | ((bj == bi) & (pos[None, :] < pos[:, None])))
    )
    rank = jnp.sum((before & valid_j).astype(jnp.int32), axis=1)
    key = jnp.full(view.queued.shape, _BIG, jnp.int32)
    ranked = scatter(key, rids, rank, valid)
    fallback = view.num_waiting > max_sorted
    return jnp.where(fallback, 0, ranked)

  return order


def dfs(*, max_sorted: int = 128) -> Scheduler:
  """SGLang 0.5.23's ``dfs-weight`` policy.

  ``schedule_policy.py`` ``_sort_by_dfs_weight`` and
  ``mem_cache/base_prefix_cache.py`` ``_dfs_weight_order``: each waiting
  request sits on the cache-tree node its prefix match ends at; a node's
  weight is the number of waiting requests at or below it; a depth-first
  walk visits children heaviest first and emits a node's own requests (in
  queue order) after its children.

  Here the tree is the vLLM cache's chain of hit blocks (a node per cached
  block prefix); children of equal weight go in the order of their first
  queued request (SGLang: the children dict's insertion order). Like
  ``lpm`` it orders at most ``max_sorted`` queued requests and is FCFS
  beyond (SGLang sorts any queue length for DFS; the cap bounds the
  ``O(W^2 M)`` work per step).
  """
  if max_sorted < 1:
    raise ValueError(f"dfs: max_sorted={max_sorted} must be >= 1")
  return _dfs(int(max_sorted))


@functools.cache
def _dfs(max_sorted: int) -> Scheduler:
  return Scheduler(name="dfs", order=_dfs_order(max_sorted))


# ------------------------------------------------------------------ fair
class FairState(NamedTuple):
  """VTC counters: ``counter [R]`` int32 per client, ``floor []`` int32."""

  counter: jax.Array
  floor: jax.Array


def _fair_init(num_requests: int) -> FairState:
  return FairState(
    counter=jnp.zeros((num_requests,), jnp.int32), floor=jnp.int32(0)
  )


def _client_mask(view, mask_rids) -> jax.Array:
  """``[R]`` bool over clients: clients with a request where ``mask_rids``."""
  r = view.client.shape[0]
  return jnp.zeros((r,), jnp.bool_).at[view.client].max(mask_rids)


def _fair_arrival(state, view, rid, mask):
  u = gather(view.client, rid[None], 0)[0]
  others = view.queued.at[rid].set(False)
  active = _client_mask(view, others)
  present = active[u]
  low = jnp.min(jnp.where(active, state.counter, _BIG))
  lift = jnp.where(jnp.any(active), low, state.floor)
  c = state.counter[u]
  new = jnp.where(mask & ~present, jnp.maximum(c, lift), c)
  return state._replace(counter=state.counter.at[u].set(new))


def _fair_pick(state, key, view):
  del key
  c = jnp.where(view.queued, gather(state.counter, view.client, 0), _BIG)
  best = jnp.min(c)
  pos = jnp.where(view.queued & (c == best), view.queue_pos, _BIG)
  return jnp.argmin(pos).astype(jnp.int32)


@functools.cache
def _fair(w_in: int, w_out: int) -> Scheduler:
  def on_admit(state, view, rid, n, mask):
    u = gather(view.client, rid[None], 0)[0]
    c = state.counter[u] + jnp.where(mask, w_in * n, 0)
    left = view.queued.at[rid].set(False)
    empty = mask & ~jnp.any(left)
    return FairState(
      counter=state.counter.at[u].set(c),
      floor=jnp.where(empty, c, state.floor),
    )

  def on_step(state, view, rids, n, kind, decode, sampled, lanes):
    # Running prefill chunks; admitted requests paid theirs at admission.
    chunk = lanes & (kind == 0) & ~decode
    charge = jnp.where(chunk, w_in * n, 0)
    charge = charge + jnp.where(lanes & sampled, w_out, 0)
    u = gather(view.client, rids, 0)
    return state._replace(
      counter=state.counter.at[jnp.where(lanes, u, 0)].add(
        jnp.where(lanes, charge, 0)
      )
    )

  return Scheduler(
    name="fair",
    pick=_fair_pick,
    init=_fair_init,
    on_arrival=_fair_arrival,
    on_admit=on_admit,
    on_step=on_step,
  )


def fair(*, w_in: int = 1, w_out: int = 2) -> Scheduler:
  """Virtual token counter fairness (VTC; Sheng et al., OSDI'24, Alg. 2).

  Each client ``u`` has a counter ``c_u`` of the service it received:
  ``w_in`` per prompt token computed and ``w_out`` per output token (the
  paper's defaults 1 and 2). The waiting request of the client with the
  lowest counter goes first (ties: the queue's order). A client arriving
  to an empty share of the queue is lifted: ``c_u = max(c_u, min c_v)``
  over the clients with queued requests, or, if nobody waits, over the
  counter of the client that last emptied the queue (the paper's ``l``).

  Charges: an admission adds ``w_in * num_tokens`` scheduled at once (so
  the next choice in the same step sees it); at the end of a step, running
  requests that continued a prefill chunk add ``w_in`` per token and every
  sampled token adds ``w_out``. Clients are the records' ``client`` field
  (a trace's ``session_ids``; all one client otherwise). Integer weights
  keep the counters exact (``int32``).

  Raises:
    TypeError / ValueError: weights not positive ints.
  """
  for name, w in (("w_in", w_in), ("w_out", w_out)):
    if isinstance(w, bool) or not isinstance(w, int):
      raise TypeError(f"fair: {name}={w!r} must be an int")
    if w < 0:
      raise ValueError(f"fair: {name}={w} must be >= 0")
  return _fair(w_in, w_out)


# -------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[..., Scheduler]] = {
  "fcfs": fcfs,
  "priority": priority,
  "lpm": lpm,
  "dfs": dfs,
  "fair": fair,
}


def register_scheduler(
  name: str, factory: Callable[..., Scheduler], *, overwrite: bool = False
) -> None:
  """Names a scheduler factory for configs and the CLI.

  Raises:
    ValueError: ``name`` is taken and ``overwrite`` is False.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"a scheduler name must be a non-empty str, got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"scheduler {name!r} is already registered")
  _REGISTRY[name] = factory


def get_scheduler(name: str | Scheduler, **params) -> Scheduler:
  """The scheduler registered as ``name``, built with ``params``.

  Raises:
    ValueError: an unknown name (the message lists the known ones).
    TypeError: the factory did not return a :class:`Scheduler`.
  """
  if isinstance(name, Scheduler):
    if params:
      raise ValueError("parameters need a scheduler name, not an instance")
    return name
  if name not in _REGISTRY:
    raise ValueError(
      f"unknown scheduler {name!r}; expected one of {scheduler_names()}"
    )
  out = _REGISTRY[name](**params)
  if not isinstance(out, Scheduler):
    raise TypeError(
      f"scheduler factory {name!r} returned {type(out).__name__}, "
      "not a Scheduler"
    )
  if out.victim not in ("last", "priority"):
    raise ValueError(
      f"scheduler {name!r}: victim={out.victim!r} must be 'last' or 'priority'"
    )
  if out.deque and (out.order is not None or out.pick is not None):
    raise ValueError(f"scheduler {name!r}: deque=True takes no order or pick")
  return out


def scheduler_names() -> tuple[str, ...]:
  """The registered names, sorted."""
  return tuple(sorted(_REGISTRY))
