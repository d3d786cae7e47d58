"""Plain-Python model of vLLM 0.33.0's v1 scheduler, step by step (oracle).

It does, for a token-id trace, what ``/work/shared/oracle/sched_harness.py``
does with the real, unmodified ``vllm.v1.core.sched.scheduler.Scheduler``
(sync ``EngineCore.step()``: add the arrived requests, ``schedule()``, a
made-up model output, ``update_from_output()``), and returns records with the
field names of the harness's ``steps.jsonl`` and ``requests.jsonl``.

Scope: one full-attention KV group, ``hash_block_size == block_size``, prefix
caching on, no speculative decoding, no KV / EC connector, no LoRA, no
multimodal inputs, no structured output, no streaming sessions, no async
scheduling, no pipeline parallelism, ``watermark=0``,
``prefill_schedule_interval=1``, ``max_num_scheduled_tokens`` =
``max_num_batched_tokens``, ``max_num_active_seqs`` = ``max_num_seqs``,
``scheduler_reserve_full_isl=True`` (vLLM's default), ``ignore_eos`` (the only
stop is the length). Under these settings every branch of ``schedule()`` that
the omitted features guard is dead code, and this model leaves it out.

Sources read: the vLLM 0.33.0 wheel from PyPI, ``vllm/v1/core/sched/
scheduler.py``, ``sched/request_queue.py``, ``sched/utils.py``,
``vllm/v1/request.py``, ``vllm/v1/core/kv_cache_manager.py``,
``kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``,
``block_pool.py``, ``vllm/v1/metrics/stats.py`` and ``vllm/config/
scheduler.py``. Every rule below names the function it models.

KV cache
--------
The block pool, the hash index, hits, allocation, publishing and release are
:class:`reference_models.vllm_apc.VllmPrefixCache` (checked against vLLM's
own ``KVCacheManager``), with ``free_order="prepend_unhashed"`` (vLLM >=
0.23). Its API fits a scheduler with two additions made here:

- The admission gate. ``Scheduler.schedule`` admits a waiting request with
  ``allocate_slots(..., full_sequence_must_fit=scheduler_reserve_full_isl)``;
  ``KVCacheManager.allocate_slots`` then first asks
  ``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` for the blocks of
  the *whole* current sequence ``min(request.num_tokens, max_model_len)``:
  ``cdiv(full, block_size) - len(hits)`` new blocks plus the hit blocks with
  ``ref_cnt == 0``; if that exceeds the free queue it returns ``None``. With
  chunked prefill this is stricter than the chunk's own allocation, which
  ``VllmPrefixCache.allocate_slots`` models. :meth:`_fits_whole_sequence`
  computes the gate from ``num_free`` and ``refcount``.
- Preemption keeps the request. ``Scheduler._preempt_request`` frees the
  request's blocks (``KVCacheManager.free``, tail first) and keeps its
  ``block_hashes``; ``VllmPrefixCache.free`` forgets the request, so the
  model registers it again with its prompt plus the tokens sampled so far,
  whose block keys are the same chain.

Scheduler rules (``scheduler.py``)
----------------------------------
- ``Scheduler.__init__``: ``waiting`` is ``create_request_queue(policy)``
  (``request_queue.py``): FCFS is a deque (``add_request`` appends,
  ``prepend_request`` appends left); PRIORITY is a heap ordered by
  ``Request.__lt__`` (``request.py``): ``(priority, arrival_time,
  request_id)``, lower first, and its ``prepend_request`` is a plain push.
- ``Scheduler.schedule``, running loop: for each running request in order,
  while the token budget lasts, ``num_new_tokens = num_tokens -
  num_computed_tokens``, capped by ``long_prefill_token_threshold`` (only
  when more than one request is running or waiting), by the budget and by
  ``max_model_len - num_computed_tokens - 1``; 0 skips the request. Then
  ``allocate_slots``; while it fails, preempt a victim: FCFS
  ``running.pop()`` (the last), PRIORITY ``max(running, key=(priority,
  arrival_time))`` (the first of equals), whose tokens, if it was scheduled
  this step, go back to the budget. When the victim is the request itself
  the request is not scheduled: FCFS stops the loop, PRIORITY goes on with
  the next running request. Any other allocation failure stops the loop.
- ``Scheduler._preempt_request``: free the blocks, status PREEMPTED,
  ``num_computed_tokens = 0``, ``num_preemptions += 1``,
  ``waiting.prepend_request``; the id goes into the next
  ``SchedulerOutput.preempted_req_ids``.
- ``Scheduler.schedule``, waiting loop: only if nothing was preempted this
  step; while the budget lasts and ``len(running) < max_num_seqs``, peek the
  head of ``waiting``; its hit is ``get_computed_blocks`` (capped at
  ``num_tokens - 1``, whole blocks); ``num_new_tokens = num_tokens - hit``,
  capped by the threshold; without chunked prefill a request that does not
  fit in the budget stops the loop, with it the chunk is cut to the budget;
  then the gate and ``allocate_slots`` (publishing the chunk's full blocks at
  once, so later requests of the same step hit them); ``None`` stops the
  loop. An admitted request is popped, appended to ``running``, listed as new
  (status WAITING) or resumed (PREEMPTED), and its ``num_computed_tokens``
  is the hit.
- ``Scheduler._update_after_schedule``: ``num_computed_tokens +=
  num_scheduled``, ``is_prefill_chunk = num_computed_tokens < num_tokens``.
- The harness's model output: every scheduled request with
  ``not is_prefill_chunk`` samples one token, the trace's
  ``output_tok_ids[pos]`` or ``(rid * 7919 + pos) % 32000 + 1``.
- ``Scheduler.update_from_output`` / ``_update_request_with_output`` /
  ``sched/utils.py check_stop``: in ``num_scheduled_tokens`` order, append
  the token (the request's block keys grow); the request stops with
  ``FINISHED_LENGTH_CAPPED`` ("length") when ``num_tokens >= max_model_len``
  or ``num_output_tokens >= max_tokens``; ``_free_request`` frees its blocks
  at once, in that order; stopped requests leave ``running`` keeping the
  order of the rest (``remove_all``).
- Stats: ``PrefillStats`` (``num_cached_tokens``) is set at each lookup of a
  never-preempted request and taken at its first output, so it is the hit at
  first schedule; ``PrefixCacheStats.record`` (``KVCacheManager.
  record_prefix_cache_stats``, at admission) counts ``num_tokens`` and hits
  of never-preempted requests into ``queries`` / ``hits`` per step.
- Start-up and input checks as the harness applies them:
  ``SchedulerConfig.verify_max_model_len`` (no chunked prefill needs
  ``max_num_batched_tokens >= max_model_len``;
  ``max_num_batched_tokens >= max_num_seqs``; threshold <= max_model_len);
  ``check_enough_kv_cache_memory`` (``max_model_len`` must fit in
  ``num_gpu_blocks - 1`` blocks); ``InputProcessor`` rejects prompts with
  ``len >= max_model_len`` (and empty ones).

Engine loop (``sched_harness.py Engine.run``): requests arrive at step 0
(``zero``), ``floor(arrival_time_ns / step_dt)`` (``time``) or
``arrival_step`` (``field``); only steps that schedule tokens count; when no
request is running or waiting the clock jumps to the next arrival
(``idle_steps``). ``Scheduler.has_requests`` is also true for one empty
``schedule()`` call after a request finished (``finished_req_ids``), which
changes nothing.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .vllm_apc import VllmPrefixCache, cdiv

Policy = Literal["fcfs", "priority"]
Arrivals = Literal["zero", "time", "field"]

# Request states (vLLM's RequestStatus; FINISHED stands for FINISHED_*).
WAITING, RUNNING, PREEMPTED = "waiting", "running", "preempted"
FINISHED = "finished"
NUM_FABRICATED_VOCAB = 32000


def fabricated_token(rid: int, pos: int) -> int:
  """The harness's output token when the trace has no output ids."""
  return (rid * 7919 + pos) % NUM_FABRICATED_VOCAB + 1


