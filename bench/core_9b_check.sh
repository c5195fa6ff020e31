#!/bin/bash
# (Run 208 ran it with a stage 0 more, the chunk prep's inverse by rows, since removed: slower.)
# Where the served 9B cell (issue 44's 0.85 bar; run 207: 0.700 at a 512-token budget) loses its time,
# and whether larger mixed steps pay, in one device call (~8 min on an H100; its whole log in $OUT/log.txt):
#   0b. the wide GEMM tiles at 512 rows with their weight tiles loaded through TMA (bench/wide_tile_probe.py);
#   1. bench/serve_9b.sh at --max-num-batched-tokens 1040 (two 512-row prompts a mixed step beside the
#      16 decode rows), 256 prompts at 16 streams, with the run's offline `nextn bench --batch 16`;
#   2. the engine alone at the served cell's settings (bench/serve_core_probe.py: 512-id prompts, K=0,
#      16 sequences, chunked, budget 512, no prefix cache, 256 prompts), then the same loop under
#      torch.profiler (CUDA): its tokens/s against the offline figure, the GPU's busy time against the
#      wall (the rest is the GPU waiting on the host), the kernels' totals;
#   3. bench/serve_9b.sh at 2064 (four prompts a mixed step), against step 1's offline figure.
# Carry .whl and .var (.var/tok.txz: the Qwen3.5 tokenizer). Usage: bash bench/core_9b_check.sh
set -o pipefail
DEADLINE=${DEADLINE:-560}
tar xJf .var/tok.txz -C .
source bench/device_env.sh
device_log
served() {  # served BUDGET: bench/serve_9b.sh at that budget -> $OUT/s9b_BUDGET.json
  SERVE_FLAGS="--prefill chunked --max-num-batched-tokens $1" NUM_PROMPTS=256 bash bench/serve_9b.sh 2>&1 | tail -5
  mv $OUT/serve_9b_vs_offline.json $OUT/s9b_$1.json
  grep -v "GET\|POST" $OUT/server_9b.log | grep -i "error\|Traceback" | head -5
  rm -f $OUT/serve_9b.json $OUT/serve_9b.log $OUT/server_9b.log
}
fits 100 "wide tiles at 512 rows: the weights through TMA" && timeout 100 python3 bench/wide_tile_probe.py --rows 512 \
  --only-extra --extra 128,128,8,4,64 128,128,8,4,64,1 128,128,8,3,64,1 128,256,8,3,64,1 --json $OUT/wide_tma.json 2>&1 \
  | grep "^wide"
fits 230 "9B served at 1040" && served 1040 && cp $OUT/offline_9b.json /tmp/offline_9b.json
fits 150 "9B engine alone at 512, then profiled" && timeout 150 python3 bench/serve_core_probe.py \
  --random-weights qwen3.5-9b --spec-k 0 --max-num-seqs 16 --prefill chunked --no-prefix-cache \
  --max-num-batched-tokens 512 --prompt-len 512 --num-prompts 256 --profile --json $OUT/core_9b.json 2>&1 \
  | grep -E "probe:|wall_s|tokens_per_s|ttft_ms|steps|busy|cuda_kernels|^\[.*\]   \(" | cut -c1-200 | head -60
fits 120 "9B served at 2064" && OFFLINE_FROM=/tmp/offline_9b.json served 2064
ls $OUT
