"""The parsed-trace cache: equal traces, keyed by bytes, never stale.

Random traces of each format are written to ``tmp_path``; a load through
the cache must equal the plain parse field by field (values and dtypes),
the first time (parsed and stored) and the second (read back), and an
edited file, another argument or a damaged entry must never give the old
trace.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from prefixjax.workloads import Trace, TraceFormatError, load_trace, trace_cache

FIELDS = (
  "arrival_times_s",
  "input_lengths",
  "output_lengths",
  "hash_ids",
  "hash_block_size",
  "input_token_ids",
  "output_token_ids",
  "session_ids",
  "priorities",
  "name",
  "source",
)


def assert_same_trace(a: Trace, b: Trace) -> None:
  for field in FIELDS:
    x, y = getattr(a, field), getattr(b, field)
    if isinstance(x, tuple):
      assert isinstance(y, tuple) and len(x) == len(y), field
      for i, (u, v) in enumerate(zip(x, y, strict=True)):
        assert u.dtype == v.dtype and not u.flags.writeable, (field, i)
        np.testing.assert_array_equal(u, v, f"{field}[{i}]")
    elif isinstance(x, np.ndarray):
      assert x.dtype == y.dtype, field
      np.testing.assert_array_equal(x, y, field)
    else:
      assert x == y, field


def _mooncake(rng, path, num=None):
  lines = []
  for i in range(num or int(rng.integers(5, 40))):
    n = int(rng.integers(1, 3000))
    ids = rng.integers(-(2**62), 2**62, size=-(-n // 512)).tolist()
    lines.append(
      json.dumps(
        dict(
          timestamp=float(rng.integers(0, 10**6)) / 7 if i % 2 else i * 3,
          input_length=n,
          output_length=int(rng.integers(0, 500)),
          hash_ids=ids,
        )
      )
    )
  path.write_text("\n".join(lines) + "\n")
  return path


def _tokens(rng, path):
  lines = []
  for _ in range(int(rng.integers(5, 30))):
    ids = rng.integers(0, 2**31 - 1, size=int(rng.integers(0, 60))).tolist()
    out = int(rng.integers(0, 20))
    record = dict(
      input_tok_ids=ids, output_toks=out, arrival_time_ns=int(rng.integers(9))
    )
    record["output_tok_ids"] = rng.integers(0, 50000, size=out).tolist()
    if rng.random() < 0.5:  # the others have the default, 0
      record["priority"] = int(rng.integers(-(2**30) + 1, 2**30))
    lines.append(json.dumps(record))
  path.write_text("\n".join(lines) + "\n")
  return path


def _csv(rng, path):
  rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
  for i in range(int(rng.integers(3, 30))):
    rows.append(
      f"2023-11-16 18:{i:02d}:0{i % 10}.{int(rng.integers(10**6))},"
      f"{int(rng.integers(1, 9000))},{int(rng.integers(0, 900))}"
    )
  path.write_text("\n".join(rows) + "\n")
  return path


WRITERS = {"mooncake": _mooncake, "tokens": _tokens, "csv": _csv}
SUFFIX = {"mooncake": ".jsonl", "tokens": ".jsonl", "csv": ".csv"}


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_cached_loads_equal_the_parse(tmp_path, rng, kind):
  path = WRITERS[kind](rng, tmp_path / f"t{SUFFIX[kind]}")
  folder = tmp_path / "cache"
  want = load_trace(path)
  first = load_trace(path, cache=folder)
  assert len(list(folder.glob("*.npz"))) == 1
  second = load_trace(path, cache=folder)
  assert_same_trace(first, want)
  assert_same_trace(second, want)
  # --limit is part of the key: a shorter trace, its own entry.
  limit = int(rng.integers(1, len(want) + 1))
  short = load_trace(path, limit=limit, cache=folder)
  assert_same_trace(short, load_trace(path, limit=limit))
  assert len(list(folder.glob("*.npz"))) == 2


def test_an_entry_is_read_instead_of_parsing(tmp_path, rng):
  """The entry for a file's bytes is what a cached load returns: an entry
  holding another trace (written here under that key) comes back."""
  path = _mooncake(rng, tmp_path / "a.jsonl")
  other = load_trace(_mooncake(rng, tmp_path / "b.jsonl"))
  folder = tmp_path / "cache"
  load_trace(path, cache=folder)
  (entry,) = folder.glob("*.npz")
  trace_cache._save(entry, other)
  got = load_trace(path, cache=folder)
  assert got.num_tokens == other.num_tokens
  assert (got.name, got.source) == ("a", str(path))


def test_edited_or_moved_files_and_other_arguments(tmp_path, rng):
  folder = tmp_path / "cache"
  path = _mooncake(rng, tmp_path / "a.jsonl", num=20)
  load_trace(path, cache=folder)
  # The same bytes elsewhere: the same entry, the new name and source.
  copy = tmp_path / "copy of a.jsonl"
  copy.write_bytes(path.read_bytes())
  moved = load_trace(copy, cache=folder)
  assert_same_trace(moved, load_trace(copy))
  assert moved.name == "copy of a" and len(list(folder.glob("*.npz"))) == 1
  # An edit (one output length) is a new entry, never the old trace.
  lines = path.read_text().splitlines()
  record = json.loads(lines[3])
  record["output_length"] += 1
  lines[3] = json.dumps(record)
  path.write_text("\n".join(lines) + "\n")
  edited = load_trace(path, cache=folder)
  assert_same_trace(edited, load_trace(path))
  assert int(edited.output_lengths[3]) == record["output_length"]
  # Another block size reads the ids at that size (here: refused, as
  # without the cache), and a gzip copy is its own entry.
  with pytest.raises(TraceFormatError):
    load_trace(path, block_size=7, cache=folder)
  packed = tmp_path / "a.jsonl.gz"
  packed.write_bytes(gzip.compress(path.read_bytes()))
  assert_same_trace(load_trace(packed, cache=folder), load_trace(packed))
  assert len(list(folder.glob("*.npz"))) == 3


def test_damage_and_unwritable_folders_fall_back_to_parsing(
  tmp_path, rng, capsys
):
  path = _tokens(rng, tmp_path / "t.jsonl")
  want = load_trace(path)
  folder = tmp_path / "cache"
  load_trace(path, cache=folder)
  (entry,) = folder.glob("*.npz")
  data = entry.read_bytes()
  entry.write_bytes(data[: int(rng.integers(1, len(data) - 1))])
  assert_same_trace(load_trace(path, cache=folder), want)
  assert "unreadable trace cache entry" in capsys.readouterr().err
  assert entry.read_bytes() == data  # rewritten whole
  blocker = tmp_path / "a file"
  blocker.write_text("")
  assert_same_trace(load_trace(path, cache=blocker / "cache"), want)
  assert "trace cache off" in capsys.readouterr().err
  # A bad trace raises as always and leaves no entry.
  bad = tmp_path / "bad.jsonl"
  bad.write_text(path.read_text() + "{not json\n")
  with pytest.raises(TraceFormatError, match=r"bad\.jsonl:\d+: bad JSON"):
    load_trace(bad, cache=folder)
  assert len(list(folder.glob("*.npz"))) == 1
  assert not list(folder.glob(".tmp-*"))


def test_folder_resolution(tmp_path, monkeypatch):
  monkeypatch.setenv(trace_cache.ENV_VAR, str(tmp_path / "env"))
  assert trace_cache.cache_folder(None) == tmp_path / "env"
  assert trace_cache.cache_folder(tmp_path / "arg") == tmp_path / "arg"
  for off in ("off", "0", "none"):
    assert trace_cache.cache_folder(off) is None
  monkeypatch.delenv(trace_cache.ENV_VAR)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert trace_cache.cache_folder(None) == tmp_path / "xdg/prefixjax/traces"


def test_cli_flags(tmp_path, rng):
  """``prefixjax replay --trace-cache DIR`` stores the trace and prints the
  same table as ``--no-trace-cache``, which stores nothing."""
  path = _mooncake(rng, tmp_path / "m.jsonl", num=30)
  folder = tmp_path / "traces"

  def replay(*flags):
    argv = [sys.executable, "-m", "prefixjax", "replay", "--trace", str(path)]
    argv += ["--capacity", "4", "16", "--policy", "fifo", "--no-compile-cache"]
    done = subprocess.run(
      [*argv, *flags], capture_output=True, text=True, check=True
    )
    return [line for line in done.stdout.splitlines() if "fifo" in line]

  plain = replay("--no-trace-cache")
  assert not folder.exists()
  assert replay("--trace-cache", str(folder)) == plain
  # The trace's entry and its replay plan's.
  assert sorted(p.stem.count(".") for p in folder.glob("*.npz")) == [0, 1]
  assert replay("--trace-cache", str(folder)) == plain


PLAN_FIELDS = ("node", "parent", "weight", "next_use", "first", "request")


@pytest.mark.parametrize("kind", ["mooncake", "tokens"])
def test_a_cached_traces_replay_plan_is_kept_beside_it(tmp_path, rng, kind):
  """``plan_trace`` of a trace from the cache equals the plan of the plain
  parse, at every warm-up and (token ids) block size, the first time
  (computed, stored) and later (read back: a planted entry comes back)."""
  from prefixjax import replay as rp

  path = WRITERS[kind](rng, tmp_path / f"t{SUFFIX[kind]}")
  folder = tmp_path / "cache"
  block_size = None if kind == "mooncake" else int(rng.choice([2, 4, 16]))
  fraction = float(rng.choice([0.0, 0.25, 0.5]))
  want = rp.plan_trace(
    load_trace(path), block_size=block_size, warmup_fraction=fraction
  )
  for _ in range(2):
    got = rp.plan_trace(
      load_trace(path, cache=folder),
      block_size=block_size,
      warmup_fraction=fraction,
    )
    for field in (*PLAN_FIELDS, "kept"):
      a, b = getattr(got, field), getattr(want, field)
      assert a.dtype == b.dtype, field
      np.testing.assert_array_equal(a, b, field)
    assert (got.num_requests, got.warmup_requests, got.block_size) == (
      want.num_requests,
      want.warmup_requests,
      want.block_size,
    )
  (derived,) = [p for p in folder.glob("*.npz") if p.stem.count(".") == 1]
  planted = trace_cache._read(derived)
  planted["weight"] = planted["weight"] + 1
  trace_cache._write(derived, planted)
  again = rp.plan_trace(
    load_trace(path, cache=folder),
    block_size=block_size,
    warmup_fraction=fraction,
  )
  np.testing.assert_array_equal(again.weight, want.weight + 1)
  # A trace not from the cache is planned afresh.
  np.testing.assert_array_equal(
    rp.plan_trace(
      load_trace(path), block_size=block_size, warmup_fraction=fraction
    ).weight,
    want.weight,
  )
