"""vLLM 0.33 v1 scheduler (FCFS or PRIORITY), one jitted engine step at a time.

The decisions are those of the plain-Python oracle
``tests/reference_models/vllm_scheduler.py`` (``VllmScheduler``, policy
``"fcfs"`` or ``"priority"``, the schedulers of the same names in
:mod:`prefixjax.serving.schedulers`, a static choice: ``scheduler=`` of
:func:`step` and :func:`run`), made on device with the prefix cache
:mod:`prefixjax.cache.prefix_cache` (``vllm_version="0.33"``, policy
``lru``) as vLLM's ``KVCacheManager``:

* Every request's whole token sequence (prompt, then the trace's output ids
  or the harness's fabricated tokens, cut at ``max_model_len``) is known up
  front, so its block keys are computed once on the host
  (:func:`prefixjax.cache.hashing.block_hashes`) into ``keys [R, M, 2]``.
  A request's keys only grow as it samples, so the row never changes.
* Running loop (``Scheduler.schedule``): for each running request in
  order while the budget lasts, ``n = num_tokens - num_computed``, capped
  by the long-prefill threshold (only with more than one request running
  or waiting), the budget and ``max_model_len - num_computed - 1``; then
  :func:`prefixjax.cache.prefix_cache.append` (``allocate_slots``: new blocks
  for ``cdiv(computed + n, K) - held``); while it is ``OUT_OF_BLOCKS``
  the last running request is preempted (released tail first, status
  preempted, ``num_computed = 0``, put at the FRONT of the waiting deque);
  preempting the request itself ends the loop.
* Waiting loop (only when nothing was preempted this step): while the
  budget lasts and fewer than ``max_num_seqs`` run, the head of the
  deque: :func:`prefixjax.cache.prefix_cache.match` over its current
  ``num_tokens`` (hit capped at ``num_tokens - 1``, whole blocks), ``n =
  num_tokens - hit`` (threshold; without chunked prefill a request that
  does not fit in the budget ends the loop, with it the chunk is cut to the
  budget), the whole-sequence admission gate of ``allocate_slots(...,
  full_sequence_must_fit=True)`` (``cdiv(min(num_tokens, max_model_len), K)
  - hits + refcount-0 hits <= num_free``; written here, it reads the
  cache's ``refcounts`` and ``num_free``), then
  :func:`prefixjax.cache.prefix_cache.allocate_with_prefix` for ``hit + n``
  tokens (it matches again with cap ``hit + n - 1``, which gives the same
  hit: ``hit <= hit + n - 1 <= num_tokens - 1``).
* Every allocation is followed by :func:`prefixjax.cache.prefix_cache.publish`
  of the full blocks of ``computed + n`` tokens (vLLM's ``cache_blocks``
  inside ``allocate_slots``), so later requests of the same step hit them.
* Model output (``update_from_output``), in scheduled order: a request
  whose computed tokens reach its ``num_tokens`` samples one token; it
  finishes at ``max_model_len`` tokens or ``max_tokens`` outputs and is
  released at once (:func:`prefixjax.cache.prefix_cache.release`), then
  leaves the running list keeping the others' order.

Any other scheduler (``lpm``, ``dfs``, ``fair``, user-defined) keeps this
loop and changes only which waiting request is tried next (its ``order``
or ``pick``) and, through ``victim``, which running request is preempted;
the waiting queue is then keyed like PRIORITY's (below) with each request's
FCFS position in ``queue_pos``. These are not vLLM's (vLLM has FCFS and
PRIORITY only): the plain-Python model they are checked against is
``tests/reference_models/schedulers.py``.

Policy ``"priority"`` (``create_request_queue``'s heap) changes three rules:

* The waiting queue is ordered by ``RequestTable.rank`` (the host's rank of
  ``(priority, arrival_time, request_id)``, ``Request.__lt__``); ``waiting``
  is then a membership buffer (``waiting[rid] = rid`` while queued, else
  -1) and its head a masked argmin of ``rank``, O(R) per admission. A
  preempted request is pushed back with its key.
* The preemption victim is the first running request with the largest
  ``RequestTable.prio_key`` (the dense rank of ``(priority,
  arrival_time)``: ``max(running, key=...)``), possibly one scheduled
  earlier this step (its tokens return to the budget and it leaves the
  scheduled list) or the request itself. The victim leaves the running
  list keeping the others' order; the loop index moves back if it was
  before. Retries after a preemption keep the request's ``n``.
* Preempting the request itself goes on with the next running request
  (FCFS ends the loop).

Failures inside jit are status values (:class:`SimStatus`): a step that
schedules nothing while requests remain is ``STALLED`` (the oracle raises),
a cache verb failing other than the modelled ``OUT_OF_BLOCKS`` is
``CACHE_ERROR``, running out of step-buffer rows is ``OUT_OF_STEPS``, and
a clock giving a step time that is NaN, infinite or negative is
``BAD_STEP_TIME``.

Dimensions: ``R`` requests, ``S`` = ``max_num_seqs`` (running slots),
``M`` = ``ceil(max_model_len / K)`` block-table columns, ``T`` steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._masked import NONE, gather, get_row, scatter
from prefixjax.cache import Status
from prefixjax.cache import prefix_cache as pc
from prefixjax.serving import roofline
from prefixjax.serving import schedulers as sch
from prefixjax.serving.engine_ops import (
  OK,
  append_tokens,
  at,
  cap,
  i32,
  publish_if,
  put,
  release_if,
  remove_at,
)
from prefixjax.serving.engine_state import (
  POLICIES,
  EngineParams,
  EngineState,
  ReqStatus,
  RequestTable,
  SchedKind,
  SimStatus,
  StepRecord,
  StepTrace,
  init_state,
  view,
)
from prefixjax.serving.fork import enqueue, wake_children

__all__ = [
  "POLICIES",
  "PROGRESS_EVERY",
  "EngineParams",
  "EngineState",
  "ReqStatus",
  "RequestTable",
  "SchedKind",
  "SimStatus",
  "StepRecord",
  "StepTrace",
  "admit",
  "complete",
  "init_state",
  "run",
  "schedule",
  "set_progress_sink",
  "step",
  "view",
]


def _running_phase(st, reqs, params, threshold, scheduler, skip_all=False):
  """The running loop of ``Scheduler.schedule`` (the policy's preemption);
  no iteration where ``skip_all``."""
  s = st.running.shape[0]
  mml = params.max_model_len
  empty = jnp.full((s,), NONE, jnp.int32)
  priority = scheduler.victim == "priority"
  carry0 = dict(
    st=st,
    i=jnp.int32(0),
    budget=i32(params.max_num_batched_tokens),
    stop=jnp.bool_(False),
    sched_rid=empty,
    sched_n=jnp.zeros((s,), jnp.int32),
    num_sched=jnp.int32(0),
    preempted=empty,
    num_pre=jnp.int32(0),
  )
  if priority:  # retrying running[i] after preempting another: same n
    carry0.update(retry=jnp.bool_(False), retry_n=jnp.int32(0))

  def cond(c):
    return (
      (~skip_all)
      & (~c["stop"])
      & (c["i"] < c["st"].num_running)
      & (c["budget"] > 0)
    )

  def body(c):
    st = c["st"]
    rid = at(st.running, c["i"])
    slot = at(st.slot, rid)
    computed = at(st.num_computed, rid)
    n = cap(at(st.num_tokens, rid) - computed, threshold)
    n = jnp.minimum(jnp.minimum(n, c["budget"]), mml - computed - 1)
    if priority:
      n = jnp.where(c["retry"], c["retry_n"], n)
    skip = n <= 0
    cache, app = append_tokens(st.cache, slot, n, skip)
    ok = (~skip) & (app == Status.OK)
    fail = (~skip) & (~ok)
    bad = fail & (app != Status.OUT_OF_BLOCKS)
    k = st.cache.block_size
    fills = (computed + n) // k > computed // k
    cache, pub = publish_if(
      ok & fills, cache, slot, get_row(reqs.keys, rid), computed + n
    )
    bad = bad | (ok & (pub != Status.OK))
    preempt = fail & ~bad
    lanes = jnp.arange(s) < st.num_running
    if priority:
      # max(running, key=(priority, arrival_time)): the first of equals.
      vkeys = jnp.where(lanes, gather(reqs.prio_key, st.running, -1), -1)
      vpos = jnp.argmax(vkeys).astype(jnp.int32)
    else:  # running.pop() (the last one)
      vpos = st.num_running - 1
    victim = at(st.running, vpos)
    vslot = at(st.slot, victim)
    cache, rel = release_if(preempt, cache, vslot)
    bad = bad | (preempt & (rel != Status.OK))
    st = st.replace(
      cache=cache,
      num_computed=put(
        put(st.num_computed, rid, computed + n, ok), victim, 0, preempt
      ),
      status=put(st.status, victim, ReqStatus.PREEMPTED, preempt),
      slot=put(st.slot, victim, NONE, preempt),
      num_preemptions=put(
        st.num_preemptions,
        victim,
        at(st.num_preemptions, victim) + 1,
        preempt,
      ),
      sampled_last=put(st.sampled_last, victim, False, preempt),
      running=remove_at(st.running, vpos, st.num_running, preempt),
      num_running=st.num_running - preempt.astype(jnp.int32),
    )
    if scheduler.deque:  # prepend_request: the deque's front
      r_len = st.waiting.shape[0]
      head = (st.waiting_head - 1 + r_len) % r_len
      st = st.replace(
        waiting=put(st.waiting, head, victim, preempt),
        waiting_head=jnp.where(preempt, head, st.waiting_head),
      )
    else:  # a keyed queue: back in, at the FCFS front
      st = st.replace(waiting=put(st.waiting, victim, victim, preempt))
    st = st.replace(
      queue_pos=put(st.queue_pos, victim, st.queue_front, preempt),
      queue_front=st.queue_front - preempt.astype(jnp.int32),
    )
    st = st.replace(
      num_waiting=st.num_waiting + preempt.astype(jnp.int32),
      error=jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), st.error),
    )
    self_pre = preempt & (victim == rid)
    sched_rid = put(c["sched_rid"], c["num_sched"], rid, ok)
    sched_n = put(c["sched_n"], c["num_sched"], n, ok)
    num_sched = c["num_sched"] + ok.astype(jnp.int32)
    out = dict(
      st=st,
      i=c["i"] + (ok | skip).astype(jnp.int32),
      budget=c["budget"] - jnp.where(ok, n, 0),
      stop=c["stop"] | bad | self_pre,
      sched_rid=sched_rid,
      sched_n=sched_n,
      num_sched=num_sched,
      preempted=put(c["preempted"], c["num_pre"], victim, preempt),
      num_pre=c["num_pre"] + preempt.astype(jnp.int32),
    )
    if priority:
      # A victim before running[i] was scheduled this step (or skipped):
      # its tokens go back to the budget, the loop index moves back.
      before = preempt & (vpos < c["i"])
      spos = jnp.argmax(
        (sched_rid == victim) & (jnp.arange(s) < num_sched)
      ).astype(jnp.int32)
      was_sched = before & (at(sched_rid, spos) == victim)
      out.update(
        i=out["i"] - before.astype(jnp.int32),
        budget=out["budget"] + jnp.where(was_sched, at(sched_n, spos), 0),
        stop=c["stop"] | bad,  # after itself: the next running request
        sched_rid=remove_at(sched_rid, spos, num_sched, was_sched),
        sched_n=jnp.where(
          jnp.arange(s) < num_sched - was_sched.astype(jnp.int32),
          remove_at(sched_n, spos, num_sched, was_sched),
          0,
        ),
        num_sched=num_sched - was_sched.astype(jnp.int32),
        retry=preempt & ~self_pre,
        retry_n=n,
      )
    return out

  return jax.lax.while_loop(cond, body, carry0)


def _decode_phase(st, reqs, params, threshold, scheduler):
  """The running loop when it is a plain decode round; ``(fast, carry)``.

  ``fast``: every running request schedules exactly one token (the running
  loop's ``n`` is 1 for each), the budget covers them all, and the free
  blocks cover every request that starts a new block. Then nobody is
  preempted and the loop schedules the running list in order, one token
  each: only requests that start a new block (an allocation, in running
  order, as the loop would make it) or fill one (a publish) touch the
  cache verbs; the others' token counts move at once. ``carry`` is the
  running loop's; where not ``fast`` the state is unchanged.
  """
  s = st.running.shape[0]
  k = st.cache.block_size
  running, rids, computed, tokens, _ = _decode_lanes(st, reqs)
  n = cap(tokens - computed, threshold)
  n = jnp.minimum(n, params.max_model_len - computed - 1)
  starts = running & (computed % k == 0)
  enabled = (
    (st.num_running > 0)
    & jnp.all(jnp.where(running, n == 1, True))
    & (st.num_running <= params.max_num_batched_tokens)
    & (jnp.sum(starts.astype(jnp.int32)) <= st.cache.paging.num_free)
  )
  lean = pc.queue_order(st.cache)
  if lean:  # publish_block's rule: every earlier full block is published
    enabled = enabled & (st.cache.stats.publish_dropped == 0)
  lanes = running & enabled
  slots = gather(st.slot, rids, 0)
  grow = starts & enabled
  fills = lanes & ((computed + 1) % k == 0)
  busy = grow | fills
  (order,) = jnp.nonzero(busy, size=s, fill_value=0)
  count = jnp.sum(busy.astype(jnp.int32))
  cache = st.cache
  if lean:
    # The lanes that start no block only count the token; the verbs below
    # read no other lane's count, so it is set for all of them first.
    rest = lanes & ~grow
    counts = scatter(
      cache.paging.num_tokens, jnp.where(rest, slots, 0), computed + 1, rest
    )
    cache = cache.replace(paging=cache.paging.replace(num_tokens=counts))

  def lean_body(c):
    # A lane starts a block or fills one (both only when K is 1); a
    # running sequence's partly filled last block is never shared or
    # published (fork copies it at once), so nothing is copied.
    j, cache, bad = c
    lane = order[j]
    rid, slot = rids[lane], slots[lane]
    col = computed[lane] // k
    key = jax.lax.dynamic_slice(reqs.keys, (rid, col, 0), (1, 1, 2))[0, 0]

    def grow_one(cache):
      return pc.append_block(cache, slot)

    def fill_one(cache):
      cache, pub = pc.publish_block(cache, slot, col, key)
      return cache, pub.status

    def skip(cache):
      return cache, OK

    # Each verb under a cond of its own against the identity: one cond
    # choosing between the two verbs made XLA copy every pool array that
    # only one of them writes (2,000 requests: 0.62 s -> 0.77 s).
    cache, app = jax.lax.cond(grow[lane], grow_one, skip, cache)
    cache, pub = jax.lax.cond(fills[lane], fill_one, skip, cache)
    return j + 1, cache, bad | (app != Status.OK) | (pub != Status.OK)

  def body(c):
    j, cache, bad = c
    lane = order[j]
    rid, slot = rids[lane], slots[lane]
    cache, app = append_tokens(cache, slot, jnp.int32(1), jnp.bool_(False))
    cache, pub = publish_if(
      fills[lane], cache, slot, get_row(reqs.keys, rid), computed[lane] + 1
    )
    bad = bad | (app != Status.OK) | (pub != Status.OK)
    return j + 1, cache, bad

  _, cache, bad = jax.lax.while_loop(
    lambda c: c[0] < count,
    lean_body if lean else body,
    (jnp.int32(0), cache, jnp.bool_(False)),
  )
  if not lean:
    quiet = lanes & ~busy
    counts = scatter(
      cache.paging.num_tokens, jnp.where(quiet, slots, 0), computed + 1, quiet
    )
    cache = cache.replace(paging=cache.paging.replace(num_tokens=counts))
  st = st.replace(
    cache=cache,
    num_computed=scatter(st.num_computed, rids, computed + 1, lanes),
    error=jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), st.error),
  )
  empty = jnp.full((s,), NONE, jnp.int32)
  out = dict(
    st=st,
    i=st.num_running,
    budget=i32(params.max_num_batched_tokens) - st.num_running,
    stop=bad,
    sched_rid=jnp.where(lanes, st.running, NONE),
    sched_n=lanes.astype(jnp.int32),
    num_sched=st.num_running,
    preempted=empty,
    num_pre=jnp.int32(0),
  )
  if scheduler.victim == "priority":
    out.update(retry=jnp.bool_(False), retry_n=jnp.int32(0))
  return enabled, out


def _waiting_head(st, reqs, scheduler, key):
  """``waiting.peek()``: ``(rid, position in st.waiting)``."""
  if scheduler.deque:
    return at(st.waiting, st.waiting_head), st.waiting_head
  v = view(st, reqs)
  if scheduler.pick is not None:
    rid = scheduler.pick(st.sched_state, key, v)
  else:
    rid = sch.lexicographic_pick(key, v)
  rid = i32(rid)
  return rid, rid


def _waiting_phase(c, reqs, params, threshold, scheduler):
  """The waiting loop of ``Scheduler.schedule`` (the queue's head first)."""
  st0 = c["st"]
  s = st0.running.shape[0]
  k = st0.cache.block_size
  m = st0.cache.max_blocks_per_seq
  r_len = st0.waiting.shape[0]
  mml = params.max_model_len
  carry0 = dict(
    c,
    stop=c["stop"] | (c["num_pre"] > 0),
    sched_kind=jnp.zeros((s,), jnp.int32),
    pc_hits=jnp.int32(0),
    pc_queries=jnp.int32(0),
  )

  def cond(c):
    st = c["st"]
    return (
      (~c["stop"])
      & (c["budget"] > 0)
      & (st.num_waiting > 0)
      & (st.num_running < s)
    )

  key = jnp.zeros_like(st0.queue_pos)
  if scheduler.order is not None:  # only when the loop runs: O(W^2 M)
    key = jax.lax.cond(
      cond(carry0),
      lambda: i32(scheduler.order(st0.sched_state, view(st0, reqs))),
      lambda: key,
    )

  def body(c):
    st = c["st"]
    budget = c["budget"]
    rid, wpos = _waiting_head(st, reqs, scheduler, key)
    keys = get_row(reqs.keys, rid)
    total = at(st.num_tokens, rid)
    # One prompt: its blocks probed in order, in one kernel.
    hit = pc.match_in_order(st.cache, keys, total)
    h = hit.hit_tokens
    n = cap(total - h, threshold)
    too_big = (~params.chunked_prefill) & (n > budget)
    n = jnp.minimum(n, budget)
    # allocate_slots(full_sequence_must_fit=True): the whole sequence.
    pstate = st.cache.paging
    lanes = jnp.arange(m) < hit.num_hit_blocks
    evictable = jnp.sum(
      (lanes & (gather(pstate.refcounts, hit.hit_blocks) == 0)).astype(
        jnp.int32
      )
    )
    full = jnp.minimum(total, mml)
    needed = (
      jnp.maximum((full + k - 1) // k - hit.num_hit_blocks, 0) + evictable
    )
    go = (~too_big) & (needed <= pstate.num_free)
    slot = jnp.argmin(pstate.active).astype(jnp.int32)
    cache, r = pc.allocate_with_prefix(
      st.cache, jnp.where(go, slot, NONE), keys, h + n, hit=hit
    )
    ok = go & (r.status == Status.OK)
    bad = (go & (r.status != Status.OUT_OF_BLOCKS) & ~ok) | (
      ok & (r.hit_tokens != h)
    )
    cache, pub = pc.publish(cache, jnp.where(ok, slot, NONE), keys, h + n)
    bad = bad | (ok & (pub.status != Status.OK))
    first = at(st.first_sched_step, rid) < 0
    fresh = at(st.num_preemptions, rid) == 0
    sched_state = scheduler.on_admit(st.sched_state, view(st, reqs), rid, n, ok)
    st = st.replace(
      cache=cache,
      sched_state=sched_state,
      status=put(st.status, rid, ReqStatus.RUNNING, ok),
      num_computed=put(st.num_computed, rid, h + n, ok),
      slot=put(st.slot, rid, slot, ok),
      first_sched_step=put(st.first_sched_step, rid, st.step, ok & first),
      hit_first_sched=put(st.hit_first_sched, rid, h, ok & first),
      resume_hit_tokens=put(
        st.resume_hit_tokens,
        rid,
        at(st.resume_hit_tokens, rid) + h,
        ok & ~first,
      ),
      running=put(st.running, st.num_running, rid, ok),
      num_running=st.num_running + ok.astype(jnp.int32),
      waiting=put(st.waiting, wpos, NONE, ok),
      waiting_head=jnp.where(ok, (st.waiting_head + 1) % r_len, st.waiting_head)
      if scheduler.deque
      else st.waiting_head,
      num_waiting=st.num_waiting - ok.astype(jnp.int32),
      error=jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), st.error),
    )
    kind = jnp.where(first, SchedKind.NEW, SchedKind.RESUMED).astype(jnp.int32)
    return dict(
      c,
      st=st,
      budget=budget - jnp.where(ok, n, 0),
      stop=~ok,
      sched_rid=put(c["sched_rid"], c["num_sched"], rid, ok),
      sched_n=put(c["sched_n"], c["num_sched"], n, ok),
      sched_kind=put(c["sched_kind"], c["num_sched"], kind, ok),
      num_sched=c["num_sched"] + ok.astype(jnp.int32),
      pc_hits=c["pc_hits"] + jnp.where(ok & fresh, h, 0),
      pc_queries=c["pc_queries"] + jnp.where(ok & fresh, total, 0),
    )

  return jax.lax.while_loop(cond, body, carry0)


def _update_from_output(st, c, reqs, params, scheduler):
  """``update_from_output``: sample, check stop, free, in scheduled order.

  The per-request updates are one vectorised pass (each request is
  scheduled once per step); only the releases of finished requests, whose
  order sets the free queue's, loop, carrying the cache alone.
  """
  s = st.running.shape[0]
  lanes = jnp.arange(s) < c["num_sched"]
  rids = jnp.where(lanes, c["sched_rid"], 0)
  sample = lanes & ~gather(st.prefill_chunk, rids, True)
  tokens = gather(st.num_tokens, rids, 0) + sample.astype(jnp.int32)
  outputs = gather(st.num_output, rids, 0) + sample.astype(jnp.int32)
  done = sample & (
    (tokens >= params.max_model_len)
    | (outputs >= gather(reqs.max_tokens, rids, 0))
  )
  (order,) = jnp.nonzero(done, size=s, fill_value=0)
  count = jnp.sum(done.astype(jnp.int32))
  slots = gather(st.slot, rids, 0)

  def body(carry):
    j, cache, bad = carry
    cache, rel = pc.release(cache, slots[order[j]])
    return j + 1, cache, bad | (rel.status != Status.OK)

  released, cache, bad = jax.lax.while_loop(
    lambda carry: carry[0] < count,
    body,
    (jnp.int32(0), st.cache, jnp.bool_(False)),
  )
  finished = jnp.where(jnp.arange(s) < count, rids[order], NONE)
  st = st.replace(
    cache=cache,
    num_tokens=scatter(st.num_tokens, rids, tokens, sample),
    num_output=scatter(st.num_output, rids, outputs, sample),
    status=scatter(st.status, rids, jnp.int32(ReqStatus.FINISHED), done),
    # After the loop (``released`` is ``count``, never negative): the loop
    # reads the old slots, and XLA would copy the [R] array otherwise.
    slot=scatter(st.slot, rids, NONE, done & (released >= 0)),
    finish_step=scatter(st.finish_step, rids, st.step, done),
    error=jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), st.error),
  )
  # Scheduler.update_from_output: remove_all keeps the others' order.
  lanes = jnp.arange(s) < st.num_running
  keep = lanes & (gather(st.status, st.running, -1) == ReqStatus.RUNNING)
  pos = jnp.cumsum(keep.astype(jnp.int32)) - 1
  running = scatter(jnp.full((s,), NONE, jnp.int32), pos, st.running, keep)
  st = st.replace(running=running, num_running=jnp.sum(keep.astype(jnp.int32)))
  if reqs.fork_parent is not None:
    first = scatter(
      jnp.zeros(st.status.shape, jnp.bool_), rids, True, sample & (outputs == 1)
    )
    st = wake_children(st, reqs, params, scheduler, first)
  return st, finished


