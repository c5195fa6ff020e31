#!/bin/bash
# The wide GEMM tiles through TMA (x's tiles and the weights', WIDE_WAY 3; the K splits in one pipelined loop;
# the norm-writing GEMMs in WIDE_K k-tiles too) on the device in one call (~6 min on an H100; log in $OUT/log.txt):
#   1. GPU tests: the wide and mid tiles' bits at the 9B's shapes and split K (test_kernels, test_q8_0), the mixed
#      rounds in CUDA graphs (the descriptors captured) and the scratch slot's pad pieces (test_batching);
#   2. the engine alone at the 9B cell's settings (bench/serve_core_probe.py: 512-id prompts, 128 out, K=0, 16
#      streams, chunked, 256 prompts) at token budgets 512, 256 and 384 (a mixed step's rows: 16 decode rows and
#      up to 448 / 192 / 320 prompt rows in whole 64-row chunks: at fewer rows the GEMMs stream the weights about
#      as a round does, at 256 in mid tiles; 384 last);
#   3. bench/chunk_rule_probe.py at 1 x 256 and 1 x 512 rows: the scan's launch (two stages, 16 value columns, 4 warps);
#   4. (if the deadline allows) the 9B cell served at the best of those budgets against the same run's offline
#      `nextn bench --batch 16` (bench/serve_9b.sh) -> $OUT/s9b_BUDGET.json.
# Carry .whl and .var (.var/tok.txz: the Qwen3.5 tokenizer). Usage: bash bench/wide_way_check.sh   Env: DEADLINE.
set -o pipefail
DEADLINE=${DEADLINE:-570}
tar xJf .var/tok.txz -C .
source bench/device_env.sh
device_log
fits 100 "gpu tests: wide / mid tiles' bits" && timeout 100 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_kernels.py -k "x_through or mid_tiles_keep or descriptor or default_wide" 2>&1 \
  | grep -E "passed|failed|Error|assert" | head -12
fits 80 "gpu tests: mixed rounds in graphs" && timeout 80 python3 -m pytest -q -p no:cacheprovider \
  tests/test_batching.py -k "any_split or mixed_rounds or wait_for" 2>&1 | grep -E "passed|failed|Error|assert" | head -8
core() {  # core BUDGET: the engine alone at the 9B cell's settings -> $OUT/core_BUDGET.json
  timeout 100 python3 bench/serve_core_probe.py --random-weights qwen3.5-9b --spec-k 0 --max-num-seqs 16 \
    --prefill chunked --no-prefix-cache --max-num-batched-tokens $1 --prompt-len 512 --num-prompts 256 \
    --json $OUT/core_$1.json 2>&1 | grep -E "tokens_per_s|ttft_ms|prefill_step|other_step" | cut -c1-200
}
for budget in 512 256; do fits 100 "engine alone, 9B cell, budget $budget" && core $budget; done
fits 100 "chunk rule: the scan's launch (stages, value columns, warps)" && timeout 100 python3 bench/chunk_rule_probe.py \
  --cases 1x256 1x512 --variants o_tf32 scan_s2 scan_bv16 scan_bv16_s2 scan_bv16_w4 scan_w4 --json $OUT/chunk_scan.json \
  2>&1 | grep -E "^1x"
fits 100 "engine alone, 9B cell, budget 384" && core 384
best=$(python3 - $OUT <<'PY'
import json, sys
from pathlib import Path
runs = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("core_*.json")}
tps = {b: r["output_tokens_per_s"] for b, r in runs.items()}
print(max(tps, key=tps.get) if tps else 512)
PY
)
fits 260 "9B served at $best" && SERVE_FLAGS="--prefill chunked --max-num-batched-tokens $best" NUM_PROMPTS=256 \
  bash bench/serve_9b.sh 2>&1 | tail -5 && mv $OUT/serve_9b_vs_offline.json $OUT/s9b_$best.json \
  && rm -f $OUT/serve_9b.json $OUT/serve_9b.log $OUT/server_9b.log $OUT/offline_9b.log
ls $OUT
