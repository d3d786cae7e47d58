"""``prefixjax sweep SPEC --out DIR``: the command line of the sweep runner.

:mod:`prefixjax.cli` owns the parser; this module adds the subcommand's
arguments and runs it.
"""

from __future__ import annotations

import pathlib
import sys
import time

__all__ = ["configure", "run"]

DESCRIPTION = (
  "Expands a sweep spec (TOML: grids and explicit points over replay and "
  "simulate fields; see experiments/ and prefixjax.sweep.spec), runs the "
  "points that share a compiled program as one call, prints a results table "
  "and writes DIR/results.csv, DIR/results.json, DIR/timing.json and "
  "DIR/plots/*.png|pdf. Rerun with the same arguments to resume a killed "
  "run; a different spec in DIR is refused."
)


def configure(p) -> None:
  """Adds the sweep arguments to the subparser ``p``."""
  p.add_argument("spec", metavar="SPEC", help="a sweep spec (.toml)")
  p.add_argument(
    "--out",
    metavar="DIR",
    default=None,
    help="results folder (default: results/<spec name>)",
  )
  p.add_argument(
    "--full",
    action="store_true",
    help="apply the spec's [full] table (the accelerator scale)",
  )
  p.add_argument("--no-plots", action="store_true", help="skip the figures")
  p.add_argument(
    "--list",
    action="store_true",
    help="print the expanded points and their groups, run nothing",
  )


def run(args) -> int:
  from prefixjax.sweep import load_spec, run_sweep
  from prefixjax.sweep.runner import groups

  spec = load_spec(args.spec, full=args.full)
  if args.list:
    for g in groups(spec):
      p0 = g[0]
      print(f"group of {len(g)}: {p0.mode} on {p0.workload.name}")
      for p in g:
        fields = ", ".join(f"{k}={v}" for k, v in p.params)
        print(f"  [{p.index}] {fields}")
    return 0
  out = pathlib.Path(args.out or pathlib.Path("results") / spec.name)
  start = time.perf_counter()
  result = run_sweep(spec, out, plots=not args.no_plots)
  wall = time.perf_counter() - start
  print(result.table())
  ran = len(result.rows) - result.reused
  print(
    f"\n{len(result.rows)} of {len(spec.points)} points "
    f"({ran} run, {result.reused} from an earlier run, "
    f"{len(result.skipped)} skipped) in {wall:.1f} s"
  )
  for index, reason in result.skipped[:3]:
    print(f"skipped point {index}: {reason}")
  print(f"results: {out / 'results.csv'} and {out / 'results.json'}")
  figures = [f for f in result.files if f.endswith(".png")]
  if figures:
    print(f"plots ({len(figures)} PNG + PDF): {out / 'plots'}")
  sys.stdout.flush()
  return 0
