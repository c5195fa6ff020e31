#!/bin/bash
# The scratch slot (nextn.config.SCRATCH_SLOTS: a slot no request holds, where a mixed round's pad piece
# runs when kept sessions or running requests hold every request slot) on the device, in one call
# (~6 min on an H100; its whole log in $OUT/log.txt):
#   1. GPU tests: the split-sharing mixed rounds (a pad piece on the scratch slot with every request slot
#      held, on real graphs);
#   2. the bundled model served under `--prefill chunked`, K=3, 128 out, 16 / 64 streams
#      (bench/serve_bench.sh), on this tree and on a copy with SCRATCH_SLOTS = 0 (the A / B), merged
#      into $OUT/serve_cells.json;
#   3. bench/serve_core_probe.py --keys under `--prefill chunked` (the bundled model, 128 prompts of
#      60-900 tokens, kept sessions: the mixed keys met, now with a pad piece always possible).
# Carry .whl. Usage: bash bench/scratch_check.sh   Env: DEADLINE (s, default 470).
set -o pipefail
DEADLINE=${DEADLINE:-470}
source bench/device_env.sh
device_log
stage "gpu tests"
timeout 150 python3 -m pytest -q tests/test_batching.py -k "any_split or mixed_rounds or wait_for" 2>&1 | tail -3
patched_tree /tmp/noscratch nextn/config/__init__.py "SCRATCH_SLOTS = 1" "SCRATCH_SLOTS = 0" || exit 2
fits 90 "bundled served, chunked, K=3, 128 out" && SERVE_FLAGS="--prefill chunked" OUTS=128 bash bench/serve_bench.sh scratch 3
fits 90 "the same without the scratch slot" && (cd /tmp/noscratch && PYTHONPATH=/tmp/noscratch:/tmp/site \
  SERVE_FLAGS="--prefill chunked" OUTS=128 bash bench/serve_bench.sh noscratch 3)
fits 90 "engine alone, chunked, keys" && timeout 90 python3 bench/serve_core_probe.py --prefill chunked --no-prefix-cache \
  --keys --num-prompts 128 --json $OUT/core_keys.json 2>&1 | grep -E "mixed_keys|ttft_ms|output_tokens|steps:" | cut -c1-300
python3 bench/serve_cells.py
ls $OUT
