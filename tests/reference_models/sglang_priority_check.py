"""SGLang 0.5.23's own priority rules against ``sglang_scheduler.py``.

Run by hand in a scratch environment, never collected by pytest: it needs
the oracle of ``/work/shared/oracle`` set up in a copy (``./setup.sh``)
and runs under that copy's interpreter::

  /tmp/oracle/venv/bin/python tests/reference_models/sglang_priority_check.py \\
      /tmp/oracle [--cases 3000] [--seed 0]

It imports SGLang's unmodified ``srt/managers/schedule_policy.py`` (the
oracle's stubs for the GPU and model-config imports, plus stubs for
``schedule_batch`` and the config modules it drags in; neither is called)
and compares, on random states drawn fresh per case:

1. ``SchedulePolicy.calc_priority`` with ``--enable-priority-scheduling``
   (policy fcfs, both signs) against ``SglangScheduler._calc_priority``
   with ``policy="priority"``: the order of the waiting queue.
2. ``PrefillAdder.preempt_to_schedule`` against
   ``SglangScheduler._preempt_to_schedule``, one to three waiting requests
   in a row against one running batch (a later call sees the earlier
   calls' preemptions): whether it preempts, which running requests it
   releases in which order with which ``release_req`` count, the running
   batch left, and the prefill budget's ``total_offset`` after.

The real side's surroundings are small stand-ins for SGLang objects (the
running batch records ``release_req`` and applies ``filter_batch``; the
allocator and tree report fixed free and evictable sizes), never for the
model's code; on the model's side only the tree-touching ``_retract_one``
and the two size readers are replaced by the same recorder and sizes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

EXTRA_STUBS = [  # imported by schedule_policy.py, not used by these rules
  "sglang.srt.dllm.config",
  "sglang.srt.configs",
  "sglang.srt.constrained.base_grammar_backend",
  "sglang.srt.managers.schedule_batch",
]


def import_sglang(oracle: pathlib.Path):
  sys.path.insert(0, str(oracle))
  os.environ["SGLANG_ENABLE_WAITING_PREFIX_REFRESH"] = "false"
  import harness_sglang_sched as h

  h.SGLANG_STUB_MODULES = h.SGLANG_STUB_MODULES + EXTRA_STUBS
  h.import_real_code(["sglang"])
  from sglang.srt.managers import schedule_policy as sp
  from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
  from sglang.srt.mem_cache.prefill_budget import PrefillBudget

  return sp, BaseTokenToKVPoolAllocator, PrefillBudget


class RealReq:
  """The fields of SGLang's ``Req`` that these rules read (hashable by
  identity, as ``Req``)."""

  def __init__(self, m):
    self.rid = m.rid
    self.priority = m.priority
    self.time_stats = types.SimpleNamespace(wait_queue_entry_time=m.entry)
    self.full_untruncated_fill_ids = m.fill()
    self.prefix_len = m.prefix_len
    self.sampling_params = types.SimpleNamespace(
      max_new_tokens=m.max_new, ignore_eos=False
    )
    self.output_ids = list(m.outputs[: m.n_out])
    self.kv = types.SimpleNamespace(req_pool_idx=None)

  def finished(self):
    return False


class Batch:
  """``ScheduleBatch``'s ``reqs``, ``release_req`` and ``filter_batch``."""

  def __init__(self, reqs, log):
    self.reqs = list(reqs)
    self.log = log

  def release_req(self, idx, remaining):
    self.log.append((self.reqs[idx].rid, remaining))

  def filter_batch(self, keep_indices):
    self.reqs = [self.reqs[i] for i in keep_indices]


def draw_req(rng, model, rid, entry, running):
  prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
  max_new = rng.choice([rng.randint(1, 64), rng.randint(3000, 6000)])
  outputs = [rng.randrange(1, 1000) for _ in range(min(max_new, 64))]
  r = model._Req(
    rid=rid,
    prompt=prompt,
    outputs=outputs,
    max_new=max_new,
    arrival_step=0,
    priority=rng.choice([0, 1, 5, 10, 11, 20, 30, -10]),
    entry=entry,
  )
  if running:
    r.n_out = rng.randint(0, min(max_new - 1, len(outputs)))
  r.prefix_len = rng.randint(0, len(r.fill()) - 1)
  return r


