"""Workloads: real trace loaders and seeded synthetic generators.

A workload is a `Trace`: R requests in replay order as host-side numpy
arrays, with per-block hash ids (Mooncake) or token ids (token-id traces and
every generator) when prefix sharing is known.
"""

from prefixjax.workloads.loaders import (
  DEFAULT_MOONCAKE_BLOCK_SIZE,
  TRACE_FORMATS,
  load_csv_trace,
  load_mooncake,
  load_token_trace,
  load_trace,
)
from prefixjax.workloads.synthetic import (
  DEFAULT_VOCAB_SIZE,
  default_workload,
  generate_workload,
  register_workload,
  unregister_workload,
  workload_defaults,
  workload_kinds,
)
from prefixjax.workloads.trace import (
  PrefixNumbering,
  Trace,
  TraceFormatError,
  merge_traces,
)

__all__ = [
  "DEFAULT_MOONCAKE_BLOCK_SIZE",
  "DEFAULT_VOCAB_SIZE",
  "TRACE_FORMATS",
  "PrefixNumbering",
  "Trace",
  "TraceFormatError",
  "default_workload",
  "generate_workload",
  "load_csv_trace",
  "load_mooncake",
  "load_token_trace",
  "load_trace",
  "merge_traces",
  "register_workload",
  "unregister_workload",
  "workload_defaults",
  "workload_kinds",
]
