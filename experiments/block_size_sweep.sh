#!/usr/bin/env bash
# Peak blocks, copy-on-write copies and fragmentation by block size.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
prefixjax demo --block-sizes 4 8 16 32 64 128 --requests 128 \
  --json results/block_size_sweep.json