def schedule(
  state: EngineState,
  reqs: RequestTable,
  params: EngineParams,
  scheduler: sch.Scheduler | str = "fcfs",
) -> dict:
  """The scheduling half of :func:`step` (``Scheduler.schedule``).

  Traceable. Runs the running and waiting loops (blocks allocated and
  published, ``num_computed`` advanced) and returns the plan: a dict with
  ``"st"`` (the state after scheduling), ``"num_sched"``, ``"sched_rid"``
  ``[S]``, ``"sched_n"`` ``[S]``, ``"sched_kind"`` ``[S]``,
  ``"preempted"`` ``[S]`` and the step's prefix-cache counts. The model
  runs between this and :func:`complete` (``prefixjax.model.Engine``: the
  scheduled tokens are ``num_computed - sched_n .. num_computed`` of each
  scheduled request); :func:`step` is the two back to back.
  """
  threshold = jnp.where(
    state.num_running + state.num_waiting <= 1,
    0,
    i32(params.long_prefill_token_threshold),
  )
  scheduler = sch.get_scheduler(scheduler)
  # Either a decode round or the general loop; no lax.cond over the state
  # (its branches would copy every [R] array each step): the loop that is
  # not taken runs no iteration.
  fast, quick = _decode_phase(state, reqs, params, threshold, scheduler)
  c = _running_phase(quick["st"], reqs, params, threshold, scheduler, fast)
  c = {
    key: c[key]
    if key == "st"
    else jax.tree.map(lambda a, b: jnp.where(fast, a, b), quick[key], c[key])
    for key in c
  }
  return _waiting_phase(c, reqs, params, threshold, scheduler)


