"""The plain-Python model of vLLM 0.33's v1 scheduler, without vLLM.

``reference_models.vllm_scheduler`` was compared step by step with the real
scheduler by ``reference_models/vllm_scheduler_check.py`` (run by hand in the
oracle's environment). These tests keep it honest where vLLM is absent:
(1) one request at a time it must give the hits of ``vllm_apc``'s sequential
replay; (2) invariants of the scheduler on random traces under memory
pressure; (3) small cases whose outcome follows from vLLM's source (each one
was also run through the real scheduler by ``sched_harness.py`` and gave
these values).
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_models.vllm_apc import VllmPrefixCache, cdiv
from reference_models.vllm_scheduler import VllmScheduler, fabricated_token

import prefixjax as pj


def _chat_trace(rng, n, *, vocab=40, max_prompt=90, max_out=24):
  """Shared system prompts and conversations that extend earlier turns."""
  systems = [
    rng.integers(1, vocab, int(rng.integers(0, 30))).tolist() for _ in range(3)
  ]
  turns: list[list[int]] = []  # prompt + output of earlier requests
  records = []
  for _ in range(n):
    if turns and rng.random() < 0.5:
      prompt = turns[int(rng.integers(len(turns)))]
    else:
      prompt = systems[int(rng.integers(len(systems)))]
    prompt = prompt + rng.integers(1, vocab, int(rng.integers(1, 16))).tolist()
    prompt = prompt[:max_prompt] or [1]
    out = rng.integers(1, vocab, int(rng.integers(1, max_out + 1))).tolist()
    rec = dict(input_tok_ids=prompt, output_toks=len(out))
    if rng.random() < 0.8:
      rec["output_tok_ids"] = out
      if rng.random() < 0.2:  # past the trace's ids: fabricated tokens
        rec["output_toks"] = len(out) + int(rng.integers(1, 5))
    turns.append(prompt + out)
    records.append(rec)
  return records


def _prefixjax_trace(rng, n):
  t = pj.generate_workload(
    "multi_turn",
    num_requests=n,
    seed=int(rng.integers(2**31)),
    system_prompt_len=24,
    question_len=(2, 24),
    output_len=(1, 16),
    vocab_size=64,
  )
  return [
    dict(
      input_tok_ids=[int(x) for x in t.input_token_ids[i]],
      output_toks=int(t.output_lengths[i]),
      output_tok_ids=[int(x) for x in t.output_token_ids[i]],
    )
    for i in range(n)
  ]


def _outputs(rid, rec, max_model_len):
  """The tokens the harness's model returns, cut as check_stop cuts."""
  prompt_len = len(rec["input_tok_ids"])
  n = min(rec["output_toks"], max_model_len - prompt_len)
  ids = rec.get("output_tok_ids") or []
  return [
    int(ids[j]) if j < len(ids) else fabricated_token(rid, j) for j in range(n)
  ]


