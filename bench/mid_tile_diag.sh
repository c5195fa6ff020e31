#!/bin/bash
# Mid tiles (linear_configs.mid_tile: 17-255 rows a call in tiles of 32-128 rows, the 16-row config's
# splits as programs) in one device call: their GPU bits tests, their time against the 16-row tiles at
# the 9B's shapes (bench/wide_tile_probe.py), a 16-row round with prompt rows riding (overlap_probe
# --mixed: run 169's 7.507 / 13.370 / 9.789 ms at 48 / 112 / 240 rows), the bundled model served
# against the tree before them (.base: bench/serve_ab.sh), then one served wave of the 9B on the engine
# alone, profiled (bench/prefill_wave_probe.py). Each stage has its own timeout; $OUT keeps <= 8 files.
# Usage (device tool, full tree, carry .whl and .base = `git archive` of the tree before, as serve_ab.sh says):
#   bash bench/mid_tile_diag.sh   (~8 min on an H100)
set -o pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
stage "gpu tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py -k "mid_tiles or wide or skinny" 2>&1 | tail -4
stage "mid tiles against 16-row tiles"
timeout 120 python3 bench/wide_tile_probe.py --rows 24 48 64 80 128 200 240 --only-extra --json "$OUT/mid.json" 2>&1 \
  | grep '^wide'
stage "a 16-row round with prompt rows riding"
timeout 90 python3 bench/overlap_probe.py --rows 512 --mixed 48 112 240 --json "$OUT/mixed.json" 2>&1 | tail -6
stage "bundled model served, before / after"
NUM_PER_STREAM=4 timeout 240 bash bench/serve_ab.sh "3:128:16 3:512:16 3:128:64" 2>&1 | tail -8
stage "9B wave"
timeout 110 python3 bench/prefill_wave_probe.py --json "$OUT/wave_steps.json" 2>&1 | grep '^\[' | head -30
echo "mid_tile_diag: done in $(($(date +%s) - t0)) s; $(ls "$OUT" | wc -l) files in \$OUT"
