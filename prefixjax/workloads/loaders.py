"""Loaders for real request traces: Mooncake JSONL, token-id JSONL, CSV.

Every loader validates every record and refuses bad input with a
`TraceFormatError` whose message starts with `path:line: ` (1-based line
numbers of the file as written, blank lines included), then says what is
wrong. Records are parsed one line at a time with `json.loads`; the numpy
conversion happens once at the end.

Formats:

- Mooncake JSONL (`load_mooncake`): `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` (one id per block of `block_size` tokens,
  512 in the published traces; `len(hash_ids) == ceil(input_length /
  block_size)`). A record may also carry `block_size` (kvcache-simulator's
  format); it must agree with the block size in use.
- Token-id JSONL (`load_token_trace`, LLMServingSim): `input_tok_ids`,
  `output_toks`, `arrival_time_ns`, optional `output_tok_ids` (length
  `output_toks`) and optional `input_toks` (must equal
  `len(input_tok_ids)`).
- Length-only CSV (`load_csv_trace`, Azure LLM inference traces):
  `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS[.fraction]`, or plain seconds),
  `ContextTokens`, `GeneratedTokens`; no prefix information.

Files ending in `.gz` are decompressed on the fly.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import gzip
import json
import math
import os
import re
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from prefixjax.workloads.trace import Trace, TraceFormatError

__all__ = [
  "DEFAULT_MOONCAKE_BLOCK_SIZE",
  "TRACE_FORMATS",
  "load_csv_trace",
  "load_mooncake",
  "load_token_trace",
  "load_trace",
]

DEFAULT_MOONCAKE_BLOCK_SIZE = 512
TRACE_FORMATS = ("auto", "mooncake", "tokens", "csv")

# Files at least this large show a progress bar (when stderr is a terminal).
_PROGRESS_MIN_BYTES = 32 * 1024 * 1024
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_DATETIME = re.compile(
  r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
)


PathLike = str | os.PathLike


# -- shared helpers ------------------------------------------------------------
_GZIP_MAGIC = b"\x1f\x8b"


def _open_text(path: Path) -> TextIO:
  """The file as text: gzip content is read through gzip whatever the
  name; other content must be UTF-8 text (checked on its first 4 KiB, so a
  binary file is named here instead of failing mid-parse)."""
  with path.open("rb") as raw:
    head = raw.read(4096)
  if head.startswith(_GZIP_MAGIC):
    return gzip.open(path, "rt", encoding="utf-8", newline="")
  try:
    head.decode("utf-8")
  except UnicodeDecodeError as error:
    # A multi-byte character cut at the end of the sample is fine.
    if error.start < len(head) - 3 or len(head) < 4096:
      raise TraceFormatError(
        f"{path}: not UTF-8 text (byte {error.start} is "
        f"{head[error.start : error.start + 1]!r}): a trace is JSONL or CSV "
        "text, optionally gzip-compressed"
      ) from None
  if b"\x00" in head:
    raise TraceFormatError(
      f"{path}: binary content (a NUL byte in its first 4 KiB): a trace is "
      "JSONL or CSV text, optionally gzip-compressed"
    )
  return path.open("r", encoding="utf-8", newline="")


@contextlib.contextmanager
def _progress(path: Path, description: str) -> Iterator[Any]:
  """Yields `update(num_bytes)`; a tqdm bar only for big files on a TTY."""
  size = path.stat().st_size
  if size < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
    yield lambda num_bytes: None
    return
  from tqdm import tqdm

  with tqdm(
    total=size,
    unit="B",
    unit_scale=True,
    desc=f"{description} {path.name}",
    file=sys.stderr,
    leave=False,
  ) as bar:
    pending = 0

    def update(num_bytes: int) -> None:
      nonlocal pending
      pending += num_bytes
      if pending >= 1 << 20:
        bar.update(pending)
        pending = 0

    yield update


def _too_long(name: str, value: int) -> str:
  """A token count past int32: the device counts tokens in int32."""
  return (
    f"{name} = {value:_} does not fit in int32 (at most {_INT32_MAX:_} "
    "tokens: the cache and the simulator count tokens in int32)"
  )


def _describe(value: Any) -> str:
  text = json.dumps(value) if not isinstance(value, str) else repr(value)
  if len(text) > 40:
    text = text[:37] + "..."
  return f"{type(value).__name__} {text}"


class _Records:
  """Iterates `(line_no, record)` over a JSONL file, validating JSON."""

  def __init__(self, path: Path, limit: int | None, description: str):
    self.path = path
    self.limit = limit
    self.description = description
    self.last_line = 0

  def error(self, line_no: int, message: str) -> TraceFormatError:
    return TraceFormatError(f"{self.path}:{line_no}: {message}")

  def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
    count = 0
    with (
      _open_text(self.path) as handle,
      _progress(self.path, self.description) as update,
    ):
      for line_no, line in enumerate(handle, start=1):
        self.last_line = line_no
        update(len(line))
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as error:
          raise self.error(
            line_no, f"bad JSON: {error.msg} (column {error.colno})"
          ) from None
        if not isinstance(record, dict):
          raise self.error(
            line_no, f"expected a JSON object, got {_describe(record)}"
          )
        yield line_no, record
        count += 1
        if self.limit is not None and count >= self.limit:
          return
    if count == 0:
      raise self.error(
        max(self.last_line, 1),
        "empty trace: no records"
        + (" (only blank lines)" if self.last_line else ""),
      )

  def field(
    self, line_no: int, record: dict[str, Any], name: str, kind: str
  ) -> Any:
    """Returns `record[name]` checked to be `kind`: "count", "number", "ids"."""
    if name not in record:
      present = ", ".join(sorted(record)) or "none"
      raise self.error(
        line_no, f"missing field {name!r} (fields present: {present})"
      )
    value = record[name]
    if kind == "count":
      # `type(...) is int` refuses bools, which JSON keeps distinct.
      if type(value) is not int:
        raise self.error(
          line_no, f"{name} must be an integer, got {_describe(value)}"
        )
      if value < 0:
        raise self.error(line_no, f"{name} = {value} is negative")
      if value > _INT32_MAX:
        raise self.error(line_no, _too_long(name, value))
    elif kind == "number":
      if type(value) not in (int, float):
        raise self.error(
          line_no, f"{name} must be a number, got {_describe(value)}"
        )
      if not math.isfinite(value):
        raise self.error(line_no, f"{name} = {value} is not finite")
      if value < 0:
        raise self.error(line_no, f"{name} = {value} is negative")
    elif kind == "ids":
      if type(value) is not list:
        raise self.error(
          line_no, f"{name} must be a list of integers, got {_describe(value)}"
        )
    return value

  def int_list(
    self, line_no: int, name: str, values: list[Any], low: int, high: int
  ) -> None:
    """Checks that every entry of `values` is an int in `[low, high]`."""
    # The common case in C loops (the per-entry loop below costs more than
    # parsing the JSON); bools are not ints here, as JSON keeps them apart.
    if not values or (
      set(map(type, values)) == {int}
      and low <= min(values)
      and max(values) <= high
    ):
      return
    for position, value in enumerate(values):
      if type(value) is not int or not low <= value <= high:
        what = (
          f"{_describe(value)} is not an integer"
          if type(value) is not int
          else f"{value} is outside [{low}, {high}]"
        )
        raise self.error(line_no, f"{name}[{position}] = {what}")


def _check_limit(limit: int | None) -> None:
  if limit is not None and (
    isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
  ):
    raise ValueError(f"limit={limit!r} must be None or a positive int")


def _check_block_size(block_size: int | None) -> None:
  if block_size is not None and (
    isinstance(block_size, bool)
    or not isinstance(block_size, int)
    or block_size < 1
  ):
    raise ValueError(
      f"block_size={block_size!r} must be None or a positive int"
    )


def _trace_name(path: Path) -> str:
  name = path.name[:-3] if path.name.endswith(".gz") else path.name
  return name.rsplit(".", 1)[0] if "." in name[1:] else name


def _as_path(path: PathLike) -> Path:
  path = Path(path)
  if path.is_dir():
    raise IsADirectoryError(
      f"trace path is a directory, not a file: {path} (pass one trace file)"
    )
  if not path.is_file():
    raise FileNotFoundError(f"trace file not found: {path}")
  return path


# -- Mooncake ------------------------------------------------------------------
def load_mooncake(
  path: PathLike, *, block_size: int | None = None, limit: int | None = None
) -> Trace:
  """Loads a Mooncake JSONL trace (per-block chained `hash_ids`).

  Args:
    path: the `.jsonl` (or `.jsonl.gz`) file.
    block_size: tokens per hash block. Default: the first record's own
      `block_size` field if it has one, else 512 (the published traces);
      a record declaring a different `block_size` is refused.
    limit: read only the first `limit` records.

  Returns:
    A `Trace` with `hash_ids` and `hash_block_size` set; arrival times are
    `timestamp / 1000` seconds.

  Raises:
    TraceFormatError: on the first malformed record (`path:line: ...`).

  Example:
    >>> trace = load_mooncake("mooncake_conversation_trace.jsonl")
    ... # doctest: +SKIP
    >>> trace.hash_block_size, len(trace)  # doctest: +SKIP
    (512, 12031)
  """
  _check_block_size(block_size)
  _check_limit(limit)
  path = _as_path(path)
  records = _Records(path, limit, "loading")
  times: list[float] = []
  inputs: list[int] = []
  outputs: list[int] = []
  hash_ids: list[list[int]] = []
  for line_no, record in records:
    if "block_size" in record:
      declared = record["block_size"]
      if type(declared) is not int or declared < 1:
        raise records.error(
          line_no,
          f"block_size must be a positive integer, got {_describe(declared)}",
        )
    else:
      declared = None
    if block_size is None:  # The first record settles the default.
      block_size = declared or DEFAULT_MOONCAKE_BLOCK_SIZE
    if declared is not None and declared != block_size:
      raise records.error(
        line_no,
        f"block_size = {declared} disagrees with the block size in use "
        f"({block_size})",
      )
    timestamp = records.field(line_no, record, "timestamp", "number")
    input_length = records.field(line_no, record, "input_length", "count")
    output_length = records.field(line_no, record, "output_length", "count")
    ids = records.field(line_no, record, "hash_ids", "ids")
    records.int_list(line_no, "hash_ids", ids, -(2**63), _INT64_MAX)
    expected = -(-input_length // block_size)
    if len(ids) != expected:
      hint = ""
      fits = -(-input_length // DEFAULT_MOONCAKE_BLOCK_SIZE) == len(ids)
      if block_size != DEFAULT_MOONCAKE_BLOCK_SIZE and fits:
        hint = (
          f": the block size {block_size} does not match the trace's (its "
          f"hash ids fit {DEFAULT_MOONCAKE_BLOCK_SIZE} tokens a block, "
          "Mooncake's; omit the block size or pass "
          f"{DEFAULT_MOONCAKE_BLOCK_SIZE})"
        )
      raise records.error(
        line_no,
        f"len(hash_ids) = {len(ids)} but input_length = {input_length} "
        f"needs ceil({input_length} / {block_size}) = {expected} blocks" + hint,
      )
    times.append(timestamp / 1000.0)
    inputs.append(input_length)
    outputs.append(output_length)
    hash_ids.append(ids)
  return Trace(
    np.asarray(times, np.float64),
    np.asarray(inputs, np.int64),
    np.asarray(outputs, np.int64),
    # Lists of checked ints: Trace packs them into one flat array at once
    # (a row at a time was 0.04 s of the 12,031-line Mooncake trace).
    hash_ids=hash_ids,
    hash_block_size=block_size,
    name=_trace_name(path),
    source=str(path),
  )


# -- token ids -----------------------------------------------------------------
def load_token_trace(path: PathLike, *, limit: int | None = None) -> Trace:
  """Loads a token-id JSONL trace (LLMServingSim's format).

  Args:
    path: the `.jsonl` (or `.jsonl.gz`) file.
    limit: read only the first `limit` records.

  Returns:
    A `Trace` with `input_token_ids` (and `output_token_ids` when every
    record has `output_tok_ids`); arrival times are `arrival_time_ns / 1e9`
    seconds. A record's optional integer `priority` (the serving
    simulator's `priority` scheduler; vLLM's default 0 where a record has
    none) makes the trace's `priorities`; it must lie in (-2**30, 2**30),
    as SGLang's priority policy compares priorities in int32 on the device.

  Raises:
    TraceFormatError: on the first malformed record (`path:line: ...`),
      including a record with `output_tok_ids` when an earlier one had none
      (or the reverse).

  Example:
    >>> trace = load_token_trace("sharegpt.jsonl")  # doctest: +SKIP
    >>> trace.has_token_ids  # doctest: +SKIP
    True
  """
  _check_limit(limit)
  path = _as_path(path)
  records = _Records(path, limit, "loading")
  times: list[float] = []
  inputs: list[np.ndarray] = []
  outputs: list[int] = []
  output_ids: list[np.ndarray] = []
  priorities: list[int] = []
  with_priority = False
  with_outputs: bool | None = None
  for line_no, record in records:
    priority = record.get("priority", 0)
    if type(priority) is not int:  # bools are not ints in JSON
      raise records.error(
        line_no, f"priority must be an integer, got {_describe(priority)}"
      )
    if not -(2**30) < priority < 2**30:
      raise records.error(
        line_no, f"priority = {priority} is outside (-2**30, 2**30)"
      )
    with_priority = with_priority or "priority" in record
    priorities.append(priority)
    ids = records.field(line_no, record, "input_tok_ids", "ids")
    records.int_list(line_no, "input_tok_ids", ids, 0, _INT32_MAX)
    output_length = records.field(line_no, record, "output_toks", "count")
    arrival = records.field(line_no, record, "arrival_time_ns", "number")
    if "input_toks" in record:
      declared = records.field(line_no, record, "input_toks", "count")
      if declared != len(ids):
        raise records.error(
          line_no,
          f"input_toks = {declared} but len(input_tok_ids) = {len(ids)}",
        )
    has_outputs = "output_tok_ids" in record
    if with_outputs is None:
      with_outputs = has_outputs
    elif has_outputs != with_outputs:
      raise records.error(
        line_no,
        "output_tok_ids is "
        + ("present" if has_outputs else "missing")
        + " but was "
        + ("missing" if has_outputs else "present")
        + " in earlier records; give it on every record or none",
      )
    if has_outputs:
      answer = records.field(line_no, record, "output_tok_ids", "ids")
      records.int_list(line_no, "output_tok_ids", answer, 0, _INT32_MAX)
      if len(answer) != output_length:
        raise records.error(
          line_no,
          f"len(output_tok_ids) = {len(answer)} but output_toks = "
          f"{output_length}",
        )
      output_ids.append(answer)  # checked ints; Trace packs them flat
    times.append(arrival / 1e9)
    inputs.append(ids)
    outputs.append(output_length)
  return Trace(
    np.asarray(times, np.float64),
    np.asarray([len(ids) for ids in inputs], np.int64),
    np.asarray(outputs, np.int64),
    input_token_ids=inputs,
    output_token_ids=output_ids if with_outputs else None,
    priorities=np.asarray(priorities, np.int64) if with_priority else None,
    name=_trace_name(path),
    source=str(path),
  )


# -- CSV -----------------------------------------------------------------------
def _parse_timestamp(
  text: str, day_cache: dict[str, int]
) -> tuple[int, float] | None:
  """(whole seconds since the epoch, fraction) of a CSV timestamp, or None.

  Datetimes are read as UTC. Whole seconds and the fraction are kept apart
  so that differences keep sub-microsecond precision.
  """
  match = _DATETIME.fullmatch(text)
  if match is None:
    try:
      value = float(text)
    except ValueError:
      return None
    if not math.isfinite(value) or value < 0:
      return None
    return math.floor(value), value - math.floor(value)
  year, month, day, hour, minute, second, fraction = match.groups()
  date = text[:10]
  if date not in day_cache:
    try:
      start = datetime.datetime(int(year), int(month), int(day))
    except ValueError:
      return None
    day_cache[date] = int(start.replace(tzinfo=datetime.UTC).timestamp())
  if int(hour) > 23 or int(minute) > 59 or int(second) > 60:
    return None
  whole = day_cache[date] + int(hour) * 3600 + int(minute) * 60 + int(second)
  return whole, int(fraction) / 10 ** len(fraction) if fraction else 0.0


def load_csv_trace(path: PathLike, *, limit: int | None = None) -> Trace:
  """Loads a length-only CSV trace (Azure LLM inference trace columns).

  Columns `TIMESTAMP`, `ContextTokens`, `GeneratedTokens` are required (in
  any order; other columns are ignored). Timestamps are datetimes
  `YYYY-MM-DD HH:MM:SS[.fraction]` (any number of fraction digits, read as
  UTC) or plain seconds; arrival times are seconds after the first row.

  Args:
    path: the `.csv` (or `.csv.gz`) file.
    limit: read only the first `limit` rows.

  Returns:
    A `Trace` of lengths only (no prefix information).

  Raises:
    TraceFormatError: on the first malformed row (`path:line: ...`).

  Example:
    >>> trace = load_csv_trace("azure2023_conv.csv")  # doctest: +SKIP
    >>> trace.has_hash_ids, trace.has_token_ids  # doctest: +SKIP
    (False, False)
  """
  _check_limit(limit)
  path = _as_path(path)
  whole_seconds: list[int] = []
  fractions: list[float] = []
  inputs: list[int] = []
  outputs: list[int] = []
  day_cache: dict[str, int] = {}

  def error(line_no: int, message: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{line_no}: {message}")

  with _open_text(path) as handle, _progress(path, "loading") as update:
    reader = csv.reader(handle)
    try:
      header = next(reader, None)
      while header is not None and not any(cell.strip() for cell in header):
        header = next(reader, None)
    except csv.Error as failure:
      raise error(reader.line_num, f"bad CSV: {failure}") from None
    if header is None:
      raise error(max(reader.line_num, 1), "empty trace: no header row")
    header_line = reader.line_num
    names = [cell.strip().lstrip("\ufeff") for cell in header]
    missing = [column for column in _CSV_COLUMNS if column not in names]
    if missing:
      raise error(
        header_line,
        f"missing column(s) {', '.join(missing)} in header {names}; "
        f"expected {', '.join(_CSV_COLUMNS)}",
      )
    columns = [names.index(column) for column in _CSV_COLUMNS]
    width = max(columns) + 1
    line_no = header_line
    while True:
      try:
        row = next(reader, None)
      except csv.Error as failure:
        raise error(reader.line_num, f"bad CSV: {failure}") from None
      if row is None:
        break
      line_no = reader.line_num
      update(sum(len(cell) + 1 for cell in row))
      if not any(cell.strip() for cell in row):
        continue
      if len(row) < width:
        raise error(
          line_no, f"expected at least {width} columns, got {len(row)}"
        )
      stamp, context, generated = (row[i].strip() for i in columns)
      parsed = _parse_timestamp(stamp, day_cache)
      if parsed is None:
        raise error(
          line_no,
          f"TIMESTAMP {stamp!r} is not a datetime YYYY-MM-DD HH:MM:SS[.f] "
          "or a nonnegative number of seconds",
        )
      lengths = []
      for column, text in (
        ("ContextTokens", context),
        ("GeneratedTokens", generated),
      ):
        if not text.isascii() or not text.isdigit():
          problem = "is negative" if text.startswith("-") else "is not"
          raise error(
            line_no,
            f"{column} {text!r} {problem}"
            + (" a nonnegative integer" if problem == "is not" else ""),
          )
        if int(text) > _INT32_MAX:
          raise error(line_no, _too_long(column, int(text)))
        lengths.append(int(text))
      whole_seconds.append(parsed[0])
      fractions.append(parsed[1])
      inputs.append(lengths[0])
      outputs.append(lengths[1])
      if limit is not None and len(inputs) >= limit:
        break
  if not inputs:
    raise error(line_no, "empty trace: header but no rows")
  whole = np.asarray(whole_seconds, np.int64)
  fraction = np.asarray(fractions, np.float64)
  return Trace(
    (whole - whole[0]).astype(np.float64) + (fraction - fraction[0]),
    np.asarray(inputs, np.int64),
    np.asarray(outputs, np.int64),
    name=_trace_name(path),
    source=str(path),
  )


# -- dispatch ------------------------------------------------------------------
def _detect_format(path: Path) -> str:
  suffixes = [suffix.lower() for suffix in path.suffixes]
  if suffixes and suffixes[-1] == ".gz":
    suffixes = suffixes[:-1]
  if suffixes and suffixes[-1] in (".csv", ".tsv"):
    return "csv"
  line_no = 0
  with _open_text(path) as handle:
    for line_no, line in enumerate(handle, start=1):
      if not line.strip():
        continue
      if not line.lstrip().startswith("{"):
        if all(column in line for column in _CSV_COLUMNS):
          return "csv"
        raise TraceFormatError(
          f"{path}:{line_no}: cannot detect the trace format: expected a "
          "JSON object (Mooncake or token-id JSONL) or a CSV header with "
          f"{', '.join(_CSV_COLUMNS)}; name the format (--format, or "
          "format= in Python)"
        )
      try:
        record = json.loads(line)
      except json.JSONDecodeError as error:
        raise TraceFormatError(
          f"{path}:{line_no}: bad JSON: {error.msg} (column {error.colno})"
        ) from None
      if isinstance(record, dict) and "hash_ids" in record:
        return "mooncake"
      if isinstance(record, dict) and "input_tok_ids" in record:
        return "tokens"
      fields = sorted(record) if isinstance(record, dict) else []
      raise TraceFormatError(
        f"{path}:{line_no}: cannot detect the trace format: the first "
        f"record has fields {fields}; expected 'hash_ids' (mooncake) or "
        "'input_tok_ids' (tokens)"
      )
  raise TraceFormatError(
    f"{path}:{max(line_no, 1)}: empty trace: no records"
    + (" (only blank lines)" if line_no else "")
  )


def load_trace(
  path: PathLike,
  format: str = "auto",
  *,
  block_size: int | None = None,
  limit: int | None = None,
  cache: PathLike | bool | None = None,
) -> Trace:
  """Loads a trace file in any supported format.

  Args:
    path: the trace file.
    format: "auto" (by extension, then the first record's fields),
      "mooncake", "tokens" or "csv".
    block_size: the hash block size of a Mooncake trace (default: the
      records' `block_size` field, else 512). Token-id and CSV traces carry
      no hash blocks, so for them it is only validated and otherwise
      ignored (blocks of any size are cut from token ids later).
    limit: read only the first `limit` records.
    cache: keep the parsed trace in a per-user cache keyed by the file's
      bytes, so a later load of the same file skips the parse
      (:mod:`prefixjax.workloads.trace_cache`): a folder, `True` for the
      default one (`PREFIXJAX_TRACE_CACHE`, else
      `~/.cache/prefixjax/traces`), `None` / `False` (the default) or
      `"off"` to parse every time.

  Returns:
    The `Trace`.

  Raises:
    TraceFormatError: malformed file (message starts with `path:line: `).
    FileNotFoundError: no such file.
    ValueError: unknown `format`, or a bad `block_size` / `limit` value.

  Example:
    >>> trace = load_trace("../shared/traces/azure2023_code.csv")
    ... # doctest: +SKIP
    >>> trace.summary()["requests"]  # doctest: +SKIP
    8819
  """
  if format not in TRACE_FORMATS:
    raise ValueError(
      f"format={format!r} is not one of {', '.join(TRACE_FORMATS)}"
    )
  _check_block_size(block_size)
  _check_limit(limit)
  path = _as_path(path)
  folder = None
  if cache is not None and cache is not False:
    from prefixjax.workloads import trace_cache

    folder = trace_cache.cache_folder(None if cache is True else cache)
  if folder is None:
    return _parse(path, format, block_size, limit)
  return trace_cache.load(
    path,
    dict(format=format, block_size=block_size, limit=limit),
    lambda: _parse(path, format, block_size, limit),
    folder,
    name=_trace_name(path),
  )


def _parse(path: Path, format: str, block_size, limit) -> Trace:
  try:
    return _parse_format(path, format, block_size, limit)
  except (gzip.BadGzipFile, EOFError, zlib.error) as err:
    raise TraceFormatError(
      f"{path}: not valid gzip data ({err or type(err).__name__}): a "
      "compressed trace must be whole gzip"
    ) from None


def _parse_format(path: Path, format: str, block_size, limit) -> Trace:
  if format == "auto":
    format = _detect_format(path)
  if format == "mooncake":
    return load_mooncake(path, block_size=block_size, limit=limit)
  if format == "tokens":
    return load_token_trace(path, limit=limit)
  return load_csv_trace(path, limit=limit)
