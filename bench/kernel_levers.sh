#!/bin/bash
# The 9B's kernel levers for prompt rows (issue 44's bar, bench/NOTES.md), measured in one device call:
#   1. the GDN step kernel's launch configs at the 9B's heads (bench/gdn_sweep.py, the conv pre-pass on):
#      decode / K=3 verify at B = 1 and 16, prefill pieces of 64 and 512 rows at B = 1 and 16, BLOCK_V 16 / 32
#      at 1 / 2 warps (today: 32 x 2): whether one config is faster for prompt rows and no slower for rounds,
#      and the chunked delta rule (tensor cores, by chunks of 64 rows) at the same prefill cases;
#   1b. bench/mixed_step_probe.py --chunked: a prompt piece riding in a 9B round with its GDN rows by the
#      chunked rule (StepBatch.chunked; run 182's pieces through the recurrence: 81-95 us a prompt row), and a
#      wave of 16 x 512 prompt rows in one graphed step with either GDN (run 184's engine wave: 408 ms);
#   2. wide tiles of other shapes at 4,096 rows (bench/wide_tile_probe.py --extra: BLOCK_N 256, 256 rows a
#      program, BLOCK_K 64), against today's (128 x 128 x 8 x 3) and cuBLAS, bits against the default's;
#   3. (NINEB=1) `nextn bench --batch 16 --spec-k 3` on the 9B in .base and here (mid tiles in the verify's 64 rows).
# A stage that would end past DEADLINE seconds (default 570) is skipped and says so.
# $OUT: gdn_levers.json, mixed_chunked.json, wide_levers.json (, bench9b_{base,head}.json).
# Usage (device tool, full tree, carry .whl [.base]): [NINEB=1] bash bench/kernel_levers.sh
set -o pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
fits 180 "GDN step configs, 9B heads" &&
  timeout 180 python3 bench/gdn_sweep.py --shapes qwen3.5-9b --tokens 1 4 --prefill-tokens 64 512 --batch 1 16 \
    --block-v 16 32 --warps 1 2 --preconv --chunk --out "$OUT/gdn_levers.json" 2>&1 | grep '^gdn' | sed 's/^gdn qwen3.5-9b //'
fits 200 "9B mixed steps, pieces by the chunked rule; the wave" &&
  timeout 200 python3 bench/mixed_step_probe.py --chunked --profile --wave --json "$OUT/mixed_chunked.json" 2>&1 | grep -E "^(round|piece|wave|    kernels)"
fits 200 "wide tiles at 4096 rows" &&
  timeout 200 python3 bench/wide_tile_probe.py --rows 4096 --extra 128,256,8,2,128 256,128,8,2,128 128,128,8,4,64 \
    128,256,8,3,64 --json "$OUT/wide_levers.json" 2>&1 | tail -30
for tree in $([ "${NINEB:-0}" = 1 ] && echo head base); do
  dir=$PWD; [ $tree = head ] || dir=$PWD/.$tree
  fits 130 "9B offline batch 16, K=3, $tree" &&
    (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 130 python3 -m nextn.cli bench --random-weights qwen3.5-9b \
      --device cuda --dtype bfloat16 --spec-k 3 --batch 16 --prompt-len 512 --prefill-len 512 --gen-len 128 \
      --repeats 1 --max-model-len 1024 --json "$OUT/bench9b_$tree.json" 2>&1 | grep '^bench:' | tail -8)
done
echo "kernel_levers: done in $(($(date +%s) - t0)) s"