@dataclass(eq=False)
class _Request:
  rid: int
  request_id: str
  prompt: list[int]
  max_tokens: int
  output_ids: list[int] | None
  arrival_step: int
  arrival_time: float
  priority: int
  record: dict[str, Any]
  output: list[int] = field(default_factory=list)
  status: str = WAITING
  num_computed_tokens: int = 0
  is_prefill_chunk: bool = False
  num_preemptions: int = 0
  sampled_last_step: bool = False  # the harness's `in_decode`

  @property
  def num_tokens(self) -> int:
    return len(self.prompt) + len(self.output)

  @property
  def order_key(self) -> tuple[int, float, str]:
    """``Request.__lt__``: priority, then arrival time, then request id."""
    return (self.priority, self.arrival_time, self.request_id)

  def next_token(self) -> int:
    pos = len(self.output)
    if self.output_ids is not None and pos < len(self.output_ids):
      return int(self.output_ids[pos])
    return fabricated_token(self.rid, pos)


class _WaitingQueue:
  """``request_queue.py``: ``FCFSRequestQueue`` / ``PriorityRequestQueue``."""

  def __init__(self, policy: Policy):
    self.policy = policy
    self._fifo: deque[_Request] = deque()
    self._heap: list[tuple[tuple[int, float, str], _Request]] = []

  def __len__(self) -> int:
    return len(self._fifo) + len(self._heap)

  def add(self, req: _Request) -> None:
    if self.policy == "fcfs":
      self._fifo.append(req)
    else:
      heapq.heappush(self._heap, (req.order_key, req))

  def prepend(self, req: _Request) -> None:
    if self.policy == "fcfs":
      self._fifo.appendleft(req)
    else:  # a heap has no front: prepend_request is add_request
      heapq.heappush(self._heap, (req.order_key, req))

  def __iter__(self):
    if self.policy == "fcfs":
      return iter(list(self._fifo))
    return iter([req for _, req in sorted(self._heap)])

  def peek(self) -> _Request:
    return self._fifo[0] if self.policy == "fcfs" else self._heap[0][1]

  def pop(self) -> _Request:
    if self.policy == "fcfs":
      return self._fifo.popleft()
    return heapq.heappop(self._heap)[1]


