"""Experiment sweeps: a spec file, one command, a results table and plots.

A sweep spec (TOML; :mod:`prefixjax.sweep.spec`) describes grids and
explicit points over the replay's and the serving simulator's fields;
:func:`run_sweep` groups the points that share a compiled program, runs
each group as one call (capacities batched by the replay engines,
configurations vmapped and sharded by the simulator), and writes tidy rows
(CSV and JSON), the timing and the figures; a killed run resumes.

Example:
  >>> from prefixjax.sweep import parse_spec, run_sweep
  >>> spec = parse_spec({
  ...     "workloads": {"w": {"generator": "system_prompt", "requests": 40}},
  ...     "replay": {"policy": ["fifo", "lru_leaf"], "capacity": [8, 32],
  ...                "warmup_fraction": 0.0}})
  >>> len(spec.points)
  4
  >>> result = run_sweep(spec)
  >>> [(r["policy"], r["capacity"]) for r in result.rows]
  [('fifo', 8), ('fifo', 32), ('lru_leaf', 8), ('lru_leaf', 32)]
"""

from prefixjax.sweep.runner import SweepError, SweepResult, run_sweep
from prefixjax.sweep.spec import (
  MODES,
  REPLAY_FIELDS,
  SIMULATE_FIELDS,
  Point,
  SpecError,
  SweepSpec,
  WorkloadSpec,
  load_spec,
  parse_spec,
)

__all__ = [
  "MODES",
  "REPLAY_FIELDS",
  "SIMULATE_FIELDS",
  "Point",
  "SpecError",
  "SweepError",
  "SweepResult",
  "SweepSpec",
  "WorkloadSpec",
  "load_spec",
  "parse_spec",
  "run_sweep",
]
