#!/usr/bin/env bash
# Retrain the bundled model's MTP head (trunk frozen) in several variants side by side on one CUDA
# GPU: one `nextn train --distill-from nextn/default_model` per variant, from the Python sources of
# that machine (its python3 standard library and site-packages), with the torch GDN kernel.
#   bench/distill_variants.sh OUT WALL_MINUTES "NAME FLAGS..." ["NAME FLAGS..." ...]
# Brings back, per variant, the checkpoint shards that differ from the bundled model's (as
# NAME.<shard>), and one tarball of every variant's log, loss curve and settings (at most 7 variants).
set -euo pipefail
out=$1 wall=$2
shift 2
mkdir -p "$out"
source bench/device_env.sh
read -r stdlib purelib < <(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['stdlib'], p['purelib'])")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "bench/distill_variants.sh OUT $wall $*" > "$out/command.txt"
names=() pids=()
for variant in "$@"; do
  read -r name flags <<< "$variant"
  names+=("$name")
  # shellcheck disable=SC2086  # the variant's flags split into words on purpose
  python3 -m nextn.train --distill-from nextn/default_model --data "$stdlib" --data "$purelib" --device cuda \
    --out "runs/$name" --gdn-kernel torch --wall-minutes "$wall" $flags > "$out/$name.log" 2>&1 &
  pids+=($!)
done
(sleep 120 && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> "$out/gpu.txt") >/dev/null 2>&1 &
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [ $status != 0 ]; then
  tail -n 5 "$out"/*.log
  exit 1
fi
files=(command.txt gpu.txt)
for name in "${names[@]}"; do
  grep -v "^ " "$out/$name.log" | tail -25
  for shard in "runs/$name"/checkpoint/*.safetensors; do
    cmp -s "$shard" "nextn/default_model/$(basename "$shard")" || cp "$shard" "$out/$name.$(basename "$shard")"
  done
  cp "runs/$name/loss.csv" "$out/$name.loss.csv"
  cp "runs/$name/train_config.json" "$out/$name.train_config.json"
  files+=("$name.log" "$name.loss.csv" "$name.train_config.json")
done
tar -czf "$out/variants.tar.gz" -C "$out" "${files[@]}"
(cd "$out" && rm "${files[@]}")
ls -la "$out"
