#!/bin/bash
# The chunked delta rule's kernels (nextn.ops.triton_gdn_chunk) against earlier trees' in one device call (~6 min
# on an H100; log in $OUT/log.txt). The earlier trees' triton_gdn_chunk.py travel in .base/NAME/ (git-ignored;
# made before the call from git, e.g. `mkdir -p .base/run212 && git show 4d2a122:nextn/ops/triton_gdn_chunk.py >
# .base/run212/triton_gdn_chunk.py`); BASE_RULE names the one the engine runs beside this tree (default
# .base/run212/triton_gdn_chunk.py):
#   1. GPU tests: the rule against the float32 reference (the 9B's heads over 517 tokens among them), pieces
#      one after another, the caches' states in place; the chunked pieces in prefill and mixed rounds;
#   2. bench/chunk_rule_probe.py at 1 x 256, 1 x 512 and 16 x 512 rows: every .base tree's rule (--base) and
#      this tree's variants (precisions, the three kernels' warps, stages and value columns)
#      -> $OUT/chunk_split.json;
#   3. the engine alone at the 9B cell's settings (bench/serve_core_probe.py, budget 512) -> $OUT/core_new.json;
#   4. the 9B cell served against the same run's offline figure, and that figure on the server's GEMM configs
#      (UNTUNED=1: `nextn bench --no-tune`) -> $OUT/s9b_new.json, $OUT/offline_9b*.json;
#   5. the engine alone on the BASE_RULE tree -> $OUT/core_base.json (each stage only if the deadline allows).
# Run 212 (4d2a122's kernels with the prep at 8 warps, against 74b882b's and 7d455c8's) ran this script.
# Carry .whl, .var and .base. Usage: bash bench/chunk_split_check.sh   Env: DEADLINE, BASE_RULE.
set -o pipefail
DEADLINE=${DEADLINE:-570}
tar xJf .var/tok.txz -C .
source bench/device_env.sh
device_log
BASE_RULE=${BASE_RULE:-.base/run212/triton_gdn_chunk.py}
[ -f $BASE_RULE ] || { echo "chunk_split_check: no $BASE_RULE (carry .base)"; exit 2; }
fits 120 "gpu tests: the chunked rule" && timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels.py -k "chunk or default_wide" 2>&1 | grep -E "passed|failed|Error|assert" | head -12
fits 90 "gpu tests: chunked pieces in steps" && timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/test_prefill.py tests/test_batching.py -k "chunk or mixed_rounds or any_split" 2>&1 \
  | grep -E "passed|failed|Error|assert" | head -8
fits 120 "chunk rule: the earlier trees against this tree's variants" && timeout 120 python3 bench/chunk_rule_probe.py \
  --cases 1x256 1x512 16x512 --base .base/*/triton_gdn_chunk.py \
  --variants default prep_w8 states_s2 states_bv16 states_bv64 out_w8 --json $OUT/chunk_split.json 2>&1 | grep -E "^[0-9]+x|Error"
core() {  # core TREE NAME: the engine alone at the 9B cell's settings -> $OUT/core_NAME.json
  (cd $1 && PYTHONPATH=$1:/tmp/site timeout 100 python3 bench/serve_core_probe.py --random-weights qwen3.5-9b \
    --spec-k 0 --max-num-seqs 16 --prefill chunked --no-prefix-cache --max-num-batched-tokens 512 --prompt-len 512 \
    --num-prompts 256 --json $OUT/core_$2.json 2>&1 | grep -E "tokens_per_s|ttft_ms|prefill_step|other_step" \
    | cut -c1-200)
}
fits 100 "engine alone, 9B cell, this tree" && core $PWD new
fits 220 "9B served, this tree" && SERVE_FLAGS="--prefill chunked --max-num-batched-tokens 512" NUM_PROMPTS=256 \
  UNTUNED=1 bash bench/serve_9b.sh 2>&1 | tail -6 && mv $OUT/serve_9b_vs_offline.json $OUT/s9b_new.json \
  && rm -f $OUT/serve_9b.json $OUT/serve_9b.log $OUT/server_9b.log $OUT/offline_9b.log
rm -rf /tmp/base_tree && cp -r . /tmp/base_tree && cp $BASE_RULE /tmp/base_tree/nextn/ops/triton_gdn_chunk.py
fits 100 "engine alone, 9B cell, the BASE_RULE tree" && core /tmp/base_tree base
ls $OUT
