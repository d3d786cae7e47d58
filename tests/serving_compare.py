"""The step-by-step comparison the serving tests share.

Imported by the test modules (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations


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
