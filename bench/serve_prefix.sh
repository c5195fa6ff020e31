#!/bin/bash
# Issue 45's GPU must-show: `nextn bench serve` with 64 requests sharing a 2,000-token prefix plus
# 100-token tails (random ids), 128 output tokens, greedy, ignore_eos, 16 streams, K=3, the prefix
# cache on against off, each against a server it starts. The warm-ups (16 requests of the same
# lengths, drawn apart: no shared prefix) warm the kernels before the timed run; WARMUPS=0 repeats
# run 136's cold start. Per-request TTFTs and send times are kept (--save-detailed).
# Usage (device tool): bash bench/serve_prefix.sh TAG   -> $OUT/prefix_<TAG>_{on,off}.json
set -o pipefail
TAG=${1:-new}
[ -n "$OUT" ] || { echo "serve_prefix: set OUT" >&2; exit 2; }
for mode in on off; do
  flags=(--spec-k 3 --max-num-seqs 64 --max-model-len 4096)
  [ $mode = off ] && flags+=(--no-enable-prefix-caching)
  timeout 200 python3 -m nextn.cli bench serve --prefix-len 2000 --random-input-len 100 --random-output-len 128 \
    --ignore-eos --num-prompts 64 --max-concurrency 16 --num-warmups "${WARMUPS:-16}" --disable-tqdm --save-detailed \
    --metadata prefix_caching=$mode tree=$TAG --json "$OUT/prefix_${TAG}_$mode.json" "${flags[@]}" 2>&1 \
    | grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|acceptance|prefix|Successful|Failed|rror" \
    | sed "s/^/[$TAG cache=$mode] /"
done
python3 - "$OUT" "$TAG" <<'PY'
import json, sys
from pathlib import Path
out, tag = Path(sys.argv[1]), sys.argv[2]
on, off = (json.loads((out / f"prefix_{tag}_{m}.json").read_text()) for m in ("on", "off"))
print(f"[{tag}] median TTFT off/on {off['median_ttft_ms'] / on['median_ttft_ms']:.2f}x (bar 3x); "
      f"output on/off {on['output_throughput'] / off['output_throughput']:.3f} (bar >= 1); "
      f"prefill tokens computed on {on.get('prefill_tokens_computed')} (bar <= 2000 + 64 x (100 + block)); "
      f"graphs on {on.get('graph_metrics')} off {off.get('graph_metrics')}")
PY
