"""prefixjax: paged KV caches with prefix sharing, on the device.

All cache bookkeeping is fixed-shape arrays in frozen pytrees, changed only by
jitted pure functions, so it runs inside ``jit`` / ``scan`` and can be
``vmap``-ed over configurations. See ``DESIGN.md`` for the semantics.

The layers, each a subpackage that imports only those below it:
:mod:`prefixjax.cache` (paging core, hashing, prefix index, eviction
policies, the prefix cache; ``prefixjax.cache.checked`` is its host-checked
layer), :mod:`prefixjax.workloads` (trace loaders and generators) and
:mod:`prefixjax.replay` (trace replay) and :mod:`prefixjax.serving` (the
serving simulator). The paging verbs are re-exported here;
``prefixjax.replay``, ``prefixjax.serving`` and ``prefixjax.plots`` load on
first use.

Example:
  >>> import prefixjax as pj
  >>> state = pj.init_paging(num_blocks=16, block_size=4, max_seqs=2,
  ...                        max_blocks_per_seq=4)
  >>> state, result = pj.allocate(state, 0, 6)
  >>> pj.Status(int(result.status)).name
  'OK'
"""

import importlib

from prefixjax import cache, workloads
from prefixjax.cache import (
  NO_BLOCK,
  NULL_BLOCK,
  AllocateResult,
  AppendResult,
  BatchView,
  CopyResult,
  PagingState,
  ReleaseResult,
  Status,
  allocate,
  append,
  batch_view,
  check_invariants,
  checked,
  copy_on_write,
  fork,
  init_paging,
  release,
  slot_mapping,
)
from prefixjax.compile_cache import enable_compile_cache
from prefixjax.workloads import (
  Trace,
  TraceFormatError,
  default_workload,
  generate_workload,
  load_csv_trace,
  load_mooncake,
  load_token_trace,
  load_trace,
  merge_traces,
  register_workload,
  workload_defaults,
  workload_kinds,
)

__version__ = "0.1.0"

# Loaded on first use, so that `import prefixjax` imports no replay engine.
_LAZY = ("plots", "replay", "serving")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"prefixjax.{name}")
  raise AttributeError(f"module 'prefixjax' has no attribute {name!r}")


__all__ = [
  "NO_BLOCK",
  "NULL_BLOCK",
  "AllocateResult",
  "AppendResult",
  "BatchView",
  "CopyResult",
  "PagingState",
  "ReleaseResult",
  "Status",
  "Trace",
  "TraceFormatError",
  "__version__",
  "allocate",
  "append",
  "batch_view",
  "cache",
  "check_invariants",
  "checked",
  "copy_on_write",
  "default_workload",
  "enable_compile_cache",
  "fork",
  "generate_workload",
  "init_paging",
  "load_csv_trace",
  "load_mooncake",
  "load_token_trace",
  "load_trace",
  "merge_traces",
  "plots",
  "register_workload",
  "release",
  "replay",
  "serving",
  "slot_mapping",
  "workload_defaults",
  "workload_kinds",
  "workloads",
]
