#!/usr/bin/env bash
# Retrain the bundled default model's MTP head for chained drafting (nextn train --distill-from
# nextn/default_model --chain-depth D; trunk frozen) on one CUDA GPU, from the Python sources of
# that machine (its python3 standard library and site-packages), with the torch GDN kernel.
#   bench/distill_chain_head.sh OUT WALL_MINUTES [TRAIN FLAGS...]
# Writes the new checkpoint's shards and a tarball of the small files under OUT (at most 8 files).
set -euo pipefail
out=$1 wall=$2
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
read -r stdlib purelib < <(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['stdlib'], p['purelib'])")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "bench/distill_chain_head.sh OUT $wall $*" > "$out/command.txt"
run=runs/chain_head
python3 -m nextn.train --distill-from nextn/default_model --data "$stdlib" --data "$purelib" --device cuda \
  --out $run --gdn-kernel torch --wall-minutes "$wall" "$@" 2>&1 | tee "$out/train.log"
cp $run/checkpoint/*.safetensors "$out/"
small=(checkpoint/config.json checkpoint/model.safetensors.index.json loss.csv train_config.json data/meta.json)
[ -f $run/loss.png ] && small+=(loss.png)
tar -czf "$out/run_files.tar.gz" -C $run "${small[@]}" -C "$(realpath "$out")" train.log command.txt gpu.txt
rm "$out/train.log" "$out/command.txt" "$out/gpu.txt"
