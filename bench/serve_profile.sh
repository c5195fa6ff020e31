#!/bin/bash
# Where a served step's time goes: `nextn serve` (bundled model, K=3, --max-num-seqs 64) under
# `nextn bench serve` at 16 streams, 128 output tokens, prompts of 60-900 tokens cut from
# nextn/engine/rounds.py (issue 44's TTFT cell), once with serve's defaults and once with each
# extra flag set given, the server and its engine core sampled by py-spy (speedscope JSON) during
# the timed requests. Needs py-spy among the carried wheels (.whl; device_env.sh installs them).
# Usage (device tool, carry .whl .tok): bash bench/serve_profile.sh TAG ["FLAGS" ...]
#   -> $OUT/profile_<TAG>_<i>.json (bench serve) and $OUT/pyspy_<TAG>_<i>.json (samples), i = 0 for
#      the defaults, 1.. for each flag set.
set -o pipefail
source bench/device_env.sh
TAG=${1:-new}; shift
PORT=8123
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
i=0
for flags in "" "$@"; do
  python3 -m nextn.cli serve --model nextn/default_model --spec-k 3 --max-num-seqs 64 --port $PORT \
    --log-level warning $flags > /tmp/server_$i.log 2>&1 &
  pid=$!
  python3 bench/wait_server.py $PORT $pid
  # warm-up requests of the same shape first, unprofiled
  python3 -m nextn.cli bench serve --base-url http://127.0.0.1:$PORT --tokenizer nextn/default_model \
    --prompt-file nextn/engine/rounds.py --random-input-len 480 --random-range-ratio 0.875 --random-output-len 128 \
    --ignore-eos --num-prompts 32 --max-concurrency 16 --seed 7 --disable-tqdm > /dev/null 2>&1
  $SPY record --pid $pid --subprocesses --rate 1000 --format speedscope --nonblocking \
    -o $OUT/pyspy_${TAG}_$i.json > /tmp/spy_$i.log 2>&1 &
  spy=$!
  sleep 1
  python3 -m nextn.cli bench serve --base-url http://127.0.0.1:$PORT --tokenizer nextn/default_model \
    --prompt-file nextn/engine/rounds.py --random-input-len 480 --random-range-ratio 0.875 --random-output-len 128 \
    --ignore-eos --num-prompts 64 --max-concurrency 16 --num-warmups 16 --disable-tqdm --save-detailed \
    --metadata tree=$TAG flags="$flags" --json $OUT/profile_${TAG}_$i.json 2>&1 \
    | grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|acceptance length" | sed "s/^/[$TAG $i: $flags] /"
  kill -INT $spy; wait $spy 2>/dev/null
  tail -2 /tmp/spy_$i.log
  kill $pid; wait $pid 2>/dev/null
  i=$((i + 1))
done
