"""`Trace`: a request trace as host-side numpy data.

A trace is R requests in file (replay) order. Every trace carries arrival
times and input/output lengths; real traces and generators add the ragged
per-request data that prefix sharing needs: Mooncake's per-block `hash_ids`,
or the token ids themselves (from which any block size can be cut).

Dimension letters: R = number of requests; B_i = number of blocks of request
i (`ceil(input_lengths[i] / hash_block_size)`); I_i / O_i = input / output
length of request i.

Turning a trace into fixed-shape device arrays (padding plus a mask) is the
replay layer's job; this module stays on the host and never imports JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max
_INT64_MAX = np.iinfo(np.int64).max


class TraceFormatError(ValueError):
  """A trace file is malformed; the message starts with `path:line: `."""


def _as_vector(
  name: str, value: Any, dtype: type, size: int | None
) -> np.ndarray:
  """Returns `value` as a fresh read-only 1-D array of `dtype`."""
  array = np.asarray(value)
  if array.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
  if array.size and not (
    np.issubdtype(array.dtype, np.integer)
    or (dtype is np.float64 and np.issubdtype(array.dtype, np.floating))
  ):
    raise TypeError(
      f"{name} must hold {np.dtype(dtype).name} values, got dtype {array.dtype}"
    )
  if size is not None and array.shape[0] != size:
    raise ValueError(
      f"{name} has {array.shape[0]} entries but the trace has {size} requests"
    )
  if (
    array.size
    and array.dtype.kind == "u"
    and np.dtype(dtype).kind == "i"
    and array.max() > np.iinfo(dtype).max
  ):  # the cast would wrap (2**63 became -2**63)
    i = int(np.argmax(array > np.iinfo(dtype).max))
    raise ValueError(
      f"{name}[{i}] = {int(array[i])} does not fit in {np.dtype(dtype).name}"
    )
  array = np.array(array, dtype=dtype, copy=True)
  array.setflags(write=False)
  return array


def _as_ragged(
  name: str, value: Sequence[Any], dtype: type, size: int
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
  """Returns `value` as a tuple of `size` fresh read-only 1-D arrays, and
  their `[size]` int64 lengths."""
  if isinstance(value, np.ndarray) or not isinstance(value, Sequence):
    raise TypeError(
      f"{name} must be a sequence of 1-D arrays (one per request), got "
      f"{type(value).__name__}"
    )
  if len(value) != size:
    raise ValueError(
      f"{name} has {len(value)} entries but the trace has {size} requests"
    )
  fast = _ragged_of_int_lists(value, dtype)
  if fast is None:
    fast = _ragged_of_int_arrays(value, dtype)
  if fast is not None:
    return fast
  rows = []
  for i, row in enumerate(value):
    array = np.asarray(row)
    if array.ndim != 1:
      raise ValueError(f"{name}[{i}] must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise TypeError(
        f"{name}[{i}] must hold integers, got dtype {array.dtype}"
      )
    if dtype is np.int32 and array.size:
      low, high = int(array.min()), int(array.max())
      if low < 0 or high > _INT32_MAX:
        raise ValueError(
          f"{name}[{i}] holds token id {low if low < 0 else high}, outside "
          f"[0, {_INT32_MAX}]"
        )
    array = np.array(array, dtype=dtype, copy=True)
    array.setflags(write=False)
    rows.append(array)
  return tuple(rows), np.fromiter(map(len, rows), np.int64, len(rows))


def _ragged_of_int_lists(value, dtype):
  """The loaders' case, lists of Python ints, in one flat array (read-only
  views of it, one per request): 5-10x faster than a row at a time. None
  when any row is not a list of ints in range (the checked path then
  names it)."""
  if not all(type(row) is list for row in value):
    return None
  flat_values = itertools.chain.from_iterable(value)
  if not value or set(map(type, flat_values)) - {int}:
    return None
  lengths = np.fromiter(map(len, value), np.int64, len(value))
  try:
    flat = np.fromiter(
      itertools.chain.from_iterable(value), np.int64, int(lengths.sum())
    )
  except OverflowError:
    return None
  return _rows_of_flat(flat, lengths, dtype)


def _ragged_of_int_arrays(value, dtype):
  """Rows that are all 1-D integer numpy arrays (generators, the trace
  cache) in one flat copy, as :func:`_ragged_of_int_lists`; None when any
  row is not one or a value is out of ``dtype``'s range."""
  if not value or not all(type(row) is np.ndarray for row in value):
    return None
  dtypes = {row.dtype for row in value}
  if {row.ndim for row in value} != {1} or any(
    d.kind not in "iu" or (d == np.uint64 and len(dtypes) > 1) for d in dtypes
  ):
    return None  # (uint64 with another dtype would concatenate to float64)
  flat = np.concatenate(value)
  if flat.dtype.kind == "u" and flat.size and flat.max() > _INT64_MAX:
    return None
  lengths = np.fromiter(map(len, value), np.int64, len(value))
  return _rows_of_flat(flat, lengths, dtype)


