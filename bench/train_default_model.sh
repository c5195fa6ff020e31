#!/usr/bin/env bash
# Train nextn's bundled default model on one CUDA GPU from the Python sources of that machine
# (its python3 standard library and site-packages), as the device run of issue 4 did.
#   bench/train_default_model.sh smoke OUT                        # ~2.5 min: data prep, torch vs fla tokens/s
#   bench/train_default_model.sh full OUT WALL_MINUTES [TRAIN FLAGS...]  # the default model
# Needs the fla-core wheel in .whl/ (pure Triton). Writes logs, shards and a tarball under OUT.
# On the H200 image (Triton 3.6) fla-core 0.6.0 refuses its backward (fla issue #640), so `full`
# falls back to the torch kernel after the fla attempt: that is how the bundled model was made.
set -euo pipefail
mode=$1 out=$2
shift 2
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
site=/tmp/site
read -r stdlib purelib < <(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['stdlib'], p['purelib'])")
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
train() { PYTHONPATH=$site python3 -m nextn.train --data "$stdlib" --data "$purelib" --device cuda "$@"; }

roundtrip() {  # nextn and transformers (no fla on the path) read the checkpoint: logits must agree
  python3 - "$1" <<'PY'
import sys, torch, transformers
from nextn.models.loader import load_model
ckpt = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(ckpt)
ids = torch.tensor([tok.encode(open(transformers.__file__).read())[:300]])
hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
ours = load_model(ckpt)
with torch.no_grad():
    ref, got = hf(ids).logits.float(), ours.logits(ours.final_norm(ours(ids)))
print(f"roundtrip {type(hf).__name__} transformers {transformers.__version__}: max |dlogit| "
      f"{(got - ref).abs().max().item():.2e} of max |logit| {ref.abs().max().item():.1f}")
PY
}

if [ "$mode" = smoke ]; then
  train --out runs/s_torch --gdn-kernel torch --max-steps 12 --log-every 4 --eval-every 1000 \
    --max-train-tokens 30000000 2>&1 | tee "$out/smoke_torch.log"
  mkdir -p runs/s_fla && cp -r runs/s_torch/tokenizer runs/s_torch/data runs/s_fla/
  train --out runs/s_fla --gdn-kernel fla --minutes 0.75 --log-every 10 --eval-every 100 \
    --max-train-tokens 30000000 2>&1 | tee "$out/smoke_fla.log"
  roundtrip runs/s_fla/checkpoint 2>&1 | tee "$out/roundtrip.log"
  PYTHONPATH=$site timeout 60 python3 -m pytest -q -m gpu tests/test_train.py -k "65 or 300" 2>&1 | tail -5 | tee "$out/pytest.log" || true
  ls -la runs/s_fla/checkpoint | tee -a "$out/roundtrip.log"
else
  # full OUT WALL_MINUTES [TRAIN FLAGS...]: the fla kernel, or the torch reference if fla fails
  run=runs/default t0=$(date +%s) wall=$1
  deadline=$(python3 -c "import time; print(time.time() + 60 * $wall)")
  shift
  left() { python3 -c "import time; print(round(max(0.5, ($deadline - time.time()) / 60), 2))"; }
  echo "bench/train_default_model.sh full OUT $wall $*" > "$out/command.txt"
  common=(--out $run --eval-every 500 --eval-sequences 256 --save-every 1000 "$@")
  train "${common[@]}" --gdn-kernel fla --wall-minutes "$(left)" 2>&1 | tee "$out/train.log" ||
    train "${common[@]}" --gdn-kernel torch --wall-minutes "$(left)" 2>&1 | tee -a "$out/train.log"
  roundtrip $run/checkpoint 2>&1 | tee "$out/roundtrip.log" || true
  cp $run/checkpoint/*.safetensors "$out/"
  tar -czf "$out/run_files.tar.gz" -C $run checkpoint/config.json checkpoint/model.safetensors.index.json \
    checkpoint/tokenizer.json checkpoint/tokenizer_config.json checkpoint/generation_config.json \
    loss.csv loss.png train_config.json data/meta.json -C "$(realpath "$out")" train.log command.txt roundtrip.log gpu.txt
  rm "$out/train.log" "$out/command.txt" "$out/roundtrip.log" "$out/gpu.txt"  # at most 8 files come back
  if [ $(( $(date +%s) - t0 )) -lt 540 ]; then
    PYTHONPATH=$site timeout 40 python3 -m pytest -q -m gpu tests/test_train.py -k "300" 2>&1 | tail -3 || true
  fi
fi
