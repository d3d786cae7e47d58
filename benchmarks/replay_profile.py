"""Per-event cost of the event engine (`replay(engine="event")`) on Mooncake.

Usage: python benchmarks/replay_profile.py [policy ...] [--events N]
Prints compile seconds and the min / median run seconds of 3 runs over the
first N block events (all by default), 4 capacities vmapped in one program.
"""

import argparse
import dataclasses

import numpy as np

import prefixjax as pj
from prefixjax import replay as rp

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
CAPS = [1827, 9139, 18279, 36558]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("policies", nargs="*", default=list(rp.REPLAY_POLICIES))
  ap.add_argument("--events", type=int, default=0)
  ap.add_argument("--repeat", type=int, default=3)
  a = ap.parse_args()
  tr = pj.load_trace(TRACE)
  plan = rp.prepare_replay(
    tr.hash_ids, tr.input_lengths, block_size=512, warmup_fraction=0.5
  )
  if a.events:
    e = a.events
    plan = dataclasses.replace(
      plan,
      node=plan.node[:e],
      weight=plan.weight[:e],
      next_use=plan.next_use[:e],
      first=plan.first[:e],
      request=plan.request[:e],
    )
  for pol in a.policies:
    # The event engine; the first call compiles, the rest reuse it.
    results = [
      rp.replay(plan, policy=pol, capacities=CAPS, engine="event")
      for _ in range(a.repeat)
    ]
    compile_s = results[0].timing.compile_s
    runs = [r.timing.run_s for r in results]
    hits = [int(p.per_request_hit_tokens.sum()) for p in results[0]]
    print(
      f"{pol}: compile {compile_s:.2f}s run min {min(runs):.3f}s "
      f"median {np.median(runs):.3f}s "
      f"({min(runs) / plan.num_events * 1e6:.2f} us/event) "
      f"hits {hits}",
      flush=True,
    )


if __name__ == "__main__":
  main()