def complete(
  plan: dict,
  reqs: RequestTable,
  params: EngineParams,
  scheduler: sch.Scheduler | str = "fcfs",
  clock=None,
) -> tuple[EngineState, StepRecord]:
  """The output half of :func:`step` (``update_from_output``).

  Traceable. Every scheduled request whose computed tokens reach its
  ``num_tokens`` samples one token; a request stops at ``max_model_len``
  tokens or ``reqs.max_tokens`` outputs (an engine that samples an end id
  lowers that request's ``max_tokens`` to its outputs so far plus one
  before calling this) and is released.

  Args:
    plan: from :func:`schedule`.
    reqs, params, scheduler, clock: as :func:`step`.

  Returns:
    ``(new_state, StepRecord)``.
  """
  scheduler = sch.get_scheduler(scheduler)
  c = plan
  st = c["st"]
  s = st.running.shape[0]
  lanes = jnp.arange(s) < c["num_sched"]
  rids = c["sched_rid"]
  # _update_after_schedule: num_computed already advanced.
  chunk = gather(st.num_computed, rids) < gather(st.num_tokens, rids)
  st = st.replace(prefill_chunk=scatter(st.prefill_chunk, rids, chunk, lanes))
  new = jnp.where(lanes, c["sched_n"], 0)
  if clock is None:
    dt_s = jnp.float32(0)
  else:
    context = jnp.where(lanes, gather(st.num_computed, rids, 0) - new, 0)
    dt_s = roofline.clock_seconds(clock, new, context)
  free_blocks = st.cache.paging.num_free
  k = st.cache.block_size
  run_lanes = jnp.arange(s) < st.num_running
  frag = jnp.sum(
    jnp.where(run_lanes, (-gather(st.num_computed, st.running, 0)) % k, 0)
  )
  st, finished = _update_from_output(st, c, reqs, params, scheduler)
  # The harness's step record (sched_harness.py / the oracle's _record_step).
  kinds = c["sched_kind"]
  decode = lanes & gather(st.sampled_last, rids, False) & (kinds == 0)
  prefill = lanes & ~decode
  n = c["sched_n"]
  sampled = lanes & ~chunk
  first_tok = sampled & (gather(st.first_token_step, rids) < 0)
  sched_state = scheduler.on_step(
    st.sched_state, view(st, reqs), rids, n, kinds, decode, sampled, lanes
  )
  prefill_steps = scatter(
    st.prefill_steps, rids, gather(st.prefill_steps, rids) + 1, prefill
  )
  prefill_tokens = jnp.sum(jnp.where(prefill, n, 0))
  decode_tokens = jnp.sum(jnp.where(decode, n, 0))
  # After every read of the old flags (through values that are never
  # negative), or XLA copies the [R] array to keep it.
  after = gather(prefill_steps, rids, 0) + prefill_tokens + decode_tokens >= 0
  st = st.replace(
    sched_state=sched_state,
    sched_steps=scatter(
      st.sched_steps, rids, gather(st.sched_steps, rids) + 1, lanes
    ),
    prefill_steps=prefill_steps,
    sampled_last=scatter(st.sampled_last, rids, sampled, lanes & after),
    first_token_step=scatter(st.first_token_step, rids, st.step, first_tok),
  )
  record = StepRecord(
    step=st.step,
    sched_rid=rids,
    sched_n=jnp.where(lanes, n, 0),
    sched_kind=jnp.where(lanes, kinds, 0),
    preempted=c["preempted"],
    finished=finished,
    num_running=st.num_running,
    num_waiting=st.num_waiting,
    free_blocks=free_blocks,
    free_blocks_end=st.cache.paging.num_free,
    prefill_tokens=prefill_tokens,
    decode_tokens=decode_tokens,
    pc_hits=c["pc_hits"],
    pc_queries=c["pc_queries"],
    frag_tokens=frag.astype(jnp.int32),
    time_ms=st.time_ms,
    time_frac=st.time_frac,
    dt_s=dt_s,
  )
  return st, record


