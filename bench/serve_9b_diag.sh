#!/bin/bash
# Where the served 9B's prefill goes, in one device call (machines go back 30 s after a call): one wave
# of 16 x 512 prompt ids on the engine alone, profiled, in serve's mode (steps + prefix cache) and
# chunked (bench/prefill_wave_probe.py); the served figure (bench/serve_9b.sh at a budget that holds
# the wave); the wide GEMM tiles against others of BLOCK_N 256 or BLOCK_K 64 (bench/wide_tile_probe.py).
# Every stage has its own timeout, so a slow one leaves the rest their time; $OUT keeps 8 files or
# fewer (what the device tool brings back): wave_{steps,chunked}.json, serve_9b_vs_offline.json,
# server_9b.log, wide.json.
# Usage (device tool, full tree, carry .whl and .llama/tok): bash bench/serve_9b_diag.sh   (~8 min on an H100)
set -o pipefail
python3 -c "import tarfile; tarfile.open('.llama/tok/tok.txz').extractall('.')" || exit 2
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for tag in steps chunked; do
  flags=$([ $tag = chunked ] && echo --prefill chunked)
  stage "wave $tag"
  timeout 120 python3 bench/prefill_wave_probe.py $flags --json "$OUT/wave_$tag.json" 2>&1 | grep '^\['
done
stage served
SERVE_FLAGS="--max-num-batched-tokens 8448" timeout 200 bash bench/serve_9b.sh 2>&1 | tail -6
rm -f "$OUT"/offline_9b.* "$OUT"/serve_9b.json "$OUT"/serve_9b.log
stage "wide tiles"
# (128,128,8,3 and 128,64,4,3: the wide tiles the 9B's shapes take today, single and gate/up)
timeout 150 python3 bench/wide_tile_probe.py --rows 4096 --only-extra --extra 128,128,8,3,128 128,64,4,3,128 \
  128,256,8,2,128 128,256,8,4,64 128,128,8,4,64 128,128,4,4,64 64,256,8,3,64 --json "$OUT/wide.json" 2>&1 | grep '^wide'
echo "serve_9b_diag: done in $(($(date +%s) - t0)) s; $(ls "$OUT" | wc -l) files in \$OUT"
