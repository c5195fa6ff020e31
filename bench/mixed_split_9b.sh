#!/bin/bash
# The 9B shape's served / offline cell (issue 44's 0.85 bar) with mixed rounds keyed by their pieces' sizes,
# one call (~6 min on an H100; its whole log in $OUT/log.txt): the GPU tests of the mixed rounds (a split
# sharing a graph, pad pieces) and the chunked rule's kernels, then bench/serve_9b.sh with 256 prompts at
# 16 streams under `--prefill chunked --max-num-batched-tokens 512` (mixed steps: 448 + 64 rows a prompt;
# its 16 slots all run, so no pad piece) against one offline `nextn bench --batch 16`.
# Carry .whl and .var (.var/tok.txz: the Qwen3.5 tokenizer). Usage: bash bench/mixed_split_9b.sh
set -o pipefail
tar xJf .var/tok.txz -C .
source bench/device_env.sh
device_log
stage "gpu tests"
timeout 150 python3 -m pytest -q tests/test_batching.py -k "any_split or mixed_rounds or wait_for" 2>&1 | tail -4
timeout 150 python3 -m pytest -q tests/test_kernels.py -k "chunk" 2>&1 | tail -4
stage "9B mixed 512"
SERVE_FLAGS="--prefill chunked --max-num-batched-tokens 512" NUM_PROMPTS=256 bash bench/serve_9b.sh 2>&1 | tail -14
rm -f $OUT/serve_9b.log $OUT/offline_9b.log
ls $OUT
