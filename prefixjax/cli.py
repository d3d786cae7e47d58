"""The ``prefixjax`` command line.

Subcommands:

* ``demo``: parallel sampling through the paging core, by block size, on a
  built-in generated workload (no files needed).

Bad arguments and bad input files exit with status 2 and a one-line message;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_USAGE = 2


class CliError(Exception):
  """A user-facing error: printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"{value} must be > 0")
  return value


def _add_demo(subparsers) -> None:
  p = subparsers.add_parser(
    "demo",
    help="parallel sampling on the paging core, by block size",
    description=(
      "Replays a generated parallel-sampling workload (prompts forked into n "
      "samples that decode one token at a time) through the paging core in "
      "one jitted scan per block size, and prints peak blocks with and "
      "without sharing, copy-on-write copies, out-of-block events and "
      "internal fragmentation."
    ),
  )
  p.add_argument(
    "--block-sizes",
    type=_positive_int,
    nargs="+",
    default=[8, 16, 32, 64],
    metavar="K",
  )
  p.add_argument("--requests", type=_positive_int, default=64)
  p.add_argument("--samples", type=_positive_int, default=4, metavar="N")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--pool-tokens",
    type=_positive_int,
    default=65_536,
    help="KV pool size in tokens (blocks = pool_tokens // block_size + 1)",
  )
  p.add_argument("--json", metavar="OUT", help="also write results as JSON")
  p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
  import dataclasses

  import jax

  from prefixjax.demo import format_table, run_demo

  print(
    f"prefixjax demo: {args.requests} requests, {args.samples} samples per "
    f"prompt, pool {args.pool_tokens:,} tokens, jax {jax.__version__} on "
    f"{jax.default_backend()}",
    flush=True,
  )
  rows = run_demo(
    block_sizes=args.block_sizes,
    num_requests=args.requests,
    samples=args.samples,
    seed=args.seed,
    pool_tokens=args.pool_tokens,
  )
  print(format_table(rows))
  print(
    "peak blocks: most blocks in use at once; unshared: the same samples "
    "without fork sharing;\nCoW: copy-on-write copies; OOB: allocations "
    "refused for lack of blocks; frag: unused slots in held blocks."
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    print(f"wrote {args.json}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  """The argument parser (exposed for tests and docs)."""
  from prefixjax import __version__

  parser = argparse.ArgumentParser(
    prog="prefixjax",
    description="On-device paged KV caches with prefix sharing.",
  )
  parser.add_argument(
    "--version", action="version", version=f"prefixjax {__version__}"
  )
  parser.add_argument(
    "--debug", action="store_true", help="show tracebacks on errors"
  )
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  _add_demo(subparsers)
  return parser


def main(argv=None) -> int:
  """Entry point of the ``prefixjax`` console script."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return EXIT_USAGE
  try:
    return args.func(args)
  except (CliError, ValueError, TypeError, OSError) as err:
    if args.debug:
      raise
    print(f"prefixjax {args.command}: error: {err}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
