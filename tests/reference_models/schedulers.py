"""Plain-Python models of the non-vLLM schedulers, inside vLLM's loop.

:class:`OrderedScheduler` is :class:`vllm_scheduler.VllmScheduler` (vLLM
0.33's loop, checked against the real scheduler) whose waiting queue is a
FCFS deque (arrivals at the back, preempted requests at the front) from
which the request tried next is chosen by a rule written here from its
source, independently of ``prefixjax.serving.schedulers``:

* ``lpm``: SGLang 0.5.23 ``python/sglang/srt/managers/schedule_policy.py``
  (``_sort_by_longest_prefix``, ``_compute_prefix_matches``,
  ``_determine_active_policy``): when the waiting loop starts, the queue is
  stably sorted by cached prefix, longest first; more than 128 waiting means
  FCFS; going down the queue, a request with a hit of at most 32 tokens
  that shares at least 32 tokens (here: whole blocks) with an earlier such
  request sorts last.
* ``dfs``: SGLang 0.5.23 ``mem_cache/base_prefix_cache.py``
  ``_dfs_weight_order`` on the tree of cached block prefixes each request
  hits: children by weight (waiting requests at or below), heaviest first,
  equal weights by their first queued request; a node's own requests after
  its children, in queue order. FCFS above 128 waiting.
* ``fair``: VTC (Sheng et al., OSDI'24, Algorithm 2) with integer weights:
  the client with the lowest counter first (ties: queue order); admission
  charges ``w_in * tokens``; after a step, running prefill chunks charge
  ``w_in`` per token and each sampled token ``w_out``; a client arriving
  with no queued request is lifted to the lowest counter among queued
  clients, or to the counter of the client that last emptied the queue.
* ``spf`` (a user-defined order used in tests): shortest prompt first.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .vllm_scheduler import VllmScheduler

BIG = float("inf")


class _Queue:
  """A FCFS deque whose ``peek`` asks the scheduler for the best request."""

  def __init__(self, owner: OrderedScheduler):
    self.owner = owner
    self._fifo: deque = deque()

  def __len__(self) -> int:
    return len(self._fifo)

  def __iter__(self):
    return iter(list(self._fifo))

  def add(self, req) -> None:
    self._fifo.append(req)

  def prepend(self, req) -> None:
    self._fifo.appendleft(req)

  def peek(self):
    reqs = list(self._fifo)
    best = min(range(len(reqs)), key=lambda i: (self.owner.key(reqs[i]), i))
    return reqs[best]

  def pop(self):
    req = self.peek()
    self._fifo.remove(req)
    return req


class OrderedScheduler(VllmScheduler):
  """vLLM's loop with an ``lpm`` / ``dfs`` / ``fair`` / ``spf`` queue."""

  POLICIES = ("lpm", "dfs", "fair", "spf")

  def __init__(
    self,
    *args,
    policy: str,
    max_sorted: int = 128,
    check_threshold: int = 32,
    deprioritize_threshold: int = 32,
    w_in: int = 1,
    w_out: int = 2,
    **kw,
  ):
    self.max_sorted = max_sorted
    self.check_threshold = check_threshold
    self.deprioritize_threshold = deprioritize_threshold
    self.w_in, self.w_out = w_in, w_out
    super().__init__(*args, policy=policy, **kw)

  def _reset(self) -> None:
    super()._reset()
    self._keys: dict[int, Any] = {}
    self.counter: dict[int, int] = {}
    self.floor = 0

  def _make_queue(self):
    return _Queue(self)

  def _parse(self, rid, rec, arrivals, step_dt_ns):
    req = super()._parse(rid, rec, arrivals, step_dt_ns)
    req.client = int(rec.get("client", 0))
    return req

  # ------------------------------------------------------------- ordering
  def key(self, req):
    if self.policy == "fair":
      return self.counter.get(req.client, 0)
    if self.policy == "spf":
      return len(req.prompt)
    return self._keys.get(id(req), 0)

  def _tokens(self, req) -> list[int]:
    return req.prompt + req.output

  def _common_tokens(self, a, b) -> int:
    k = self.block_size
    ta, tb = self._tokens(a), self._tokens(b)
    blocks = 0
    for d in range(min(len(ta), len(tb)) // k):
      if ta[d * k : (d + 1) * k] != tb[d * k : (d + 1) * k]:
        break
      blocks += 1
    return blocks * k

  def _begin_waiting(self) -> None:
    if self.policy not in ("lpm", "dfs"):
      return
    queue = list(self.waiting)
    self._keys = {}
    if len(queue) > self.max_sorted:
      return  # FCFS: every key 0
    hit = {
      id(r): self.cache.get_computed_blocks(r.request_id)[1] for r in queue
    }
    if self.policy == "lpm":
      primary = self._lpm_primary(queue, hit)
    else:
      primary = self._dfs_paths(queue, hit)
    ranked = sorted(range(len(queue)), key=lambda i: (primary[i], i))
    for rank, i in enumerate(ranked):
      self._keys[id(queue[i])] = rank

  def _lpm_primary(self, queue, hit) -> list:
    deprioritized = set()
    inserted = []
    if self.check_threshold >= 0:
      for r in queue:
        if hit[id(r)] > self.check_threshold:
          continue
        common = max((self._common_tokens(r, j) for j in inserted), default=0)
        if common >= self.deprioritize_threshold:
          deprioritized.add(id(r))
        else:
          inserted.append(r)
    return [BIG if id(r) in deprioritized else -hit[id(r)] for r in queue]

  def _dfs_paths(self, queue, hit) -> list:
    k = self.block_size
    depth = [hit[id(r)] // k for r in queue]

    def node(i, d):
      return tuple(self._tokens(queue[i])[: (d + 1) * k])

    weight: dict[tuple, int] = {}
    first: dict[tuple, int] = {}
    for i in range(len(queue)):
      for d in range(depth[i]):
        x = node(i, d)
        weight[x] = weight.get(x, 0) + 1
        first.setdefault(x, i)
    longest = max(depth, default=0) + 1
    paths = []
    for i in range(len(queue)):
      path = [(-weight[node(i, d)], first[node(i, d)]) for d in range(depth[i])]
      path += [(BIG, 0)] * (longest - depth[i])
      paths.append(path)
    return paths

  # ----------------------------------------------------------------- VTC
  def _add_request(self, req) -> None:
    if self.policy == "fair":
      queued = [r for r in self.waiting]
      if not any(r.client == req.client for r in queued):
        active = {r.client for r in queued}
        lift = (
          min(self.counter.get(c, 0) for c in active) if active else self.floor
        )
        c = self.counter.get(req.client, 0)
        self.counter[req.client] = max(c, lift)
    super()._add_request(req)

  def _admitted(self, req, num_tokens: int) -> None:
    if self.policy != "fair":
      return
    c = self.counter.get(req.client, 0) + self.w_in * num_tokens
    self.counter[req.client] = c
    if not len(self.waiting):
      self.floor = c

  def update_from_output(self, out):
    if self.policy == "fair":
      admitted = {id(r) for r in out.new + out.resumed}
      for req, n in out.scheduled.items():
        decode = req.sampled_last_step and id(req) not in admitted
        charge = 0
        if id(req) not in admitted and not decode:
          charge += self.w_in * n
        if not req.is_prefill_chunk:
          charge += self.w_out
        self.counter[req.client] = self.counter.get(req.client, 0) + charge
    return super().update_from_output(out)