# --------------------------------------------------------------------- (1)
@pytest.mark.parametrize("source", ["chat", "prefixjax"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_one_at_a_time_matches_sequential_replay(rng, source, block_size):
  max_model_len = 128
  need = cdiv(max_model_len, block_size)
  num_gpu_blocks = need + 1 + int(rng.integers(0, need))  # evictions
  records = (_chat_trace if source == "chat" else _prefixjax_trace)(rng, 120)
  arrival = sorted(rng.integers(0, 400, len(records)).tolist())
  for rec, step in zip(records, arrival, strict=True):
    rec["arrival_step"] = step
  sched = VllmScheduler(
    num_gpu_blocks,
    block_size,
    max_num_seqs=1,
    max_num_batched_tokens=1024,
    max_model_len=max_model_len,
    chunked_prefill=False,
  )
  steps, reqs = sched.simulate(records, "field", check_invariants=True)

  replay = VllmPrefixCache(num_gpu_blocks, block_size)
  expected, served = [], []
  for rid, rec in enumerate(records):
    if len(rec["input_tok_ids"]) >= max_model_len:
      assert reqs[rid]["status"] == "rejected"
      continue
    outputs = _outputs(rid, rec, max_model_len)
    expected.append(replay.run_request(rec["input_tok_ids"], outputs))
    served.append(reqs[rid])
  assert [r["hit_first_sched"] for r in served] == expected
  assert all(r["num_preemptions"] == 0 for r in served)
  # One at a time, in arrival order, each prefilled in one step.
  for prev, cur in zip(served, served[1:], strict=False):
    assert cur["first_sched_step"] > prev["finish_step"]
  assert all(len(s["sched"]) == 1 for s in steps)


# --------------------------------------------------------------------- (2)
@pytest.mark.parametrize(
  "policy, chunked, threshold",
  [
    ("fcfs", True, 0),
    ("fcfs", True, 7),
    ("fcfs", False, 0),
    ("priority", True, 0),
    ("priority", False, 0),
  ],
)
def test_invariants_under_memory_pressure(rng, policy, chunked, threshold):
  block_size = int(rng.choice([2, 4, 8]))
  max_model_len = 96
  need = cdiv(max_model_len, block_size)
  # Fewer blocks than two full-length sequences need: two requests that both
  # run to max_model_len cannot finish side by side.
  num_gpu_blocks = need + 1 + int(rng.integers(0, need // 2))
  max_num_seqs = int(rng.integers(2, 9))
  budget = (
    int(rng.integers(max(max_num_seqs, 8), 129))
    if chunked
    else int(rng.integers(max_model_len, 161))
  )
  pair = [
    dict(
      input_tok_ids=rng.integers(100, 200, max_model_len // 3).tolist(),
      output_toks=max_model_len,
      arrival_step=0,
      priority=0,
    )
    for _ in range(2)
  ]
  others = _chat_trace(rng, 80, max_prompt=110)
  for rec in others:
    rec["arrival_step"] = int(rng.integers(0, 300))
    rec["priority"] = int(rng.integers(0, 4))
  records = pair + others
  sched = VllmScheduler(
    num_gpu_blocks,
    block_size,
    max_num_seqs,
    budget,
    max_model_len,
    chunked_prefill=chunked,
    policy=policy,
    long_prefill_token_threshold=threshold,
  )
  steps, reqs = sched.simulate(records, "field", check_invariants=True)

  preempted_at: dict[int, list[int]] = {}
  resumed_at: dict[int, list[int]] = {}
  for s in steps:
    rids = [rid for rid, _ in s["sched"]]
    assert len(set(rids)) == len(rids)
    assert all(n >= 1 for _, n in s["sched"])
    assert s["tokens"] == sum(n for _, n in s["sched"]) <= budget
    assert len(rids) <= max_num_seqs and s["running"] <= max_num_seqs
    assert s["tokens"] == s["prefill_tokens"] + s["decode_tokens"]
    assert not (s["preempted"] and s["new"] + s["resumed"])  # no admission
    for rid in s["preempted"]:
      preempted_at.setdefault(rid, []).append(s["step"])
    for rid in s["resumed"]:
      resumed_at.setdefault(rid, []).append(s["step"])
    if threshold:
      assert all(n <= threshold for _, n in s["sched"]) or len(rids) == 1
    if not chunked:  # a prefill is never cut: it is scheduled whole
      for rid in s["new"]:
        n = dict(s["sched"])[rid]
        assert n == reqs[rid]["prompt_len"] - reqs[rid]["hit_first_sched"]
  for rid, (rec, r) in enumerate(zip(records, reqs, strict=True)):
    prompt_len = len(rec["input_tok_ids"])
    if prompt_len >= max_model_len:
      assert r["status"] == "rejected"
      continue
    assert r["status"] == "finished" and r["finish_reason"] == "length"
    assert r["num_output_tokens"] == len(_outputs(rid, rec, max_model_len))
    assert r["arrival_step"] <= r["first_sched_step"]
    assert r["first_token_step"] <= r["finish_step"]
    assert r["hit_first_sched"] % block_size == 0
    assert r["hit_first_sched"] < prompt_len
    # Every preemption is followed by a readmission, before the next one.
    pre, res = preempted_at.get(rid, []), resumed_at.get(rid, [])
    assert len(pre) == len(res) == r["num_preemptions"]
    assert all(p < q for p, q in zip(pre, res, strict=True))
    assert all(q < p for q, p in zip(res, pre[1:], strict=False))
  assert sum(r.get("num_preemptions", 0) for r in reqs) > 0
  served = [r for r in reqs if r["status"] == "finished"]
  # PrefixCacheStats counts the first admissions only.
  assert sum(s["pc_queries"] for s in steps) == sum(
    r["prompt_len"] for r in served
  )
  assert sum(s["pc_hits"] for s in steps) == sum(
    r["hit_first_sched"] for r in served
  )
  _check_admission_order(policy, steps, reqs, preempted_at, resumed_at)


def _check_admission_order(policy, steps, reqs, preempted_at, resumed_at):
  """Admissions pop the head of `waiting` (request_queue.py).

  PRIORITY: every request admitted in a step has a smaller (priority,
  arrival_time) than every request still waiting after it (the records
  have no arrival_time_ns, so arrival_time is rid * 1e-3). FCFS: preempted
  requests are prepended, so none is left waiting after a step that admitted
  a new request, and new requests are admitted in arrival order.
  """
  served = [r for r in reqs if r["status"] == "finished"]

  def waiting_after(step):
    out = []
    for r in served:
      rid = r["rid"]
      if r["arrival_step"] <= step < r["first_sched_step"]:
        out.append((rid, False))
      pre, res = preempted_at.get(rid, []), resumed_at.get(rid, [])
      if any(p <= step < q for p, q in zip(pre, res, strict=True)):
        out.append((rid, True))
    return out

  key = {r["rid"]: (r["priority"], r["rid"]) for r in served}
  for s in steps:
    admitted = s["new"] + s["resumed"]
    if not admitted:
      continue
    left = waiting_after(s["step"])
    if policy == "priority":
      assert max(key[r] for r in admitted) < min(
        (key[r] for r, _ in left), default=(np.inf, 0)
      )
    elif s["new"]:
      assert not any(was_preempted for _, was_preempted in left)
      last = max((reqs[r]["arrival_step"], r) for r in s["new"])
      assert all((reqs[r]["arrival_step"], r) > last for r, _ in left)


# --------------------------------------------------------------------- (3)
# Small cases whose outcome follows from vLLM 0.33's source. Each was also
# run through the real scheduler (reference_models/vllm_scheduler_check.py
# --config hand, which replays HAND_CASES through sched_harness.py): every
# step and request record was equal.
SMALL = dict(num_gpu_blocks=64, block_size=4, max_num_seqs=2)
TIGHT = dict(num_gpu_blocks=7, block_size=4, max_num_seqs=2)  # 6 usable
TWINS = [dict(input_tok_ids=list(range(100, 117)), output_toks=3)] * 2
PAIR = [
  dict(input_tok_ids=list(range(1, 9)), output_toks=10, priority=1),
  dict(input_tok_ids=list(range(11, 19)), output_toks=10, priority=0),
]
PAIR_LATE = [dict(rec, arrival_step=k) for k, rec in enumerate(PAIR)]


def _case(records, arrivals="zero", **config):
  config.setdefault("max_num_batched_tokens", 100)
  return dict(records=records, arrivals=arrivals, config=config)


HAND_CASES = {
  "twins": _case(TWINS, **SMALL, max_model_len=64),
  "twins_threshold": _case(
    TWINS, **SMALL, max_model_len=64, long_prefill_token_threshold=8
  ),
  "twins_budget": _case(
    TWINS, **SMALL, max_model_len=64, max_num_batched_tokens=10
  ),
  "single_threshold": _case(
    TWINS[:1], **SMALL, max_model_len=64, long_prefill_token_threshold=8
  ),
  "fcfs_preempt": _case(PAIR, **TIGHT, max_model_len=24),
  "priority_self": _case(
    PAIR_LATE, "field", **TIGHT, max_model_len=24, policy="priority"
  ),
  "fcfs_late": _case(PAIR_LATE, "field", **TIGHT, max_model_len=24),
  "priority_scheduled_victim": _case(
    [
      dict(
        input_tok_ids=list(range(1, 9)),
        output_toks=12,
        priority=1,
        arrival_step=0,
      ),
      dict(input_tok_ids=list(range(11, 21)), output_toks=12, arrival_step=1),
      dict(input_tok_ids=list(range(31, 35)), output_toks=12, arrival_step=1),
    ],
    "field",
    num_gpu_blocks=9,
    block_size=4,
    max_num_seqs=3,
    max_model_len=32,
    policy="priority",
  ),
  "front_of_queue": _case(
    [
      dict(input_tok_ids=list(range(1, 9)), output_toks=5),
      dict(input_tok_ids=list(range(11, 23)), output_toks=4),
      dict(input_tok_ids=[31, 32, 33, 34], output_toks=2),
    ],
    **TIGHT,
    max_model_len=24,
  ),
  "whole_sequence_gate": _case(
    [
      dict(input_tok_ids=list(range(1, 13)), output_toks=4),
      dict(input_tok_ids=list(range(21, 37)), output_toks=2),
    ],
    **TIGHT,
    max_model_len=24,
    max_num_batched_tokens=20,
  ),
  "no_chunk": _case(
    [
      dict(input_tok_ids=list(range(1, 13)), output_toks=2),
      dict(input_tok_ids=list(range(21, 33)), output_toks=2),
      dict(input_tok_ids=[40, 41, 42, 43], output_toks=2),
    ],
    num_gpu_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_model_len=20,
    max_num_batched_tokens=20,
    chunked_prefill=False,
  ),
  "cut_reject_idle": _case(
    [
      dict(input_tok_ids=list(range(1, 11)), output_toks=100, arrival_step=0),
      dict(input_tok_ids=list(range(1, 17)), output_toks=5, arrival_step=0),
      dict(input_tok_ids=[5, 6, 7], output_toks=2, arrival_step=100),
    ],
    "field",
    num_gpu_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_model_len=16,
    max_num_batched_tokens=64,
  ),
  "resumed_gate": _case(
    [
      dict(input_tok_ids=[1, 2, 3, 4], output_toks=4, arrival_step=2),
      dict(input_tok_ids=list(range(11, 23)), output_toks=8, arrival_step=0),
      dict(input_tok_ids=[31, 32], output_toks=5, arrival_step=0),
    ],
    "field",
    num_gpu_blocks=7,
    block_size=4,
    max_num_seqs=3,
    max_model_len=24,
    max_num_batched_tokens=5,
  ),
}
HAND_CASES["chunk"] = _case(
  HAND_CASES["no_chunk"]["records"],
  **{**HAND_CASES["no_chunk"]["config"], "chunked_prefill": True},
)


def _run(name):
  case = HAND_CASES[name]
  steps, reqs = VllmScheduler(**case["config"]).simulate(
    case["records"], case["arrivals"], check_invariants=True
  )
  return {s["step"]: s for s in steps}, reqs


def _sched(steps, k):
  return steps[k]["sched"]


def test_twin_hits_in_flight_prefix_in_the_same_step():
  # KVCacheManager.allocate_slots ends with coordinator.cache_blocks(...,
  # min(computed + new, num_tokens)): rid 0's 4 full blocks are in the hash
  # table before the waiting loop looks rid 1 up. Its hit is capped at
  # num_tokens - 1 = 16 (get_computed_blocks), so it computes 1 token.
  steps, reqs = _run("twins")
  assert _sched(steps, 0) == [[0, 17], [1, 1]]
  assert [r["hit_first_sched"] for r in reqs] == [0, 16]
  assert [r["finish_step"] for r in reqs] == [2, 2]


def test_twin_hits_the_chunk_published_so_far():
  # long_prefill_token_threshold caps each prefill chunk at 8 tokens (two
  # requests wait, so the cap applies): rid 0's first chunk publishes 2
  # blocks, which rid 1 hits in the same step.
  steps, reqs = _run("twins_threshold")
  assert _sched(steps, 0) == [[0, 8], [1, 8]]
  assert _sched(steps, 1) == [[0, 8], [1, 1]]
  assert [r["hit_first_sched"] for r in reqs] == [0, 8]
  assert [r["first_token_step"] for r in reqs] == [2, 1]


def test_a_lone_request_ignores_the_long_prefill_threshold():
  # schedule(): with one eligible request "there is nobody to starve", so
  # the threshold is 0 for that step.
  steps, _ = _run("single_threshold")
  assert _sched(steps, 0) == [[0, 17]]


def test_twin_admitted_next_step_after_the_budget_ran_out():
  # Budget 10: rid 0 takes it all in step 0 (a chunk of 10); in step 1 it
  # finishes its prefill first (running requests go first), publishing all
  # 4 blocks, and rid 1 then hits 16 tokens.
  steps, reqs = _run("twins_budget")
  assert _sched(steps, 0) == [[0, 10]]
  assert _sched(steps, 1) == [[0, 7], [1, 1]]
  assert [r["first_sched_step"] for r in reqs] == [0, 1]
  assert [r["hit_first_sched"] for r in reqs] == [0, 16]


def test_fcfs_preempts_the_last_running_request():
  # Step 0: both 8-token prompts (2 blocks each); step 1: a third block each;
  # the pool is full. Step 5: rid 0 needs a 4th block (13 tokens), so FCFS
  # preempts running[-1] = rid 1 (Scheduler.schedule); its 3 hashed blocks
  # go to the free queue's tail, tail first, and rid 0 takes the first. The
  # waiting loop is skipped in a step that preempted. rid 1 waits while the
  # whole-sequence gate (4 blocks - 2 hits + 2 evictable hits > 2 free)
  # fails. Step 9: rid 0 needs a 5th block (17 tokens) and pops rid 1's
  # second prompt block. rid 0 finishes (10 outputs, steps 0-9); rid 1 comes
  # back at step 10 hitting only its first block: 13 - 4 = 9 tokens.
  steps, reqs = _run("fcfs_preempt")
  assert _sched(steps, 5) == [[0, 1]] and steps[5]["preempted"] == [1]
  assert _sched(steps, 10) == [[1, 9]] and steps[10]["resumed"] == [1]
  assert all(not steps[k]["resumed"] for k in range(6, 10))
  assert [r["num_preemptions"] for r in reqs] == [0, 1]
  assert reqs[1]["resume_hit_tokens"] == 4
  assert [r["finish_step"] for r in reqs] == [9, 14]


def test_priority_preempts_the_lowest_priority_even_itself():
  # rid 0 (priority 1) runs from step 0, rid 1 (priority 0, runs first)
  # arrives at step 1. Step 5: rid 0, first in `running`, needs a 4th block;
  # the victim is max(running, key=(priority, arrival_time)) = rid 0
  # itself, and the loop goes on with rid 1 (Scheduler.schedule, PRIORITY
  # branch). rid 1's 5th block (step 10) evicts rid 0's second prompt
  # block, so rid 0 returns at step 11 with a 4-token hit. FCFS preempts
  # running[-1] = rid 1 instead.
  steps, reqs = _run("priority_self")
  assert _sched(steps, 5) == [[1, 1]] and steps[5]["preempted"] == [0]
  assert _sched(steps, 11) == [[0, 9]] and steps[11]["resumed"] == [0]
  assert [r["num_preemptions"] for r in reqs] == [1, 0]
  assert [r["finish_step"] for r in reqs] == [15, 10]
  steps, reqs = _run("fcfs_late")
  assert _sched(steps, 5) == [[0, 1]] and steps[5]["preempted"] == [1]
  assert [r["num_preemptions"] for r in reqs] == [0, 1]
  assert [r["finish_step"] for r in reqs] == [9, 15]


def test_priority_victim_scheduled_earlier_in_the_step():
  # 8 usable blocks; rid 0 (priority 1) runs from step 0, rids 1 and 2
  # (priority 0) join at step 1: running = [0, 1, 2]. Step 4: rid 0 (12
  # tokens) fits its 3 blocks and is scheduled; rid 1 (13 tokens) needs a
  # 4th and none is free. The victim, rid 0, was scheduled this step: its
  # tokens go back to the budget, it leaves the step, and req_index moves
  # back so rid 2 is still scheduled. Step 10: rid 2 (priority 0, later
  # arrival than rid 1) is the victim. Step 13: the heap readmits rid 2
  # before rid 0.
  steps, reqs = _run("priority_scheduled_victim")
  assert _sched(steps, 4) == [[1, 1], [2, 1]] and steps[4]["preempted"] == [0]
  assert _sched(steps, 10) == [[1, 1]] and steps[10]["preempted"] == [2]
  assert _sched(steps, 13) == [[2, 5], [0, 12]]
  assert [r["finish_step"] for r in reqs] == [20, 12, 15]


def test_preempted_request_returns_first_and_hits_its_blocks():
  # max_num_seqs 2 keeps rid 2 waiting. Step 1: rid 0 (9 tokens) takes the
  # last free block; rid 1 (13 tokens) needs a 4th and FCFS preempts it
  # (itself, the last running): waiting = [1, 2] (prepend_request). While
  # rid 0 runs, rid 1 fails the whole-sequence gate (4 - 3 hits + 3
  # evictable > 3 free) and, at the head, holds rid 2 back. rid 0 finishes at
  # step 4; at step 5 rid 1 hits all 3 of its blocks (12 = num_tokens - 1)
  # and computes 1 token, then rid 2 is admitted.
  steps, reqs = _run("front_of_queue")
  assert steps[1]["preempted"] == [1]
  assert all(not steps[k]["new"] for k in range(1, 5))
  assert _sched(steps, 5) == [[1, 1], [2, 4]]
  assert reqs[1]["resume_hit_tokens"] == 12
  assert reqs[2]["first_sched_step"] == 5


def test_waiting_request_needs_room_for_its_whole_sequence():
  # scheduler_reserve_full_isl (default on) makes schedule() call
  # allocate_slots(full_sequence_must_fit=True): rid 1's first chunk (8 of
  # the 20-token budget) would fit in the 3 free blocks, but its 16 tokens
  # need 4, so it waits until rid 0 (4 outputs) has finished.
  steps, reqs = _run("whole_sequence_gate")
  assert _sched(steps, 0) == [[0, 12]]
  assert _sched(steps, 4) == [[1, 16]]
  assert [r["first_sched_step"] for r in reqs] == [0, 4]


def test_resumed_request_needs_room_for_its_sampled_tokens_too():
  # rid 0 (4-token prompt) is preempted at step 4 after sampling 1 token.
  # At step 7 one block is free and a 4-token chunk would fit, but the gate
  # counts request.num_tokens = 5 (outputs included): 2 blocks, and its
  # prompt block was evicted meanwhile, so it waits until rid 1 finishes.
  steps, reqs = _run("resumed_gate")
  assert steps[4]["preempted"] == [0]
  assert all(not steps[k]["resumed"] for k in range(5, 10))
  assert _sched(steps, 10) == [[0, 5]] and steps[10]["resumed"] == [0]
  assert reqs[0]["num_preemptions"] == 1 and reqs[0]["finish_step"] == 12


@pytest.mark.parametrize("chunked", [False, True])
def test_no_chunked_prefill_stops_at_the_first_prompt_that_does_not_fit(
  chunked,
):
  # Budget 20: rid 0 takes 12. Without chunked prefill rid 1 (12 > 8 left)
  # stops the waiting loop, so rid 2 (4 tokens) waits too; with it, rid 1
  # gets an 8-token chunk.
  steps, _ = _run("chunk" if chunked else "no_chunk")
  if chunked:
    assert _sched(steps, 0) == [[0, 12], [1, 8]]
    assert _sched(steps, 1) == [[0, 1], [1, 4], [2, 4]]
  else:
    assert _sched(steps, 0) == [[0, 12]]
    assert _sched(steps, 1) == [[0, 1], [1, 12], [2, 4]]


def test_max_model_len_cuts_rejects_and_idle_steps_jump():
  # check_stop: num_tokens >= max_model_len stops rid 0 after 16 - 10 = 6
  # outputs; InputProcessor rejects rid 1 (len 16 >= max_model_len); rid 2
  # arrives at step 100 after the engine idled (no steps recorded).
  steps, reqs = _run("cut_reject_idle")
  assert sorted(steps) == [0, 1, 2, 3, 4, 5, 100, 101]
  assert reqs[0]["num_output_tokens"] == 6 and reqs[0]["finish_step"] == 5
  assert reqs[1]["status"] == "rejected"
  assert reqs[2]["first_sched_step"] == 100


@pytest.mark.parametrize(
  "kw",
  [
    dict(max_model_len=64, num_gpu_blocks=16),  # 16 blocks needed, 15 usable
    dict(chunked_prefill=False, max_num_batched_tokens=32),  # < max_model_len
    dict(max_num_batched_tokens=1),  # < max_num_seqs
    dict(long_prefill_token_threshold=65),  # > max_model_len
    dict(policy="lifo"),
  ],
)
def test_configs_vllm_refuses(kw):
  cfg = dict(**SMALL, max_num_batched_tokens=100, max_model_len=64)
  with pytest.raises(ValueError):
    VllmScheduler(**{**cfg, **kw})
