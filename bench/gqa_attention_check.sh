#!/bin/bash
# The GQA-packed step attention (branch wip/gqa-attention: a program a kv head and chunk for one row, or for
# 16 (row, head) pairs of one slot's rows, tensor-core dots) against today's, in one device stage: the GPU
# tests and bench/attention_probe.py under today's kernel (from .base/) and each variant .gqa/NAME.py (a
# whole nextn/ops/triton_attention.py: gqa.py, one row a program; packed.py, rows packed), then where MIXED=1
# bench/mixed_step_probe.py (a prompt piece riding in a 9B round, every trunk kernel) under today's and each
# variant, where WAVE=1 one served wave of the 9B on the engine alone (bench/prefill_wave_probe.py; run 181's:
# attention 89.4 ms of 460), then the bundled model's GPU exactness tests. A stage that would end past
# DEADLINE seconds (default 570) is skipped and says so. $OUT: attn_{base,NAME}.json (, mixed_*.json, wave_NAME.json).
# .gqa here: mkdir -p .gqa && git show wip/gqa-attention~1:nextn/ops/triton_attention.py > .gqa/gqa.py &&
#   git show wip/gqa-attention:nextn/ops/triton_attention.py > .gqa/packed.py
# Usage (device tool, carry .whl .base .gqa): [VARIANTS="packed gqa"] MIXED=1 bash bench/gqa_attention_check.sh
set -o pipefail
source bench/device_env.sh
fits 60 "attention, today's kernel (.base)" &&
  PYTHONPATH=$PWD/.base:/tmp/site timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_base.json" 2>&1 | tail -7
if [ "${MIXED:-0}" = 1 ] && fits 150 "9B mixed steps, today's kernel"; then
  timeout 150 python3 bench/mixed_step_probe.py --json "$OUT/mixed_base.json" 2>&1 | grep -E "^(round|piece)" | tail -6
fi
cp nextn/ops/triton_attention.py /tmp/triton_attention_today.py
for variant in ${VARIANTS:-$(ls .gqa/*.py | xargs -n1 basename | sed 's/\.py$//')}; do  # (each a whole triton_attention.py)
  cp ".gqa/$variant.py" nextn/ops/triton_attention.py
  fits 120 "attention, $variant: tests" &&
    timeout 120 python3 -m pytest -q tests/test_kernels.py tests/test_kv_fp8.py -k "attention or attend or fp8_cache or kv" \
      2>&1 | tail -2
  fits 60 "attention, $variant: probe" &&
    timeout 60 python3 bench/attention_probe.py --json "$OUT/attn_$variant.json" 2>&1 | tail -7
  if [ "${MIXED:-0}" = 1 ] && fits 150 "9B mixed steps, $variant"; then
    timeout 150 python3 bench/mixed_step_probe.py --json "$OUT/mixed_$variant.json" 2>&1 | grep -E "^(round|piece)" | tail -6
  fi
  if [ "${WAVE:-0}" = 1 ] && fits 110 "9B wave, $variant"; then
    timeout 110 python3 bench/prefill_wave_probe.py --json "$OUT/wave_$variant.json" 2>&1 | grep '^\[' | head -6
  fi
  fits 150 "bundled model exactness on the GPU, $variant" &&
    timeout 150 python3 -m pytest -q -m gpu tests/test_graphs.py tests/test_sessions.py 2>&1 | tail -2
done
cp /tmp/triton_attention_today.py nextn/ops/triton_attention.py
echo "gqa_attention_check: done in $(($(date +%s) - t0)) s"