@dataclass
class _StepOutput:
  """What ``schedule()`` hands the model runner (the parts used here)."""

  scheduled: dict[_Request, int]  # num_scheduled_tokens, in its order
  new: list[_Request]
  resumed: list[_Request]
  preempted: list[_Request]
  pc_hits: int = 0
  pc_queries: int = 0


def model_kwargs(config) -> dict[str, Any]:
  """A :class:`prefixjax.serving.ServingConfig`'s fields as
  :class:`VllmScheduler` arguments (``scheduler`` is its ``policy``)."""
  kw = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  kw["policy"] = config.scheduler_name
  del kw["scheduler"]
  if kw.pop("parallel_sampling", "fan_out") != "fan_out":
    raise ValueError("the vLLM 0.33 model has no fork parallel sampling")
  if kw.pop("semantics", "vllm") != "vllm":
    raise ValueError("this is the vLLM model; see sglang_scheduler.py")
  kw.pop("max_prefill_tokens", None)  # SGLang knobs
  for name in (
    "waiting_prefix_refresh",
    "low_priority_first",
    "priority_preemption",
    "priority_preemption_threshold",
  ):
    kw.pop(name, None)
  return kw


class VllmScheduler:
  """vLLM 0.33.0 ``Scheduler`` (sync) + ``KVCacheManager``, in Python.

  ``num_gpu_blocks`` counts vLLM's blocks *including* the null block 0 (the
  harness's ``--num-gpu-blocks``). Call :meth:`simulate` with the trace.
  Subclasses (``schedulers.py``) change the waiting queue through
  :meth:`_make_queue` and the hooks :meth:`_begin_waiting` and
  :meth:`_admitted` (no-ops here).
  """

  POLICIES: tuple[str, ...] = ("fcfs", "priority")

  def __init__(
    self,
    num_gpu_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    chunked_prefill: bool = True,
    policy: Policy = "fcfs",
    long_prefill_token_threshold: int = 0,
  ):
    if policy not in self.POLICIES:
      raise ValueError(f"unknown {policy=}; expected one of {self.POLICIES}")
    if min(num_gpu_blocks, block_size, max_num_seqs) < 1:
      raise ValueError(
        f"{num_gpu_blocks=}, {block_size=} and {max_num_seqs=} must be >= 1"
      )
    if max_num_batched_tokens < max_num_seqs:
      raise ValueError(
        f"{max_num_batched_tokens=} must be >= {max_num_seqs=} "
        "(SchedulerConfig.verify_max_model_len)"
      )
    if not chunked_prefill and max_num_batched_tokens < max_model_len:
      raise ValueError(
        f"without chunked prefill {max_num_batched_tokens=} must be >= "
        f"{max_model_len=} (SchedulerConfig.verify_max_model_len)"
      )
    if not 0 <= long_prefill_token_threshold <= max_model_len:
      raise ValueError(
        f"{long_prefill_token_threshold=} must be in [0, {max_model_len=}]"
      )
    if cdiv(max_model_len, block_size) > num_gpu_blocks - 1:
      raise ValueError(
        f"{max_model_len=} needs {cdiv(max_model_len, block_size)} blocks "
        f"but only {num_gpu_blocks - 1} usable blocks exist "
        "(vLLM's check_enough_kv_cache_memory refuses to start)"
      )
    self.num_gpu_blocks = num_gpu_blocks
    self.block_size = block_size
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.max_model_len = max_model_len
    self.chunked_prefill = chunked_prefill
    self.policy = policy
    self.long_prefill_token_threshold = long_prefill_token_threshold
    self._reset()

  def _reset(self) -> None:
    self.cache = VllmPrefixCache(
      self.num_gpu_blocks, self.block_size, free_order="prepend_unhashed"
    )
    self.running: list[_Request] = []
    self.waiting = self._make_queue()
    self._finished_since_schedule = False  # Scheduler.finished_req_ids
    self._preempted_since_schedule: list[_Request] = []

  def _make_queue(self):
    return _WaitingQueue(self.policy)

  def _begin_waiting(self) -> None:
    """Called when the waiting loop starts (not after a preemption)."""

  def _admitted(self, req: _Request, num_tokens: int) -> None:
    """Called when ``req`` left the waiting queue with ``num_tokens``."""

  # ------------------------------------------------------------- requests
  def _add_request(self, req: _Request) -> None:
    """``Scheduler.add_request``: enqueue, the block keys of the prompt."""
    self.cache.add_request(req.request_id, req.prompt)
    self.waiting.add(req)

  def _preempt(self, req: _Request) -> None:
    """``Scheduler._preempt_request`` (caller removed it from running)."""
    self.cache.free(req.request_id)
    # vLLM keeps Request.block_hashes; the cache model forgot the request.
    self.cache.add_request(req.request_id, req.prompt + req.output)
    req.status = PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    self.waiting.prepend(req)
    self._preempted_since_schedule.append(req)

  def _fits_whole_sequence(self, req: _Request, hits: Sequence[int]) -> bool:
    """``allocate_slots(full_sequence_must_fit=True)``'s first check."""
    full = min(req.num_tokens, self.max_model_len)
    evictable = sum(self.cache.refcount(b) == 0 for b in hits)
    needed = max(cdiv(full, self.block_size) - len(hits), 0) + evictable
    return needed <= self.cache.num_free

  # ------------------------------------------------------------- schedule
  def schedule(self) -> _StepOutput:
    """``Scheduler.schedule`` + ``_update_after_schedule``."""
    budget = self.max_num_batched_tokens
    scheduled: dict[_Request, int] = {}
    out = _StepOutput(scheduled, [], [], [])
    threshold = self.long_prefill_token_threshold
    if len(self.running) + len(self.waiting) <= 1:
      threshold = 0  # nobody to starve

    # First the RUNNING requests, in order.
    i = 0
    while i < len(self.running) and budget > 0:
      req = self.running[i]
      n = req.num_tokens - req.num_computed_tokens
      if 0 < threshold < n:
        n = threshold
      # The max_model_len cap ("necessary when using spec decoding") never
      # binds here: check_stop ends a request at max_model_len tokens.
      n = min(n, budget, self.max_model_len - req.num_computed_tokens - 1)
      if n <= 0:
        i += 1
        continue
      allocated = False
      while True:
        if self.cache.allocate_slots(req.request_id, n) is not None:
          allocated = True
          break
        if self.policy == "priority":
          victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
          k = self.running.index(victim)
          del self.running[k]
          if k < i:
            i -= 1
          if victim in scheduled:
            budget += scheduled.pop(victim)
        else:
          victim = self.running.pop()
        self._preempt(victim)
        out.preempted.append(victim)
        if victim is req:
          break
      if not allocated:
        if self.policy == "priority" and req.status == PREEMPTED:
          continue  # later (higher-priority) requests may still fit
        break
      scheduled[req] = n
      budget -= n
      i += 1

    # Then the WAITING requests, unless this step preempted.
    if not out.preempted:
      self._begin_waiting()
      while budget > 0 and self.waiting:
        if len(self.running) >= self.max_num_seqs:
          break
        req = self.waiting.peek()
        assert req.num_computed_tokens == 0
        hits, hit = self.cache.get_computed_blocks(req.request_id)
        n = req.num_tokens - hit
        if 0 < threshold < n:
          n = threshold
        if not self.chunked_prefill and n > budget:
          break
        n = min(n, budget)
        if not self._fits_whole_sequence(req, hits):
          break
        if self.cache.allocate_slots(req.request_id, n, hits) is None:
          break
        if req.num_preemptions == 0:  # PrefixCacheStats.record
          out.pc_queries += req.num_tokens
          out.pc_hits += hit
        assert self.waiting.pop() is req
        self._admitted(req, n)
        self.running.append(req)
        (out.new if req.status == WAITING else out.resumed).append(req)
        scheduled[req] = n
        budget -= n
        req.status = RUNNING
        req.num_computed_tokens = hit

    assert out.preempted == self._preempted_since_schedule
    self._preempted_since_schedule = []
    self._finished_since_schedule = False
    for req, n in scheduled.items():
      req.num_computed_tokens += n
      req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens
    return out

  def update_from_output(self, out: _StepOutput) -> list[_Request]:
    """``Scheduler.update_from_output`` with the harness's made-up tokens.

    Returns the requests that finished, in ``num_scheduled_tokens`` order.
    """
    finished: list[_Request] = []
    for req in out.scheduled:
      if req.is_prefill_chunk:
        continue  # a partial prefill chunk samples nothing
      token = req.next_token()
      req.output.append(token)
      self.cache.append_tokens(req.request_id, [token])
      # check_stop: no EOS (ignore_eos), no stop tokens; length only.
      if (
        req.num_tokens >= self.max_model_len
        or len(req.output) >= req.max_tokens
      ):
        req.status = FINISHED
        self.cache.free(req.request_id)
        finished.append(req)
    if finished:
      done = set(finished)
      self.running = [r for r in self.running if r not in done]
      self._finished_since_schedule = True
    return finished

  def check_invariants(self) -> None:
    """Raise AssertionError if the scheduler state is inconsistent."""
    self.cache.check_invariants()
    assert len(self.running) <= self.max_num_seqs
    assert len(set(map(id, self.running))) == len(self.running)
    held = set()
    for req in self.running:
      assert req.status == RUNNING, req.rid
      assert 0 < req.num_computed_tokens < req.num_tokens + 1, req.rid
      blocks = self.cache.request_blocks(req.request_id)
      # Full attention, no lookahead: a running request holds exactly the
      # blocks of the tokens it has computed (allocate_slots' cdiv).
      assert len(blocks) == cdiv(req.num_computed_tokens, self.block_size)
      held.update(blocks)
    for req in self.waiting:
      assert req.status in (WAITING, PREEMPTED), req.rid
      assert req.num_computed_tokens == 0, req.rid
      assert not self.cache.request_blocks(req.request_id), req.rid
    assert self.cache.num_free + len(held) == self.num_gpu_blocks - 1

  # -------------------------------------------------------------- engine
  def _has_requests(self) -> bool:
    """``Scheduler.has_requests`` (no connectors)."""
    return bool(self.running or self.waiting or self._finished_since_schedule)

  def simulate(
    self,
    trace_records: Iterable[Mapping[str, Any]],
    arrivals: Arrivals = "zero",
    step_dt_ms: float | None = None,
    *,
    cached_hashes: bool = False,
    check_invariants: bool = False,
  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Runs the trace; returns ``(steps, requests)`` as the harness writes.

    ``trace_records`` are the harness's trace lines: ``input_tok_ids``,
    ``output_toks`` (= ``max_tokens``; default ``len(output_tok_ids)``),
    optional ``output_tok_ids``, ``arrival_time_ns``, ``arrival_step`` and
    ``priority``; ``rid`` is the index. ``steps`` has one dict per executed
    step with the keys of ``steps.jsonl`` (``cached_hashes`` only if asked:
    it costs a pass over the index per step); ``requests`` has one dict per
    request with the keys of ``requests.jsonl``. The scheduler starts empty
    on every call. ``check_invariants`` checks the state after every step.
    """
    if arrivals not in ("zero", "time", "field"):
      raise ValueError(f"unknown {arrivals=}")
    if arrivals == "time" and not step_dt_ms:
      raise ValueError("arrivals='time' needs step_dt_ms")
    step_dt_ns = int(round(step_dt_ms * 1e6)) if step_dt_ms else None
    self._reset()
    rows = [
      self._parse(rid, rec, arrivals, step_dt_ns)
      for rid, rec in enumerate(trace_records)
    ]
    pending = sorted(rows, key=lambda r: (r.arrival_step, r.rid))
    usable = self.num_gpu_blocks - 1
    steps: list[dict[str, Any]] = []
    step = pi = 0
    max_steps = (
      10 * sum(len(r.prompt) + r.max_tokens for r in rows)
      + (pending[-1].arrival_step if pending else 0)
      + 1000
    )
    while True:
      while pi < len(pending) and pending[pi].arrival_step <= step:
        req = pending[pi]
        pi += 1
        if not 0 < len(req.prompt) < self.max_model_len:
          req.record["status"] = "rejected"  # InputProcessor
          req.status = FINISHED
          continue
        req.record.update(
          status="waiting",
          first_sched_step=None,
          hit_first_sched=None,
          num_cached_tokens=None,
          first_token_step=None,
          finish_step=None,
          finish_reason=None,
          num_output_tokens=0,
          num_preemptions=0,
          resume_hit_tokens=0,
          sched_steps=0,
          prefill_steps=0,
        )
        self._add_request(req)
      if not self._has_requests():
        if pi < len(pending):
          step = pending[pi].arrival_step  # idle: jump to the next arrival
          continue
        break
      out = self.schedule()
      free = self.cache.num_free
      finished = self.update_from_output(out)
      if not out.scheduled:
        if (self.running or self.waiting) and pi >= len(pending):
          raise RuntimeError(f"stalled at step {step}: nothing schedulable")
        if self.running or self.waiting:
          step += 1  # time passes until the next arrival
        continue
      steps.append(self._record_step(step, out, finished, free, usable))
      if check_invariants:
        self.check_invariants()
      if cached_hashes:
        steps[-1]["cached_hashes"] = self._num_cached_hashes()
      step += 1
      if len(steps) > max_steps:
        raise RuntimeError(f"no termination after {max_steps} steps")
    return steps, [r.record for r in rows]

  def _num_cached_hashes(self) -> int:
    """``len(BlockPool.cached_block_hash_to_block)``: distinct hashes."""
    # cached_blocks() copies the index and rehashes every chained key (a
    # nested tuple, hashed in O(depth)); the length alone needs no copy.
    index = getattr(self.cache, "_index", None)
    if isinstance(index, dict):
      return len(index)
    return len(self.cache.cached_blocks())

  def _parse(
    self,
    rid: int,
    rec: Mapping[str, Any],
    arrivals: Arrivals,
    step_dt_ns: int | None,
  ) -> _Request:
    """``sched_harness.py load_trace`` and the ``Request`` it builds."""
    prompt = [int(t) for t in rec["input_tok_ids"]]
    out_ids = rec.get("output_tok_ids")
    if out_ids is not None:
      out_ids = [int(t) for t in out_ids]
    max_tokens = int(rec["output_toks"]) if "output_toks" in rec else None
    if max_tokens is None:
      if out_ids is None:
        raise ValueError(f"record {rid}: no output_toks and no output_tok_ids")
      max_tokens = len(out_ids)
    if max_tokens < 1:
      raise ValueError(f"record {rid}: {max_tokens=} must be >= 1")
    arr_ns = rec.get("arrival_time_ns")
    if arrivals == "zero":
      astep = 0
    elif arrivals == "time":
      if arr_ns is None:
        raise ValueError(f"record {rid}: no arrival_time_ns")
      assert step_dt_ns is not None
      astep = int(arr_ns) // step_dt_ns
    else:
      astep = int(rec["arrival_step"])
    priority = int(rec.get("priority", 0))
    return _Request(
      rid=rid,
      request_id=f"r{rid:07d}",
      prompt=prompt,
      max_tokens=max_tokens,
      output_ids=out_ids,
      arrival_step=astep,
      # The harness's Request(arrival_time=...), which priority order uses.
      arrival_time=arr_ns / 1e9 if arr_ns is not None else rid * 1e-3,
      priority=priority,
      record=dict(
        rid=rid,
        prompt_len=len(prompt),
        max_tokens=max_tokens,
        arrival_step=astep,
        priority=priority,
      ),
    )

  def _record_step(
    self,
    step: int,
    out: _StepOutput,
    finished: list[_Request],
    free: int,
    usable: int,
  ) -> dict[str, Any]:
    """One ``steps.jsonl`` line; updates the per-request records."""
    sched, new, resumed = [], [], []
    prefill_tokens = decode_tokens = 0
    admitted = {id(r) for r in out.new + out.resumed}
    for req in out.preempted:
      req.record["num_preemptions"] += 1
      req.sampled_last_step = False
    for req, n in out.scheduled.items():
      rec = req.record
      hit = req.num_computed_tokens - n
      if rec["first_sched_step"] is None:
        rec["first_sched_step"] = step
        rec["hit_first_sched"] = hit
        rec["num_cached_tokens"] = hit  # PrefillStats
        new.append(req.rid)
      elif id(req) in admitted:
        rec["resume_hit_tokens"] += hit
        resumed.append(req.rid)
      rec["sched_steps"] += 1
      if req.sampled_last_step and id(req) not in admitted:
        decode_tokens += n
      else:
        prefill_tokens += n
        rec["prefill_steps"] += 1
      sched.append([req.rid, n])
      req.sampled_last_step = not req.is_prefill_chunk
      if req.sampled_last_step:
        if rec["first_token_step"] is None:
          rec["first_token_step"] = step
        rec["num_output_tokens"] += 1
    for req in finished:
      req.record.update(finish_step=step, finish_reason="length")
      req.record["status"] = "finished"
    return dict(
      step=step,
      sched=sched,
      tokens=sum(out.scheduled.values()),
      prefill_tokens=prefill_tokens,
      decode_tokens=decode_tokens,
      new=sorted(new),
      resumed=sorted(resumed),
      preempted=sorted(r.rid for r in out.preempted),
      finished=sorted(r.rid for r in finished),
      running=len(self.running),
      waiting=len(self.waiting),
      free_blocks=free,
      usage=round(1 - free / usable, 5),
      free_blocks_end=self.cache.num_free,
      pc_hits=out.pc_hits,
      pc_queries=out.pc_queries,
    )
