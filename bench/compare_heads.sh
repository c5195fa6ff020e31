#!/usr/bin/env bash
# The bundled model's speculative speed on the H200 with other MTP heads in its place (heads from
# bench/distill_variants.sh): for each NAME=SHARD, the bundled checkpoint with SHARD (a file named
# NAME.<shard name>) replacing its shard of that name; NAME= alone is the checkpoint as shipped.
# Per prompt, every head runs before the next prompt, so drift over the run hits them alike.
#   bench/compare_heads.sh OUT NAME=[SHARD] ...
# Writes, per head: pmin_NAME_PROMPT.json (greedy K=6 at p_min 0 and 0.5, 5 repeats) for the
# prompts scheduler.py and rounds.py, and sampled_NAME.json (rounds.py: greedy and T=0.7 at K=3,
# the sampled runs over seeds 0..9).
set -euo pipefail
out=$1
shift
source bench/device_env.sh
log=$out/log.txt
echo "bench/compare_heads.sh OUT $*" | tee "$log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$log"
names=()
for spec in "$@"; do
  name=${spec%%=*} shard=${spec#*=}
  names+=("$name")
  rm -rf "/tmp/heads/$name" && mkdir -p /tmp/heads && cp -r nextn/default_model "/tmp/heads/$name"
  base=$(basename "$shard")
  if [ -n "$shard" ]; then cp "$shard" "/tmp/heads/$name/${base#"$name".}"; fi
  sha256sum /tmp/heads/"$name"/*.safetensors | tee -a "$log"
done
bench() {  # NAME JSON ARGS...
  local name=$1 json=$2
  shift 2
  echo "--- $name $json $(date +%T)" | tee -a "$log"
  timeout 200 python3 -m nextn.cli bench --model "/tmp/heads/$name" --device cuda --dtype bfloat16 "$@" \
    --json "$out/$json" 2>&1 | grep -v "^ " | grep "bench: \(K=\|T=\|plain\|decode\)" | tee -a "$log"
}
for prompt in scheduler rounds; do
  for name in "${names[@]}"; do
    bench "$name" "pmin_${name}_$prompt.json" --prompt-file "nextn/engine/$prompt.py" --spec-k 6 --p-min 0 0.5 --repeats 5
  done
done
for name in "${names[@]}"; do
  bench "$name" "sampled_$name.json" --prompt-file nextn/engine/rounds.py --spec-k 3 --temperature 0.7 --repeats 10
done
echo "=== end $(date +%T)" | tee -a "$log"
rm -f "$out"/*.png  # at most 8 files come back
