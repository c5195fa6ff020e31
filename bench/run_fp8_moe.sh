#!/bin/bash
# Issue 50's must-shows on one H200: Qwen3-Next-80B-A3B and Qwen3.5-122B-A10B with random weights drawn
# straight into FP8 (nextn.models.random_weights), each stage one device call (under 10 minutes).
# Usage (device tool, nvidia-h200): bash bench/run_fp8_moe.sh [stages...]
#   tests: the FP8 MoE tests (512 experts, top-10: the decode block and the grouped GEMMs, compiled) and
#     the MoE / FP8 kernel tests at real shapes;
#   next80 q122: spec == plain for K = 1..8, plain decode against the roofline counted from the routing,
#     profile_spec_speedup at 0.85,0.75,0.65 (one repeat per K), into $OUT/fp8_<preset>.json;
#   next80batch q122batch: --batch 1 8 32 (the 122B: 1 8, what fits; see bench_args) at K = 3 through the same
#     profile, into $OUT/fp8_batch_<preset>.json;
#   parse: every stage's bench command line parsed (no GPU, no weights: run it on the CPU before a device call).
# Each bench logs its fit line first (weights, a sequence's cache, the sequences that fit).
set -o pipefail
preset_of() {
  case $1 in
    next80 | next80batch) echo qwen3-next-80b-a3b ;;
    q122 | q122batch) echo qwen3.5-122b-a10b ;;
  esac
}
# the bench's flags per stage (the parse stage checks the same lists)
bench_args() {  # $1 stage
  local preset
  preset=$(preset_of "$1")
  local common=(bench --random-weights "$preset" --quantization fp8 --device cuda --dtype bfloat16
    --acceptance-profile 0.85,0.75,0.65 --repeats 1)
  # the 122B's 123.4 GiB of weights (FP8, its MTP head's experts bf16) leave 1.8 GiB at the default 0.9 of
  # the GPU: nothing fits beside the engine's 5.3 GiB reserve; at 0.97, 11.6 GiB: a sequence of the bench's
  # 800 tokens takes 504 MiB at K = 3 (nextn.engine.memory.bytes_per_sequence since the GDN states are two a
  # slot, not K + 1 per verify row: it was ~2 GiB), so 8 fit and 32 (16 GiB) do not. So the 122B runs at 0.97
  # and --batch 1 8.
  case $1 in
    next80) echo "${common[@]}" --spec-k 1 2 3 4 5 6 7 8 --json "$OUT/fp8_$preset.json" ;;
    q122) echo "${common[@]}" --gpu-memory-utilization 0.97 --spec-k 1 2 3 4 5 6 7 8 --json "$OUT/fp8_$preset.json" ;;
    next80batch) echo "${common[@]}" --spec-k 3 --batch 1 8 32 --json "$OUT/fp8_batch_$preset.json" ;;
    q122batch) echo "${common[@]}" --gpu-memory-utilization 0.98 --spec-k 3 --batch 1 8 \
      --json "$OUT/fp8_batch_$preset.json" ;;
  esac
}
if [ "$1" = parse ]; then  # on the CPU: the flags parse, the presets exist, before a device call is spent
  export PYTHONPATH=$PWD OUT=${OUT:-/tmp}
  for stage in next80 q122 next80batch q122batch; do
    ${PYTHON:-python3} - $(bench_args $stage) <<'PY' || exit 1
import sys
from nextn.cli import parse_args
from nextn.models.random_weights import preset_config
args = parse_args(sys.argv[1:])
preset_config(args.random_weights)
print("parse:", " ".join(sys.argv[1:]))
PY
  done
  exit 0
fi
source bench/device_env.sh
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee $LOG
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $LOG
for stage in "$@"; do
  echo "=== $stage $(date +%T)" | tee -a $LOG
  case $stage in
    tests) timeout 500 python3 -m pytest -q -x tests/test_fp8_moe.py tests/test_kernels.py -k "moe or grouped" 2>&1 \
             | tail -25 | tee -a $LOG ;;
    next80 | q122 | next80batch | q122batch)
      # shellcheck disable=SC2046  # bench_args prints the words of one command line
      timeout 560 python3 -m nextn.cli $(bench_args $stage) --log-level info 2>&1 | grep -v '^ ' | tail -60 | tee -a $LOG ;;
    *) echo "unknown stage $stage" | tee -a $LOG ;;
  esac
done
