#!/bin/bash
# Mixed rounds keyed by their pieces' count, total rows and chunks (any split: StepBatch.resplit; a pad piece
# filling them to a bucket where a slot is free), the chunked rule over pieces one after another
# (chunk_starts), with the thirtieth session's host-wait and compile fixes, on the device in one call
# (~8 min on an H100; its whole log in $OUT/log.txt):
#   1. GPU tests: the split-sharing mixed round on real graphs, the chunked rule's kernels (the varlen scan
#      natively, the 9B heads), the GPU-marked batching / graphs / prefill tests; the sync test on a copy
#      with RequestRounds._settle's old synchronizing copy put back (it must fail there);
#   2. bench/sync_probe.py (no implicit sync, no Triton compile after the warm-up expected);
#   3. bench/serve_core_probe.py --keys under `--prefill chunked` (the bundled model, 128 prompts of 60-900
#      tokens: the mixed keys met and the TTFT, engine alone);
#   4. the bundled model served, spec on / off (bench/serve_bench.sh) under serve's default prefill and
#      under `--prefill chunked`, merged into $OUT/serve_cells.json (<= 8 files return).
# Carry .whl. Usage: bash bench/mixed_split_check.sh   Env: DEADLINE (s, default 540).
set -o pipefail
DEADLINE=${DEADLINE:-540}
source bench/device_env.sh
device_log
stage "gpu tests"
timeout 150 python3 -m pytest -q tests/test_batching.py -k "any_split or mixed_rounds or wait_for" 2>&1 | tail -4
timeout 150 python3 -m pytest -q tests/test_kernels.py -k "chunk" 2>&1 | tail -2
timeout 150 python3 -m pytest -q -m gpu tests/test_graphs.py tests/test_prefill.py 2>&1 | tail -2
patched_tree /tmp/old nextn/engine/rounds.py "        cache.ctl.copy_(to_device(ctl, cache.ctl.device, torch.int32))" \
  "        cache.ctl.copy_(ctl.to(cache.ctl.device))" || exit 2
stage "sync test, _settle's old copy (must fail)"
(cd /tmp/old && timeout 60 python3 -m pytest -q -m gpu tests/test_batching.py -k wait_for_the_gpu 2>&1 | grep -E "^E .*assert|passed|failed" | head -4)
fits 100 "sync probe" && timeout 100 python3 bench/sync_probe.py --requests 32 --json $OUT/sync_probe.json 2>&1 \
  | grep -E "synchronizing|^ +[0-9]+ |compiled a kernel" | cut -c1-160 | tail -20
fits 90 "engine alone, chunked, keys" && timeout 90 python3 bench/serve_core_probe.py --prefill chunked --no-prefix-cache --keys \
  --num-prompts 128 --json $OUT/core_keys.json 2>&1 | grep -E "mixed_keys|ttft|output_tokens|steps:|compiles" | cut -c1-300
fits 150 "bundled served, serve's default prefill" && NUM_PER_STREAM=8 bash bench/serve_bench.sh default 3 0
fits 80 "bundled served, chunked, 128 out" && SERVE_FLAGS="--prefill chunked" OUTS=128 NUM_PER_STREAM=8 bash bench/serve_bench.sh chunked 3 0
python3 bench/serve_cells.py
ls $OUT
