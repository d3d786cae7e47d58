"""The serving engine's state: request table, knobs, state, step records.

The arrays :mod:`prefixjax.serving.vllm_v1` steps (one jitted loop over
engine steps); every array has a fixed size. Dimensions: ``R`` requests,
``S`` = ``max_num_seqs`` (running slots), ``M`` block-table columns.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import _struct as struct
from prefixjax._masked import NONE, scatter
from prefixjax.cache import prefix_cache as pc
from prefixjax.serving import schedulers as sch

__all__ = [
  "POLICIES",
  "EngineParams",
  "EngineState",
  "ReqStatus",
  "RequestTable",
  "SchedKind",
  "SimStatus",
  "StepRecord",
  "StepTrace",
  "init_state",
  "view",
]

POLICIES = ("fcfs", "priority")
"""The schedulers that are vLLM's own (step-exact with its scheduler)."""


class ReqStatus(enum.IntEnum):
  """Request states (vLLM's ``RequestStatus``; FINISHED stands for all)."""

  WAITING = 0
  RUNNING = 1
  PREEMPTED = 2
  FINISHED = 3
  REJECTED = 4
  DORMANT = 5  # a fork child waiting for its parent's first token


class SchedKind(enum.IntEnum):
  """How a scheduled request entered this step's list."""

  RUNNING = 0
  NEW = 1
  RESUMED = 2


class SimStatus(enum.IntEnum):
  """Status of a simulation (``EngineState.error``)."""

  OK = 0
  STALLED = 1
  CACHE_ERROR = 2
  OUT_OF_STEPS = 3
  BAD_STEP_TIME = 4  # the clock gave a step time not finite or negative
  BAD_ROUTE = 5  # a cluster's router picked a replica that does not exist


@struct.dataclass
class RequestTable:
  """The trace on device; read only.

  Attributes:
    keys: ``[R, M, 2]`` uint32 content keys of each request's full blocks
      (prompt + outputs, cut at ``max_model_len``).
    prompt_len: ``[R]`` int32.
    max_tokens: ``[R]`` int32 output tokens requested.
    arrival_step: ``[R]`` int32 step at which each request arrives.
    arrival_order: ``[R]`` int32 request ids by ``(arrival_step, rid)``.
    rank: ``[R]`` int32 position of each request in the order ``(priority,
      arrival_time, request_id)`` (a permutation of ``0 .. R-1``); read by
      policy ``"priority"`` only (``None`` for FCFS).
    prio_key: ``[R]`` int32 dense rank of ``(priority, arrival_time)``
      (equal keys equal); read by policy ``"priority"`` only.
    client: ``[R]`` int32 dense client id of each request (``fair``), or
      ``None`` (one client).
    arrival_ms, arrival_frac: ``[R]`` int32 whole milliseconds and
      ``[R]`` float32 fraction of a millisecond of each arrival time; read
      by a timed clock (``clock=`` of :func:`run`), which queues a request
      once the engine's time reaches it (``arrival_step`` is then unused).
    fork_parent: ``[R]`` int32 the request a fork child is forked from
      (-1: none), or ``None`` (no fork children;
      :mod:`prefixjax.serving.fork`).
  """

  keys: jax.Array
  prompt_len: jax.Array
  max_tokens: jax.Array
  arrival_step: jax.Array
  arrival_order: jax.Array
  rank: jax.Array | None = None
  prio_key: jax.Array | None = None
  client: jax.Array | None = None
  arrival_ms: jax.Array | None = None
  arrival_frac: jax.Array | None = None
  fork_parent: jax.Array | None = None


@struct.dataclass
class EngineParams:
  """Scheduler knobs that do not change shapes (``[]`` int32 / bool).

  Attributes:
    max_num_batched_tokens: the token budget of a step.
    max_model_len: the longest sequence.
    chunked_prefill: ``[]`` bool.
    long_prefill_token_threshold: 0 is no cap.
  """

  max_num_batched_tokens: jax.Array
  max_model_len: jax.Array
  chunked_prefill: jax.Array
  long_prefill_token_threshold: jax.Array