def step(
  state: EngineState,
  reqs: RequestTable,
  params: EngineParams,
  scheduler: sch.Scheduler | str = "fcfs",
  clock=None,
) -> tuple[EngineState, StepRecord]:
  """One sync ``EngineCore.step()``: ``schedule()``, outputs, bookkeeping.

  Traceable (the body of :func:`run`'s loop): :func:`complete` of
  :func:`schedule`. Does not advance ``state.step`` or flag a stall:
  :func:`run` does both.

  Args:
    state: the engine.
    reqs: the trace (``rank`` and ``prio_key`` set for ``"priority"``).
    params: the scheduler knobs.
    scheduler: a :class:`prefixjax.serving.schedulers.Scheduler` or its
      registered name (static).
    clock: ``None`` (counted steps) or an object whose
      ``step_time_s(new_tokens [S], context_tokens [S])`` gives the step's
      seconds (:class:`prefixjax.serving.roofline.RooflineClock`), static;
      context is each scheduled request's computed tokens before the step
      (hits included).

  Returns:
    ``(new_state, StepRecord)``.
  """
  plan = schedule(state, reqs, params, scheduler)
  return complete(plan, reqs, params, scheduler, clock)


def _reached(ms, frac, now) -> jax.Array:
  """Time ``(ms, frac)`` is at or before ``now``: the engine's time (an
  :class:`EngineState`) or a ``(ms, frac)`` pair."""
  now_ms, now_frac = (
    now if isinstance(now, tuple) else (now.time_ms, now.time_frac)
  )
  return (ms < now_ms) | ((ms == now_ms) & (frac <= now_frac))


