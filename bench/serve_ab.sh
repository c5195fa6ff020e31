#!/bin/bash
# Served figures of two trees on one machine, one after the other (the bundled model's serving is
# host-bound, so figures from different machines do not compare): a base tree unpacked in .base/ (a
# `git archive` of REV, the bundled model linked from this tree) against this tree, every cell with
# this tree's client (`nextn bench serve`) and prompt file. Cells are K:OUT:C (spec K, output tokens,
# concurrent streams); each tree starts one server a K. Prints one line a cell, writes
# $OUT/ab.json (every cell's JSON by its name, ab_<tree>_k<K>_<out>_c<C>.json: one file of the few
# the device tool brings back) and the servers' logs.
#   rm -rf .base && mkdir .base && git archive REV nextn | tar x -C .base && rm -r .base/nextn/default_model \
#     && ln -s ../../nextn/default_model .base/nextn/default_model
#   bash bench/serve_ab.sh "3:128:16 0:512:64"   (device tool, carry .whl and .base; NUM_PER_STREAM, 8;
#   TREES="base alt head": a third tree in .alt/, unpacked as .base is)
set -o pipefail
source bench/device_env.sh
CELLS=${1:-"3:128:16 0:512:64"}
PORT=8123
per=${NUM_PER_STREAM:-8}
ROOT=$PWD
mkdir -p /tmp/ab
[ -d .base/nextn ] || { echo "serve_ab: no .base/nextn (see the header)"; exit 2; }
for tree in ${TREES:-base head}; do  # (TREES: more trees, each X but head unpacked in .X/ as .base is)
  dir=$ROOT; [ $tree = head ] || dir=$ROOT/.$tree
  for K in $(for cell in $CELLS; do echo ${cell%%:*}; done | sort -u); do
    (cd $dir && PYTHONPATH=$dir:/tmp/site exec python3 -m nextn.cli serve --model nextn/default_model --spec-k $K \
      --max-num-seqs 64 --port $PORT --log-level warning) > $OUT/ab_server_${tree}_k$K.log 2>&1 &
    pid=$!
    python3 bench/wait_server.py $PORT $pid
    for cell in $CELLS; do
      IFS=: read k out c <<< "$cell"
      [ "$k" = "$K" ] || continue
      f=/tmp/ab/ab_${tree}_k${K}_${out}_c$c.json
      timeout 200 python3 -m nextn.cli bench serve --base-url http://127.0.0.1:$PORT --tokenizer nextn/default_model \
        --prompt-file nextn/engine/rounds.py --random-input-len 480 --random-range-ratio 0.875 \
        --random-output-len $out --ignore-eos --num-prompts $((c * per)) --max-concurrency $c --num-warmups $c \
        --disable-tqdm --metadata tree=$tree spec_k=$K --json $f > /dev/null 2>&1
      python3 -c "import json; d = json.load(open('$f'))
print(f\"$tree K=$K out=$out c=$c: {d['output_throughput']:.0f} tok/s, median TTFT {d['median_ttft_ms']:.1f} ms, median TPOT {d['median_tpot_ms']:.2f} ms, {d['completed']}/{d['num_prompts']}\")" || echo "$tree $cell: failed"
    done
    kill $pid; wait $pid 2>/dev/null
    grep -ciE "compiled a kernel variant" $OUT/ab_server_${tree}_k$K.log | sed "s/^/$tree K=$K compile warnings: /"
  done
done
python3 -c "import glob, json, os; json.dump({os.path.basename(f): json.load(open(f)) for f in sorted(glob.glob('/tmp/ab/ab_*.json'))}, open('$OUT/ab.json', 'w'), indent=1)"