@struct.dataclass
class EngineState:
  """Scheduler + KV cache; every array has a fixed size.

  Attributes:
    cache: the :class:`prefixjax.cache.prefix_cache.PrefixCacheState`
      (``S`` sequence slots, ``M`` columns).
    status: ``[R]`` int32 :class:`ReqStatus`.
    num_computed: ``[R]`` int32 ``num_computed_tokens``.
    num_tokens: ``[R]`` int32 prompt + sampled tokens.
    num_output: ``[R]`` int32 sampled tokens.
    slot: ``[R]`` int32 cache sequence slot while running, else -1.
    prefill_chunk: ``[R]`` bool ``is_prefill_chunk`` of the last schedule.
    sampled_last: ``[R]`` bool sampled a token in its last scheduled step.
    first_sched_step: ``[R]`` int32, -1 before.
    hit_first_sched: ``[R]`` int32 hit tokens at the first schedule.
    first_token_step: ``[R]`` int32, -1 before.
    finish_step: ``[R]`` int32, -1 before.
    num_preemptions: ``[R]`` int32.
    resume_hit_tokens: ``[R]`` int32 hit tokens summed over resumptions.
    sched_steps: ``[R]`` int32 steps the request was scheduled in.
    prefill_steps: ``[R]`` int32 of those, steps counted as prefill.
    running: ``[S]`` int32 request ids in vLLM's running-list order, -1
      past ``num_running``.
    num_running: ``[]`` int32.
    waiting: ``[R]`` int32 circular deque of request ids (a ``deque``
      scheduler: FCFS); otherwise ``waiting[rid]`` is ``rid`` while it is
      queued, else -1.
    waiting_head: ``[]`` int32 index of the deque's front in ``waiting``
      (``deque`` only).
    num_waiting: ``[]`` int32.
    queue_pos: ``[R]`` int32 FCFS position of each queued request (see
      :class:`prefixjax.serving.schedulers.WaitingView`).
    queue_back: ``[]`` int32 the next arrival's position (counts up).
    queue_front: ``[]`` int32 the next preempted request's position
      (counts down from -1).
    sched_state: the scheduler's state (``Scheduler.init``).
    num_arrived: ``[]`` int32 entries of ``RequestTable.arrival_order``
      that have arrived (queued, or rejected).
    step: ``[]`` int32 the clock: the number of the next engine step.
    num_steps: ``[]`` int32 engine steps executed (each scheduled tokens).
    idle_steps: ``[]`` int32 clock steps skipped while the engine was empty.
    error: ``[]`` int32 :class:`SimStatus`.
    time_ms, time_frac: ``[]`` int32 and float32, the engine's time in
      milliseconds (whole and fraction; a timed clock only, else 0): a
      float32 of seconds would lose a millisecond's precision within hours.
  """

  cache: pc.PrefixCacheState
  status: jax.Array
  num_computed: jax.Array
  num_tokens: jax.Array
  num_output: jax.Array
  slot: jax.Array
  prefill_chunk: jax.Array
  sampled_last: jax.Array
  first_sched_step: jax.Array
  hit_first_sched: jax.Array
  first_token_step: jax.Array
  finish_step: jax.Array
  num_preemptions: jax.Array
  resume_hit_tokens: jax.Array
  sched_steps: jax.Array
  prefill_steps: jax.Array
  running: jax.Array
  num_running: jax.Array
  waiting: jax.Array
  waiting_head: jax.Array
  num_waiting: jax.Array
  queue_pos: jax.Array
  queue_back: jax.Array
  queue_front: jax.Array
  sched_state: object
  num_arrived: jax.Array
  step: jax.Array
  num_steps: jax.Array
  idle_steps: jax.Array
  error: jax.Array
  time_ms: jax.Array
  time_frac: jax.Array