def check_order(rng, sp, model) -> None:
  low = rng.random() < 0.5
  n = rng.randint(0, 20)
  entries = rng.sample(range(1000), n)
  reqs = [draw_req(rng, model, i, entries[i], False) for i in range(n)]
  m = object.__new__(model.SglangScheduler)
  m.policy, m.sign, m.refresh = "priority", 1 if low else -1, False
  m.calc_priority_calls = 0
  m.waiting = list(reqs)
  m._calc_priority()
  pol = object.__new__(sp.SchedulePolicy)
  pol.policy = sp.CacheAgnosticPolicy.FCFS
  pol.tree_cache = types.SimpleNamespace(
    supports_fast_match_prefix=lambda: False,
    supports_prefix_sharing=lambda: True,
  )
  pol.enable_priority_scheduling = True
  pol.schedule_low_priority_values_first = low
  pol.priority_sign = 1 if low else -1
  pol._waiting_prefix_refresh_calls = 0
  queue = [RealReq(r) for r in reqs]
  pol.calc_priority(queue)
  got, want = [r.rid for r in queue], [r.rid for r in m.waiting]
  assert got == want, (low, got, want)


def check_preempt(rng, sp, base, budget_cls, model) -> tuple[int, int]:
  low = rng.random() < 0.5
  threshold = rng.choice([0, 5, 10, 10, 20])
  ratio = rng.uniform(0.05, 1.0)
  page = rng.choice([1, 4, 16])
  n_run = rng.randint(0, 12)
  entries = rng.sample(range(10_000), n_run + 3)
  running = [draw_req(rng, model, i, entries[i], True) for i in range(n_run)]
  waiting = [
    draw_req(rng, model, 100 + j, entries[n_run + j], False)
    for j in range(rng.randint(1, 3))
  ]
  avail = rng.randint(0, 3000) // page * page
  evictable = rng.randint(0, 3000)

  # The model.
  m = object.__new__(model.SglangScheduler)
  m.running, m.preempted = list(running), []
  m.sign, m.threshold, m.ratio = (1 if low else -1), threshold, ratio
  m._available, m._evictable = (lambda: avail), (lambda: evictable)
  m_log = []
  m._retract_one = lambda v, left: m_log.append((v.rid, left))
  offset = sum(m._offset(r) for r in running) + rng.choice([0, 0, 17, 250])

  # SGLang.
  class Alloc(base):
    def __init__(self):  # the pool's sizes only
      self.page_size = page

    def available_size(self):
      return avail

    def alloc(self, *a, **k):  # the abstract rest: never called here
      raise AssertionError("alloc")

    clear = free = alloc

  tree = types.SimpleNamespace(
    supports_mamba=lambda: False, evictable_size=lambda: evictable
  )
  s_log = []
  adder = object.__new__(sp.PrefillAdder)
  adder.running_batch = Batch([RealReq(r) for r in running], s_log)
  adder.preempt_list = []
  adder.new_token_ratio = ratio
  adder.priority_scheduling_preemption_threshold = threshold
  adder.token_to_kv_pool_allocator = Alloc()
  adder.tree_cache = tree
  adder.memory_budget = budget_cls(adder.token_to_kv_pool_allocator, tree)
  adder.memory_budget.total_offset = offset
  sp.get_schedule = lambda: types.SimpleNamespace(
    schedule_low_priority_values_first=low
  )

  preempted = 0
  for w in waiting:
    m_done, offset = m._preempt_to_schedule(w, offset)
    s_done = adder.preempt_to_schedule(RealReq(w))
    state = (low, threshold, ratio, avail, evictable, w.rid)
    assert m_done == s_done, (state, m_done, s_done)
    assert m_log == s_log, (state, m_log, s_log)
    assert [r.rid for r in m.running] == [
      r.rid for r in adder.running_batch.reqs
    ], state
    assert abs(offset - adder.memory_budget.total_offset) < 1e-6, (
      state,
      offset,
      adder.memory_budget.total_offset,
    )
    preempted += int(s_done)
  return preempted, len(s_log)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("oracle", type=pathlib.Path)
  p.add_argument("--cases", type=int, default=3000)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  sp, base, budget_cls = import_sglang(args.oracle.resolve())
  from tests.reference_models import sglang_scheduler as model

  rng = random.Random(args.seed)
  for _ in range(args.cases):
    check_order(rng, sp, model)
  calls = released = 0
  for _ in range(args.cases):
    c, r = check_preempt(rng, sp, base, budget_cls, model)
    calls, released = calls + c, released + r
  print(
    f"{args.cases} queue orders equal; {args.cases} preemption cases equal "
    f"({calls} calls preempted, {released} requests released)"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
