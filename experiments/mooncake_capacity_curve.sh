#!/usr/bin/env bash
# Hit rate against capacity on the Mooncake conversation trace (block 512).
# Usage: experiments/mooncake_capacity_curve.sh [path/to/trace.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
trace=${1:-../shared/traces/mooncake_conversation_trace.jsonl}
mkdir -p results
# 1%, 2%, 5%, 10%, 20%, 40% of the trace's 182,790 distinct blocks.
prefixjax replay --trace "$trace" \
  --capacity 1827 3655 9139 18279 36558 73116 \
  --policy fifo lru_leaf belady_leaf \
  --json results/mooncake_capacity_curve.json \
  --plot results/mooncake_capacity_curve.png
