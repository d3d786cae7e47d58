"""The step-by-step comparison the serving tests share.

Imported by the test modules (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import importlib

import numpy as np

from prefixjax.serving import sglang_sim

simulate_module = importlib.import_module("prefixjax.serving.simulate")


def builder_args(records, config, arrivals, rate, step_time_ms, clock, seed):
  """The positional arguments of ``simulate``'s private builders
  (``_build``, ``_sglang_inputs``), as :func:`prefixjax.serving.simulate`
  passes them; the roofline clock uses the Llama 3 8B and H100 presets."""
  roof = clock == "roofline"
  return (
    simulate_module._check_records(records),
    config,
    arrivals,
    step_time_ms,
    rate,
    seed,
    clock,
    "llama3_8b" if roof else None,
    "h100" if roof else None,
  )


def sglang_engine_inputs(records, config, arrivals="zero", rate=None,
                         step_time_ms=None, clock="steps", seed=0):  # fmt: skip
  """The SGLang engine's inputs as :func:`prefixjax.serving.simulate`
  builds them: ``(consts, cfg, knobs, clock object or None)``."""
  inputs, timer = simulate_module._sglang_inputs(
    *builder_args(records, config, arrivals, rate, step_time_ms, clock, seed)
  )
  prep = sglang_sim._prepare(
    config,
    inputs["tokens"],
    inputs["arr"],
    inputs["client"],
    inputs["priority"],
    inputs["parent"],
    inputs["sample"],
    inputs.get("trie"),
  )
  return prep.consts, prep.cfg, prep.knobs, timer


def assert_same_run(got, steps, reqs) -> None:
  """A :class:`prefixjax.serving.SimResult` equals a reference model's run.

  ``steps`` and ``requests`` are the model's records (the oracle's
  ``steps.jsonl`` / ``requests.jsonl`` keys). The scheduled list of each
  step is compared first, so a failure names the first step that differs.
  """
  assert got.status == "OK"
  mine = got.steps()
  for s_model, s_mine in zip(steps, mine, strict=False):
    assert s_mine["sched"] == s_model["sched"], f"step {s_model['step']}"
    assert s_mine == s_model, f"step {s_model['step']}"
  assert len(mine) == len(steps)
  for r_model, r_mine in zip(reqs, got.requests(), strict=True):
    assert r_mine == r_model, f"request {r_model['rid']}"


def backlogged_clients(rng, per_client: int = 24) -> list[dict]:
  """Client 0's requests first, then as many of client 1's: prompts of
  8-23 random tokens, 2-7 outputs (the fairness tests' trace)."""
  records = []
  for c in (0, 1):
    for _ in range(per_client):
      records.append(
        dict(
          input_tok_ids=rng.integers(1, 500, int(rng.integers(8, 24))).tolist(),
          output_toks=int(rng.integers(2, 8)),
          client=c,
        )
      )
  return records


def worst_service_gap(got, records, weight) -> int:
  """The largest ``|service(0) - service(1)|`` over the steps in which both
  clients are backlogged (each still has a request not started); a step's
  tokens count ``weight(step)`` each."""
  first = np.asarray(got.first_sched_step)
  client = np.asarray([r["client"] for r in records])
  served = np.zeros((2,), np.int64)
  worst = 0
  for step in got.steps():
    for rid, n in step["sched"]:
      served[client[rid]] += weight(step) * n
    later = first > step["step"]
    if later[client == 0].any() and later[client == 1].any():
      worst = max(worst, abs(int(served[0] - served[1])))
  return worst


def random_run(rng, all_at_once: float):
  """Random run arguments for :func:`prefixjax.serving.simulate`: all at
  step 0 with probability ``all_at_once``, else Poisson arrivals (0.5-40
  requests/s, a random seed) on the steps clock (2-50 ms a step) or the
  roofline clock."""
  if rng.random() < all_at_once:
    return dict(arrivals="zero")
  clock = str(rng.choice(["steps", "roofline"]))
  run = dict(
    arrivals="poisson",
    rate=float(rng.uniform(0.5, 40)),
    clock=clock,
    seed=int(rng.integers(0, 100)),
  )
  if clock == "steps":
    run["step_time_ms"] = float(rng.uniform(2, 50))
  return run