def _rows_of_flat(flat, lengths, dtype):
  """A fresh flat integer array as read-only rows of ``dtype`` (views cut
  at ``lengths``; slicing is about 4x faster than ``np.split`` at 12,000
  rows) and ``lengths``, as :func:`_as_ragged` returns them; None when a
  value is outside int32 for an int32 ``dtype``."""
  if (
    dtype is np.int32
    and flat.size
    and (flat.min() < 0 or flat.max() > _INT32_MAX)
  ):
    return None
  flat = flat.astype(dtype, copy=False)
  flat.setflags(write=False)
  ends = np.cumsum(lengths).tolist()
  starts = [0, *ends[:-1]]
  rows = tuple(flat[a:b] for a, b in zip(starts, ends, strict=True))
  return rows, lengths


def _first_wrong_length(lengths, expected: np.ndarray) -> int | None:
  """The first ``i`` with ``lengths[i] != expected[i]``, or None (one
  comparison, not a loop over the rows)."""
  wrong = np.flatnonzero(lengths != expected)
  return int(wrong[0]) if wrong.size else None


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
  """R requests in file order, as host-side numpy arrays.

  Attributes:
    arrival_times_s: `float64[R]` arrival time of each request, in seconds.
    input_lengths: `int64[R]` prompt length in tokens.
    output_lengths: `int64[R]` number of generated tokens.
    hash_ids: optional ragged `int64[B_i]` per request: one id per block of
      `hash_block_size` tokens (the last block may be partial), chained so
      that equal ids mean equal prefixes (Mooncake traces).
    hash_block_size: tokens per hash block; required with `hash_ids`.
    input_token_ids: optional ragged `int32[I_i]` per request: the prompt.
    output_token_ids: optional ragged `int32[O_i]` per request: the answer
      (a later prompt that re-sends it can hit the blocks it filled).
    session_ids: optional `int64[R]`: the conversation, sampling group, tree
      or agent run each request belongs to (set by the generators).
    priorities: optional `int64[R]`: each request's scheduling priority
      (vLLM's ``priority`` of a request, lower first; SGLang's, ordered by
      its ``--schedule-low-priority-values-first``); read by the serving
      simulator's ``priority`` scheduler, 0 when absent.
    name: short human-readable name.
    source: where the trace came from: a file path or a generator spec.

  Arrays are copied on construction and made read-only, so a `Trace` is
  immutable. Invariants are checked in `__post_init__` and violations raise
  `ValueError` / `TypeError` naming the field and request.

  Example:
    >>> import numpy as np
    >>> trace = Trace(
    ...   arrival_times_s=[0.0, 0.5], input_lengths=[3, 5],
    ...   output_lengths=[2, 1],
    ...   hash_ids=[np.array([7]), np.array([7, 8])], hash_block_size=4)
    >>> len(trace), trace.num_tokens, trace.has_hash_ids
    (2, 11, True)
  """

  arrival_times_s: np.ndarray  # [R] float64
  input_lengths: np.ndarray  # [R] int64
  output_lengths: np.ndarray  # [R] int64
  _: dataclasses.KW_ONLY
  hash_ids: tuple[np.ndarray, ...] | None = None  # R x [B_i] int64
  hash_block_size: int | None = None
  input_token_ids: tuple[np.ndarray, ...] | None = None  # R x [I_i] int32
  output_token_ids: tuple[np.ndarray, ...] | None = None  # R x [O_i] int32
  session_ids: np.ndarray | None = None  # [R] int64
  priorities: np.ndarray | None = None  # [R] int64
  name: str = "trace"
  source: str = ""

  def __post_init__(self):
    set_field = object.__setattr__.__get__(self)
    lengths = _as_vector("input_lengths", self.input_lengths, np.int64, None)
    size = lengths.shape[0]
    set_field("input_lengths", lengths)
    set_field(
      "output_lengths",
      _as_vector("output_lengths", self.output_lengths, np.int64, size),
    )
    set_field(
      "arrival_times_s",
      _as_vector("arrival_times_s", self.arrival_times_s, np.float64, size),
    )
    for field in ("input_lengths", "output_lengths"):
      values = getattr(self, field)
      if size and values.min() < 0:
        i = int(np.argmin(values))
        raise ValueError(
          f"{field}[{i}] = {int(values[i])} is negative; lengths must be >= 0"
        )
    if size and not np.all(np.isfinite(self.arrival_times_s)):
      i = int(np.argmin(np.isfinite(self.arrival_times_s)))
      raise ValueError(
        f"arrival_times_s[{i}] = {self.arrival_times_s[i]} is not finite"
      )
    if self.session_ids is not None:
      set_field(
        "session_ids",
        _as_vector("session_ids", self.session_ids, np.int64, size),
      )
    if self.priorities is not None:
      set_field(
        "priorities",
        _as_vector("priorities", self.priorities, np.int64, size),
      )
    if not isinstance(self.name, str) or not isinstance(self.source, str):
      raise TypeError(
        f"name and source must be str, got {self.name!r} and {self.source!r}"
      )
    self._check_hash_ids(size)
    for field, lengths_field in (
      ("input_token_ids", "input_lengths"),
      ("output_token_ids", "output_lengths"),
    ):
      rows = getattr(self, field)
      if rows is None:
        continue
      rows, lengths = _as_ragged(field, rows, np.int32, size)
      expected = getattr(self, lengths_field)
      i = _first_wrong_length(lengths, expected)
      if i is not None:
        raise ValueError(
          f"len({field}[{i}]) = {rows[i].shape[0]} but {lengths_field}[{i}] "
          f"= {int(expected[i])}"
        )
      set_field(field, rows)

  def _check_hash_ids(self, size: int) -> None:
    if self.hash_ids is None:
      if self.hash_block_size is not None:
        raise ValueError(
          f"hash_block_size={self.hash_block_size} given without hash_ids"
        )
      return
    block_size = self.hash_block_size
    if isinstance(block_size, bool) or not isinstance(
      block_size, int | np.integer
    ):
      raise TypeError(
        f"hash_block_size must be a positive int when hash_ids are given, "
        f"got {block_size!r}"
      )
    if block_size <= 0:
      raise ValueError(f"hash_block_size={block_size} must be positive")
    object.__setattr__(self, "hash_block_size", int(block_size))
    rows, lengths = _as_ragged("hash_ids", self.hash_ids, np.int64, size)
    i = _first_wrong_length(lengths, -(-self.input_lengths // block_size))
    if i is not None:
      expected = -(-int(self.input_lengths[i]) // block_size)
      raise ValueError(
        f"len(hash_ids[{i}]) = {rows[i].shape[0]} but input_lengths[{i}] = "
        f"{int(self.input_lengths[i])} needs ceil("
        f"{int(self.input_lengths[i])} / {block_size}) = {expected} blocks"
      )
    object.__setattr__(self, "hash_ids", rows)

  def __repr__(self) -> str:
    # The dataclass repr would print every ragged array.
    fields = [f"name={self.name!r}", f"requests={len(self)}"]
    if self.has_hash_ids:
      fields.append(f"hash_block_size={self.hash_block_size}")
    if self.has_token_ids:
      fields.append("token_ids=True")
    if self.priorities is not None:
      fields.append("priorities=True")
    if self.source:
      fields.append(f"source={self.source!r}")
    return f"Trace({', '.join(fields)})"

  # -- sizes -------------------------------------------------------------------
  def __len__(self) -> int:
    return int(self.input_lengths.shape[0])

  @property
  def num_requests(self) -> int:
    """R, the number of requests."""
    return len(self)

  @property
  def num_input_tokens(self) -> int:
    """Total prompt tokens over all requests."""
    return int(self.input_lengths.sum())

  @property
  def num_output_tokens(self) -> int:
    """Total generated tokens over all requests."""
    return int(self.output_lengths.sum())

  @property
  def num_tokens(self) -> int:
    """Total tokens, prompt plus output, over all requests."""
    return self.num_input_tokens + self.num_output_tokens

  @property
  def kv_tokens(self) -> np.ndarray:
    """``[R]`` int64 tokens with KV when each request finishes: the prompt
    and every output token but the last sampled one (``P + max(O, 1) -
    1``; a request always samples at least one token). What a serving
    cache holds for it at the end."""
    return (
      self.input_lengths.astype(np.int64)
      + np.maximum(self.output_lengths.astype(np.int64), 1)
      - 1
    )

  @property
  def has_token_ids(self) -> bool:
    """Whether the prompts' token ids are known (any block size works)."""
    return self.input_token_ids is not None

  @property
  def has_hash_ids(self) -> bool:
    """Whether per-block hash ids are known (one fixed block size)."""
    return self.hash_ids is not None

  @property
  def duration_s(self) -> float:
    """Time from the first to the last arrival (0 for < 2 requests)."""
    if len(self) < 2:
      return 0.0
    return float(self.arrival_times_s.max() - self.arrival_times_s.min())

  # -- views -------------------------------------------------------------------
  def slice(self, start: int | None = None, stop: int | None = None) -> Trace:
    """Returns requests `[start:stop]` (Python slice rules) as a new trace.

    Arrival times are kept as they are (not shifted to start at 0).

    Example:
      >>> trace = Trace([0.0, 1.0, 2.0], [1, 2, 3], [0, 0, 0])
      >>> trace.slice(1).input_lengths.tolist()
      [2, 3]
    """
    window = slice(start, stop)

    def cut(rows):
      return None if rows is None else rows[window]

    return Trace(
      self.arrival_times_s[window],
      self.input_lengths[window],
      self.output_lengths[window],
      hash_ids=cut(self.hash_ids),
      hash_block_size=self.hash_block_size,
      input_token_ids=cut(self.input_token_ids),
      output_token_ids=cut(self.output_token_ids),
      session_ids=cut(self.session_ids),
      priorities=cut(self.priorities),
      name=self.name,
      source=self.source,
    )

  def with_token_ids(self) -> Trace:
    """This trace with prompt token ids synthesised where it has none.

    For a serving simulation, whose cache hashes token ids, of a trace
    that carries sharing only as Mooncake-style ``hash_ids`` or not at all:

    * With ``hash_ids``: block ``j`` of a prompt (``hash_block_size``
      tokens, the last one possibly partial) becomes the first tokens of a
      fixed pseudo-random sequence keyed by its hash id, so equal ids give
      equal tokens and prompts that share ``n`` hash blocks share exactly
      their first ``n * hash_block_size`` tokens; at any cache block size
      the hits are those of the trace. Different ids collide only if their
      30-bit token draws agree token for token (never in practice).
    * Length-only (no ids at all, e.g. the Azure CSVs): every request gets
      its own tokens, so nothing is shared and every prefix hit is 0.
    * With token ids already: the trace itself.

    Token ids are in ``[1, 2**30]``; output ids are left as they are (a
    simulator fabricates the outputs of a trace without them).

    Example:
      >>> import numpy as np
      >>> t = Trace([0.0, 1.0], [6, 5], [1, 1],
      ...           hash_ids=[np.array([3, 4]), np.array([3, 9])],
      ...           hash_block_size=4).with_token_ids()
      >>> bool((t.input_token_ids[0][:4] == t.input_token_ids[1][:4]).all())
      True
      >>> bool((t.input_token_ids[0][4:] == t.input_token_ids[1][4:5]).all())
      False
    """
    if self.input_token_ids is not None:
      return self
    if self.hash_ids is not None:
      k = self.hash_block_size
      offsets = np.arange(k, dtype=np.uint64)
      rows = []
      for ids, n in zip(self.hash_ids, self.input_lengths, strict=True):
        keys = ids.astype(np.uint64)[:, None] * np.uint64(k) + offsets
        rows.append(_token_draw(keys.ravel()[: int(n)], _HASH_STREAM))
    else:
      # One stream per request: nothing is shared.
      rows = [
        _token_draw(
          np.uint64(i) * np.uint64(1 << 32)
          + np.arange(int(n), dtype=np.uint64),
          _LENGTH_STREAM,
        )
        for i, n in enumerate(self.input_lengths)
      ]
    return dataclasses.replace(self, input_token_ids=rows)

  def summary(self) -> dict[str, Any]:
    """Returns request count, length statistics and duration as a dict.

    Keys: `name`, `requests`, `input_mean`, `input_median`, `input_max`,
    `output_mean`, `output_median`, `output_max`, `input_tokens`,
    `output_tokens`, `duration_s`, `has_hash_ids`, `has_token_ids`.
    Statistics of an empty trace are 0.
    """
    stats: dict[str, Any] = {"name": self.name, "requests": len(self)}
    for label, values in (
      ("input", self.input_lengths),
      ("output", self.output_lengths),
    ):
      empty = values.size == 0
      stats[f"{label}_mean"] = 0.0 if empty else float(values.mean())
      stats[f"{label}_median"] = 0.0 if empty else float(np.median(values))
      stats[f"{label}_max"] = 0 if empty else int(values.max())
    stats["input_tokens"] = self.num_input_tokens
    stats["output_tokens"] = self.num_output_tokens
    stats["duration_s"] = self.duration_s
    stats["has_hash_ids"] = self.has_hash_ids
    stats["has_token_ids"] = self.has_token_ids
    return stats

  def block_hash_ids(self, block_size: int) -> list[np.ndarray]:
    """Chained per-block ids cut from the prompt token ids, on the host.

    Block `j` of a prompt gets an id determined by the whole prefix up to
    and including that block, so equal ids mean equal prefixes (the same
    contract as Mooncake's `hash_ids`). The last block may be partial and
    is included, so request `i` gets `ceil(input_lengths[i] / block_size)`
    ids. Ids are small integers assigned in order of first appearance.
    This is a host-side helper for reference models and tests; the prefix
    index hashes on the device.

    Args:
      block_size: tokens per block, positive.

    Returns:
      One `int64[ceil(I_i / block_size)]` array per request.

    Raises:
      ValueError: if the trace has no token ids or `block_size` < 1.
    """
    if isinstance(block_size, bool) or not isinstance(
      block_size, int | np.integer
    ):
      raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
      raise ValueError(f"block_size={block_size} must be positive")
    if self.input_token_ids is None:
      raise ValueError(
        f"trace {self.name!r} has no input_token_ids to cut blocks from"
      )
    numbering = PrefixNumbering()
    result = []
    for tokens in self.input_token_ids:
      node = 0
      row = np.empty(math.ceil(tokens.shape[0] / block_size), np.int64)
      for j in range(row.shape[0]):
        block = tokens[j * block_size : (j + 1) * block_size].tobytes()
        node = numbering.child(node, block)
        row[j] = node - 1
      result.append(row)
    return result


_HASH_STREAM = np.uint64(0x243F6A8885A308D3)
_LENGTH_STREAM = np.uint64(0x13198A2E03707344)


def _token_draw(keys: np.ndarray, stream: np.uint64) -> np.ndarray:
  """``int32`` token ids in ``[1, 2**30]``, a fixed function of each
  ``uint64`` key: splitmix64's finaliser (Steele, Lea and Flood, OOPSLA
  2014) of ``key + stream``; uint64 arithmetic wraps by design."""
  with np.errstate(over="ignore"):
    z = keys.astype(np.uint64) + stream
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return ((z >> np.uint64(34)) + np.uint64(1)).astype(np.int32)


class PrefixNumbering:
  """Numbers the nodes of a prefix trie on the host, in order of first sight.

  A block's identity is its whole prefix: node ``child(parent, key)`` is the
  same id every time the same ``key`` follows the same ``parent`` node. Node
  0 is the root; new nodes get ``1, 2, ...``. Every replay plan and
  :meth:`Trace.block_hash_ids` number blocks through this one rule.

  Example:
    >>> n = PrefixNumbering()
    >>> a = n.child(0, "x"); b = n.child(a, "y"); c = n.child(0, "x")
    >>> (a, b, c, n.parent)
    (1, 2, 1, [0, 0, 1])
  """

  def __init__(self):
    self._ids: dict = {}
    self.parent: list[int] = [0]
    """``parent[v]`` of every node ``v`` (``parent[0] = 0``)."""

  def __len__(self) -> int:
    """Nodes numbered so far, the root included."""
    return len(self.parent)

  def child(self, parent: int, key) -> int:
    """The node of ``key`` under ``parent`` (numbered now if new)."""
    node = self._ids.setdefault((parent, key), len(self.parent))
    if node == len(self.parent):
      self.parent.append(parent)
    return node

  def fresh(self, parent: int) -> int:
    """A new node under ``parent`` that no later key reaches."""
    self.parent.append(parent)
    return len(self.parent) - 1


def merge_traces(
  traces: Sequence[Trace], *, name: str = "merged", source: str = ""
) -> Trace:
  """Merges traces into one, ordered by arrival time (stable).

  Ragged fields are kept only when every input has them (and, for
  `hash_ids`, the same `hash_block_size`). Session ids are renumbered so
  sessions of different inputs never collide (inputs without session ids
  get one session per request). Priorities are kept when any input has
  them, a request of an input without them at the default, 0.

  Args:
    traces: the traces to merge (at least one).
    name: name of the merged trace.
    source: source of the merged trace (default: the inputs' sources).

  Returns:
    The merged `Trace`.

  Example:
    >>> a = Trace([0.0, 2.0], [1, 1], [1, 1])
    >>> b = Trace([1.0], [5], [1])
    >>> merge_traces([a, b]).input_lengths.tolist()
    [1, 5, 1]
  """
  if not traces:
    raise ValueError("merge_traces needs at least one trace, got none")
  times = np.concatenate([t.arrival_times_s for t in traces])
  order = np.argsort(times, kind="stable")

  def cat(field):
    return np.concatenate([getattr(t, field) for t in traces])[order]

  def ragged(field):
    if any(getattr(t, field) is None for t in traces):
      return None
    rows = [row for t in traces for row in getattr(t, field)]
    return [rows[i] for i in order]

  sessions, offset = [], 0
  for t in traces:
    local = (
      np.arange(len(t), dtype=np.int64)
      if t.session_ids is None
      else t.session_ids
    )
    if len(t) and local.min() < 0:  # shifted to start at 0: no collision
      local = local - local.min()
    sessions.append(local + offset)
    offset += int(local.max()) + 1 if len(t) else 0
  if all(t.priorities is None for t in traces):
    priorities = None
  else:  # a request without one has the default, 0
    priorities = np.concatenate(
      [
        np.zeros(len(t), np.int64) if t.priorities is None else t.priorities
        for t in traces
      ]
    )[order]
  block_sizes = {t.hash_block_size for t in traces}
  keep_hashes = len(block_sizes) == 1 and None not in block_sizes
  return Trace(
    times[order],
    cat("input_lengths"),
    cat("output_lengths"),
    hash_ids=ragged("hash_ids") if keep_hashes else None,
    hash_block_size=block_sizes.pop() if keep_hashes else None,
    input_token_ids=ragged("input_token_ids"),
    output_token_ids=ragged("output_token_ids"),
    session_ids=np.concatenate(sessions)[order],
    priorities=priorities,
    name=name,
    source=source or " + ".join(t.source or t.name for t in traces),
  )
