"""Bucketed replay shapes: the padding changes no result, and traces of
different lengths in one bucket share one compiled program.

Every replay engine's ``prepare(..., bucketed=True)`` (what
:func:`prefixjax.replay.replay` passes) pads its trace-sized arrays to
powers of two. Oracles: the same engine on the trace's own shapes
(``bucketed=False``) and the plain-Python models in
``tests/reference_models``, on random hash-id traces drawn fresh per case.
The compile tests watch JAX's compile log in this process and the
persistent cache's entries across two processes; both fail when a trace
of another length in the same bucket compiles anew (as it did before the
padding: ``prefixjax replay --limit 300`` then ``--limit 310`` compiled
3.8 s each).
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import logging
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models import kvcache_sim, vllm_apc
from reference_models.sglang_radix import SglangRadixCache

from prefixjax import replay as rp
from prefixjax.replay import frame, vllm_engine
from prefixjax.replay import sglang as sglang_replay
from prefixjax.replay.kvcache_sim.stack import lru_stack_minimum
from prefixjax.workloads import Trace

_COMPILING = re.compile(r"Compiling jit\((\w+)\)")

KVCACHE_SIM_ENGINES = [
  *(("kvcache_sim.event", p) for p in rp.REPLAY_POLICIES),
  *(("kvcache_sim.chunked", p) for p in rp.REPLAY_POLICIES),
  ("kvcache_sim.stack", "lru_leaf"),
  ("kvcache_sim.keys", "belady_leaf"),
]


def _num_requests(rng, low: int, high: int) -> int:
  """A request count in ``[low, high)`` that is not a power of two, so the
  bucketed request axis always pads (a drawn 64 padded nothing, and the
  padding tests' premise failed: seed 4290000935)."""
  while True:
    n = int(rng.integers(low, high))
    if n & (n - 1):
      return n


def _trace(rng, num_requests: int, block_size: int) -> Trace:
  """A hash-id trace with heavy sharing: each request extends a prefix of
  an earlier one (or starts afresh) with a short random tail; chained ids
  (equal ids mean equal prefixes); partial last prompt blocks; outputs of
  0 to 3 blocks."""
  chain: dict[tuple, int] = {}
  paths: list[list[int]] = []
  rows, prompt_lens, output_lens = [], [], []
  for _ in range(num_requests):
    labels = []
    if paths and rng.random() < 0.85:
      old = paths[int(rng.integers(len(paths)))]
      labels = old[: int(rng.integers(0, len(old) + 1))]
    labels = labels + rng.integers(0, 3, size=rng.integers(0, 5)).tolist()
    labels = labels or [int(rng.integers(0, 3))]
    paths.append(labels)
    row, parent = [], -1
    for label in labels:
      parent = chain.setdefault((parent, label), len(chain) + 7)
      row.append(parent)
    rows.append(np.asarray(row, np.int64))
    n = len(row)
    prompt_lens.append(
      int(rng.integers((n - 1) * block_size + 1, n * block_size + 1))
    )
    output_lens.append(int(rng.integers(0, 3 * block_size + 1)))
  return Trace(
    np.arange(num_requests, dtype=np.float64),
    prompt_lens,
    output_lens,
    hash_ids=rows,
    hash_block_size=block_size,
    name="buckets",
  )


def _held(trace: Trace, block_size: int) -> int:
  """Blocks the largest request holds (the serving semantics' minimum)."""
  held = trace.input_lengths + np.maximum(trace.output_lengths, 1) - 1
  return -(-int(held.max()) // block_size)


def _compiled(caplog, fn) -> list[str]:
  """Names of the programs JAX compiles while ``fn`` runs."""
  caplog.clear()
  with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
    fn()
  return _COMPILING.findall(caplog.text)


# ---------------------------------------------------------------------------
# The padding changes no result.


def test_scan_prefix_never_reads_the_padding(rng):
  """Equal to ``lax.scan`` over the real rows, whatever the padding holds
  (NaN here: one read of it would show in the carry)."""
  real, rows = int(rng.integers(1, 20)), 32
  xs = np.full((rows, 3), np.nan, np.float32)
  xs[:real] = rng.normal(size=(real, 3))

  def step(carry, x):
    return carry + x, jnp.sum(x)

  like = jax.ShapeDtypeStruct((), jnp.float32)
  carry, ys = jax.jit(frame.scan_prefix, static_argnums=(0, 4))(
    step, jnp.zeros(3), xs, jnp.int32(real), like
  )
  want_carry, want_ys = jax.lax.scan(step, jnp.zeros(3), xs[:real])
  np.testing.assert_array_equal(carry, want_carry)
  np.testing.assert_array_equal(ys[:real], want_ys)
  assert not np.asarray(ys[real:]).any()


def test_padded_sizes():
  assert [frame.padded(n) for n in (0, 1, 2, 3, 5, 8, 9, 300, 310)] == [
    1,
    1,
    2,
    4,
    8,
    8,
    16,
    512,
    512,
  ]
  assert frame.padded(300, bucketed=False) == 300
  # A bucket past int32 falls back to the size itself.
  assert frame.padded(2**31 - 5) == 2**31 - 5
  padded = frame.pad_rows(np.arange(6).reshape(3, 2), 5, -1)
  assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]
  with pytest.raises(ValueError, match="rows=2 is below the 3 rows"):
    frame.pad_rows(np.zeros(3), 2, 0)


@pytest.mark.parametrize(
  ("name", "policy"), KVCACHE_SIM_ENGINES, ids=lambda x: str(x)
)
def test_kvcache_sim_padding_changes_no_result(name, policy, rng):
  block_size = int(rng.integers(1, 5))
  trace = _trace(rng, _num_requests(rng, 20, 70), block_size)
  warmup = float(rng.choice([0.0, 0.25, 0.5]))
  plan = rp.plan_trace(trace, warmup_fraction=warmup)
  if name == "kvcache_sim.stack":  # it serves these capacities only
    low = lru_stack_minimum(plan)
    capacities = sorted({low, low + 3, *rng.integers(low, 60, size=3).tolist()})
  else:
    capacities = sorted(set(rng.integers(0, 40, size=6).tolist()))
  engine = rp.get_engine(name)
  exact = engine.prepare(plan, capacities, policy=policy, bucketed=False)
  padded = engine.prepare(plan, capacities, policy=policy, bucketed=True)
  assert padded.shape_key != exact.shape_key  # the case pads something
  got = frame.execute(engine, padded, capacities)
  want = frame.execute(engine, exact, capacities)
  model_policy = rp.KVCACHE_SIM_POLICY_NAMES[policy]
  hash_ids = [row.tolist() for row in trace.hash_ids]
  for capacity, g, w in zip(capacities, got, want, strict=True):
    model = kvcache_sim.simulate(
      hash_ids, trace.input_lengths, block_size, capacity, model_policy, warmup
    )
    where = f"{name} {policy} capacity {capacity}"
    assert g.per_request_hit_tokens.tolist() == (
      w.per_request_hit_tokens.tolist()
    ), where
    assert (
      g.per_request_hit_tokens.tolist() == (model["per_request_hit_tokens"])
    ), where
    assert (g.hit_tokens, g.underfilled) == (w.hit_tokens, w.underfilled), where
    assert g.hit_tokens == model["hit_tokens"], where
    assert g.underfilled == model["underfilled"], where


@pytest.mark.parametrize("free_order", ["prepend_unhashed", "append"])
def test_vllm_padding_changes_no_result(free_order, rng):
  block_size = int(rng.choice([1, 3, 4, 16]))
  trace = _trace(rng, _num_requests(rng, 20, 90), block_size)
  need = _held(trace, block_size)
  capacities = [need, need + int(rng.integers(1, 4)), 3 * need]
  exact = vllm_engine.ENGINE.prepare(
    trace, capacities, block_size=block_size, free_order=free_order
  )
  padded = vllm_engine.ENGINE.prepare(
    trace,
    capacities,
    block_size=block_size,
    free_order=free_order,
    bucketed=True,
  )
  assert padded.shape_key != exact.shape_key
  got = vllm_engine.replay_hits(
    trace, block_size, capacities, free_order=free_order, bucketed=True
  )
  want = vllm_engine.replay_hits(
    trace, block_size, capacities, free_order=free_order, bucketed=False
  )
  for capacity, g, w in zip(capacities, got, want, strict=True):
    cache = vllm_apc.VllmPrefixCache.from_capacity(
      capacity, block_size, free_order=free_order
    )
    model = [
      cache.run_request_hashed(
        trace.hash_ids[r].tolist(),
        int(trace.input_lengths[r]),
        int(trace.output_lengths[r]),
      )
      for r in range(len(trace))
    ]
    assert g.tolist() == w.tolist() == model, capacity


@pytest.mark.parametrize("interval", [32, 3, None])
def test_sglang_padding_changes_no_result(interval, rng):
  block_size = int(rng.choice([1, 2, 4]))
  trace = _trace(rng, _num_requests(rng, 20, 90), block_size)
  need = _held(trace, block_size)
  capacities = [need, need + int(rng.integers(1, 4)), 3 * need]
  options = dict(block_size=block_size, waiting_refresh_interval=interval)
  exact = sglang_replay.ENGINE.prepare(trace, capacities, **options)
  padded = sglang_replay.ENGINE.prepare(
    trace, capacities, bucketed=True, **options
  )
  assert padded.shape_key != exact.shape_key
  got = sglang_replay.hits_and_free(
    trace, block_size, capacities, waiting_refresh_interval=interval
  )
  want = sglang_replay.hits_and_free(
    trace,
    block_size,
    capacities,
    waiting_refresh_interval=interval,
    bucketed=False,
  )
  for i, capacity in enumerate(capacities):
    cache = SglangRadixCache(
      capacity, page_size=block_size, waiting_refresh_interval=interval
    )
    hits, free = [], []
    for r in range(len(trace)):
      hits.append(
        cache.run_request_hashed(
          trace.hash_ids[r].tolist(),
          int(trace.input_lengths[r]),
          int(trace.output_lengths[r]),
        )
      )
      free.append(cache.num_free_pages)
    assert got[0][i].tolist() == want[0][i].tolist() == hits, capacity
    assert got[1][i].tolist() == want[1][i].tolist() == free, capacity


# ---------------------------------------------------------------------------
# One compiled program per bucket.


def _bucket_of(prepared) -> tuple:
  """A preparation's shape key with every size replaced by its bucket."""
  tree, leaves, static = prepared.shape_key

  def size(v):
    is_int = isinstance(v, int) and not isinstance(v, bool)
    return frame.bucket(v) if is_int else v

  leaves = tuple((tuple(map(size, shape)), dtype) for shape, dtype in leaves)
  static = dict(static)
  if "num_queue_keys" in static:  # vLLM: head keys and the rest apart
    static["num_queue_keys"] -= static["num_head_keys"]
  return tree, leaves, tuple((k, size(v)) for k, v in static.items())


def _buckets(trace: Trace, block_size: int, capacities) -> list:
  """The buckets of the trace's own sizes (unpadded preparations), for
  every program :func:`_replay_all` compiles."""
  plan = rp.plan_trace(trace)
  keys = []
  for name, policy in (
    ("kvcache_sim.chunked", "fifo"),
    ("kvcache_sim.stack", "lru_leaf"),
    ("kvcache_sim.keys", "belady_leaf"),
    ("kvcache_sim.event", "fifo"),
  ):
    engine = rp.get_engine(name)
    prepared = engine.prepare(plan, capacities, policy=policy)
    keys.append(_bucket_of(prepared))
  for engine in (vllm_engine.ENGINE, sglang_replay.ENGINE):
    prepared = engine.prepare(trace, capacities, block_size=block_size)
    keys.append(_bucket_of(prepared))
  # SGLang's page table is flat ([R * M]): its columns apart.
  keys.append(
    frame.bucket(sglang_replay.plan_pages(trace, block_size).max_pages)
  )
  return keys


def _replay_all(trace: Trace, capacities) -> list:
  """Every engine :func:`prefixjax.replay.replay` picks (for ``lru_leaf``:
  the stack engine; capacities hold the longest request) and the
  per-event one; returns the results."""
  results = [
    rp.replay(trace, policy=policy, capacities=capacities)
    for policy in rp.REPLAY_POLICIES
  ]
  results.append(
    rp.replay(trace, policy="fifo", capacities=capacities, engine="event")
  )
  for semantics in ("vllm", "sglang"):
    results.append(rp.replay(trace, semantics=semantics, capacities=capacities))
  return results


def _two_lengths(rng, block_size: int):
  """A trace and a shorter prefix of it whose programs fall in the same
  buckets, and capacities serving both (most draws qualify)."""
  for _ in range(20):
    longer = _trace(rng, int(rng.integers(40, 60)), block_size)
    cut = len(longer) - int(rng.integers(1, 4))
    shorter = dataclasses.replace(longer.slice(0, cut), name="shorter")
    low = max(
      lru_stack_minimum(rp.plan_trace(longer)), _held(longer, block_size)
    )
    capacities = [low, low + 5]
    if _buckets(longer, block_size, capacities) == _buckets(
      shorter, block_size, capacities
    ):
      return longer, shorter, capacities
  raise AssertionError("20 draws straddled a bucket boundary")


def test_a_trace_of_another_length_in_the_bucket_compiles_nothing(rng, caplog):
  """After one trace, a shorter one in the same buckets compiles no
  program in this process, on every engine and semantics (before the
  padding, each of its 7 programs compiled again)."""
  block_size = int(rng.choice([2, 4]))
  longer, shorter, capacities = _two_lengths(rng, block_size)
  first = _replay_all(longer, capacities)
  results = []
  names = _compiled(
    caplog, lambda: results.extend(_replay_all(shorter, capacities))
  )
  assert names == []
  assert [r.timing.compile_s for r in results] == [0.0] * len(results)
  # Both traces' own results, not one's reused.
  assert [len(r[0].per_request_hit_tokens) for r in first] == [len(longer)] * 6
  assert [len(r[0].per_request_hit_tokens) for r in results] == [
    len(shorter)
  ] * 6


_PROCESS = """
import sys
from prefixjax.compile_cache import enable_compile_cache
enable_compile_cache(sys.argv[2])
from prefixjax import replay as rp
from prefixjax.workloads import load_mooncake
trace = load_mooncake(sys.argv[1])
capacities = [int(c) for c in sys.argv[3].split(",")]
for policy in rp.REPLAY_POLICIES:
  rp.replay(trace, policy=policy, capacities=capacities)
for semantics in ("vllm", "sglang"):
  rp.replay(trace, semantics=semantics, capacities=capacities)
"""


def _write_mooncake(trace: Trace, path: pathlib.Path) -> None:
  with open(path, "w") as f:
    for r in range(len(trace)):
      row = dict(
        timestamp=r,
        input_length=int(trace.input_lengths[r]),
        output_length=int(trace.output_lengths[r]),
        hash_ids=trace.hash_ids[r].tolist(),
      )
      f.write(json.dumps(row) + "\n")


def test_a_new_process_reuses_the_persistent_cache(rng, tmp_path):
  """A new process replaying a trace of another length in the same
  buckets finds every program in JAX's persistent cache: it writes no
  entry (before the padding it wrote one per program)."""
  longer, shorter, capacities = _two_lengths(rng, 512)
  cache = tmp_path / "cache"
  entries = []
  for trace in (longer, shorter):
    path = tmp_path / f"{trace.name}.jsonl"
    _write_mooncake(trace, path)
    subprocess.run(
      [
        sys.executable,
        "-c",
        _PROCESS,
        str(path),
        str(cache),
        ",".join(map(str, capacities)),
      ],
      check=True,
      capture_output=True,
    )
    entries.append(sorted(p.name for p in cache.iterdir()))
  assert len(entries[0]) >= 5  # fifo, lru_leaf, belady_leaf, vllm, sglang
  assert entries[1] == entries[0]


# ---------------------------------------------------------------------------
# ReplayResult.frame().


def test_frame_docstring_example_runs():
  result = doctest.testmod(frame, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("semantics", rp.SEMANTICS)
def test_frame_is_the_points(semantics, rng):
  block_size = 4
  trace = _trace(rng, int(rng.integers(10, 40)), block_size)
  low = _held(trace, block_size)
  capacities = [low + 4, low, 3 * low]
  policy = "belady_leaf" if semantics == "kvcache-sim" else None
  result = rp.replay(
    trace,
    semantics=semantics,
    policy=policy,
    capacities=capacities,
    warmup_fraction=0.25,
  )
  df = result.frame()
  base = ["semantics", "engine", "trace", "warmup_fraction", "policy_params"]
  vllm = {"vllm": ["publish", "vllm_version"]}.get(semantics, [])
  sglang = ["waiting_refresh_interval"] if semantics == "sglang" else []
  metrics = [
    "policy",
    "capacity_blocks",
    "block_size",
    "hit_tokens",
    "total_tokens",
    "hit_rate",
    "measured_requests",
    "underfilled",
  ]
  assert list(df.columns) == base + vllm + sglang + metrics
  assert len(df) == len(result)
  for row, point, engine in zip(
    df.to_dict("records"), result, result.engines, strict=True
  ):
    assert row["semantics"] == semantics
    assert row["engine"] == engine
    assert row["trace"] == "buckets"
    assert row["warmup_fraction"] == 0.25
    assert row["policy_params"] == "{}"
    for column in metrics:
      assert row[column] == getattr(point, column), column
  assert df["capacity_blocks"].tolist() == capacities
  if semantics == "vllm":
    assert set(df["publish"]) == {"early"}
    assert set(df["vllm_version"]) == {"0.33"}


def test_frame_of_a_plan_and_of_a_bare_result():
  plan = rp.prepare_replay(
    [[1, 2], [1, 2, 3], [1, 4]], [20, 30, 17], block_size=10
  )
  df = rp.replay(plan, policy="fifo", capacities=[3, 8]).frame()
  assert df["trace"].isna().all() and df["warmup_fraction"].isna().all()
  assert df["engine"].tolist() == ["kvcache_sim.chunked"] * 2
  bare = rp.ReplayResult(tuple(rp.replay(plan, policy="fifo", capacities=[3])))
  df = bare.frame()
  assert df["semantics"].isna().all() and df["engine"].isna().all()
  assert df["hit_tokens"].tolist() == [bare[0].hit_tokens]
  assert len(rp.ReplayResult(()).frame()) == 0