class StepRecord(NamedTuple):
  """What one engine step did (one ``steps.jsonl`` line of the harness).

  Attributes:
    step: ``[]`` int32 the step's number on the clock.
    sched_rid: ``[S]`` int32 scheduled requests in scheduler order, -1 pad.
    sched_n: ``[S]`` int32 their scheduled tokens, 0 pad.
    sched_kind: ``[S]`` int32 :class:`SchedKind`.
    preempted: ``[S]`` int32 preempted requests in preemption order, -1 pad.
    finished: ``[S]`` int32 finished requests in scheduled order, -1 pad.
    num_running: ``[]`` int32 running after the step.
    num_waiting: ``[]`` int32 waiting after the step.
    free_blocks: ``[]`` int32 free blocks after scheduling.
    free_blocks_end: ``[]`` int32 free blocks after the outputs.
    prefill_tokens: ``[]`` int32.
    decode_tokens: ``[]`` int32.
    pc_hits: ``[]`` int32 ``PrefixCacheStats`` hits of this step.
    pc_queries: ``[]`` int32 ``PrefixCacheStats`` queries of this step.
    frag_tokens: ``[]`` int32 reserved but unused token slots after
      scheduling: ``(-num_computed) mod K`` summed over running requests.
    time_ms, time_frac: ``[]`` the engine's time when the step started
      (a timed clock; 0 otherwise).
    dt_s: ``[]`` float32 the step's duration in seconds (a timed clock; 0
      otherwise).
  """

  step: jax.Array
  sched_rid: jax.Array
  sched_n: jax.Array
  sched_kind: jax.Array
  preempted: jax.Array
  finished: jax.Array
  num_running: jax.Array
  num_waiting: jax.Array
  free_blocks: jax.Array
  free_blocks_end: jax.Array
  prefill_tokens: jax.Array
  decode_tokens: jax.Array
  pc_hits: jax.Array
  pc_queries: jax.Array
  frag_tokens: jax.Array
  time_ms: jax.Array
  time_frac: jax.Array
  dt_s: jax.Array


StepTrace = StepRecord
"""A :class:`StepRecord` with a leading ``[T]`` axis (one row per step)."""


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32)


def init_state(
  cache: pc.PrefixCacheState,
  waiting: jax.Array,
  num_waiting,
  status: jax.Array,
  prompt_len: jax.Array,
  num_arrived=0,
  scheduler: sch.Scheduler | str = "fcfs",
) -> EngineState:
  """An engine with the given requests waiting, in deque order.

  Args:
    cache: an empty prefix cache with ``S`` sequence slots.
    waiting: ``[R]`` int32 request ids in arrival (FCFS) order, padded;
      for policy ``"priority"`` the membership buffer (``waiting[rid] =
      rid`` if queued, else -1).
    num_waiting: int32 scalar, ids in ``waiting``.
    status: ``[R]`` int32 :class:`ReqStatus` (``WAITING`` or ``REJECTED``).
    prompt_len: ``[R]`` int32 prompt lengths.
    num_arrived: int32 scalar, leading entries of
      ``RequestTable.arrival_order`` already in ``waiting`` (or rejected);
      :func:`run` queues the others as the clock reaches their step.
      Requests queued here get FCFS positions in ``waiting``'s order (deque)
      or by id (otherwise), and no ``on_arrival`` call.
    scheduler: the :class:`prefixjax.serving.schedulers.Scheduler` (or its
      registered name) whose ``init`` builds ``sched_state``.

  Returns:
    An :class:`EngineState`.
  """
  r = prompt_len.shape[0]
  s = cache.paging.max_seqs
  zeros = jnp.zeros((r,), jnp.int32)
  minus = jnp.full((r,), NONE, jnp.int32)
  false = jnp.zeros((r,), jnp.bool_)
  zero = jnp.int32(0)
  scheduler = sch.get_scheduler(scheduler)
  waiting = _i32(waiting)
  if scheduler.deque:
    pos = scatter(zeros, waiting, jnp.arange(r, dtype=jnp.int32), waiting >= 0)
  else:
    pos = jnp.arange(r, dtype=jnp.int32)
  return EngineState(
    cache=cache,
    status=_i32(status),
    num_computed=zeros,
    num_tokens=_i32(prompt_len),
    num_output=zeros,
    slot=minus,
    prefill_chunk=false,
    sampled_last=false,
    first_sched_step=minus,
    hit_first_sched=zeros,
    first_token_step=minus,
    finish_step=minus,
    num_preemptions=zeros,
    resume_hit_tokens=zeros,
    sched_steps=zeros,
    prefill_steps=zeros,
    running=jnp.full((s,), NONE, jnp.int32),
    num_running=zero,
    waiting=waiting,
    waiting_head=zero,
    num_waiting=_i32(num_waiting),
    queue_pos=pos,
    queue_back=jnp.int32(r),
    queue_front=jnp.int32(-1),
    sched_state=scheduler.init(r),
    num_arrived=_i32(num_arrived),
    step=zero,
    num_steps=zero,
    idle_steps=zero,
    error=zero,
    time_ms=zero,
    time_frac=jnp.float32(0),
  )


