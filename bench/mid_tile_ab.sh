#!/bin/bash
# Mid tiles against the tree before them, in one device call: the bundled model served (bench/serve_ab.sh,
# trees in TREES: .base = before, .alt = a variant, head = this tree) and the 9B's offline batch of 16
# (`nextn bench --batch 16 --spec-k 3`: plain 16-row rounds, and verify rounds of 64 rows, mid tiles)
# in .base and here. $OUT: ab.json (every served cell), bench9b_{base,head}.json.
# Usage (device tool, full tree, carry .whl .base [.alt]): TREES="base alt head" bash bench/mid_tile_ab.sh
set -o pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
stage "gpu tests"
timeout 100 python3 -m pytest -q -m gpu tests/test_kernels.py -k "mid_tiles" 2>&1 | tail -2
stage "bundled model served: ${TREES:-base head}"
NUM_PER_STREAM=${NUM_PER_STREAM:-8} timeout 330 bash bench/serve_ab.sh "3:128:16 3:512:16 3:128:64" 2>&1 | tail -16
for tree in $([ "${NINEB:-1}" = 1 ] && echo head base); do  # (NINEB=0: not the 9B)
  stage "9B offline, $tree"
  dir=$PWD; [ $tree = head ] || dir=$PWD/.$tree
  (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 130 python3 -m nextn.cli bench --random-weights qwen3.5-9b \
    --device cuda --dtype bfloat16 --spec-k 3 --batch 16 --prompt-len 512 --prefill-len 512 --gen-len 128 \
    --repeats 1 --max-model-len 1024 --json "$OUT/bench9b_$tree.json" 2>&1 | grep '^bench:' | tail -8)
done
echo "mid_tile_ab: done in $(($(date +%s) - t0)) s; $(ls "$OUT" | wc -l) files in \$OUT"