def _plus_ms(ms, frac, dt_ms):
  """The clock ``(ms, frac)`` ``dt_ms`` milliseconds later (float32
  fraction, whole milliseconds carried into ``ms``)."""
  frac = frac + dt_ms
  carry = jnp.floor(frac)
  return ms + carry.astype(jnp.int32), frac - carry


def _add_ms(st: EngineState, dt_ms) -> EngineState:
  ms, frac = _plus_ms(st.time_ms, st.time_frac, dt_ms)
  return st.replace(time_ms=ms, time_frac=frac)


def admit(
  st: EngineState,
  reqs: RequestTable,
  scheduler: sch.Scheduler,
  timed: bool = False,
) -> EngineState:
  """The harness's ``add_arrivals``: queue every request due by the clock.

  Requests arrive in ``arrival_order``; a rejected one (status
  ``REJECTED``) or a fork child (``DORMANT``) is consumed without being
  queued.
  """
  r_len = st.waiting.shape[0]

  def due(st):
    rid = gather(reqs.arrival_order, st.num_arrived[None], NONE)[0]
    if timed:
      ms = gather(reqs.arrival_ms, rid[None], 0)[0]
      frac = gather(reqs.arrival_frac, rid[None], 0)[0]
      return (st.num_arrived < r_len) & _reached(ms, frac, st)
    return (st.num_arrived < r_len) & (
      gather(reqs.arrival_step, rid[None], 0)[0] <= st.step
    )

  def body(st):
    rid = at(reqs.arrival_order, st.num_arrived)
    queue = at(st.status, rid) == ReqStatus.WAITING
    st = st.replace(num_arrived=st.num_arrived + 1)
    return enqueue(st, reqs, scheduler, rid, queue)

  return jax.lax.while_loop(due, body, st)


def run(
  state: EngineState,
  reqs: RequestTable,
  params: EngineParams,
  *,
  max_steps: int,
  scheduler: sch.Scheduler | str = "fcfs",
  clock=None,
  record_lanes: bool = True,
  progress: bool = False,
  jump: bool = True,
  base=0,
) -> tuple[EngineState, StepTrace]:
  """Engine steps until no request is left, in one ``lax.while_loop``.

  The clock (``state.step``) follows ``sched_harness.py Engine.run``: each
  iteration first queues the requests whose ``arrival_step`` the clock has
  reached (so they can be scheduled in that step); when nothing is running
  or waiting the clock jumps to the next arrival (``idle_steps`` counts the
  skipped steps); a step that schedules tokens is recorded and advances the
  clock; one that schedules nothing while requests are left advances the
  clock if arrivals are still due, else it is ``STALLED``.

  Args:
    state: from :func:`init_state`.
    reqs: the trace.
    params: the scheduler knobs.
    max_steps: ``T``, static: rows of the step buffers.
    scheduler: a :class:`prefixjax.serving.schedulers.Scheduler` or its
      registered name, static (default ``"fcfs"``); one that is not a
      ``deque`` needs a ``state`` built by :func:`init_state` with it
      (``waiting`` a membership buffer); ``victim="priority"`` needs
      ``reqs.rank`` and ``reqs.prio_key``.
    clock: ``None`` (default: the clock counts steps, requests arrive at
      ``arrival_step``) or a timed clock (see :func:`step`), static: then
      the engine's time advances by each step's ``step_time_s``, a request
      is queued when the time at the start of a step has reached its
      ``arrival_ms + arrival_frac``, and an empty (or stuck) engine jumps
      to the next arrival's time; ``step`` then counts executed steps only
      and ``idle_steps`` stays 0.
    record_lanes: keep every step's ``[S]`` fields (``sched_rid``,
      ``sched_n``, ``sched_kind``, ``preempted``, ``finished``); when
      False they hold one scratch row and only the ``[]`` fields are
      per step (what the metrics read), so ``[T, S]`` buffers cost nothing.
    progress: every :data:`PROGRESS_EVERY` executed steps, call the host
      function set with :func:`set_progress_sink` with ``(requests done,
      steps)`` (``jax.debug.callback``; a static flag, so one compile).
    base: traced, the steps of earlier runs this one continues (a state
      resumed after ``OUT_OF_STEPS`` with ``num_steps`` 0, its rows in
      fresh buffers): progress reports count from it.
    jump: take runs of decode steps (every running request decodes one
      token and none finishes, nothing waits or arrives, the blocks they
      start fit the free ones) up to :data:`JUMP_MAX` at a time in one
      loop iteration, their block starts and fills made in step order
      (:func:`_jump`; static, default True). Exact: the state and every
      step record equal the step-by-step loop's (False), which tests
      compare; it skips loop iterations, not steps. Not taken under a
      scheduler with a per-step state (``fair``). A cache verb failing
      inside a run (``CACHE_ERROR``, a bug) ends it, but the loop still
      runs that iteration's step before it stops.

  Raises:
    ValueError: an unknown scheduler, or ``"priority"`` without ranks.

  Returns:
    ``(final_state, StepTrace)``: rows ``0 .. final_state.num_steps - 1``
    are the executed steps. ``final_state.error`` is ``OUT_OF_STEPS`` when
    requests were left after ``T`` executed steps, ``STALLED`` when a step
    scheduled nothing and no arrival was due.
  """
  scheduler = sch.get_scheduler(scheduler)
  if scheduler.victim == "priority" and (
    reqs.rank is None or reqs.prio_key is None
  ):
    raise ValueError(
      f"scheduler {scheduler.name!r} needs RequestTable.rank and prio_key"
    )
  if clock is not None and (
    reqs.arrival_ms is None or reqs.arrival_frac is None
  ):
    raise ValueError(
      "a timed clock needs RequestTable.arrival_ms and arrival_frac"
    )
  return _run(
    state,
    reqs,
    params,
    max_steps=max_steps,
    scheduler=scheduler,
    clock=clock,
    record_lanes=record_lanes,
    progress=progress,
    jump=jump,
    base=np.int32(base),
  )


PROGRESS_EVERY = 256
_SINK: list = [None]


def set_progress_sink(fn) -> None:
  """The host function ``fn(done, steps)`` that ``run(progress=True)``
  calls (``None``: nobody listens)."""
  _SINK[0] = fn


def report_progress(done, steps) -> None:
  """Hands ``(requests done, steps)`` to the sink of
  :func:`set_progress_sink`, if any (the host end of the engines'
  ``jax.debug.callback``)."""
  if _SINK[0] is not None:
    _SINK[0](int(done), int(steps))


def _pending(st: EngineState) -> jax.Array:
  return st.num_running + st.num_waiting > 0


def _more(st: EngineState, reqs: RequestTable) -> jax.Array:
  return st.num_arrived < reqs.arrival_order.shape[0]


def _going(st: EngineState, reqs: RequestTable, max_steps: int) -> jax.Array:
  """The loop goes on: no error, steps left, requests left."""
  return (
    (st.error == SimStatus.OK)
    & (st.num_steps < max_steps)
    & (_pending(st) | _more(st, reqs))
  )


def _to_next_arrival(st, reqs, timed: bool, go=True):
  """The time (or step) of the next arrival, if one is left (and ``go``)."""
  rid = gather(reqs.arrival_order, st.num_arrived[None], NONE)[0]
  more = _more(st, reqs)
  if timed:
    ms = gather(reqs.arrival_ms, rid[None], 0)[0]
    frac = gather(reqs.arrival_frac, rid[None], 0)[0]
    later = go & more & ~_reached(ms, frac, st)
    return st.replace(
      time_ms=jnp.where(later, ms, st.time_ms),
      time_frac=jnp.where(later, frac, st.time_frac),
    )
  nxt = jnp.where(
    go & more, gather(reqs.arrival_step, rid[None], 0)[0], st.step
  )
  nxt = jnp.maximum(nxt, st.step)
  return st.replace(step=nxt, idle_steps=st.idle_steps + nxt - st.step)


