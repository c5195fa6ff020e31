#!/bin/bash
# Graphed mixed rounds on the device, one call (~5-8 min on an H100): their GPU tests, then the 9B shape
# served against its offline figure (bench/serve_9b.sh, 256 prompts at 16 streams) in variants, one offline
# bench for all of them: mixed steps at a 512-token budget (448 + 64 rows a prompt), at 528 (one 512-row
# piece), and the alternating `--prefill steps` prefill at 8,448. Each variant's merged JSON lands in
# $OUT/v_<name>.json (bench/serve_9b.sh's serve_9b_vs_offline.json), the offline one in $OUT/offline_9b.json.
# Carry .whl and .var with .var/tok.txz (the Qwen3.5 tokenizer, tar.xz of .tok/qwen3.5: the tree with the
# bundled model, .whl and .tok is over 64 MiB). Usage: bash bench/graphed_mixed_check.sh
# Env: DEADLINE (s, default 500): a variant starts only if ~110 s remain before it.
set -o pipefail
tar xJf .var/tok.txz -C .
DEADLINE=${DEADLINE:-500}
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
stage "gpu tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_batching.py tests/test_graphs.py tests/test_prefill.py 2>&1 | tail -4
mkdir -p /tmp/keep
variant() {  # NAME SERVE_FLAGS
  SERVE_FLAGS="$2" NUM_PROMPTS=256 bash bench/serve_9b.sh
  [ -f $OUT/offline_9b.json ] && cp $OUT/offline_9b.json /tmp/keep/offline_9b.json
  [ -f $OUT/serve_9b_vs_offline.json ] && mv $OUT/serve_9b_vs_offline.json $OUT/v_$1.json
  rm -f $OUT/serve_9b.json $OUT/serve_9b.log
  export OFFLINE_FROM=/tmp/keep/offline_9b.json
}
stage "mixed, 512"; variant mixed512 "--prefill chunked --max-num-batched-tokens 512"
fits 110 "mixed, 528" && variant mixed528 "--prefill chunked --max-num-batched-tokens 528"
fits 110 "steps, 8448" && variant steps8448 "--prefill steps --max-num-batched-tokens 8448"
ls $OUT
