#!/bin/bash
# Served throughput on the device (issue 44's matrix): for each server (K = 0 and 3, --max-num-seqs 64),
# prefill-heavy (128 output tokens) and decode-heavy (512) work at 16 and 64 concurrent streams, prompts
# of 60-900 tokens cut from nextn/engine/rounds.py (Python the bundled model never trained on), greedy,
# ignore_eos, streamed /v1/completions, measured by `nextn bench serve` into $OUT/serve_<tag>_k<K>_<out>_c<C>.json.
# Usage: bash bench/serve_bench.sh TAG [K ...]   (TAG names the tree: run from the tree under test)
# Env: SERVE_FLAGS adds server flags; NUM_PER_STREAM prompts per stream (8); OUTS, CONCS the output lengths
# (128 512) and stream counts (16 64).
set -o pipefail
TAG=${1:-new}; shift
KS=${*:-0 3}
PORT=8123
per=${NUM_PER_STREAM:-8}
for K in $KS; do
  python3 -m nextn.cli serve --model nextn/default_model --spec-k $K --max-num-seqs 64 --port $PORT \
    --log-level warning $SERVE_FLAGS > $OUT/server_${TAG}_k$K.log 2>&1 &
  pid=$!
  python3 bench/wait_server.py $PORT $pid
  for out in ${OUTS:-128 512}; do
    for c in ${CONCS:-16 64}; do
      timeout 200 python3 -m nextn.cli bench serve --base-url http://127.0.0.1:$PORT --tokenizer nextn/default_model \
        --prompt-file nextn/engine/rounds.py --random-input-len 480 --random-range-ratio 0.875 \
        --random-output-len $out --ignore-eos --num-prompts $((c * per)) --max-concurrency $c --num-warmups $c \
        --disable-tqdm --metadata tree=$TAG spec_k=$K --json $OUT/serve_${TAG}_k${K}_${out}_c$c.json 2>&1 \
        | grep -E "Output token throughput|Median TTFT|Median TPOT|acceptance length|Successful|Failed|rror" \
        | sed "s/^/[$TAG K=$K out=$out c=$c] /"
    done
  done
  kill $pid; wait $pid 2>/dev/null
  tail -3 $OUT/server_${TAG}_k$K.log
done
