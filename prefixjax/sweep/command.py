"""``prefixjax sweep SPEC --out DIR``: the command line of the sweep runner.

:mod:`prefixjax.cli` owns the parser; this module adds the subcommand's
arguments and runs it.
"""

from __future__ import annotations

import os
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
  dist = p.add_argument_group(
    "multi-host",
    "run one process per host (or per GPU) with the same arguments: each "
    "runs its share of the point groups into the shared DIR, process 0 "
    "gathers the results (jax.distributed; see the README)",
  )
  dist.add_argument(
    "--distributed",
    action="store_true",
    help="call jax.distributed.initialize(): with the three flags below, "
    "or $PREFIXJAX_COORDINATOR_ADDRESS / $PREFIXJAX_NUM_PROCESSES / "
    "$PREFIXJAX_PROCESS_ID, else JAX's own detection (TPU pods, SLURM, "
    "Open MPI, $JAX_COORDINATOR_ADDRESS)",
  )
  dist.add_argument("--coordinator-address", metavar="HOST:PORT")
  dist.add_argument("--num-processes", type=int, metavar="N")
  dist.add_argument("--process-id", type=int, metavar="I")
  p.add_argument(
    "--list",
    action="store_true",
    help="print the expanded points and their groups, run nothing",
  )


def _distributed(args) -> tuple[int, int]:
  """``(process index, process count)``; initializes jax.distributed."""
  flags = {
    "coordinator_address": args.coordinator_address,
    "num_processes": args.num_processes,
    "process_id": args.process_id,
  }
  if not args.distributed:
    for key, value in flags.items():
      if value is not None:
        raise ValueError(f"--{key.replace('_', '-')} is for --distributed")
    return 0, 1
  given = dict(flags)
  for key, env in (
    ("coordinator_address", "PREFIXJAX_COORDINATOR_ADDRESS"),
    ("num_processes", "PREFIXJAX_NUM_PROCESSES"),
    ("process_id", "PREFIXJAX_PROCESS_ID"),
  ):
    if given[key] is None and os.environ.get(env):
      given[key] = os.environ[env]
      if key != "coordinator_address":
        try:
          given[key] = int(given[key])
        except ValueError:
          raise ValueError(
            f"${env}={os.environ[env]!r}: not an integer"
          ) from None
  address = given["coordinator_address"]
  if address is not None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(
        f"--coordinator-address {address!r}: must be HOST:PORT (e.g. "
        "10.0.0.1:1234), the port a number in 1..65535"
      )
  n, i = given["num_processes"], given["process_id"]
  if n is not None and n < 1:
    raise ValueError(f"--num-processes {n}: must be >= 1")
  if i is not None and not (0 <= i < (n if n is not None else 1 << 30)):
    raise ValueError(f"--process-id {i}: must be in [0, --num-processes)")
  import jax

  jax.distributed.initialize(
    **{k: v for k, v in given.items() if v is not None}
  )
  return jax.process_index(), jax.process_count()


def run(args) -> int:
  from prefixjax.sweep import load_spec, run_sweep
  from prefixjax.sweep.runner import groups, left_out_notes

  spec = load_spec(args.spec, full=args.full)
  if args.list:
    for note in left_out_notes(spec):
      print(note)
    for name, w in spec.workloads.items():
      if any(p.workload.name == name for p in spec.points) and (
        why := w.missing()
      ):
        print(f"workload {name}: {why}; its points would be skipped")
    for g in groups(spec):
      p0 = g[0]
      print(f"group of {len(g)}: {p0.mode} on {p0.workload.name}")
      for p in g:
        fields = ", ".join(f"{k}={v}" for k, v in p.params)
        if p.workload.generator:  # points may differ by seed alone
          fields = f"workload_seed={p.workload.seed}, {fields}"
        print(f"  [{p.index}] {fields}")
    return 0
  out = pathlib.Path(args.out or pathlib.Path("results") / spec.name)
  process = _distributed(args)
  start = time.perf_counter()
  result = run_sweep(spec, out, plots=not args.no_plots, process=process)
  if process[0] != 0:
    print(
      f"process {process[0]} of {process[1]}: {len(result.rows)} points "
      f"written to {out / 'points'}; process 0 writes the results"
    )
    return 0
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
