"""Timing and table helpers shared by the ``*_ops.py`` pool-size benchmarks.

Imported as ``_timing``: the benchmarks run as ``python benchmarks/X.py``, so
this folder is the first entry of ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import numpy as np

POOLS = (4_096, 65_536, 262_144)


def add_scan_args(parser: argparse.ArgumentParser) -> None:
  """``--steps``, ``--repeats`` and ``--pools``, common to the benchmarks."""
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--pools", type=int, nargs="+", default=list(POOLS))


def machine() -> str:
  """``jax <version> on <backend> (<processor>)``, for the table's heading."""
  return (
    f"jax {jax.__version__} on {jax.default_backend()} "
    f"({platform.processor() or platform.machine()})"
  )


def time_median(fn, *args, repeats):
  """``(median seconds of fn(*args) over repeats, first output)``; the first
  call compiles and warms up and is not timed."""
  out = fn(*args)
  jax.block_until_ready(out)  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), out


def print_flatness_table(
  rows, scenarios, pools, *, value, name_width, cell_width
):
  """One line per scenario: ``rows[value]`` by pool and the max/min ratio,
  ``flat`` when it is within 2x."""
  header = f"{'scenario':{name_width}s}" + "".join(
    f"{p:>{cell_width + 2},d}" for p in pools
  )
  print(header + "   max/min")
  for name in scenarios:
    cells = [r[value] for r in rows if r["scenario"] == name]
    ratio = max(cells) / min(cells)
    flat = "flat" if ratio <= 2 else "NOT FLAT"
    line = f"{name:{name_width}s}" + "".join(
      f"{c:{cell_width}.2f}us" for c in cells
    )
    print(f"{line}   {ratio:5.2f} {flat}")


def write_json(path, rows):
  """Writes ``{"jax": version, "rows": rows}`` to ``path`` when it is set."""
  if path:
    with open(path, "w") as f:
      json.dump({"jax": jax.__version__, "rows": rows}, f, indent=2)
