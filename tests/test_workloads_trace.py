"""`Trace`: invariants, immutability, views, merging, host-side block ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefixjax.workloads import Trace, merge_traces


def _ids(*rows):
  return [np.asarray(row, np.int32) for row in rows]


def test_fields_are_converted_and_read_only():
  trace = Trace([0, 1], [3, 5], [1, 2], name="t", source="here")
  assert trace.arrival_times_s.dtype == np.float64
  assert trace.input_lengths.dtype == np.int64
  assert trace.output_lengths.dtype == np.int64
  with pytest.raises(ValueError, match="read-only"):
    trace.input_lengths[0] = 7
  with pytest.raises(dataclasses.FrozenInstanceError):
    trace.name = "other"  # type: ignore[misc]


def test_construction_copies_caller_arrays():
  lengths = np.array([3, 4])
  trace = Trace([0.0, 1.0], lengths, [1, 1])
  lengths[0] = 99
  assert trace.input_lengths.tolist() == [3, 4]
  assert lengths.flags.writeable


def test_sizes_and_summary():
  trace = Trace(
    [1.0, 2.0, 4.0],
    [2, 4, 9],
    [1, 0, 5],
    input_token_ids=_ids([1, 2], [1, 2, 3, 4], range(9)),
  )
  assert len(trace) == trace.num_requests == 3
  assert trace.num_input_tokens == 15
  assert trace.num_output_tokens == 6
  assert trace.num_tokens == 21
  assert trace.has_token_ids and not trace.has_hash_ids
  summary = trace.summary()
  assert summary["requests"] == 3
  assert summary["input_mean"] == pytest.approx(5.0)
  assert summary["input_median"] == 4.0
  assert summary["input_max"] == 9
  assert summary["output_max"] == 5
  assert summary["duration_s"] == pytest.approx(3.0)


def test_empty_trace_summary():
  summary = Trace([], [], []).summary()
  assert summary["requests"] == 0
  assert summary["input_mean"] == 0.0 and summary["duration_s"] == 0.0


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (
      dict(input_lengths=[1, 2], output_lengths=[1]),
      ValueError,
      "output_lengths has 1 entries but the trace has 2",
    ),
    (
      dict(input_lengths=[1, -2], output_lengths=[1, 1]),
      ValueError,
      r"input_lengths\[1\] = -2 is negative",
    ),
    (  # uint64 past int64 used to wrap and be called negative
      dict(
        input_lengths=np.array([1, 2**63], np.uint64), output_lengths=[1, 1]
      ),
      ValueError,
      r"input_lengths\[1\] = 9223372036854775808 does not fit in int64",
    ),
    (
      dict(input_lengths=[[1, 2]], output_lengths=[1]),
      ValueError,
      "input_lengths must be 1-D",
    ),
    (
      dict(input_lengths=[1.5, 2.0], output_lengths=[1, 1]),
      TypeError,
      "input_lengths must hold int64",
    ),
    (
      dict(input_lengths=[True, False], output_lengths=[1, 1]),
      TypeError,
      "input_lengths must hold int64",
    ),
    (
      dict(arrival_times_s=[0.0, np.nan]),
      ValueError,
      r"arrival_times_s\[1\] = nan is not finite",
    ),
    (
      dict(hash_ids=[np.array([1]), np.array([1])], hash_block_size=4),
      ValueError,
      r"len\(hash_ids\[1\]\) = 1 but input_lengths\[1\] = 5 needs ceil\(5 "
      r"/ 4\) = 2",
    ),
    (
      dict(hash_ids=[np.array([1]), np.array([1, 2])]),
      TypeError,
      "hash_block_size must be a positive int",
    ),
    (
      dict(hash_block_size=4),
      ValueError,
      "hash_block_size=4 given without hash_ids",
    ),
    (
      dict(input_token_ids=_ids([1, 2, 3], [1, 2, 3, 4])),
      ValueError,
      r"len\(input_token_ids\[1\]\) = 4 but input_lengths\[1\] = 5",
    ),
    (
      dict(input_token_ids=_ids([1, 2, 3], [1, 2, 3, 4, -5])),
      ValueError,
      r"input_token_ids\[1\] holds token id -5",
    ),
    (
      dict(output_token_ids=_ids([1], [])),
      ValueError,
      r"len\(output_token_ids\[1\]\) = 0 but output_lengths\[1\] = 2",
    ),
    (
      dict(session_ids=[1]),
      ValueError,
      "session_ids has 1 entries but the trace has 2",
    ),
  ],
)
def test_invariants_are_checked(kwargs, error, match):
  fields = dict(
    arrival_times_s=[0.0, 1.0], input_lengths=[3, 5], output_lengths=[1, 2]
  )
  fields.update(kwargs)
  with pytest.raises(error, match=match):
    Trace(**fields)


def test_slice_keeps_every_field():
  trace = Trace(
    [0.0, 1.0, 2.0],
    [1, 5, 4],
    [1, 2, 3],
    hash_ids=[np.array([7]), np.array([7, 8]), np.array([9])],
    hash_block_size=4,
    input_token_ids=_ids([1], [1, 2, 3, 4, 5], [6, 7, 8, 9]),
    output_token_ids=_ids([1], [2, 3], [4, 5, 6]),
    session_ids=[0, 0, 1],
    priorities=[5, -3, 2],
    name="n",
    source="s",
  )
  tail = trace.slice(1)
  assert len(tail) == 2
  assert tail.arrival_times_s.tolist() == [1.0, 2.0]
  assert [row.tolist() for row in tail.hash_ids] == [[7, 8], [9]]
  assert tail.hash_block_size == 4
  assert tail.input_token_ids[1].tolist() == [6, 7, 8, 9]
  assert tail.output_token_ids[0].tolist() == [2, 3]
  assert tail.session_ids.tolist() == [0, 1]
  assert tail.priorities.tolist() == [-3, 2]
  assert (tail.name, tail.source) == ("n", "s")
  assert len(trace.slice(1, 1)) == 0
  assert trace.slice(-1).input_lengths.tolist() == [4]


def test_merge_orders_by_arrival_and_renumbers_sessions():
  a = Trace(
    [0.0, 2.0],
    [1, 2],
    [1, 1],
    input_token_ids=_ids([1], [1, 2]),
    session_ids=[0, 0],
  )
  b = Trace([1.0, 2.0], [3, 1], [1, 1], input_token_ids=_ids([5, 6, 7], [9]))
  merged = merge_traces([a, b], name="m")
  assert merged.arrival_times_s.tolist() == [0.0, 1.0, 2.0, 2.0]
  assert merged.input_lengths.tolist() == [1, 3, 2, 1]  # stable on ties
  assert merged.session_ids.tolist() == [0, 1, 0, 2]
  assert merged.input_token_ids[1].tolist() == [5, 6, 7]
  assert merged.output_token_ids is None
  with pytest.raises(ValueError, match="at least one trace"):
    merge_traces([])
  # Negative session ids of two inputs must not collide either.
  c = Trace([0.0], [1], [1], session_ids=[-1])
  d = Trace([1.0], [1], [1], session_ids=[-1])
  ids = merge_traces([c, d]).session_ids.tolist()
  assert ids[0] != ids[1], ids


def test_merge_keeps_priorities_at_the_default_where_absent(rng):
  """Merged priorities against a numpy reference: the inputs' priorities
  (0 for an input without them) in the stable arrival order."""
  traces, expect_p, times = [], [], []
  for _ in range(int(rng.integers(2, 5))):
    n = int(rng.integers(1, 8))
    t = np.sort(rng.integers(0, 6, n)).astype(float)
    p = rng.integers(-50, 50, n) if rng.random() < 0.6 else None
    traces.append(Trace(t, np.ones(n, int), np.ones(n, int), priorities=p))
    expect_p.append(np.zeros(n, int) if p is None else p)
    times.append(t)
  merged = merge_traces(traces)
  if all(t.priorities is None for t in traces):
    assert merged.priorities is None
  else:
    order = np.argsort(np.concatenate(times), kind="stable")
    np.testing.assert_array_equal(
      merged.priorities, np.concatenate(expect_p)[order]
    )
  with pytest.raises(ValueError, match="priorities has 1 entries"):
    Trace([0.0, 1.0], [1, 1], [1, 1], priorities=[3])


def test_block_hash_ids_follow_shared_prefixes(rng):
  shared = rng.integers(0, 50, 10).tolist()
  prompts = [
    shared + [1, 2, 3],
    shared + [1, 2, 4],
    shared[:5],
    [99] + shared,
  ]
  trace = Trace(
    np.zeros(4),
    [len(p) for p in prompts],
    [1, 1, 1, 1],
    input_token_ids=_ids(*prompts),
  )
  rows = [row.tolist() for row in trace.block_hash_ids(4)]
  assert [len(row) for row in rows] == [4, 4, 2, 3]
  assert rows[0][:3] == rows[1][:3]  # blocks 0-2 hold the shared tokens
  assert rows[0][3] != rows[1][3]
  assert rows[2][0] == rows[0][0]  # same first block
  assert rows[2][1] != rows[0][1]  # partial block 1 differs from full one
  assert not set(rows[3]) & set(rows[0])  # shifted: nothing shared
  with pytest.raises(ValueError, match="block_size=0 must be positive"):
    trace.block_hash_ids(0)
  with pytest.raises(ValueError, match="has no input_token_ids"):
    Trace([0.0], [1], [1]).block_hash_ids(4)


def test_kv_tokens_is_prompt_plus_all_but_the_last_sampled_token(rng):
  n = int(rng.integers(1, 50))
  inputs = rng.integers(1, 5000, size=n)
  outputs = rng.integers(0, 300, size=n)
  trace = Trace(
    arrival_times_s=np.zeros(n), input_lengths=inputs, output_lengths=outputs
  )
  want = [
    int(p) + max(int(o), 1) - 1 for p, o in zip(inputs, outputs, strict=True)
  ]
  assert trace.kv_tokens.tolist() == want
  assert trace.kv_tokens.dtype == np.int64


def test_lists_of_ints_give_the_rows_of_arrays(rng):
  # The loaders pass lists of Python ints (one flat conversion); anything
  # else goes row by row. Both give equal read-only rows, and lists with a
  # bad entry are refused by the row-by-row checks, naming the row.
  lengths = rng.integers(1, 9, 6)
  rows = [rng.integers(0, 1 << 20, int(n)).tolist() for n in lengths]
  kw = dict(
    arrival_times_s=np.arange(6.0),
    input_lengths=lengths,
    output_lengths=np.ones(6, np.int64),
  )
  fast = Trace(**kw, input_token_ids=rows)
  slow = Trace(**kw, input_token_ids=[np.asarray(r) for r in rows])
  for a, b, r in zip(
    fast.input_token_ids, slow.input_token_ids, rows, strict=True
  ):
    assert a.dtype == b.dtype == np.int32
    assert a.tolist() == b.tolist() == r
    assert not a.flags.writeable
  bad = int(rng.integers(0, 6))
  for value, match in [(-1, "holds token id -1"), (1.5, "must hold")]:
    broken = [list(r) for r in rows]
    broken[bad][-1] = value
    with pytest.raises((TypeError, ValueError), match=match) as err:
      Trace(**kw, input_token_ids=broken)
    assert f"input_token_ids[{bad}]" in str(err.value)


def _hash_id_trace(rng, n, hbs):
  """Mooncake-style requests: each extends a random earlier one's first
  hash blocks (or starts afresh) with new ids; the last block partial."""
  rows, lens, next_id = [], [], 0
  for _ in range(n):
    keep = []
    if rows and rng.random() < 0.7:
      base = rows[int(rng.integers(len(rows)))]
      keep = list(base[: int(rng.integers(0, len(base) + 1))])
    new = int(rng.integers(0 if keep else 1, 4))
    row = keep + list(range(next_id, next_id + new))
    next_id += new
    length = (len(row) - 1) * hbs + int(rng.integers(1, hbs + 1))
    rows.append(np.asarray(row, np.int64))
    lens.append(length)
  return Trace(
    np.zeros(n),
    lens,
    rng.integers(1, 5, n),
    hash_ids=rows,
    hash_block_size=hbs,
  )


def _common(a, b):
  m = min(len(a), len(b))
  diff = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
  return int(diff[0]) if len(diff) else m


def test_token_ids_from_hash_ids_share_exactly_the_hash_prefixes(rng):
  hbs = int(rng.integers(2, 9))
  trace = _hash_id_trace(rng, 30, hbs)
  tokens = trace.with_token_ids().input_token_ids
  kept = trace.with_token_ids().hash_ids
  assert [r.tolist() for r in kept] == [r.tolist() for r in trace.hash_ids]
  for i in range(len(trace)):
    assert len(tokens[i]) == trace.input_lengths[i]
    assert tokens[i].min() >= 1 and tokens[i].max() <= 2**30
    for j in range(i):
      d = _common(trace.hash_ids[i], trace.hash_ids[j])
      m = min(len(trace.hash_ids[i]), len(trace.hash_ids[j]))
      n = min(trace.input_lengths[i], trace.input_lengths[j])
      # Up to the first differing id every token agrees; from it, none of
      # the first tokens does (a 30-bit draw: equal by chance ~1e-9).
      want = n if d == m else min(d * hbs, n)
      assert _common(tokens[i], tokens[j]) == want, (i, j)


def test_length_only_token_ids_share_nothing(rng):
  n = int(rng.integers(5, 20))
  trace = Trace(np.zeros(n), rng.integers(1, 50, n), np.ones(n, np.int64))
  tokens = trace.with_token_ids().input_token_ids
  for i in range(n):
    assert len(tokens[i]) == trace.input_lengths[i]
    for j in range(i):
      assert tokens[i][0] != tokens[j][0]
  same = Trace([0.0], [2], [1], input_token_ids=[np.array([5, 6])])
  assert same.with_token_ids() is same
