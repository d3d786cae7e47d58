"""prefixjax: paged KV caches with prefix sharing, on the device.

All cache bookkeeping is fixed-shape arrays in frozen pytrees, changed only by
jitted pure functions, so it runs inside ``jit`` / ``scan`` and can be
``vmap``-ed over configurations. See ``DESIGN.md`` for the semantics.

Example:
  >>> import prefixjax as pj
  >>> state = pj.init_paging(num_blocks=16, block_size=4, max_seqs=2,
  ...                        max_blocks_per_seq=4)
  >>> state, result = pj.allocate(state, 0, 6)
  >>> pj.Status(int(result.status)).name
  'OK'
"""

from prefixjax import (
  hashing,
  index,
  paging,
  plots,
  policies,
  prefix_cache,
  replay,
  serving_replay,
  sglang_replay,
  victim_tree,
  workloads,
)
from prefixjax.paging import (
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
  copy_on_write,
  fork,
  release,
  slot_mapping,
)
from prefixjax.paging import init as init_paging
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
  "check_invariants",
  "copy_on_write",
  "default_workload",
  "fork",
  "generate_workload",
  "hashing",
  "index",
  "init_paging",
  "load_csv_trace",
  "load_mooncake",
  "load_token_trace",
  "load_trace",
  "merge_traces",
  "paging",
  "plots",
  "policies",
  "prefix_cache",
  "register_workload",
  "release",
  "replay",
  "serving_replay",
  "sglang_replay",
  "slot_mapping",
  "victim_tree",
  "workload_defaults",
  "workload_kinds",
  "workloads",
]
