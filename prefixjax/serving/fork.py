"""Parallel sampling by fork and copy-on-write (``parallel_sampling="fork"``).

vLLM 0.33 fans a request with ``n > 1`` out into ``n`` independent child
requests (:func:`prefixjax.serving.simulate.fan_out`): each one is admitted
on its own and recomputes the prompt's partial last block. The fork mode is
the other classic design (vLLM 0.x's ``SequenceGroup``, block manager
``fork`` and copy-on-write): sample 0 is the parent and prefills the prompt
alone; samples ``1 .. n - 1`` wait (status ``DORMANT``, never queued) until
the parent samples its first token in :func:`prefixjax.serving.vllm_v1.
complete`, then each child, in request order:

* finishes at once if one output is all it may have (``max_tokens`` 1, or
  the prompt is ``max_model_len - 1`` long);
* otherwise, when a running slot, a cache sequence slot and the block a
  copy needs are free, is **forked**: :func:`prefixjax.cache.prefix_cache.
  fork` shares every block of the parent (full prompt blocks and the partly
  filled last one, refcounts up), then :func:`prefixjax.cache.prefix_cache.
  copy_on_write` gives the child its own copy of the partly filled last
  block at once (every child writes its next token there in its next step,
  so the copy is never wasted; the parent keeps the original, its refcount
  back to 1). The child joins the end of the running list having computed
  the prompt and sampled one token (from the parent's logits: the engine
  draws it with the child's own key);
* otherwise it is queued at the back of the waiting queue as a plain new
  request (it will prefill with the parent's published blocks as hits and
  sample its own first token).

A child that is forked or finishes at once computes no prompt token: its
whole prompt (the partly filled last block included) counts as its hit
tokens at its first schedule (``hit_first_sched``, so ``hit_tokens``,
``token_hit_rate`` and ``prefill_tokens_saved`` count the prompt shared by
fork, and computed plus saved prefill tokens is every prompt token when
nothing is preempted). A queued child's hits are its prefix-cache hits.

No step-exact reference exists for this mode (vLLM 0.33 has no fork); the
engine's tests check that it gives the fan-out mode's tokens and logits to
the bit while computing fewer prefill tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixjax._masked import gather
from prefixjax.cache import Status
from prefixjax.cache import prefix_cache as pc
from prefixjax.serving import schedulers as sch
from prefixjax.serving.engine_ops import at, put
from prefixjax.serving.engine_state import (
  EngineState,
  ReqStatus,
  RequestTable,
  SimStatus,
  view,
)

__all__ = ["enqueue", "wake_children"]


def enqueue(
  st: EngineState,
  reqs: RequestTable,
  scheduler: sch.Scheduler,
  rid,
  queue,
) -> EngineState:
  """``add_request``: ``rid`` joins the back of the waiting queue where
  ``queue`` (a deque's tail, or a keyed queue's membership)."""
  r_len = st.waiting.shape[0]
  if scheduler.deque:
    tail = (st.waiting_head + st.num_waiting) % r_len
  else:  # add_request: a heap push (keyed by rid)
    tail = rid
  st = st.replace(
    waiting=put(st.waiting, tail, rid, queue),
    num_waiting=st.num_waiting + queue.astype(jnp.int32),
    queue_pos=put(st.queue_pos, rid, st.queue_back, queue),
    queue_back=st.queue_back + queue.astype(jnp.int32),
  )
  return st.replace(
    sched_state=scheduler.on_arrival(st.sched_state, view(st, reqs), rid, queue)
  )


def wake_children(
  st: EngineState,
  reqs: RequestTable,
  params,
  scheduler: sch.Scheduler,
  first: jax.Array,
) -> EngineState:
  """Forks (or queues, or finishes) the dormant children of every request
  that sampled its first token this step (``first``: ``[R]`` bool).

  Runs after the step's outputs (finished requests released, the running
  list compacted). See the module docstring for the rules.
  """
  r = st.status.shape[0]
  s = st.running.shape[0]
  k = st.cache.block_size
  parent = reqs.fork_parent
  has = parent >= 0
  wake = (
    has
    & gather(first, jnp.where(has, parent, 0), False)
    & (st.status == ReqStatus.DORMANT)
  )
  (order,) = jnp.nonzero(wake, size=r, fill_value=0)
  count = jnp.sum(wake.astype(jnp.int32))

  def body(carry):
    j, st = carry
    c = order[j]
    p = at(parent, c)
    plen = at(reqs.prompt_len, c)
    now = (at(reqs.max_tokens, c) <= 1) | (plen + 1 >= params.max_model_len)
    pstate = st.cache.paging
    p_slot = at(st.slot, p)
    slot = jnp.argmin(pstate.active).astype(jnp.int32)
    copy = (plen % k) != 0
    room = (
      (~now)
      & (p_slot >= 0)
      & (st.num_running < s)
      & ~jnp.all(pstate.active)
      & (pstate.num_free >= copy.astype(jnp.int32))
    )

    def go(cache):
      cache, status = pc.fork(cache, p_slot, slot)
      cache, cow = pc.copy_on_write(cache, slot)
      return cache, (status != Status.OK) | (cow.status != Status.OK)

    cache, bad = jax.lax.cond(
      room, go, lambda cache: (cache, jnp.bool_(False)), st.cache
    )
    queue = (~now) & (~room)
    start = now | room  # sampled its first token this step
    status = jnp.where(
      now, ReqStatus.FINISHED, jnp.where(room, ReqStatus.RUNNING, 0)
    ).astype(jnp.int32)
    st = st.replace(
      cache=cache,
      status=put(
        st.status,
        c,
        jnp.where(queue, jnp.int32(ReqStatus.WAITING), status),
        True,
      ),
      slot=put(st.slot, c, slot, room),
      num_computed=put(st.num_computed, c, plen, room),
      num_tokens=put(st.num_tokens, c, plen + 1, start),
      num_output=put(st.num_output, c, 1, start),
      sampled_last=put(st.sampled_last, c, True, room),
      first_sched_step=put(st.first_sched_step, c, st.step, start),
      # Its whole prompt is the parent's KV, not computed: counted as hit
      # tokens at its first schedule, so computed + saved is every prompt
      # token and fork compares with fan-out by hit rate.
      hit_first_sched=put(st.hit_first_sched, c, plen, start),
      first_token_step=put(st.first_token_step, c, st.step, start),
      finish_step=put(st.finish_step, c, st.step, now),
      running=put(st.running, st.num_running, c, room),
      num_running=st.num_running + room.astype(jnp.int32),
      error=jnp.where(bad, jnp.int32(SimStatus.CACHE_ERROR), st.error),
    )
    st = enqueue(st, reqs, scheduler, c, queue)
    return j + 1, st

  _, st = jax.lax.while_loop(
    lambda carry: carry[0] < count, body, (jnp.int32(0), st)
  )
  return st
