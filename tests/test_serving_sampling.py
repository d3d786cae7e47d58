"""Parallel sampling (``n > 1``) as vLLM 0.33 fans it out.

``LLMEngine.add_request`` turns a request with ``n`` samples into ``n``
child requests with the same prompt, queued one after another; they share
the prompt's blocks through the prefix cache. The simulator's fan-out is
checked against the plain-Python vLLM model fed children written out by
hand here, and for the hits the fan-out exists for.
"""

from __future__ import annotations

import dataclasses

import pytest
from reference_models.vllm_scheduler import VllmScheduler, model_kwargs

from prefixjax import serving
from prefixjax.serving import ServingConfig

CONFIG = ServingConfig(
  num_gpu_blocks=120,
  block_size=8,
  max_num_seqs=6,
  max_num_batched_tokens=96,
  max_model_len=192,
)


def _records(rng):
  out = []
  for _ in range(int(rng.integers(3, 7))):
    rec = dict(
      input_tok_ids=rng.integers(1, 300, int(rng.integers(9, 80))).tolist(),
      output_toks=int(rng.integers(1, 10)),
      n=int(rng.integers(1, 5)),
    )
    if rng.random() < 0.5:
      rec["output_tok_ids"] = rng.integers(1, 300, rec["output_toks"]).tolist()
    out.append(rec)
  return out


def test_fan_out_matches_model_with_children_written_out(rng):
  records = _records(rng)
  children = []
  for rec in records:
    for idx in range(rec["n"]):
      child = dict(
        input_tok_ids=rec["input_tok_ids"], output_toks=rec["output_toks"]
      )
      if idx == 0 and "output_tok_ids" in rec:
        child["output_tok_ids"] = rec["output_tok_ids"]
      children.append(child)
  steps, reqs = VllmScheduler(**model_kwargs(CONFIG)).simulate(children)
  got = serving.simulate(records, CONFIG)
  assert got.steps() == steps
  mine = got.requests()
  parents = [i for i, rec in enumerate(records) for _ in range(rec["n"])]
  assert [r.pop("parent") for r in mine] == parents
  assert [r.pop("sample") for r in mine] == [
    j for rec in records for j in range(rec["n"])
  ]
  assert mine == reqs


def test_children_hit_the_prompt_their_sibling_publishes(rng):
  k = CONFIG.block_size
  p = int(rng.integers(2 * k + 1, 60))
  n = int(rng.integers(2, 5))
  records = [
    dict(input_tok_ids=rng.integers(1, 300, p).tolist(), output_toks=3, n=n)
  ]
  reqs = serving.simulate(records, CONFIG).requests()
  assert [r["sample"] for r in reqs] == list(range(n))
  assert reqs[0]["hit_first_sched"] == 0
  # Published at allocation: siblings scheduled after it hit its full blocks
  # (a hit stops one token short of the prompt).
  assert all(r["hit_first_sched"] == (p - 1) // k * k for r in reqs[1:])


@pytest.mark.parametrize("mode", ["fan_out", "fork"])
def test_every_prompt_token_is_computed_or_saved(rng, mode):
  """Without preemption every prompt token of a served request is either
  prefilled (counted from the step records) or served without compute
  (hits): a forked child's whole prompt is its parent's KV and counts as
  its hit tokens, a fanned-out child's cache hits likewise."""
  records = _records(rng)
  records[0]["n"] = int(rng.integers(2, 5))
  config = dataclasses.replace(
    CONFIG, num_gpu_blocks=600, parallel_sampling=mode
  )
  got = serving.simulate(records, config)
  m = got.metrics()
  assert m["preemptions"] == 0 and m["rejected"] == 0
  computed = sum(s["prefill_tokens"] for s in got.steps())
  assert computed == m["prefill_tokens_computed"]
  assert computed + m["prefill_tokens_saved"] == m["prompt_tokens"]
  assert m["prompt_tokens"] == sum(
    len(r["input_tok_ids"]) * r["n"] for r in records
  )


def test_samples_past_int32_request_ids_are_refused_before_any_is_built():
  records = [dict(input_tok_ids=[1, 2, 3], output_toks=1, n=2**30)] * 2
  with pytest.raises(ValueError, match="record 1: n=1073741824 takes the"):
    serving.simulate(records, CONFIG)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_n_is_refused(n):
  with pytest.raises(ValueError, match="record 0: n="):
    serving.simulate(
      [dict(input_tok_ids=[1, 2, 3], output_toks=1, n=n)], CONFIG
    )
