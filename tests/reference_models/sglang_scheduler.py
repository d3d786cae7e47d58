"""Plain-Python model of SGLang 0.5.23's scheduler loop (test oracle).

The normal (non-overlap) event loop of ``srt/managers/scheduler.py``
(``Scheduler.event_loop_normal``) over a paged ``RadixCache`` with LRU
eviction (the tree verbs are :class:`SglangRadixCache`'s, checked against
the real cache, see :mod:`tests.reference_models.sglang_radix`), with the
``fcfs``, ``lpm`` or ``dfs-weight`` (``"dfs"``) schedule policy, or
``"priority"`` (``--schedule-policy fcfs --enable-priority-scheduling``, with
its preemption, see below), or this project's ``fair`` (VTC over SGLang's
loop: see :class:`SglangScheduler`), chunked
prefill, no mixed chunks (SGLang's default ``enable_mixed_chunk=False``),
one data-parallel rank. Requests are not
``ignore_eos`` (the scheduler does not know an output stops at
``max_new_tokens`` before it does, so the ``new_token_ratio`` estimate
applies); each stops at its ``max_new_tokens``
(the trace's output length). Paths are in the 0.5.23 wheel's ``sglang/srt/``.

One loop iteration is one engine step; the step runs either a prefill batch
or a decode batch, never both (``get_next_batch_to_run``: "Run prefill first
if possible"). Step ``s``:

1. Arrivals with ``arrival_step <= s`` join the back of the waiting queue
   (``_add_request_to_queue``: ``waiting_queue.append``).
2. ``get_next_batch_to_run``: a request in the middle of a chunked prefill
   publishes its computed chunk (``stash_chunked_request`` ->
   ``common.py checkpoint_kv_cache``); the last prefill batch, minus the
   chunked request and finished requests, is appended to the running batch
   (``filter_batch``, ``merge_batch``); finished requests leave the running
   batch. Any request leaving clears ``batch_is_full``.
3. ``_get_new_batch_prefill_raw``: nothing when (``batch_is_full`` or no
   request waits) and no chunked request is pending, or when no request
   slot is left (``get_num_allocatable_reqs``: ``max_running_requests -
   running``; the request-row pool is assumed larger, as SGLang sizes it).
   Else ``SchedulePolicy.calc_priority`` orders the queue (``fcfs``: queue
   order, and on its 1st, 33rd, 65th, ... call ``_touch_waiting_prefixes``
   refreshes the prompt path of the first 128 waiting requests, head last;
   ``lpm``: every waiting request is matched against the tree, uncapped,
   and sorted by ``-min(match, len - 1)`` (stable), except that a request
   whose match is at most 32 tokens and which shares at least 32 tokens with
   an earlier low-match request of the queue (the simulated waiting-queue
   tree, token granular) goes last; more than 128 waiting: FCFS order, no
   matching; ``dfs``: every waiting request is matched, however many wait,
   and the queue is put in :func:`dfs_weight_order`). A ``PrefillAdder``
   (``schedule_policy.py``, budgets from ``mem_cache/prefill_budget.py
   PrefillBudget``) then admits:

   * ``rem_total = available + evictable - total_offset`` and ``rem_current
     = available + evictable - current_offset`` (tokens; ``evictable`` is
     the tree's unlocked size); ``total_offset`` starts at the running
     requests' ``min(max_new_tokens - outputs, 4096) * new_token_ratio``
     (``_get_running_request_total_token_offset``);
   * the chunked request first (``add_chunked_req``): ``min(rem_chunk,
     int(rem_total))`` tokens (``rem_chunk`` when that is not positive),
     not page-aligned;
   * then each waiting request in order (``add_one_req``): stop
     (``batch_is_full``) once ``max_running_requests - running`` requests
     are in the batch; match its prefix, capped at ``len - 1`` tokens
     (``Req.init_next_round_input``); with that prefix locked for the check
     (``_lock_node``), it needs ``extend + min(max_new_tokens - outputs,
     4096) + page_size < rem_total`` (``PrefillBudget.check_prefill``), else
     NO_TOKEN; an extend longer than ``rem_chunk`` (page-ceiled) is cut to
     ``rem_chunk`` rounded down to pages (and its end to a page boundary)
     and becomes the chunked request, reserving no decode tokens;
   * each admission reserves ``ceil_page(extend) + page_size +
     max_new_tokens_reserved`` of ``total_offset`` (``ceil_page(extend) +
     page_size`` of ``current_offset``) and takes ``ceil_page(extend)``
     from ``rem_input`` (``max_prefill_tokens``) and ``rem_chunk``
     (``chunked_prefill_size``); then NO_TOKEN unless ``rem_total > 0`` and
     ``rem_current > 0``, OTHER (stop) once ``rem_input`` or ``rem_chunk``
     is spent (``budget_state``); a NO_TOKEN sets ``batch_is_full`` when
     something runs or was admitted.
4. A prefill batch allocates (``allocation.py
   alloc_paged_token_slots_extend``): evict until ``sum(extend) + batch *
   page_size`` tokens are free (``sum(extend)`` when ``page_size == 1``),
   then each request takes ``cdiv(extend_end, K) - cdiv(prefix, K)`` pages.
   After the forward (``batch_result_processor.py
   process_batch_result_prefill``) every request but the chunked one samples
   a token; a finished one is released with a checkpoint, the others publish
   their prefill (``checkpoint_kv_cache``).
5. Otherwise the running batch decodes (``update_running_batch``):
   ``check_decode_mem`` evicts until ``K * #{requests whose KV length is a
   multiple of K}`` tokens are free and checks they are; if not,
   ``retract_decode`` retracts requests (fewest outputs first, then longest
   prompt, then latest in the batch; at least one always, one always kept)
   until the check passes: each is released without a checkpoint (its
   published prefix stays in the tree, unlocked) and then ``(requests still
   kept) * 20`` tokens are freed by eviction (``release_req``,
   ``SGLANG_RETRACT_DECODE_STEPS``), and goes to the back of the waiting
   queue with its outputs (it re-prefills prompt + outputs);
   ``new_token_ratio`` becomes ``min(1, (outputs + 20 * n) / (max_new + 1))``
   over the kept requests; with no retraction it decays by ``(0.7 - 0.098) /
   600`` to at least ``0.098`` (``new_token_ratio_tracker.py``, ``environ.py``
   defaults 0.7, 0.14, 600). ``prepare_for_decode`` evicts until ``batch *
   K`` tokens are free and takes a page for each request whose KV length is
   a multiple of ``K``; each request samples one token; finished ones are
   released with a checkpoint (``release_kv_cache(checkpoint=True)``).
6. ``"priority"`` (``--enable-priority-scheduling``; ``managers/
   scheduler.py _get_new_batch_prefill_raw``, ``schedule_policy.py
   _sort_by_priority_and_fcfs`` and ``PrefillAdder.preempt_to_schedule``):
   each request's ``priority`` (record field, default 0; higher values
   first, or lower with ``--schedule-low-priority-values-first``); every
   queue entry (arrival, retraction, preemption) stamps
   ``wait_queue_entry_time`` (``_add_request_to_queue``), and
   ``calc_priority`` sorts the queue by ``(priority * sign, entry)``, then
   the FCFS refresh runs on the sorted queue. With preemption (on unless
   ``--disable-priority-preemption``), ``batch_is_full`` is cleared at every
   prefill attempt and the no-slot shortcut is skipped, so the queue is
   ordered every step a request waits; once the slot check sets
   ``batch_is_full``, each further candidate first calls
   ``preempt_to_schedule``: running requests, least preferred first (ties:
   latest entry first), are taken while the candidate's priority beats
   theirs by more than ``--priority-scheduling-preemption-threshold``
   (default 10), each lowering ``extend + min(max_new_tokens, 4096) -
   rem_total`` (``extend`` from the candidate's last match, 0 if never
   matched or reset) by its ``min(max_new - outputs, 4096) *
   new_token_ratio``, until it is at most 0; if it never gets there nothing
   is preempted and admission stops. Otherwise the chosen ones, in batch
   order, give back their offset, are released as a retraction is
   (``release_req``: no checkpoint, then ``(running left) * 20`` tokens
   evicted, ``reset_for_retract``) and the candidate is tried as usual. The
   preempted requests re-enter the queue after the pass (also when nothing
   was admitted), in batch order (SGLang keeps them in a ``set``; its order
   there is the objects' addresses'). Decode retraction stays
   ``--retraction-policy length``.
7. An iteration with no batch is idle: the ratio resets to 0.7
   (``Scheduler.on_idle``), and the clock jumps to the next arrival.

Checked against the real code (2026-12-02, scratch environment of
``../shared/oracle``): with ``max_running_requests=1``, no chunking and the
refresh off, the hits per request equal those of
``harness_sglang_sched.py --sglang-driver scheduler`` (SGLang 0.5.23's own
``RadixCache``, paged allocator, ``alloc_paged_token_slots_extend`` /
``_decode``, ``checkpoint`` and ``release_kv_cache`` in its scheduler's
order) on 300 generated requests with heavy eviction at page sizes 1, 4
and 16 (80,650 / 94,664 / 80,208 hit tokens, 0 requests differ). The
concurrent rules (the PrefillAdder's budgets, ``batch_is_full``,
retraction, ``new_token_ratio``, ``lpm``, priority and its preemption) are read
from the source only:
the oracle cannot drive SGLang's ``Scheduler`` itself (it needs a model
runner).

Request lengths (``Scheduler.init_req_max_new_tokens``,
``validate_input_length``, ``TpModelWorker.get_worker_info``; with
``max_model_len`` as ``--context-length``): ``max_req_len = min(
max_model_len - 1, pool tokens - 1)``; a prompt of ``max_req_len - 5``
tokens or more is aborted (rejected); outputs are clipped to ``max_req_len
- prompt - 1`` and to ``pool - ceil_page(prompt) - page - 1``.

Choices of this model (not SGLang rules): a step is one loop iteration; a
prefill allocation that does not fit raises (SGLang raises "Prefill out of
memory" too); a request clipped to no output (SGLang's prefill-only
requests) raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .sglang_radix import (
  SglangRadixCache,
  cdiv,
  page_keys_for_tokens,
)

CLIP_MAX_NEW_TOKENS = 4096  # schedule_policy.py
RETRACT_DECODE_STEPS = 20  # environ.py SGLANG_RETRACT_DECODE_STEPS
INIT_NEW_TOKEN_RATIO = 0.7  # environ.py SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
WAITING_QUEUE_PREFIX_MATCH_MAX = 128  # schedule_policy.py
WAITING_PREFIX_REFRESH_INTERVAL = 32  # schedule_policy.py
IN_BATCH_CHECK = 32  # IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD
IN_BATCH_DEPRIORITIZE = 32  # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
# "dfs": --schedule-policy dfs-weight; "priority": fcfs with
# --enable-priority-scheduling
POLICIES = ("fcfs", "lpm", "dfs", "fair", "priority")
PRIORITY_THRESHOLD = 10  # --priority-scheduling-preemption-threshold
FAIR_W_IN, FAIR_W_OUT = 1, 2  # VTC's weights (prefixjax's fair defaults)


class OutOfMemory(RuntimeError):
  """A prefill allocation found too few free pages (SGLang raises too)."""


@dataclasses.dataclass
class _Req:
  rid: int
  prompt: list[int]
  outputs: list[int]  # the tokens it will sample, in order
  max_new: int
  arrival_step: int
  client: int = 0
  priority: int = 0
  entry: int = 0  # wait_queue_entry_time's order
  n_out: int = 0
  prefix_len: int = 0
  extend_end: int = 0
  last_node: Any = None
  lock: Any = None
  row_pages: int = 0  # pages in its KV row
  protected: int = 0  # of which the tree owns (cache_protected_len / K)
  retractions: int = 0
  hit_first: int | None = None
  first_token_step: int | None = None
  finish_step: int | None = None
  num_matched: int = 0

  def fill(self) -> list[int]:
    return self.prompt + self.outputs[: self.n_out]

  def committed(self) -> int:
    """KV length (``kv_committed_len``) of a request past its prefill."""
    return len(self.prompt) + self.n_out - 1


class SglangScheduler:
  """SGLang 0.5.23's normal scheduler loop over the paged RadixCache.

  ``policy="fair"`` is not an SGLang policy: it is prefixjax's VTC
  (``prefixjax.serving.schedulers.fair``, Sheng et al., OSDI'24) over this
  loop, with the same rules as over vLLM's: the queue keeps FCFS order (and
  the FCFS waiting-prefix refresh); the PrefillAdder's next candidate is
  the waiting request of the client with the lowest counter (ties: queue
  order), chosen again after every admission; an admission charges
  ``w_in`` per token it schedules (so the next choice sees it, and the
  client that empties the queue sets the floor), and at the end of a step
  the continued chunk of the chunked request charges ``w_in`` per token and
  every sampled token ``w_out``; a request arriving for a client with
  nothing queued lifts its counter to the lowest counter of the clients
  with queued requests (the floor if none). Retracted requests re-queue
  without a lift.
  """

  def __init__(
    self,
    *,
    num_pages: int,
    page_size: int,
    max_running_requests: int,
    chunked_prefill_size: int | None,
    max_prefill_tokens: int,
    max_model_len: int,
    policy: str = "fcfs",
    waiting_prefix_refresh: bool = True,
    low_priority_first: bool = False,
    priority_preemption: bool = True,
    priority_threshold: int = PRIORITY_THRESHOLD,
  ):
    if policy not in POLICIES:
      raise ValueError(f"policy {policy!r} not in {POLICIES}")
    self.K = page_size
    self.num_pages = num_pages
    self.tree = SglangRadixCache(num_pages, page_size)
    self.max_running = max_running_requests
    self.chunk = chunked_prefill_size
    self.max_prefill = max_prefill_tokens
    self.max_model_len = max_model_len
    self.policy = policy
    self.refresh = waiting_prefix_refresh
    self.ratio_init = min(INIT_NEW_TOKEN_RATIO, 1.0)
    self.ratio_min = min(self.ratio_init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
    self.ratio_decay = (
      self.ratio_init - self.ratio_min
    ) / NEW_TOKEN_RATIO_DECAY_STEPS
    self.ratio = self.ratio_init
    self.waiting: list[_Req] = []
    self.running: list[_Req] = []
    self.last_prefill: list[_Req] = []
    self.chunked: _Req | None = None
    self.batch_is_full = False
    self.calc_priority_calls = 0
    self.refresh_calls = 0
    self.vtc: dict[int, int] = {}  # fair: client -> counter
    self.vtc_floor = 0
    self.sign = 1 if low_priority_first else -1  # SchedulePolicy.priority_sign
    self.preempt = policy == "priority" and priority_preemption
    self.threshold = priority_threshold
    self.entries = 0
    self.preempted: list[_Req] = []  # this step's preemptions

  # --------------------------------------------------------------- helpers
  def _max_req_len(self) -> int:
    """``TpModelWorker.get_worker_info``: ``min(context_len - 1,
    kv_capacity - 1)``; the request input limit is this minus 5."""
    return min(self.max_model_len - 1, self.num_pages * self.K - 1)

  def _init_max_new_tokens(self, input_len: int, max_new: int) -> int:
    """``Scheduler.init_req_max_new_tokens`` with one KV shard: the
    context clip, then ``max_new_tokens_for_memory``'s page-rounded one."""
    max_new = max(0, min(max_new, self._max_req_len() - input_len - 1))
    paged = -(-input_len // self.K) * self.K
    capacity = self.num_pages * self.K
    max_new = max(0, min(max_new, capacity - paged - self.K - 1))
    if max_new == 0 and 0 < input_len < self._max_req_len() - 5:
      raise NotImplementedError(
        f"a prompt of {input_len} tokens gets max_new_tokens 0: SGLang "
        "serves it prefill-only, which this model does not"
      )
    return max_new

  def _keys(self, tokens: Sequence[int]) -> list:
    return page_keys_for_tokens(tokens, self.K)

  def _available(self) -> int:
    return self.tree.num_free_pages * self.K

  def _evictable(self) -> int:
    return self.tree.evictable_size()

  def _match(self, req: _Req, *, capped: bool) -> tuple[int, Any]:
    fill = req.fill()
    n = len(fill) - 1 if capped else len(fill)
    h, node = self.tree.match_prefix(self._keys(fill[:n]))
    return h * self.K, node

  def _checkpoint(self, req: _Req, up_to: int) -> None:
    """``RadixCache.checkpoint(req, up_to)`` (``_insert_cache``)."""
    keys = self._keys(req.fill()[:up_to])
    n_pages = len(keys)
    tree = self.tree
    prefix, _, new = tree._insert(keys)
    dup = prefix - req.protected
    assert dup >= 0
    tree._private -= dup + new
    tree.num_free_pages += dup
    prompt_pages = len(req.prompt) // self.K
    if 0 < prompt_pages < n_pages:  # split_prompt
      tree._insert(keys[:prompt_pages])
    _, last = tree.match_prefix(keys)
    tree.dec_lock_ref(req.lock)
    tree.inc_lock_ref(last)
    req.lock = last
    req.protected = n_pages

  def _free_row(self, req: _Req) -> None:
    """``free_kv_row`` past ``cache_protected_len``, then unlock."""
    private = req.row_pages - req.protected
    self.tree._private -= private
    self.tree.num_free_pages += private
    self.tree.dec_lock_ref(req.lock)
    req.lock = None
    req.row_pages = req.protected = 0

  def _release(self, req: _Req) -> None:
    """``release_kv_cache(checkpoint=True)`` of a finished request."""
    self._checkpoint(req, req.committed())
    self._free_row(req)

  def _retract_one(self, req: _Req, left: int) -> None:
    """``release_req``: the row freed without a checkpoint, ``left * 20``
    tokens evicted, ``reset_for_retract``."""
    self._free_row(req)
    self.tree._evict_for(left * RETRACT_DECODE_STEPS)
    req.prefix_len = 0
    req.retractions += 1

  def _take(self, req: _Req, pages: int) -> None:
    if pages > self.tree.num_free_pages:
      raise OutOfMemory(
        f"request {req.rid} needs {pages} pages, "
        f"{self.tree.num_free_pages} free"
      )
    self.tree.num_free_pages -= pages
    self.tree._private += pages
    req.row_pages += pages

  # ------------------------------------------------------------ scheduling
  def _calc_priority(self) -> None:
    self.calc_priority_calls += 1
    q = self.waiting
    if self.policy == "priority":  # _sort_by_priority_and_fcfs
      q.sort(key=lambda r: (r.priority * self.sign, r.entry))
    if self.policy == "lpm" and len(q) <= WAITING_QUEUE_PREFIX_MATCH_MAX:
      deprioritized = set()
      seen: list[list[int]] = []
      for r in q:
        prefix_len, node = self._match(r, capped=False)
        r.prefix_len, r.last_node = prefix_len, node
        r.num_matched = min(prefix_len, len(r.fill()) - 1)
        if prefix_len <= IN_BATCH_CHECK:
          fill = r.fill()
          best = max((_lcp(fill, s) for s in seen), default=0)
          if best >= IN_BATCH_DEPRIORITIZE:
            deprioritized.add(r.rid)
          else:
            seen.append(fill)
      q.sort(
        key=lambda r: float("inf") if r.rid in deprioritized else -r.num_matched
      )
      return
    if self.policy == "dfs":
      # CacheAwarePolicy.DFS_WEIGHT: every waiting request is matched (no
      # 128 cap, _determine_active_policy caps LPM and HRRN only), then
      # _sort_by_dfs_weight; cache-aware, so no waiting-prefix refresh
      for r in q:
        r.prefix_len, r.last_node = self._match(r, capped=False)
      order = dfs_weight_order(self.tree.root, [r.last_node for r in q])
      q[:] = [q[i] for i in order]
      return
    # fcfs (and lpm over 128 waiting): queue order; _touch_waiting_prefixes
    # counts its calls with a non-empty queue and refreshes every 32nd
    if not self.refresh or not q:
      return
    self.refresh_calls += 1
    if (self.refresh_calls - 1) % WAITING_PREFIX_REFRESH_INTERVAL == 0:
      for r in reversed(q[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
        self._match(r, capped=False)  # touch_prefix: no lock, no record

  def _rem_total(self, total_offset: float) -> float:
    return self._available() + self._evictable() - total_offset

  def _offset(self, r: _Req) -> float:
    """``_get_running_request_total_token_offset``."""
    return min(r.max_new - r.n_out, CLIP_MAX_NEW_TOKENS) * self.ratio

  def _preempt_to_schedule(self, req: _Req, total_offset: float):
    """``PrefillAdder.preempt_to_schedule``: ``(done, total_offset)``."""
    order = sorted(
      self.running, key=lambda x: (-x.priority * self.sign, -x.entry)
    )
    need = (
      len(req.fill())
      - req.prefix_len
      + min(req.max_new, CLIP_MAX_NEW_TOKENS)
      - self._rem_total(total_offset)
    )
    chosen = []
    for v in order:
      if (req.priority - v.priority) * -self.sign > self.threshold:
        chosen.append(v)
        need -= self._offset(v)
        if need <= 0:
          break
      else:
        break
    if not chosen or need > 0:
      return False, total_offset
    ids = {id(v) for v in chosen}
    n = len(self.running)
    count = 0
    for v in self.running:  # batch order
      if id(v) not in ids:
        continue
      total_offset -= self._offset(v)
      count += 1
      self._retract_one(v, n - count)
      self.preempted.append(v)
    self.running = [v for v in self.running if id(v) not in ids]
    return True, total_offset

  def _enter(self, req: _Req) -> None:
    """``_add_request_to_queue``: append, stamp the entry time."""
    req.entry = self.entries
    self.entries += 1
    self.waiting.append(req)

  def _prefill(self, step: int) -> list[tuple[_Req, int]] | None:
    start = len(self.preempted)
    batch = self._prefill_pass(step)
    for r in self.preempted[start:]:  # back into the queue after the pass
      self._enter(r)
    return batch

  def _prefill_pass(self, step: int) -> list[tuple[_Req, int]] | None:
    if self.preempt:  # reset to try preemption with a prefill adder
      self.batch_is_full = False
    if (self.batch_is_full or not self.waiting) and self.chunked is None:
      return None
    if (
      self.max_running - len(self.running) <= 0
      and self.chunked is None
      and not self.preempt
    ):
      self.batch_is_full = True
      return None
    self._calc_priority()
    K = self.K
    total_offset = sum(
      min(r.max_new - r.n_out, CLIP_MAX_NEW_TOKENS) * self.ratio
      for r in self.running
    )
    current_offset = 0
    rem_input = self.max_prefill
    rem_chunk = self.chunk
    batch: list[tuple[_Req, int]] = []  # (request, extend tokens)

    def reserve(extend: int, max_new: int) -> None:
      nonlocal total_offset, current_offset, rem_input, rem_chunk
      ext = cdiv(extend, K) * K
      total_offset += ext + K + max_new
      current_offset += ext + K
      rem_input -= ext
      if rem_chunk is not None:
        rem_chunk -= ext

    def budget_state() -> str:
      rt = self._rem_total(total_offset)
      rc = self._available() + self._evictable() - current_offset
      if not (rt > 0 and rc > 0):
        return "no_token"
      if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
        return "other"
      return "continue"

    if self.chunked is not None:  # add_chunked_req
      req = self.chunked
      avail = min(rem_chunk, int(self._rem_total(total_offset)))
      rem = avail if avail > 0 else rem_chunk
      cand = len(req.fill()) - req.prefix_len
      truncated = cand > rem
      new_len = min(cand, rem)
      req.extend_end = req.prefix_len + new_len
      batch.append((req, new_len))
      reserve(
        new_len,
        0 if truncated else min(req.max_new, CLIP_MAX_NEW_TOKENS),
      )
      if not truncated:
        self.chunked = None

    admitted: list[_Req] = []
    for req in self._candidates(admitted):
      if budget_state() == "other":
        break
      if len(batch) >= self.max_running - len(self.running):
        self.batch_is_full = True
      if self.batch_is_full:
        if not self.preempt:
          break
        done, total_offset = self._preempt_to_schedule(req, total_offset)
        if not done:
          break
      prefix_len, node = self._match(req, capped=True)
      req.prefix_len, req.last_node = prefix_len, node
      fill_len = len(req.fill())
      max_new = min(max(req.max_new - req.n_out, 0), CLIP_MAX_NEW_TOKENS)
      extend = fill_len - prefix_len
      total = extend + max_new + K
      self.tree.inc_lock_ref(node)  # _lock_node for the check
      ok = total < self._rem_total(total_offset)
      self.tree.dec_lock_ref(node)
      if not ok:
        self.batch_is_full = bool(batch) or bool(self.running)
        break
      ext_tokens = cdiv(extend, K) * K
      reserved_new = min(req.max_new, CLIP_MAX_NEW_TOKENS)
      if rem_chunk is not None and ext_tokens > rem_chunk:
        ext = rem_chunk // K * K
        end = (prefix_len + ext) // K * K
        ext = end - prefix_len
        if ext <= 0:
          break  # OTHER
        if self.chunked is not None:  # SGLang asserts this cannot happen
          raise AssertionError("a second chunked request")
        extend, reserved_new = ext, 0
        self.chunked = req
      elif rem_chunk is None and batch and ext_tokens >= rem_input:
        break  # OTHER: no chunking, the input cap (first one always goes)
      req.lock = node
      self.tree.inc_lock_ref(node)  # _commit_prefill_admission
      req.row_pages = req.protected = prefix_len // K
      req.extend_end = prefix_len + extend
      if req.hit_first is None:
        req.hit_first = prefix_len
      batch.append((req, extend))
      admitted.append(req)
      if self.policy == "fair":
        self._charge(req, FAIR_W_IN * extend)
        if len(admitted) == len(self.waiting):  # the queue is empty
          self.vtc_floor = self.vtc.get(req.client, 0)
      reserve(extend, reserved_new)
      state = budget_state()
      if state != "continue":
        if state == "no_token":
          self.batch_is_full = bool(batch) or bool(self.running)
        break
    if not batch:
      return None
    ids = {id(r) for r in admitted}
    self.waiting = [r for r in self.waiting if id(r) not in ids]
    # prepare_for_extend: evict for the batch, then take pages
    ext_sum = sum(e for _, e in batch)
    demand = ext_sum + (len(batch) * K if K > 1 else 0)
    self.tree._evict_for(demand)
    for req, _ in batch:
      self._take(req, cdiv(req.extend_end, K) - cdiv(req.prefix_len, K))
    return batch

  def _candidates(self, admitted: list[_Req]):
    """The waiting requests in the order the PrefillAdder tries them."""
    if self.policy != "fair":
      yield from list(self.waiting)
      return
    while True:  # re-chosen after each admission (counters moved)
      taken = {id(r) for r in admitted}
      rest = [
        (self.vtc.get(r.client, 0), i, r)
        for i, r in enumerate(self.waiting)
        if id(r) not in taken
      ]
      if not rest:
        return
      yield min(rest, key=lambda x: x[:2])[2]

  def _charge(self, req: _Req, amount: int) -> None:
    self.vtc[req.client] = self.vtc.get(req.client, 0) + amount

  def _arrive(self, req: _Req) -> None:
    """``waiting_queue.append``; ``fair``: the returning client's lift."""
    if self.policy == "fair":
      queued = {r.client for r in self.waiting}
      if req.client not in queued:
        lift = min((self.vtc.get(u, 0) for u in queued), default=self.vtc_floor)
        self.vtc[req.client] = max(self.vtc.get(req.client, 0), lift)
    self._enter(req)

  def _finish_prefill(self, batch, step: int) -> None:
    for req, _ in batch:
      if req is self.chunked:
        continue
      req.n_out += 1
      if req.first_token_step is None:
        req.first_token_step = step
      if req.n_out >= req.max_new:
        req.finish_step = step
        self._release(req)
      else:
        self._checkpoint(req, req.extend_end)
        req.prefix_len = req.extend_end

  def _retract(self) -> list[_Req]:
    K = self.K
    order = list(range(len(self.running)))
    order.sort(
      key=lambda i: (
        self.running[i].n_out,
        -len(self.running[i].prompt),
      ),
      reverse=True,
    )
    retracted = []

    def fits(idx) -> bool:
      need = K * sum(1 for i in idx if self.running[i].committed() % K == 0)
      self.tree._evict_for(need)
      return self._available() >= need

    first = True
    while first or not fits(order):
      if len(order) == 1:
        break
      first = False
      req = self.running[order.pop()]
      self._retract_one(req, len(order))
      retracted.append(req)
    if len(order) <= 1 and not fits(order):
      raise OutOfMemory("the last decoding request does not fit")
    # The kept batch in retraction-preference order: filter_batch(
    # keep_indices=sorted_indices) (schedule_batch.py, lines 3532, 3873).
    self.running = [self.running[i] for i in order]
    outs = sum(r.n_out for r in self.running)
    maxs = sum(r.max_new for r in self.running)
    self.ratio = min(
      1.0, (outs + RETRACT_DECODE_STEPS * len(self.running)) / (maxs + 1)
    )
    for r in retracted:
      self._enter(r)
    return retracted

  def _decode(self, step: int) -> tuple[list[_Req], list[_Req]]:
    K = self.K
    need = K * sum(1 for r in self.running if r.committed() % K == 0)
    self.tree._evict_for(need)
    retracted = []
    if self._available() < need:
      retracted = self._retract()
      self.batch_is_full = False
    else:
      self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
    self.tree._evict_for(len(self.running) * K)
    for r in self.running:
      if r.committed() % K == 0:
        self._take(r, 1)
    done = []
    for r in self.running:
      r.n_out += 1
      if r.n_out >= r.max_new:
        r.finish_step = step
        self._release(r)
        done.append(r)
    return list(self.running), retracted

  # ------------------------------------------------------------------ loop
  def simulate(
    self, records: Sequence[Mapping[str, Any]], arrival_steps: Sequence[int]
  ) -> tuple[list[dict], list[dict]]:
    """Run every record; return ``(steps, requests)``.

    ``records`` have ``input_tok_ids``, ``output_toks`` and optionally
    ``output_tok_ids`` (else :func:`fabricated` tokens); the step list has one
    entry per executed step: ``step``, ``kind`` (``"prefill"`` or
    ``"decode"``), ``sched`` (``[rid, tokens]`` in batch order),
    ``retracted`` (rids) and ``finished`` (rids).
    """
    reqs = []
    rejected = set()
    for rid, rec in enumerate(records):
      prompt = [int(t) for t in rec["input_tok_ids"]]
      o = int(rec["output_toks"])
      ids = rec.get("output_tok_ids")
      outs = (
        [int(t) for t in ids][:o]
        if ids is not None
        else [fabricated(rid, j) for j in range(o)]
      )
      o = self._init_max_new_tokens(len(prompt), o)
      if not 0 < len(prompt) < self._max_req_len() - 5:
        rejected.add(rid)
      reqs.append(
        _Req(
          rid,
          prompt,
          outs,
          max(o, 1),
          int(arrival_steps[rid]),
          client=int(rec.get("client", 0)),
          priority=int(rec.get("priority", 0)),
        )
      )
    pending = sorted(
      (r for r in reqs if r.rid not in rejected),
      key=lambda r: (r.arrival_step, r.rid),
    )
    steps: list[dict] = []
    step, nxt = 0, 0
    last_prefill: list[_Req] = []
    while True:
      while nxt < len(pending) and pending[nxt].arrival_step <= step:
        self._arrive(pending[nxt])
        nxt += 1
      # get_next_batch_to_run: stash, merge, filter
      if self.chunked is not None:
        self._checkpoint_chunk(self.chunked)
      left = False
      for r in last_prefill:
        if r is self.chunked or r.finish_step is not None:
          left = True
          continue
        self.running.append(r)
      n = len(self.running)
      self.running = [r for r in self.running if r.finish_step is None]
      if left or len(self.running) < n or not self.running:
        self.batch_is_full = False
      self.preempted = []
      chunk_before = self.chunked
      out_before = {id(r): r.n_out for r in reqs}
      batch = self._prefill(step)
      if batch is not None:
        self._finish_prefill(batch, step)
        if self.policy == "fair":  # end of step: chunk continued, samples
          for r, e in batch:
            if r is chunk_before:
              self._charge(r, FAIR_W_IN * e)
          self._charge_samples(reqs, out_before)
        last_prefill = [r for r, _ in batch]
        steps.append(
          dict(
            step=step,
            kind="prefill",
            sched=[[r.rid, e] for r, e in batch],
            retracted=[r.rid for r in self.preempted],
            finished=[r.rid for r, _ in batch if r.finish_step == step],
          )
        )
        step += 1
        continue
      last_prefill = []
      if self.running:
        ran, retracted = self._decode(step)
        if self.policy == "fair":
          self._charge_samples(reqs, out_before)
        steps.append(
          dict(
            step=step,
            kind="decode",
            sched=[[r.rid, 1] for r in ran],
            retracted=[r.rid for r in self.preempted + retracted],
            finished=[r.rid for r in ran if r.finish_step == step],
          )
        )
        step += 1
        continue
      # idle
      self.ratio = self.ratio_init
      if self.waiting:
        raise RuntimeError(f"step {step}: nothing runs but requests wait")
      if nxt >= len(pending):
        break
      step = max(step, pending[nxt].arrival_step)
    out = []
    for r in reqs:
      out.append(
        dict(
          rid=r.rid,
          prompt_len=len(r.prompt),
          rejected=r.rid in rejected,
          hit_tokens=r.hit_first or 0,
          first_token_step=r.first_token_step,
          finish_step=r.finish_step,
          num_output_tokens=r.n_out,
          retractions=r.retractions,
        )
      )
    return steps, out

  def _charge_samples(self, reqs, out_before) -> None:
    for r in reqs:
      if r.n_out > out_before[id(r)]:
        self._charge(r, FAIR_W_OUT * (r.n_out - out_before[id(r)]))

  def _checkpoint_chunk(self, req: _Req) -> None:
    """``stash_chunked_request``: publish the chunk, resume after it."""
    if req.extend_end > req.prefix_len:
      self._checkpoint(req, req.extend_end)
      req.prefix_len = req.extend_end


def dfs_weight_order(root, last_nodes: Sequence[Any]) -> list[int]:
  """Waiting-queue indices in SGLang's DFS-weight order.

  ``mem_cache/base_prefix_cache.py _dfs_weight_order`` (0.5.23): a node's
  weight is the number of waiting requests whose match ends in its
  subtree; a depth-first walk from the root visits each node's children
  by decreasing weight (ties in the children dict's order: a node's
  children by the time their first page joined it) and lists the
  requests ending at a node after its whole subtree, in queue order.
  """
  own: dict[int, list[int]] = {}
  for i, node in enumerate(last_nodes):
    own.setdefault(id(node), []).append(i)
  # parents before children, then weights bottom-up
  nodes, todo = [], [root]
  while todo:
    node = todo.pop()
    nodes.append(node)
    todo.extend(node.children.values())
  weight: dict[int, int] = {}
  for node in reversed(nodes):
    weight[id(node)] = len(own.get(id(node), ())) + sum(
      weight[id(ch)] for ch in node.children.values()
    )
  order: list[int] = []
  todo = [(root, False)]  # (node, its subtree already listed)
  while todo:
    node, done = todo.pop()
    if done:
      order.extend(own.get(id(node), ()))
      continue
    todo.append((node, True))
    kids = sorted(node.children.values(), key=lambda ch: -weight[id(ch)])
    todo.extend((ch, False) for ch in reversed(kids))
  return order


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b, strict=False):
    if x != y:
      break
    n += 1
  return n


def fabricated(rid: int, pos: int) -> int:
  """The oracle harness's output token when the trace has none."""
  return (rid * 7919 + pos) % 32000 + 1