JUMP_MAX = 32
"""Most quiet decode steps one iteration of :func:`run`'s loop jumps."""


def _jump_window(scheduler, cache, jump: bool, blocks: bool = True) -> int:
  """``W``, the decode steps one iteration may jump (static). With vLLM's
  ``lru`` cache (:func:`prefixjax.cache.prefix_cache.queue_order`) the
  block starts and fills inside the run are made in step order by the
  one-block verbs, so ``W`` is :data:`JUMP_MAX`; with another policy, or
  not ``blocks`` (:func:`run_batched`: vmapped, the verbs' loop would run
  every lane's branches for as many trips as the busiest lane needs), a
  run stops at the first start or fill, and as a running request fills
  or starts a block at least every ``K - 1`` steps, ``W`` is ``K - 2``.
  0 (no jump) when not ``jump``, or when the scheduler keeps a per-step
  state (``on_step``, e.g. ``fair``'s service counters)."""
  if (
    not jump
    or scheduler.on_step is not sch.Scheduler._field_defaults["on_step"]
  ):
    return 0
  if blocks and pc.queue_order(cache):
    return JUMP_MAX
  return max(0, min(cache.block_size - 2, JUMP_MAX))


def _decode_lanes(st, reqs):
  """The running lanes and their requests' counts: ``(lanes, rids,
  computed, tokens, outputs)``, ``[S]`` each."""
  s = st.running.shape[0]
  lanes = jnp.arange(s) < st.num_running
  rids = jnp.where(lanes, st.running, 0)
  return (
    lanes,
    rids,
    gather(st.num_computed, rids, 0),
    gather(st.num_tokens, rids, 0),
    gather(st.num_output, rids, 0),
  )


def _jump_limit(st, reqs, params, timed, max_steps, w, blocks, lanes_counts):
  """How many quiet decode steps :func:`_jump` may take from ``st``
  (``[]`` int32, 0 when the next step is not quiet): the counts' bound,
  and on the steps clock the next arrival's; a timed clock's arrivals and
  step times are checked inside :func:`_jump`."""
  k = st.cache.block_size
  lanes, rids, computed, tokens, outputs = lanes_counts
  decoding = (tokens - computed == 1) & gather(st.sampled_last, rids, False)
  r = computed % k
  # Steps before each running request's first event: it finishes after
  # the step (max_model_len tokens or max_tokens outputs), or (without the
  # one-block verbs) starts a block (computed % K == 0 at the step) or
  # fills one (computed + 1 == 0 mod K).
  room = jnp.minimum(
    i32(params.max_model_len) - tokens - 1,
    gather(reqs.max_tokens, rids, 0) - outputs - 1,
  )
  blocks = (
    st.cache.stats.publish_dropped == 0  # publish_block's rule
    if blocks and pc.queue_order(st.cache)
    else jnp.bool_(False)
  )
  room = jnp.where(
    blocks, room, jnp.minimum(room, jnp.where(r == 0, 0, k - 1 - r))
  )
  quiet = (
    (st.error == SimStatus.OK)
    & (st.num_waiting == 0)
    & (st.num_running > 0)
    & (st.num_running <= i32(params.max_num_batched_tokens))
    & jnp.all(jnp.where(lanes, decoding, True))
  )
  limit = jnp.minimum(jnp.min(jnp.where(lanes, room, w)), w)
  # The blocks started in the first j steps fit the free ones (decode's
  # fast path: no step of the run can preempt).
  js = jnp.arange(1, w + 1, dtype=jnp.int32)[:, None]
  started = (computed[None] + js + k - 1) // k - (computed[None] + k - 1) // k
  started = jnp.sum(jnp.where(lanes[None], started, 0), axis=1)
  limit = jnp.minimum(
    limit, jnp.sum((started <= st.cache.paging.num_free).astype(jnp.int32))
  )
  limit = jnp.minimum(limit, max_steps - 1 - st.num_steps)
  if not timed:
    nxt = gather(reqs.arrival_order, st.num_arrived[None], NONE)
    step_next = gather(reqs.arrival_step, nxt, 0)[0]
    limit = jnp.where(
      _more(st, reqs), jnp.minimum(limit, step_next - st.step), limit
    )
  return jnp.where(quiet, jnp.maximum(limit, 0), 0)


