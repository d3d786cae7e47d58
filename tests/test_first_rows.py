"""``engine_state.first_rows``: step buffers cut on the device to the
first power of two of rows at least the steps run (all rows when that is
not fewer), against numpy slicing, on random buffers of several shapes and
dtypes; and a simulated run's trace keeps every step it ran."""

from __future__ import annotations

import numpy as np

from prefixjax import serving
from prefixjax.serving import ServingConfig
from prefixjax.serving.engine_state import first_rows, join_rows
from prefixjax.workloads import default_workload


def test_first_rows_equals_numpy(rng):
  for _ in range(6):
    T = 1 << int(rng.integers(0, 12))
    S = int(rng.integers(1, 9))
    bufs = {
      "lanes": rng.integers(-5, 5, (T, S)).astype(np.int32),
      "scalar": rng.standard_normal(T).astype(np.float32),
    }
    n = int(rng.integers(0, T + 1))
    got = first_rows(bufs, n)
    rows = 1 << max(n - 1, 0).bit_length()
    want = min(rows, T)
    for k, v in bufs.items():
      assert got[k].shape[0] == want >= n
      np.testing.assert_array_equal(np.asarray(got[k]), v[:want])


def test_a_run_keeps_every_step(rng):
  n = int(rng.integers(20, 40))
  trace = default_workload(num_requests=n, seed=int(rng.integers(0, 1000)))
  for semantics in ("vllm", "sglang"):
    config = ServingConfig(
      num_gpu_blocks=400,
      block_size=16,
      max_num_seqs=4,
      max_num_batched_tokens=512,
      max_model_len=4096,
      semantics=semantics,
    )
    r = serving.simulate(trace, config)
    assert r.ok and r.num_steps > 0
    rows = r.trace.sched_rid.shape[0]
    assert r.num_steps <= rows < 2 * max(r.num_steps, 1)
    # every request's first token and finish are inside the kept rows
    assert r.finished.all()


def test_join_rows_equals_numpy(rng):
  """Segments' rows joined: every full segment's first ``rows``, the last
  whole; a field of one row in every segment (a scratch row) is the
  last one's."""
  for _ in range(6):
    k = int(rng.integers(1, 5))
    S = int(rng.integers(1, 5))
    pieces = []
    for _ in range(k):
      T = 1 << int(rng.integers(0, 6))
      r = int(rng.integers(0, T + 1))
      bufs = {
        "lanes": rng.integers(-5, 5, (T, S)).astype(np.int32),
        "scalar": rng.standard_normal(T).astype(np.float32),
        "scratch": rng.integers(0, 9, (1, S)).astype(np.int32),
      }
      pieces.append((bufs, r))
    got = join_rows(pieces)
    for f in ("lanes", "scalar"):
      want = [b[f][:r] for b, r in pieces[:-1]] + [pieces[-1][0][f]]
      if k == 1:
        want = [pieces[0][0][f]]
      if all(b[f].shape[0] == 1 for b, _ in pieces) and k > 1:
        want = [pieces[-1][0][f]]
      np.testing.assert_array_equal(got[f], np.concatenate(want))
    np.testing.assert_array_equal(got["scratch"], pieces[-1][0]["scratch"])
