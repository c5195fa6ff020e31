#!/bin/bash
# The GQA-packed step attention (branch wip/gqa-attention: one program a row, kv head and chunk, tensor-core
# dots) against today's, in one device stage: its GPU tests, bench/attention_probe.py under both kernels
# (today's from .base/, the new one copied over this tree's from .gqa/triton_attention.py), then one served
# wave of the 9B on the engine alone with it where WAVE=1 (bench/prefill_wave_probe.py; run 181's: attention
# 89.4 ms of 460), then the bundled model's GPU exactness tests. $OUT: attn_{base,gqa}.json (, wave_gqa.json).
# Usage (device tool, carry .whl .base .gqa): bash bench/gqa_attention_check.sh
set -o pipefail
source bench/device_env.sh
t0=$(date +%s)
stage() { echo "=== $1 (+$(($(date +%s) - t0)) s)"; }
stage "attention, today's kernel (.base)"
PYTHONPATH=$PWD/.base:/tmp/site timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_base.json" 2>&1 | tail -7
cp .gqa/triton_attention.py nextn/ops/triton_attention.py
stage "attention, GQA-packed: tests"
timeout 120 python3 -m pytest -q tests/test_kernels.py tests/test_kv_fp8.py -k "attention or attend or fp8_cache or kv" 2>&1 \
  | tail -3
stage "attention, GQA-packed: probe"
timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_gqa.json" 2>&1 | tail -7
if [ "${WAVE:-0}" = 1 ]; then
  stage "9B wave, GQA-packed"
  timeout 110 python3 bench/prefill_wave_probe.py --json "$OUT/wave_gqa.json" 2>&1 | grep '^\[' | head -6
fi
stage "bundled model exactness on the GPU, GQA-packed"
timeout 150 python3 -m pytest -q -m gpu tests/test_graphs.py tests/test_sessions.py 2>&1 | tail -3
echo "gqa_attention_check: done in $(($(date +%s) - t0)) s"