def _jump_blocks(cache, reqs, lanes, rids, slots, computed, taken, w):
  """The block starts and fills of ``taken`` decode steps, in the order
  the step-by-step loop makes them (step by step, running order within a
  step, a start before a fill): :func:`_decode_phase`'s one-block verbs,
  each lane's slot holding the count it holds at that point of its step.

  Returns ``(cache, taken, free [w], bad)``: ``taken`` cut after the
  first step in which the index refused a key (from the next step on the
  step-by-step loop publishes another way) or a verb failed (``bad``,
  ``CACHE_ERROR``); ``free``, the free blocks after each step's starts.
  """
  s = lanes.shape[0]
  k = cache.block_size
  js = jnp.arange(w, dtype=jnp.int32)[:, None]
  at_step = computed[None] + js  # [w, s] each lane's count at each step
  valid = lanes[None] & (js < taken)
  start = valid & (at_step % k == 0)
  fill = valid & ((at_step + 1) % k == 0)
  free = cache.paging.num_free - jnp.cumsum(
    jnp.sum(start.astype(jnp.int32), axis=1)
  )
  busy = (start | fill).reshape(-1)
  start, fill = start.reshape(-1), fill.reshape(-1)
  (order,) = jnp.nonzero(busy, size=w * s, fill_value=0)
  count = jnp.sum(busy.astype(jnp.int32))

  def cond(c):
    e, _, cut, _ = c
    return (e < count) & (order[e] // s < cut)

  def body(c):
    e, cache, cut, bad = c
    idx = order[e]
    j, lane = idx // s, idx % s
    slot, count_at = slots[lane], computed[lane] + j
    col = count_at // k
    key = jax.lax.dynamic_slice(reqs.keys, (rids[lane], col, 0), (1, 1, 2))
    paging = cache.paging
    cache = cache.replace(
      paging=paging.replace(
        num_tokens=put(
          paging.num_tokens,
          slot,
          count_at + (~start[idx]).astype(jnp.int32),
        )
      )
    )

    def grow_one(cache):
      return pc.append_block(cache, slot)

    def fill_one(cache):
      cache, pub = pc.publish_block(cache, slot, col, key[0, 0])
      return cache, pub.status

    def skip(cache):
      return cache, OK

    cache, app = jax.lax.cond(start[idx], grow_one, skip, cache)
    cache, pub = jax.lax.cond(fill[idx], fill_one, skip, cache)
    failed = (app != Status.OK) | (pub != Status.OK)
    stop = failed | (cache.stats.publish_dropped > 0)
    return (
      e + 1,
      cache,
      jnp.where(stop, jnp.minimum(cut, j + 1), cut),
      bad | failed,
    )

  _, cache, taken, bad = jax.lax.while_loop(
    cond, body, (jnp.int32(0), cache, taken, jnp.bool_(False))
  )
  return cache, taken, free, bad


def _jump(st, reqs, params, clock, max_steps, w, blocks):
  """Quiet decode steps, up to ``w`` of them at once: ``(state, records
  [w], rows [w])`` (the rows of the steps not taken are ``max_steps``).

  A step is quiet when every running request decodes one token (its
  prompt done, it sampled last step) within the budget, nothing waits
  and no arrival is due at the step's start, no running request finishes,
  and the blocks it starts fit the free ones (with another cache policy
  than ``lru``: none starts or fills a block). Such steps differ only in
  their counts, their block starts and fills, and their clock (issue
  14's hint: between events every decode step is the same), so they are
  taken together: the starts and fills made in step order
  (:func:`_jump_blocks`), each running request's ``num_computed``,
  ``num_tokens``, ``num_output``, ``sched_steps`` and its slot's token
  count moved by the number taken, and each step's record the one
  :func:`step` writes.
  A timed clock's step times and arrivals are followed one step at a
  time, with :func:`_add_ms`'s float32 arithmetic, so the times are the
  step-by-step loop's bit for bit. The first step that is not quiet is
  left to :func:`step`.
  """
  s = st.running.shape[0]
  k = st.cache.block_size
  timed = clock is not None
  lanes_counts = _decode_lanes(st, reqs)
  lanes, rids, computed, tokens, outputs = lanes_counts
  limit = _jump_limit(
    st, reqs, params, timed, max_steps, w, blocks, lanes_counts
  )
  more = _more(st, reqs)
  nxt = gather(reqs.arrival_order, st.num_arrived[None], NONE)
  new = lanes.astype(jnp.int32)
  js = jnp.arange(w, dtype=jnp.int32)
  if timed:
    ms_next = gather(reqs.arrival_ms, nxt, 0)[0]
    frac_next = gather(reqs.arrival_frac, nxt, 0)[0]

    def cond(c):
      return (c[0] < limit) & ~c[1]

    def body(c):
      j, _, ms, frac, t_ms, t_frac, dts = c
      due = more & (j > 0) & _reached(ms_next, frac_next, (ms, frac))
      dt = roofline.clock_seconds(clock, new, jnp.where(lanes, computed + j, 0))
      stop = due | ~(jnp.isfinite(dt) & (dt >= 0))
      t_ms, t_frac = t_ms.at[j].set(ms), t_frac.at[j].set(frac)
      dts = dts.at[j].set(dt)
      later_ms, later_frac = _plus_ms(ms, frac, dt * 1e3)
      go = ~stop
      return (
        j + go.astype(jnp.int32),
        stop,
        jnp.where(go, later_ms, ms),
        jnp.where(go, later_frac, frac),
        t_ms,
        t_frac,
        dts,
      )

    taken, _, ms, frac, t_ms, t_frac, dts = jax.lax.while_loop(
      cond,
      body,
      (
        jnp.int32(0),
        jnp.bool_(False),
        st.time_ms,
        st.time_frac,
        jnp.zeros((w,), st.time_ms.dtype),
        jnp.zeros((w,), st.time_frac.dtype),
        jnp.zeros((w,), jnp.float32),
      ),
    )
  else:
    taken = limit
    ms, frac = st.time_ms, st.time_frac
    t_ms = jnp.broadcast_to(ms, (w,))
    t_frac = jnp.broadcast_to(frac, (w,))
    dts = jnp.zeros((w,), jnp.float32)
  slots = gather(st.slot, rids, 0)
  cache = st.cache
  free = jnp.full((w,), cache.paging.num_free, jnp.int32)
  error = st.error
  if blocks and pc.queue_order(cache):
    planned = taken
    cache, taken, free, bad = _jump_blocks(
      cache, reqs, lanes, rids, slots, computed, taken, w
    )
    error = jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), error)
    if timed:  # cut short: the clock when step `taken` starts
      cut = taken < planned
      ms = jnp.where(cut, gather(t_ms, taken[None], 0)[0], ms)
      frac = jnp.where(cut, gather(t_frac, taken[None], 0)[0], frac)
  paging = cache.paging
  paging = paging.replace(
    num_tokens=scatter(paging.num_tokens, slots, computed + taken, lanes)
  )
  run_rids = jnp.where(lanes, st.running, NONE)
  rows = jnp.where(js < taken, st.num_steps + js, max_steps)
  frag = jnp.sum(
    jnp.where(lanes[None], (-(computed[None] + js[:, None] + 1)) % k, 0),
    axis=1,
  )
  none = jnp.full((w, s), NONE, jnp.int32)
  full = functools.partial(jnp.full, (w,), dtype=jnp.int32)
  rec = StepRecord(
    step=st.step + js,
    sched_rid=jnp.broadcast_to(run_rids, (w, s)),
    sched_n=jnp.broadcast_to(new, (w, s)),
    sched_kind=jnp.zeros((w, s), jnp.int32),
    preempted=none,
    finished=none,
    num_running=full(st.num_running),
    num_waiting=full(st.num_waiting),
    free_blocks=free,
    free_blocks_end=free,
    prefill_tokens=full(0),
    decode_tokens=full(st.num_running),
    pc_hits=full(0),
    pc_queries=full(0),
    frag_tokens=frag.astype(jnp.int32),
    time_ms=t_ms,
    time_frac=t_frac,
    dt_s=dts,
  )
  st = st.replace(
    cache=cache.replace(paging=paging),
    error=error,
    num_computed=scatter(st.num_computed, rids, computed + taken, lanes),
    num_tokens=scatter(st.num_tokens, rids, tokens + taken, lanes),
    num_output=scatter(st.num_output, rids, outputs + taken, lanes),
    sched_steps=scatter(
      st.sched_steps, rids, gather(st.sched_steps, rids, 0) + taken, lanes
    ),
    step=st.step + taken,
    num_steps=st.num_steps + taken,
    time_ms=ms,
    time_frac=frac,
  )
  return st, rec, rows


def _arrive(st, reqs, scheduler, timed):
  """The start of an iteration of :func:`run`'s loop: an empty engine
  jumps to the next arrival (no jump when one is due now), then the due
  arrivals are queued; no lax.cond: a step with nothing to do changes
  nothing."""
  st = _to_next_arrival(st, reqs, timed, ~_pending(st))
  return admit(st, reqs, scheduler, timed)


def _step_once(
  st, reqs, params, scheduler, clock, max_steps, progress, n0, base=0
):
  """:func:`step`, then the clock and the loop's flags: ``(state, record,
  row)``, ``row`` the buffer row the record goes to (``max_steps``, out
  of range, when no step was executed); ``n0``: the executed steps when
  the iteration began, ``base``: those of earlier runs (progress
  reports)."""
  timed = clock is not None
  st, rec = step(st, reqs, params, scheduler, clock)
  ran = rec.sched_rid[0] >= 0
  row = jnp.where(ran, st.num_steps, max_steps)
  more = _more(st, reqs)
  stalled = (~ran) & _pending(st) & ~more
  wait = (~ran) & _pending(st) & more  # time passes until an arrival
  if timed:
    # A step time that is NaN, infinite or negative stops the run with
    # BAD_STEP_TIME; the clock does not move (NaN cast to int32 is garbage).
    bad = ran & ~(jnp.isfinite(rec.dt_s) & (rec.dt_s >= 0))
    st = st.replace(
      error=jnp.where(
        bad & (st.error == SimStatus.OK),
        jnp.int32(SimStatus.BAD_STEP_TIME),
        st.error,
      )
    )
    st = _add_ms(st, jnp.where(ran & ~bad, rec.dt_s * 1e3, 0))
    st = _to_next_arrival(st, reqs, timed, wait)
    wait = jnp.bool_(False)
  st = st.replace(
    step=st.step + (ran | wait).astype(jnp.int32),
    num_steps=st.num_steps + ran.astype(jnp.int32),
    error=jnp.where(
      stalled & (st.error == SimStatus.OK),
      jnp.int32(SimStatus.STALLED),
      st.error,
    ),
  )
  if progress:
    done = st.num_arrived - st.num_running - st.num_waiting
    steps = base + st.num_steps
    jax.lax.cond(
      steps // PROGRESS_EVERY > (base + n0) // PROGRESS_EVERY,
      lambda: jax.debug.callback(report_progress, done, steps),
      lambda: None,
    )
  return st, rec, row


