"""A per-user cache of parsed traces, keyed by the file's bytes.

Parsing and checking a JSONL trace record by record is most of a short
replay's loading time (0.1 s of the 12,031-line Mooncake trace, 30 s a GB),
paid again by every new process on the same file. :func:`load` keeps the
parsed :class:`~prefixjax.workloads.Trace` as one ``.npz`` of flat arrays;
a later load of the same bytes with the same arguments reads it back
(a few milliseconds) instead of parsing.

The key is a BLAKE2b digest of the file's bytes (whatever its name, date
or place), the loader's arguments and the source code of the loaders and
of :class:`Trace`, so an edited file, other arguments or another prefixjax
never reuse an entry. A missing, unreadable or corrupt entry is parsed
again and rewritten (atomically: a temporary file, then a rename); a folder
that cannot be written is a one-line warning, and the trace is parsed.
Errors in the trace are raised by the parse as always (nothing is cached
for a bad file).

Arrays computed from a cached trace can be kept beside its entry with
:func:`derived` (the replay's plan of flat block events: 0.05 s of the
Mooncake trace, then 4 ms), keyed by the entry, a name for what and how
it was computed, and the source of the module that computes it.

The folder, first match wins:

1. the ``folder`` argument (the CLI's ``--trace-cache DIR``);
2. the environment variable ``PREFIXJAX_TRACE_CACHE`` (a folder, or
   ``off`` / ``0`` / ``none`` to disable);
3. ``$XDG_CACHE_HOME/prefixjax/traces`` (by default
   ``~/.cache/prefixjax/traces``).

The library's :func:`prefixjax.workloads.load_trace` does not cache
unless given ``cache=``; the CLI does by default (``--no-trace-cache``).
Entries are about the size of the trace's ids in int64 (2.6 MB for the
Mooncake trace); delete the folder to reclaim the space.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import sys
import tempfile
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixjax.workloads.trace import Trace

__all__ = ["ENV_VAR", "cache_folder", "default_cache_dir", "derived", "load"]

ENV_VAR = "PREFIXJAX_TRACE_CACHE"
"""Environment variable naming the cache folder (or ``off``)."""

_OFF = ("", "0", "off", "none", "false", "no")
_FORMAT = b"prefixjax-trace-cache-1"
_RAGGED = ("hash_ids", "input_token_ids", "output_token_ids")
_VECTORS = (
  "arrival_times_s",
  "input_lengths",
  "output_lengths",
  "session_ids",
  "priorities",
)
# The entry each trace the cache returned lives in (for derived()).
_ENTRIES: weakref.WeakKeyDictionary[Trace, pathlib.Path] = (
  weakref.WeakKeyDictionary()
)


def default_cache_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/prefixjax/traces``, else
  ``~/.cache/prefixjax/traces``."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return pathlib.Path(base) / "prefixjax" / "traces"


def cache_folder(folder: str | os.PathLike | None) -> pathlib.Path | None:
  """The folder in use for ``folder`` (see the module docstring), or
  ``None`` when the cache is off."""
  if folder is None:
    folder = os.environ.get(ENV_VAR)
    if folder is None:
      return default_cache_dir()
  if str(folder).strip().lower() in _OFF:
    return None
  return pathlib.Path(folder).expanduser()


@functools.cache
def _code_digest() -> bytes:
  """The loaders' and ``Trace``'s source (``loaders.py`` and ``trace.py``
  beside this file): a change to either makes new keys."""
  digest = hashlib.blake2b(_FORMAT, digest_size=16)
  for name in ("loaders.py", "trace.py"):
    digest.update(pathlib.Path(__file__).with_name(name).read_bytes())
  return digest.digest()


def _key(path: pathlib.Path, arguments: dict[str, Any]) -> str:
  digest = hashlib.blake2b(_code_digest(), digest_size=20)
  digest.update(repr(sorted(arguments.items())).encode())
  with path.open("rb") as handle:
    while chunk := handle.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


def _save(entry: pathlib.Path, trace: Trace) -> None:
  arrays: dict[str, np.ndarray] = {}
  for name in _VECTORS:
    if getattr(trace, name) is not None:
      arrays[name] = getattr(trace, name)
  for name in _RAGGED:
    rows = getattr(trace, name)
    if rows is not None:
      arrays[f"{name}.lengths"] = np.fromiter(map(len, rows), np.int64)
      arrays[f"{name}.flat"] = (
        np.concatenate(rows) if rows else np.zeros(0, np.int64)
      )
  if trace.hash_block_size is not None:
    arrays["hash_block_size"] = np.int64(trace.hash_block_size)
  _write(entry, arrays)


def _write(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
  """``arrays`` as the ``.npz`` ``path``, whole or not at all."""
  handle = tempfile.NamedTemporaryFile(
    dir=path.parent, prefix=".tmp-", suffix=".npz", delete=False
  )
  try:
    with handle:
      np.savez(handle, **arrays)
    os.replace(handle.name, path)
  except BaseException:
    pathlib.Path(handle.name).unlink(missing_ok=True)
    raise


def _read(path: pathlib.Path) -> dict[str, np.ndarray]:
  # Our own handle: np.load leaves its file open when the zip is damaged.
  with path.open("rb") as handle, np.load(handle, allow_pickle=False) as data:
    return {key: data[key] for key in data.files}


def _restore(entry: pathlib.Path, name: str, source: str) -> Trace:
  data = _read(entry)
  fields: dict[str, Any] = {k: data[k] for k in _VECTORS if k in data}
  for key in _RAGGED:
    if f"{key}.flat" in data:
      flat = data[f"{key}.flat"]
      ends = np.cumsum(data[f"{key}.lengths"]).tolist()
      starts = [0, *ends[:-1]]
      fields[key] = [flat[a:b] for a, b in zip(starts, ends, strict=True)]
  if "hash_block_size" in data:
    fields["hash_block_size"] = int(data["hash_block_size"])
  return Trace(
    fields.pop("arrival_times_s"),
    fields.pop("input_lengths"),
    fields.pop("output_lengths"),
    name=name,
    source=source,
    **fields,
  )


def load(
  path: pathlib.Path,
  arguments: dict[str, Any],
  parse: Callable[[], Trace],
  folder: pathlib.Path,
  *,
  name: str,
) -> Trace:
  """``parse()``'s trace of the file ``path``, read from ``folder`` when
  an entry for its bytes and ``arguments`` is there, else parsed and
  stored (module docstring). ``name``: the trace's name for this path
  (the source is the path)."""
  try:
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / f"{_key(path, arguments)}.npz"
  except OSError as error:
    print(f"prefixjax: warning: trace cache off ({error})", file=sys.stderr)
    return parse()
  trace = _read_or_make(
    entry,
    lambda: _restore(entry, name, str(path)),
    parse,
    lambda trace: _save(entry, trace),
    f"parsing {path} again",
  )
  if entry.is_file():
    _ENTRIES[trace] = entry
  return trace


def _read_or_make(path, read, make, write, redo: str):
  """``read()`` when ``path`` exists and reads, else ``make()``, then
  ``write``-n to ``path``; damage and unwritable folders are warnings."""
  if path.is_file():
    try:
      return read()
    except Exception as error:  # noqa: BLE001 (any damage: make it again)
      print(
        f"prefixjax: warning: unreadable trace cache entry {path} "
        f"({type(error).__name__}: {error}); {redo}",
        file=sys.stderr,
      )
  value = make()
  try:
    write(value)
  except OSError as error:
    print(
      f"prefixjax: warning: trace cache entry not written ({error})",
      file=sys.stderr,
    )
  return value


def derived(
  trace: Trace,
  name: str,
  code: tuple[types.ModuleType, ...],
  compute: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
  """``compute()``'s arrays, a pure function of ``trace`` (and of the
  source of the modules ``code``), kept beside the trace's entry when the
  trace came from the cache: a later process reads them back instead of
  computing (the replay's plan: 0.05 s of the Mooncake trace). Computed
  every time for any other trace. ``name`` names what is computed and
  its parameters."""
  entry = _ENTRIES.get(trace)
  if entry is None:
    return compute()
  digest = hashlib.blake2b(name.encode(), digest_size=8)
  for module in code:
    digest.update(pathlib.Path(module.__file__).read_bytes())
  path = entry.with_name(f"{entry.stem}.{digest.hexdigest()}.npz")
  return _read_or_make(
    path,
    lambda: _read(path),
    compute,
    lambda arrays: _write(path, arrays),
    "computing it again",
  )
