#!/usr/bin/env bash
# Fine-tune the bundled model into a coding assistant on one CUDA GPU (issue 17), then retrain its
# MTP head's chain as bench/distill_chain_head.sh did, and ask it ten coding requests.
#   bench/finetune_chat.sh OUT CHAT_TGZ FINETUNE_STEPS CHAIN_MINUTES [PEAK_LR]
# CHAT_TGZ: the .chat files of bench/chat_data.py (made on the CPU machine, carried here).
# Mixed with the machine's Python standard library and site-packages, the pretraining corpus
# (run 29 mixed the standard library alone, 2.7M tokens, and the model lost much of its Python).
set -euo pipefail
out=$1 chat=$2 ft_steps=$3 chain_min=$4 lr=${5:-6e-4}
mkdir -p "$out" /tmp/chat
tar xzf "$chat" -C /tmp/chat
export PYTHONUNBUFFERED=1
read -r stdlib purelib < <(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['stdlib'], p['purelib'])")
python3 -m nextn.train --finetune-from nextn/default_model --data /tmp/chat --data "$stdlib" --data "$purelib" \
  --suffix .chat --suffix .py --device cuda --out runs/chat --gdn-kernel torch --max-steps "$ft_steps" \
  --lr "$lr" --warmup-steps 30 --eval-every 100 --eval-sequences 128 --save-every 100000 --max-prep-seconds 60 \
  2>&1 | grep -v "^ " | tee "$out/finetune_log.txt"
python3 -m nextn.train --distill-from runs/chat/checkpoint --data "$stdlib" --data "$purelib" --device cuda --out runs/chat_chain \
  --gdn-kernel torch --wall-minutes "$chain_min" --chain-depth 3 --max-prep-seconds 20 --lr 1e-3 --warmup-steps 50 \
  --eval-every 200 --eval-sequences 128 --save-every 100000 2>&1 | grep -v "^ " | tee "$out/chain_log.txt"
python3 bench/chat_eval.py --model runs/chat_chain/checkpoint --device cuda --out "$out/chat_eval.json" \
  2>&1 | tail -60 | tee "$out/chat_eval_log.txt"
# the gate for shipping it: the held-out code NLL and head acceptance, before and after (run 29's
# fine-tune met the chat bar but lost much of its Python: docs/model_card.md, stage 3)
for m in nextn/default_model runs/chat_chain/checkpoint; do
  python3 -m nextn.cli replay "$m" --file tests/test_sampling.py --k 3 --max-tokens 2000 --stride 2 --json
done 2>/dev/null | tee "$out/code_nll.jsonl"
# what comes back: the shards one by one (each under the device tool's 16 MiB), the rest in one tarball
cp runs/chat/train_config.json "$out/finetune_config.json"
cp runs/chat_chain/train_config.json "$out/chain_config.json"
cp runs/chat_chain/checkpoint/*.safetensors "$out/"
tar czf "$out/rest.tgz" -C runs/chat_chain/checkpoint --exclude '*.safetensors' . \
  -C "$out" finetune_log.txt chain_log.txt chat_eval_log.txt finetune_config.json chain_config.json
rm "$out"/finetune_log.txt "$out"/chain_log.txt "$out"/chat_eval_log.txt "$out"/finetune_config.json "$out"/chain_config.json