def _advance(
  st, reqs, params, scheduler, clock, max_steps, jump=True, blocks=False
):
  """One iteration of :func:`run_batched`'s (vmapped) loop without the
  step buffers: ``(state, records, rows)``: ``[W + 1]`` step records
  (``W`` from :func:`_jump_window`: the quiet decode steps :func:`_jump`
  took, then the step :func:`step` executed) and the buffer row each goes
  to (``max_steps``, out of range, for a step not taken). ``blocks``: as
  :func:`_jump_window`'s (False: vmapped, the run stops at a block start
  or fill; 16 configurations of ``simulate_scaling.py --batch`` on this
  2-core CPU: 5.1 s step by step, 8.9 s with the starts and fills inside
  the jump, 4.6-5.6 s without)."""
  timed = clock is not None
  n0 = st.num_steps
  st = _arrive(st, reqs, scheduler, timed)
  w = _jump_window(scheduler, st.cache, jump, blocks)
  if w:
    st, jrec, jrows = _jump(st, reqs, params, clock, max_steps, w, blocks)
    st = admit(st, reqs, scheduler, timed)
  st, rec, row = _step_once(
    st, reqs, params, scheduler, clock, max_steps, False, n0
  )
  recs = jax.tree.map(lambda x: x[None], rec)
  rows = row[None]
  if w:
    recs = jax.tree.map(
      lambda a, b: jnp.concatenate([a.astype(b.dtype), b]), jrec, recs
    )
    rows = jnp.concatenate([jrows, rows])
  return st, recs, rows


def _write(trace: StepTrace, rec: StepRecord, row, max_steps) -> StepTrace:
  """``rec`` into row ``row`` of the buffers, nothing when ``row`` is
  ``max_steps``; a one-row (unrecorded) buffer takes every record in its
  row 0. With ``rec`` fields of a leading ``[n]`` axis and ``row`` ``[n]``,
  the ``n`` records go to their rows."""
  keep = row < max_steps

  def put(buf, x):
    t = buf.shape[0]
    if t == 1 and jnp.ndim(row):  # the scratch row keeps the last record
      return buf.at[jnp.where(keep[-1], 0, 1)].set(x[-1], mode="drop")
    return buf.at[jnp.where(keep, row if t > 1 else 0, t)].set(x, mode="drop")

  return jax.tree.map(put, trace, rec)


def _trace0(state, reqs, params, scheduler, clock, max_steps, record_lanes):
  """Empty step buffers: ``[T]`` per ``[]`` field, ``[T, S]`` (or one
  scratch row ``[1, S]`` when not ``record_lanes``) per ``[S]`` field."""
  _, rec0 = jax.eval_shape(
    functools.partial(step, scheduler=scheduler, clock=clock),
    state,
    reqs,
    params,
  )

  def rows(x):
    return max_steps if (record_lanes or x.ndim == 0) else 1

  return jax.tree.map(lambda x: jnp.zeros((rows(x), *x.shape), x.dtype), rec0)


def _finish(st: EngineState, reqs: RequestTable) -> EngineState:
  """``OUT_OF_STEPS`` when the loop ended with requests left."""
  return st.replace(
    error=jnp.where(
      (st.error == SimStatus.OK) & (_pending(st) | _more(st, reqs)),
      jnp.int32(SimStatus.OUT_OF_STEPS),
      st.error,
    )
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "max_steps",
    "scheduler",
    "clock",
    "record_lanes",
    "progress",
    "jump",
  ),
)
def _run(
  state,
  reqs,
  params,
  *,
  max_steps,
  scheduler,
  clock,
  record_lanes,
  progress,
  jump,
  base,
):
  trace0 = _trace0(
    state, reqs, params, scheduler, clock, max_steps, record_lanes
  )

  timed = clock is not None
  w = _jump_window(scheduler, state.cache, jump)

  def body(carry):
    st, trace = carry
    n0 = st.num_steps
    st = _arrive(st, reqs, scheduler, timed)
    if w:
      # The jump in a loop of at most one trip, entered when nothing waits
      # and something runs: under load (requests waiting) an iteration
      # pays for that test alone (10,000 requests at 16 sequences: 1.90 s
      # step by step, 1.99 s with the bound computed every iteration).
      def once(c):
        st, trace, _ = c
        st, rec, rows = _jump(st, reqs, params, clock, max_steps, w, True)
        st = admit(st, reqs, scheduler, timed)
        return st, _write(trace, rec, rows, max_steps), jnp.bool_(False)

      enter = (st.num_waiting == 0) & (st.num_running > 0)
      st, trace, _ = jax.lax.while_loop(
        lambda c: c[2], once, (st, trace, enter)
      )
    st, rec, row = _step_once(
      st, reqs, params, scheduler, clock, max_steps, progress, n0, base
    )
    return st, _write(trace, rec, row, max_steps)

  st, trace = jax.lax.while_loop(
    lambda carry: _going(carry[0], reqs, max_steps), body, (state, trace0)
  )
  return _finish(st, reqs), trace


@functools.partial(
  jax.jit,
  static_argnames=("max_steps", "scheduler", "clock", "jump", "until_full"),
)
def run_batched(
  state, reqs, params, keys, *, max_steps, scheduler, clock=None, jump=True,
  until_full=False,
):  # fmt: skip
  """:func:`run` (``record_lanes=False``) for a leading configuration
  axis: ``state``, ``params`` and ``reqs`` (its ``keys`` None) are batched
  ``[n, ...]``; ``keys``, the prompts' block keys, are shared. Each lane's
  ``(final_state, StepTrace)`` equals :func:`run`'s (``jump`` as there:
  each lane jumps its own quiet runs, so the loop runs while the lane with
  the most iterations, not the most steps, goes on).

  Not ``jax.vmap(run)``: a vmapped ``while_loop`` with a per-lane
  predicate selects every carry between its old and new value each
  iteration, the ``[n, T]`` step buffers included (a full copy per step).
  Here the loop runs while any lane goes, the steps are vmapped, a lane
  that has stopped keeps its state (a select over the state alone), and
  the buffers are written in place at the row of each lane that stepped.

  ``until_full``: stop every lane once one lane has run ``max_steps``
  steps (those left with requests end ``OUT_OF_STEPS``), so that the
  caller resumes them together into fresh buffers, ``num_steps`` 0 again
  (else that lane would wait out the others and then run alone).
  """
  scheduler = sch.get_scheduler(scheduler)

  def lane(fn):
    return jax.vmap(lambda s, r, *a: fn(s, r.replace(keys=keys), *a))

  trace = lane(
    lambda s, r, p: _trace0(s, r, p, scheduler, clock, max_steps, False)
  )(state, reqs, params)
  going = lane(lambda s, r: _going(s, r, max_steps))

  def body(carry):
    st, trace = carry
    go = going(st, reqs)
    # A timed clock steps one step at a time here: inside the vmapped jump
    # loop the roofline's float32 sums need not round as the vmapped
    # step's (test_batch_equals_one_by_one[vmap-roofline] found a lane a
    # step time apart).
    new, rec, row = lane(
      lambda s, r, p: _advance(
        s, r, p, scheduler, clock, max_steps, jump=jump and clock is None
      )
    )(st, reqs, params)
    st = jax.tree.map(
      lambda a, b: jnp.where(go.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      new,
      st,
    )
    row = jnp.where(go[:, None], row, max_steps)
    return st, jax.vmap(_write, in_axes=(0, 0, 0, None))(
      trace, rec, row, max_steps
    )

  def cond(carry):
    go = jnp.any(going(carry[0], reqs))
    if until_full:
      go = go & ~jnp.any(carry[0].num_steps >= max_steps)
    return go

  st, trace = jax.lax.while_loop(cond, body, (state, trace))
  return lane(_finish)(st, reqs), trace
