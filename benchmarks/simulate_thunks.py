"""Where the serving loop's time goes on XLA:CPU: thunks executed per loop.

On CPU the jitted loop of :func:`prefixjax.serving.simulate` spends most of
its time in XLA's thunk executor (one thunk per fused HLO operation), not in
the generated code, so its cost is about the number of thunks it executes.
This runs ``simulate`` once to compile, then again under
:func:`jax.profiler.trace` with XLA's per-thunk trace events on
(``--xla_cpu_enable_xprof_traceme=true``), reads the trace with
:class:`jax.profiler.ProfileData` and prints, for every ``while`` and
``conditional`` thunk, how often it ran and how many thunks ran inside it
per run, with the ``jit(...)`` path of the operation in the compiled HLO.
The trace slows the run by about 50x: read the counts, not the times.

Usage: ``python benchmarks/simulate_thunks.py [--requests 300] [--seqs 16]
[--top 15]``.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import collections
import os
import re
import shutil
import tempfile

# Before jax is imported: XLA reads its flags once. The optimized HLO of
# every program is dumped as text, to name each while / cond thunk.
_DUMP = tempfile.mkdtemp(prefix="prefixjax_thunks_")
atexit.register(shutil.rmtree, _DUMP, ignore_errors=True)
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_cpu_enable_xprof_traceme=true"
  + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"
  + " --xla_dump_hlo_pass_re=NONE"
).strip()

import jax  # noqa: E402

from prefixjax import serving  # noqa: E402
from prefixjax.serving import ServingConfig  # noqa: E402
from prefixjax.workloads import default_workload  # noqa: E402


def _op_names(hlo: str) -> dict[str, str]:
  """HLO instruction name -> its ``op_name`` metadata (the jit path)."""
  out = {}
  pat = re.compile(r'^\s*%?([\w.\-]+) = .*?op_name="([^"]*)"')
  for line in hlo.splitlines():
    m = pat.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=300)
  p.add_argument("--seqs", type=int, default=16)
  p.add_argument("--top", type=int, default=15)
  args = p.parse_args()
  trace = default_workload(num_requests=args.requests, seed=0)
  config = ServingConfig(
    num_gpu_blocks=4097,
    block_size=16,
    max_num_seqs=args.seqs,
    max_num_batched_tokens=2048,
    max_model_len=4096,
  )
  result = serving.simulate(trace, config)
  # The engine loop's program: the largest optimized module dumped.
  dumps = [
    os.path.join(_DUMP, f)
    for f in os.listdir(_DUMP)
    if f.endswith("after_optimizations.txt")
  ]
  with open(max(dumps, key=os.path.getsize)) as f:
    names = _op_names(f.read())
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      serving.simulate(trace, config)
    files = [
      os.path.join(r, f)
      for r, _, fs in os.walk(d)
      for f in fs
      if f.endswith(".xplane.pb")
    ]
    prof = jax.profiler.ProfileData.from_file(files[0])
  calls = collections.Counter()
  inside = collections.Counter()
  total = 0
  for plane in prof.planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      evs = sorted(
        (e.start_ns, e.start_ns + e.duration_ns, e.name)
        for e in line.events
        if not e.name.startswith("ThunkExecutor")
      )
      total += len(evs)
      starts = [e[0] for e in evs]
      for s, e, name in evs:
        calls[name] += 1
        if name.startswith(("while", "cond")):
          i, j = bisect.bisect_right(starts, s), bisect.bisect_left(starts, e)
          inside[name] += j - i
  steps = result.num_steps
  print(
    f"jax {jax.__version__}, {args.requests} requests, {args.seqs} "
    f"sequences: {steps} steps, {total:,} thunks ({total / steps:.0f} a step)"
  )
  print(f"{'thunk':>12} {'runs':>7} {'inside/run':>10} {'share':>6}  jit path")
  for name, n in inside.most_common(args.top):
    path = names.get(name, "?").split("/", 1)[-1]
    print(
      f"{name:>12} {calls[name]:>7} {n / calls[name]:>10.1f} "
      f"{n / total:>6.1%}  {path}"
    )


if __name__ == "__main__":
  main()
