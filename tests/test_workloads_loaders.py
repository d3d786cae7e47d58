"""Trace loaders: fixtures in tmp_path, malformed input, real-trace smoke."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
from reference_models import shared_trace, shared_traces_dir

from prefixjax.workloads import (
  Trace,
  TraceFormatError,
  generate_workload,
  load_csv_trace,
  load_mooncake,
  load_token_trace,
  load_trace,
)


def _write(tmp_path, name, lines):
  path = tmp_path / name
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return path


def _jsonl(records):
  return [r if isinstance(r, str) else json.dumps(r) for r in records]


def _mooncake_record(input_length=1000, output_length=10, timestamp=0, **kw):
  blocks = math.ceil(input_length / 512) if type(input_length) is int else 2
  record = dict(
    timestamp=timestamp,
    input_length=input_length,
    output_length=output_length,
    hash_ids=list(range(blocks)),
  )
  record.update(kw)
  return record


def _token_record(ids=(1, 2, 3), output_toks=2, arrival_time_ns=5, **kw):
  record = dict(
    input_toks=len(ids),
    output_toks=output_toks,
    arrival_time_ns=arrival_time_ns,
    input_tok_ids=list(ids),
  )
  record.update(kw)
  return record


def _raises_at(path, line_no, match, loader, **kwargs):
  with pytest.raises(TraceFormatError, match=match) as info:
    loader(path, **kwargs)
  message = str(info.value)
  assert message.startswith(f"{path}:{line_no}: "), message
  assert isinstance(info.value, ValueError)
  return message


# -- Mooncake ------------------------------------------------------------------
def test_mooncake_round_trip(tmp_path):
  records = [
    _mooncake_record(1024, 5, 0, hash_ids=[0, 1]),
    _mooncake_record(1025, 0, 1500, hash_ids=[0, 1, 2]),
    _mooncake_record(0, 7, 2000, hash_ids=[]),
  ]
  path = _write(tmp_path, "m.jsonl", _jsonl(records))
  trace = load_mooncake(path)
  assert trace.hash_block_size == 512
  assert trace.input_lengths.tolist() == [1024, 1025, 0]
  assert trace.output_lengths.tolist() == [5, 0, 7]
  assert trace.arrival_times_s.tolist() == [0.0, 1.5, 2.0]
  assert [row.tolist() for row in trace.hash_ids] == [[0, 1], [0, 1, 2], []]
  assert trace.name == "m" and trace.source == str(path)
  assert load_trace(path).input_lengths.tolist() == [1024, 1025, 0]
  assert len(load_mooncake(path, limit=2)) == 2


def test_mooncake_block_size_from_argument_or_records(tmp_path):
  plain = _write(
    tmp_path,
    "a.jsonl",
    _jsonl(
      [dict(timestamp=0, input_length=5, output_length=1, hash_ids=[1, 2])]
    ),
  )
  assert load_mooncake(plain, block_size=4).hash_block_size == 4
  declared = _write(
    tmp_path,
    "b.jsonl",
    _jsonl(
      [
        dict(
          timestamp=0,
          input_length=5,
          output_length=1,
          hash_ids=[1, 2],
          block_size=4,
        )
      ]
    ),
  )
  assert load_trace(declared).hash_block_size == 4
  _raises_at(
    declared,
    1,
    r"block_size = 4 disagrees with the block size in use \(8\)",
    load_mooncake,
    block_size=8,
  )
  late = _write(
    tmp_path,
    "c.jsonl",
    _jsonl([_mooncake_record(), _mooncake_record(block_size=4)]),
  )
  _raises_at(
    late, 2, r"disagrees with the block size in use \(512\)", load_trace
  )


@pytest.mark.parametrize(
  "bad, match",
  [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (
      json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": []}),
      "missing field 'input_length'",
    ),
    (json.dumps(_mooncake_record(hash_ids=None)), "hash_ids must be a list"),
    (
      json.dumps(_mooncake_record(input_length="1000")),
      "input_length must be an integer, got str",
    ),
    (
      json.dumps(_mooncake_record(output_length=True)),
      "output_length must be an integer, got bool",
    ),
    (
      json.dumps(_mooncake_record(input_length=1000.0, hash_ids=[1, 2])),
      "input_length must be an integer, got float",
    ),
    (
      json.dumps(_mooncake_record(output_length=-1)),
      "output_length = -1 is negative",
    ),
    (
      json.dumps(_mooncake_record(timestamp=-5)),
      "timestamp = -5 is negative",
    ),
    (
      json.dumps(_mooncake_record(timestamp=False)),
      "timestamp must be a number, got bool",
    ),
    (
      json.dumps(_mooncake_record(hash_ids=[1, True])),
      r"hash_ids\[1\] = bool true is not an integer",
    ),
    (
      json.dumps(_mooncake_record(hash_ids=[1, 2.5])),
      r"hash_ids\[1\] = float 2.5 is not an integer",
    ),
    (
      json.dumps(_mooncake_record(input_length=1025, hash_ids=[1, 2])),
      r"len\(hash_ids\) = 2 but input_length = 1025 needs ceil\(1025 / 512\)"
      r" = 3 blocks",
    ),
    (
      json.dumps(_mooncake_record(block_size=0)),
      "block_size must be a positive integer",
    ),
    (
      json.dumps(_mooncake_record(output_length=5_000_000_000_000)),
      "output_length = 5_000_000_000_000 does not fit in int32",
    ),
  ],
)
def test_mooncake_malformed_line_is_located(tmp_path, bad, match):
  good = json.dumps(_mooncake_record())
  path = _write(tmp_path, "trace.jsonl", [good, "", good, bad, good])
  _raises_at(path, 4, match, load_mooncake)
  _raises_at(path, 4, match, load_trace, format="mooncake")


def test_empty_files_are_refused(tmp_path):
  empty = _write(tmp_path, "empty.jsonl", [])
  _raises_at(empty, 1, "empty trace: no records", load_mooncake)
  _raises_at(empty, 1, "empty trace", load_trace)
  blank = _write(tmp_path, "blank.jsonl", ["", "  "])
  _raises_at(blank, 2, r"empty trace: no records \(only blank", load_mooncake)
  _raises_at(blank, 2, r"empty trace: no records \(only blank", load_trace)
  _raises_at(blank, 2, "empty trace", load_token_trace)
  csv_empty = _write(tmp_path, "empty.csv", [])
  _raises_at(csv_empty, 1, "empty trace: no header row", load_csv_trace)
  header_only = _write(
    tmp_path, "header.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens"]
  )
  _raises_at(header_only, 1, "header but no rows", load_trace)


# -- token ids -----------------------------------------------------------------
def test_token_trace_round_trip(tmp_path):
  records = [
    _token_record([5, 6, 7], 2, 1_500_000_000, output_tok_ids=[8, 9]),
    _token_record([5, 6], 1, 2_000_000_000, output_tok_ids=[4]),
  ]
  path = _write(tmp_path, "t.jsonl", _jsonl(records))
  trace = load_token_trace(path)
  assert trace.has_token_ids and not trace.has_hash_ids
  assert trace.arrival_times_s.tolist() == [1.5, 2.0]
  assert trace.input_lengths.tolist() == [3, 2]
  assert trace.output_lengths.tolist() == [2, 1]
  assert trace.input_token_ids[0].dtype == np.int32
  assert [r.tolist() for r in trace.output_token_ids] == [[8, 9], [4]]
  without_outputs = _write(
    tmp_path,
    "u.jsonl",
    _jsonl([{k: v for k, v in _token_record().items() if k != "input_toks"}]),
  )
  trace = load_trace(without_outputs)
  assert trace.output_token_ids is None
  assert trace.output_lengths.tolist() == [2]


@pytest.mark.parametrize(
  "bad, match",
  [
    (
      _token_record(input_toks=4),
      r"input_toks = 4 but len\(input_tok_ids\) = 3",
    ),
    (_token_record(ids=[1, -2]), r"input_tok_ids\[1\] = -2 is outside"),
    (_token_record(ids=[1, 2**31]), r"input_tok_ids\[1\] = 2147483648 is"),
    (_token_record(ids=[False]), r"input_tok_ids\[0\] = bool false is not"),
    (
      _token_record(output_toks="2"),
      "output_toks must be an integer, got str",
    ),
    (
      {k: v for k, v in _token_record().items() if k != "arrival_time_ns"},
      "missing field 'arrival_time_ns'",
    ),
    (
      _token_record(arrival_time_ns=float("inf")),
      "arrival_time_ns = inf is not finite",
    ),
    (
      _token_record(output_tok_ids=[1]),
      "output_tok_ids is present but was missing in earlier records",
    ),
    (_token_record(priority=True), "priority must be an integer, got bool"),
    (_token_record(priority=1.5), "priority must be an integer, got float"),
    (_token_record(priority=2**30), r"priority = 1073741824 is outside"),
    (_token_record(priority=-(2**30)), r"priority = -1073741824 is outside"),
  ],
)
def test_token_trace_malformed_line_is_located(tmp_path, bad, match):
  good = json.dumps(_token_record())
  path = _write(tmp_path, "tok.jsonl", [good, good, json.dumps(bad)])
  _raises_at(path, 3, match, load_token_trace)


def test_token_trace_priorities_default_to_zero(tmp_path, rng):
  """A record's ``priority`` becomes the trace's ``priorities``, 0 where a
  record has none; a file with none at all has no priorities."""
  n = int(rng.integers(2, 30))
  given = rng.random(n) < 0.5
  given[int(rng.integers(n))] = True
  values = rng.integers(-(2**30) + 1, 2**30, size=n)
  records = [
    _token_record(**({"priority": int(v)} if g else {}))
    for g, v in zip(given, values, strict=True)
  ]
  path = _write(tmp_path, "p.jsonl", _jsonl(records))
  got = load_token_trace(path).priorities
  assert got.dtype == np.int64
  np.testing.assert_array_equal(got, np.where(given, values, 0))
  plain = _write(tmp_path, "q.jsonl", _jsonl([_token_record()] * n))
  assert load_token_trace(plain).priorities is None


def test_token_trace_output_ids_must_match_output_toks(tmp_path):
  path = _write(
    tmp_path,
    "tok.jsonl",
    _jsonl([_token_record(output_tok_ids=[1, 2]), _token_record()]),
  )
  _raises_at(
    path, 2, "output_tok_ids is missing but was present", load_token_trace
  )
  path = _write(
    tmp_path, "tok2.jsonl", _jsonl([_token_record(output_tok_ids=[1])])
  )
  _raises_at(
    path,
    1,
    r"len\(output_tok_ids\) = 1 but output_toks = 2",
    load_token_trace,
  )


def test_generated_workload_round_trips_through_token_jsonl(tmp_path, rng):
  trace = generate_workload(
    "multi_turn",
    num_requests=30,
    seed=int(rng.integers(2**31)),
    output_len=(1, 16),
    question_len=(1, 16),
  )
  records = [
    dict(
      input_toks=int(trace.input_lengths[i]),
      output_toks=int(trace.output_lengths[i]),
      arrival_time_ns=int(round(trace.arrival_times_s[i] * 1e9)),
      input_tok_ids=trace.input_token_ids[i].tolist(),
      output_tok_ids=trace.output_token_ids[i].tolist(),
    )
    for i in range(len(trace))
  ]
  path = tmp_path / "gen.jsonl.gz"
  with gzip.open(path, "wt", encoding="utf-8") as handle:
    handle.writelines(json.dumps(r) + "\n" for r in records)
  loaded = load_trace(path)
  np.testing.assert_array_equal(loaded.input_lengths, trace.input_lengths)
  # The format carries whole nanoseconds: equal up to that rounding (a
  # relative tolerance alone failed for a first arrival of 63 us).
  np.testing.assert_allclose(
    loaded.arrival_times_s, trace.arrival_times_s, rtol=1e-7, atol=5e-10
  )
  for got, want in zip(
    loaded.input_token_ids, trace.input_token_ids, strict=True
  ):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(
    loaded.output_token_ids, trace.output_token_ids, strict=True
  ):
    np.testing.assert_array_equal(got, want)


# -- CSV -----------------------------------------------------------------------
def test_csv_round_trip(tmp_path):
  path = _write(
    tmp_path,
    "azure.csv",
    [
      "TIMESTAMP,ContextTokens,GeneratedTokens",
      "2023-11-16 18:15:46.6805900,374,44",
      "",
      "2023-11-16 18:15:50.9951690,396,109",
      "2023-11-17 00:00:00,1,0",
    ],
  )
  trace = load_csv_trace(path)
  assert isinstance(trace, Trace)
  assert not trace.has_hash_ids and not trace.has_token_ids
  assert trace.input_lengths.tolist() == [374, 396, 1]
  assert trace.output_lengths.tolist() == [44, 109, 0]
  np.testing.assert_allclose(
    trace.arrival_times_s,
    [0.0, 4.314579, 20653.31941],
    rtol=0,
    atol=1e-6,
  )
  assert load_trace(path).input_lengths.tolist() == [374, 396, 1]
  assert len(load_trace(path, limit=1)) == 1


def test_csv_columns_in_any_order_and_numeric_timestamps(tmp_path):
  path = _write(
    tmp_path,
    "other.txt",
    [
      "GeneratedTokens,Extra,TIMESTAMP,ContextTokens",
      "3,x,10.5,7",
      "4,y,12,8",
    ],
  )
  trace = load_trace(path)
  assert trace.input_lengths.tolist() == [7, 8]
  assert trace.output_lengths.tolist() == [3, 4]
  assert trace.arrival_times_s.tolist() == [0.0, 1.5]


@pytest.mark.parametrize(
  "row, match",
  [
    ("2023-11-16 18:15:46,12,", "GeneratedTokens '' is not a nonnegative"),
    ("2023-11-16 18:15:46,-12,3", "ContextTokens '-12' is negative"),
    ("2023-11-16 18:15:46,1.5,3", "ContextTokens '1.5' is not a"),
    ("2023-11-16 18:15:46,12", "expected at least 3 columns, got 2"),
    ("2023-13-16 18:15:46,1,1", "TIMESTAMP '2023-13-16 18:15:46' is not"),
    ("yesterday,1,1", "TIMESTAMP 'yesterday' is not a datetime"),
    (
      "2023-11-16 18:15:46,2147483648,3",
      "ContextTokens = 2_147_483_648 does not fit in int32",
    ),
  ],
)
def test_csv_malformed_row_is_located(tmp_path, row, match):
  path = _write(
    tmp_path,
    "bad.csv",
    [
      "TIMESTAMP,ContextTokens,GeneratedTokens",
      "2023-11-16 18:15:46.1,1,1",
      row,
    ],
  )
  _raises_at(path, 3, match, load_csv_trace)


def test_csv_missing_columns_are_named(tmp_path):
  path = _write(tmp_path, "bad.csv", ["TIMESTAMP,Context", "1,2"])
  message = _raises_at(path, 1, "missing column", load_csv_trace)
  assert "ContextTokens, GeneratedTokens" in message


# -- dispatch ------------------------------------------------------------------
def test_load_trace_rejects_bad_arguments(tmp_path):
  path = _write(tmp_path, "m.jsonl", _jsonl([_mooncake_record()]))
  with pytest.raises(ValueError, match="format='parquet' is not one of"):
    load_trace(path, format="parquet")
  with pytest.raises(ValueError, match="block_size=0 must be"):
    load_trace(path, block_size=0)
  with pytest.raises(ValueError, match="limit=0 must be"):
    load_trace(path, limit=0)
  with pytest.raises(FileNotFoundError, match="trace file not found"):
    load_trace(tmp_path / "missing.jsonl")


def test_auto_detection_reports_unknown_records(tmp_path):
  path = _write(tmp_path, "x.jsonl", ["", json.dumps({"prompt": "hi"})])
  _raises_at(
    path, 2, r"cannot detect the trace format.*\['prompt'\]", load_trace
  )
  path = _write(tmp_path, "x.log", ["hello world"])
  _raises_at(path, 1, "cannot detect the trace format", load_trace)
  path = _write(tmp_path, "x.jsonl", [json.dumps(_token_record())])
  assert load_trace(path).has_token_ids


# -- the real traces (read in place from ../shared/traces) --------------------
def _real(name):
  path = shared_trace(name)
  if path is None:
    pytest.skip(
      f"real trace {name} not found in {shared_traces_dir()} (set "
      "PREFIXJAX_TRACES_DIR to the shared traces directory)"
    )
  return path


def test_real_mooncake_trace():
  trace = load_trace(_real("mooncake_conversation_trace.jsonl"))
  summary = trace.summary()
  assert summary["requests"] == 12_031
  assert round(summary["input_mean"]) == 12_035
  assert summary["input_median"] == 6_909
  assert summary["input_max"] == 126_195
  assert round(summary["output_mean"]) == 343
  assert trace.hash_block_size == 512
  assert sum(len(row) for row in trace.hash_ids) == 288_500
  assert 3_500 < summary["duration_s"] < 3_600  # 59 minutes


def test_real_token_trace():
  trace = load_trace(
    _real("llmservingsim_sharegpt-llama-3.1-8b-300-sps10.jsonl")
  )
  assert len(trace) == 300
  assert trace.has_token_ids and trace.output_token_ids is not None
  assert all(
    len(ids) == n
    for ids, n in zip(trace.output_token_ids, trace.output_lengths, strict=True)
  )
  assert all(
    len(ids) == n
    for ids, n in zip(trace.input_token_ids, trace.input_lengths, strict=True)
  )
  blocks = trace.block_hash_ids(16)
  assert [len(b) for b in blocks] == [-(-n // 16) for n in trace.input_lengths]


@pytest.mark.parametrize(
  "name, requests",
  [("azure2023_conv.csv", 19_366), ("azure2023_code.csv", 8_819)],
)
def test_real_azure_traces(name, requests):
  trace = load_trace(_real(name))
  assert len(trace) == requests
  assert not trace.has_hash_ids and not trace.has_token_ids
  assert trace.arrival_times_s[0] == 0.0
  assert np.all(np.diff(trace.arrival_times_s) >= 0)
  assert 3_000 < trace.duration_s < 3_700  # one hour


def test_progress_bar_only_for_big_files_on_a_terminal(
  tmp_path, monkeypatch, capsys
):
  from prefixjax.workloads import loaders

  path = _write(tmp_path, "m.jsonl", _jsonl([_mooncake_record()] * 3))
  load_mooncake(path)
  assert capsys.readouterr().err == ""  # small file, not a terminal
  monkeypatch.setattr(loaders, "_PROGRESS_MIN_BYTES", 0)
  load_mooncake(path)
  assert capsys.readouterr().err == ""  # still not a terminal
  monkeypatch.setattr(loaders.sys.stderr, "isatty", lambda: True)
  assert len(load_mooncake(path)) == 3
  assert "loading m.jsonl" in capsys.readouterr().err


def test_traces_dir_can_be_overridden(tmp_path, monkeypatch):
  import reference_models

  monkeypatch.setenv(reference_models.TRACES_ENV_VAR, str(tmp_path))
  assert shared_traces_dir() == tmp_path
  assert shared_trace("absent.jsonl") is None
  (tmp_path / "present.jsonl").write_text("{}\n")
  assert shared_trace("present.jsonl") == tmp_path / "present.jsonl"


def test_a_directory_is_named_as_one(tmp_path):
  with pytest.raises(IsADirectoryError, match="is a directory, not a file"):
    load_trace(tmp_path)


def test_gzip_content_is_read_whatever_the_file_is_called(tmp_path, rng):
  lengths = rng.integers(1, 3000, size=int(rng.integers(2, 9))).tolist()
  lines = _jsonl([_mooncake_record(input_length=n) for n in lengths])
  path = tmp_path / "trace.jsonl"  # gzip bytes, no .gz suffix
  path.write_bytes(gzip.compress("".join(x + "\n" for x in lines).encode()))
  assert load_trace(path).input_lengths.tolist() == lengths


@pytest.mark.parametrize("cut", ["magic", "truncated", "corrupt"])
def test_broken_gzip_is_refused_with_the_path(tmp_path, rng, cut):
  lines = _jsonl([_mooncake_record() for _ in range(50)])
  whole = gzip.compress("".join(x + "\n" for x in lines).encode())
  if cut == "magic":
    data = whole[:2] + b"XXXXtrunc"
  elif cut == "truncated":
    data = whole[: int(rng.integers(12, len(whole) - 8))]
  else:
    data = bytearray(whole)
    data[len(whole) // 2] ^= 0xFF
    data = bytes(data)
  path = tmp_path / "trace.jsonl.gz"
  path.write_bytes(data)
  with pytest.raises(TraceFormatError) as info:
    load_trace(path)
  assert str(info.value).startswith(f"{path}: not valid gzip data"), info.value


def test_binary_content_is_refused_with_the_path(tmp_path, rng):
  path = tmp_path / "trace.jsonl"
  junk = rng.integers(128, 256, size=64).astype(np.uint8).tobytes()
  path.write_bytes(b'{"timestamp": 0, ' + junk)
  with pytest.raises(TraceFormatError, match=r"trace\.jsonl: not UTF-8 text"):
    load_trace(path)


def test_a_block_size_that_does_not_match_mooncake_is_named(tmp_path, rng):
  path = _write(
    tmp_path,
    "m.jsonl",
    _jsonl([_mooncake_record(input_length=int(rng.integers(2000, 9000)))]),
  )
  bad = int(rng.integers(2, 300))  # always a different block count
  with pytest.raises(
    TraceFormatError,
    match=rf"m\.jsonl:1: .*the block size {bad} does not match the trace's",
  ):
    load_trace(path, block_size=bad)
