#!/bin/bash
# The wide GEMM tiles' splits in one pipelined loop (a split's sum added to the splits before it at its last
# k-tile, where a loop a split drained and refilled the pipeline at every split) and x's tiles through TMA
# (config way 3, linear_configs.WIDE_WAY), on the device in one call (~9 min on an H100; log in $OUT/log.txt):
#   1. GPU tests: the wide tiles' bits (test_kernels, test_q8_0: 9B shapes, split K, descriptors, way 3);
#   2. bench/wide_tile_probe.py at 512 rows (the 9B cell's mixed steps): this tree's wide tile by way 0 / 1 / 3,
#      and the tree before (HEAD's two files in .base/nextn/ops, carried) by way 0 / 1, with cuBLAS in each;
#   3. the engine alone at the 9B cell's settings (bench/serve_core_probe.py, 512-id prompts, K=0, 16 streams,
#      chunked at a 512 budget, 256 prompts): the tree before, this tree, this tree with WIDE_WAY = 0 (pointer
#      loads; run 210 ran it while 0 was the default, the copy then taking 3).
# Carry .whl and .base. Usage: bash bench/gemm_levers.sh   Env: DEADLINE (s, default 560).
set -o pipefail
DEADLINE=${DEADLINE:-560}
source bench/device_env.sh
device_log
[ -f .base/nextn/ops/triton_linear.py ] || { echo "gemm_levers: carry .base (the tree before's GEMM files)"; exit 2; }
rm -rf /tmp/old && cp -r . /tmp/old && cp .base/nextn/ops/*.py /tmp/old/nextn/ops/
patched_tree /tmp/w0 nextn/ops/linear_configs.py "WIDE_WAY = 3" "WIDE_WAY = 0" || exit 2
fits 110 "gpu tests: wide tiles' bits" && timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  tests/test_q8_0.py -k "wide or descriptor or x_through or split or bf16" 2>&1 | tail -3
probe() {  # probe TREE NAME EXTRA...: wide_tile_probe at 512 rows in TREE -> $OUT/wide_NAME.json
  local tree=$1 name=$2; shift 2
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 100 python3 bench/wide_tile_probe.py --rows 512 --only-extra \
    --extra "$@" --json $OUT/wide_$name.json 2>&1 | grep "^wide")
}
fits 100 "wide tiles at 512 rows, this tree (ways 0 / 1 / 3)" && probe $PWD new 128,128,8,4,64 128,128,8,4,64,1 \
  128,128,8,4,64,3 128,128,8,3,64,3
fits 80 "wide tiles at 512 rows, the tree before (ways 0 / 1)" && probe /tmp/old old 128,128,8,4,64 128,128,8,4,64,1
core() {  # core TREE NAME: the engine alone at the 9B cell's settings -> $OUT/core_NAME.json
  (cd $1 && PYTHONPATH=$1:/tmp/site timeout 120 python3 bench/serve_core_probe.py --random-weights qwen3.5-9b \
    --spec-k 0 --max-num-seqs 16 --prefill chunked --no-prefix-cache --max-num-batched-tokens 512 --prompt-len 512 \
    --num-prompts 256 --json $OUT/core_$2.json 2>&1 | grep -E "tokens_per_s|ttft_ms|prefill_step|other_step" | cut -c1-200)
}
fits 120 "engine alone, 9B cell, this tree" && core $PWD new
fits 120 "engine alone, 9B cell, WIDE_WAY = 0" && core /tmp/w0 w0
fits 120 "engine alone, 9B cell, the tree before" && core /tmp/old old
ls $OUT
