#!/bin/bash
# The GQA-packed step attention (branch wip/gqa-attention: a program a kv head and chunk for one row, or for
# 16 (row, head) pairs of one slot's rows, tensor-core dots) against today's, in one device stage: the GPU
# tests and bench/attention_probe.py under today's kernel (from .base/) and each variant .gqa/NAME.py (a
# whole nextn/ops/triton_attention.py: gqa.py, one row a program; packed.py, rows packed), then one served
# wave of the 9B on the engine alone with it where WAVE=1 (bench/prefill_wave_probe.py; run 181's: attention
# 89.4 ms of 460), then the bundled model's GPU exactness tests. $OUT: attn_{base,NAME}.json (, wave_NAME.json).
# .gqa here: mkdir -p .gqa && git show wip/gqa-attention~1:nextn/ops/triton_attention.py > .gqa/gqa.py &&
#   git show wip/gqa-attention:nextn/ops/triton_attention.py > .gqa/packed.py
# Usage (device tool, carry .whl .base .gqa): bash bench/gqa_attention_check.sh
set -o pipefail
source bench/device_env.sh
stage "attention, today's kernel (.base)"
PYTHONPATH=$PWD/.base:/tmp/site timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_base.json" 2>&1 | tail -7
cp nextn/ops/triton_attention.py /tmp/triton_attention_today.py
for variant in $(ls .gqa/*.py | xargs -n1 basename | sed 's/\.py$//'); do  # (each a whole triton_attention.py)
  cp ".gqa/$variant.py" nextn/ops/triton_attention.py
  stage "attention, $variant: tests"
  timeout 120 python3 -m pytest -q tests/test_kernels.py tests/test_kv_fp8.py -k "attention or attend or fp8_cache or kv" \
    2>&1 | tail -2
  stage "attention, $variant: probe"
  timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_$variant.json" 2>&1 | tail -7
  if [ "${WAVE:-0}" = 1 ]; then
    stage "9B wave, $variant"
    timeout 110 python3 bench/prefill_wave_probe.py --json "$OUT/wave_$variant.json" 2>&1 | grep '^\[' | head -6
  fi
  stage "bundled model exactness on the GPU, $variant"
  timeout 150 python3 -m pytest -q -m gpu tests/test_graphs.py tests/test_sessions.py 2>&1 | tail -2
done
cp /tmp/triton_attention_today.py nextn/ops/triton_attention.py
echo "gqa_attention_check: done in $(($(date +%s) - t0)) s"