def view(st: EngineState, reqs: RequestTable) -> sch.WaitingView:
  """What a scheduler reads of the engine (a :class:`WaitingView`)."""
  r = st.status.shape[0]
  zeros = jnp.zeros((r,), jnp.int32)
  # A deque holds ids by slot, a keyed queue by id: either way this marks
  # the queued ids.
  queued = scatter(
    jnp.zeros((r,), jnp.bool_), st.waiting, True, st.waiting >= 0
  )
  return sch.WaitingView(
    queued=queued,
    queue_pos=st.queue_pos,
    num_waiting=st.num_waiting,
    running=st.status == ReqStatus.RUNNING,
    num_tokens=st.num_tokens,
    prompt_len=reqs.prompt_len,
    keys=reqs.keys,
    cache=st.cache,
    client=zeros if reqs.client is None else reqs.client,
    rank=zeros if reqs.rank is None else reqs.rank,
    step=st.step,
  )


def first_rows(buffers, n: int, axis: int = 0):
  """The step buffers ``[T, ...]`` (``axis`` 1: ``[B, T, ...]``, a batch's)
  cut on the device to the first rows that hold ``n`` steps: a power of two
  at least ``n`` (one compile per size), all ``T`` if that is not fewer.
  ``T`` is sized for the slowest order of events (up to every output token
  its own step), often far above the run: at 10,000 requests and 64
  running, ``2**21`` rows against 29,753 steps, 2.8 GB whose copy to the
  host cost more than the run (2026-12-07, this 2-core CPU). A one-row
  field (a scratch row) stays whole."""
  leaves = jax.tree.leaves(buffers)
  if not leaves:
    return buffers
  rows = next_pow2(n)
  T = max(x.shape[axis] for x in leaves)
  return buffers if rows >= T else _head(buffers, rows, axis)


def join_rows(pieces):
  """One run's step buffers from its segments' ``[(buffers, rows)]``
  (host arrays, each a pytree of ``[T', ...]`` fields): every segment's
  first ``rows``, then the last segment whole (its padding); a field of
  one row in every segment (a scratch row) is the last segment's."""
  last = pieces[-1][0]
  if len(pieces) == 1:
    return last

  def cat(*xs):
    if all(x.shape[0] == 1 for x in xs):
      return xs[-1]
    head = [x[:r] for x, (_, r) in zip(xs[:-1], pieces[:-1], strict=True)]
    return np.concatenate([*head, xs[-1]])

  return jax.tree.map(cat, *(b for b, _ in pieces))


LANE_FIELDS = ("sched_rid", "sched_n", "sched_kind", "preempted", "finished")
"""The ``[S]`` fields of a :class:`StepRecord` (the rest are ``[]``)."""

SEGMENT_BYTES = 32 << 20
"""Step-buffer bytes of one segment of a single run (:func:`segment_rows`)."""


def segment_rows(bound: int, lanes: int, configs: int = 1) -> int:
  """Rows of a run's step buffers, filled and resumed a segment at a
  time: the power of two whose buffers (``lanes`` columns per ``[S]``
  field, one when they are not recorded, 4 bytes each; ``configs`` runs
  side by side) take at most :data:`SEGMENT_BYTES` (16,384 rows at 64
  lanes), at least 64, at most ``bound`` (the rows the slowest order of
  events needs: up to every output token its own step). Sized by that
  bound the buffers were ``2**21`` rows, 2.8 GB, at 10,000 requests and 64
  running against 29,753 steps run, and allocating and filling them cost
  about 1 s of a 3.6 s SGLang run (2026-12-07, this 2-core CPU)."""
  fields = len(StepRecord._fields)
  per = 4 * (fields - len(LANE_FIELDS) + len(LANE_FIELDS) * max(lanes, 1))
  per *= max(int(configs), 1)
  rows = 1 << max((SEGMENT_BYTES // per).bit_length() - 1, 6)
  return min(rows, int(bound))


def next_pow2(n: int) -> int:
  """The smallest power of two at least ``n`` (1 for ``n <= 1``): step
  buffers' row counts."""
  return 1 << max(int(n) - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnums=(1, 2))
def _head(buffers, rows: int, axis: int):
  return jax.tree.map(
    lambda a: jax.lax.slice_in_dim(a, 0, min(rows, a.shape[axis]), axis=axis),
    buffers,
  )
