#!/bin/bash
# The Qwen3.5-9B shape served against its offline figure, in one device run: random weights drawn on
# the GPU, prompts of 512 random token ids, 128 output tokens (ignore_eos, greedy), plain decoding (K=0).
#   1. offline: `nextn bench --random-weights qwen3.5-9b --batch 16`: batch_tokens_per_s.plain.16, 16
#      sequences decoding 128 tokens together, timed after their prefills -> $OUT/offline_9b.json
#   2. served: `nextn serve --random-weights qwen3.5-9b --tokenizer .tok/qwen3.5 --max-num-seqs 16` in
#      the background, `nextn bench serve` with 64 prompts at 16 streams (16 warm-up requests first):
#      output_throughput, prefills included -> $OUT/serve_9b.json
#   3. $OUT/serve_9b_vs_offline.json: the served JSON's fields plus offline_tokens_per_s and
#      served_over_offline (and offline_prefill_tokens_per_s, one 512-token prompt alone, and
#      offline_estimate_with_prefill_tokens_per_s: 16 x 128 tokens over 16 such prefills plus the
#      batch's decode, what the served figure also pays; offline_tuned_linear_configs_unlike_the_servers:
#      the GEMM block configs the bench tuned for itself where the server runs triton_linear's table),
#      then a 3-line summary.
# Needs .tok/qwen3.5 (git-ignored, carried: `python bench/qwen_tokenizer.py --out .tok/qwen3.5` here
# first) and .whl (the wheels device_env.sh installs). Usage (device tool, carry .whl and .tok):
#   bash bench/serve_9b.sh    (about 3-4 min on an H100; at most 220 + 170 + 150 s)
# Env: NUM_PROMPTS (64), the served requests; UNTUNED=1, the offline bench again with --no-tune (the server's
# GEMM configs; offline_untuned_tokens_per_s, ~60 s more); OFFLINE_FROM, an offline_9b.json this GPU run made (a second
# served variant skips the offline bench);
# SERVE_FLAGS, the server's extra flags (default --prefill chunked, as the offline bench and LLM
# prefill; serve's own default is steps; SERVE_FLAGS= for serve's defaults); PORT (8123); SPY=1 samples
# the server and its engine core with py-spy (a wheel in .whl) during the served bench, 200 Hz, into
# $OUT/pyspy_9b.json (speedscope) and prints the core's top frames (bench/pyspy_top.py).
set -o pipefail
source bench/device_env.sh
TOK=.tok/qwen3.5
PORT=${PORT:-8123}
SERVE_FLAGS=${SERVE_FLAGS-"--prefill chunked"}
[ -f $TOK/tokenizer.json ] || { echo "serve_9b: no $TOK/tokenizer.json (build it with bench/qwen_tokenizer.py, carry .tok)"; exit 2; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$(date +%s)

if [ -n "$OFFLINE_FROM" ]; then  # another served variant in the same GPU run: its offline figure again
  echo "=== offline: $OFFLINE_FROM (this run's)"
  cp "$OFFLINE_FROM" $OUT/offline_9b.json || exit 1
else
  echo "=== offline: nextn bench --batch 16 ($(date +%T))"
  timeout 220 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 --spec-k 0 \
    --batch 16 --prompt-len 512 --prefill-len 512 --gen-len 128 --repeats 1 --max-model-len 1024 \
    --json $OUT/offline_9b.json > $OUT/offline_9b.log 2>&1
  rc=$?
  grep '^bench:' $OUT/offline_9b.log | tail -6
  [ $rc -eq 0 ] || { echo "serve_9b: the offline bench failed (rc $rc):"; tail -5 $OUT/offline_9b.log; exit 1; }
  if [ "${UNTUNED:-0}" = 1 ]; then  # the same bench on the server's GEMM configs (the table: --no-tune)
    echo "=== offline, the server's GEMM configs: nextn bench --batch 16 --no-tune ($(date +%T))"
    timeout 150 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 --spec-k 0 \
      --batch 16 --prompt-len 512 --prefill-len 512 --gen-len 128 --repeats 1 --max-model-len 1024 --no-tune \
      --json $OUT/offline_9b_untuned.json > $OUT/offline_9b_untuned.log 2>&1 || tail -3 $OUT/offline_9b_untuned.log
    rm -f $OUT/offline_9b_untuned.log
  fi
fi

echo "=== served: nextn serve + nextn bench serve, 16 streams ($(date +%T), +$(($(date +%s) - t0)) s)"
python3 -m nextn.cli serve --random-weights qwen3.5-9b --tokenizer $TOK --device cuda --dtype bfloat16 --spec-k 0 \
  --max-num-seqs 16 --max-model-len 1024 --port $PORT --log-level info $SERVE_FLAGS > $OUT/server_9b.log 2>&1 &
pid=$!
python3 bench/wait_server.py $PORT $pid 170
ready=$?
if [ $ready -eq 0 ]; then
  echo "server ready (+$(($(date +%s) - t0)) s): $(grep -m1 'cache:' $OUT/server_9b.log)"
  if [ "${SPY:-0}" = 1 ]; then
    $(command -v py-spy || echo /tmp/site/bin/py-spy) record --pid $pid --subprocesses --rate 200 --format speedscope \
      --nonblocking -o $OUT/pyspy_9b.json > /tmp/spy_9b.log 2>&1 &
    spy=$!
  fi
  timeout 150 python3 -m nextn.cli bench serve --base-url http://127.0.0.1:$PORT --dataset random \
    --random-input-len 512 --random-output-len 128 --ignore-eos --num-prompts ${NUM_PROMPTS:-64} --max-concurrency 16 \
    --num-warmups 16 --tokenizer $TOK --disable-tqdm --metadata preset=qwen3.5-9b spec_k=0 "serve_flags=$SERVE_FLAGS" \
    --json $OUT/serve_9b.json > $OUT/serve_9b.log 2>&1
  rc=$?
  grep -E "Successful|Failed|duration|Output token throughput|Median TTFT|Median TPOT|rror" $OUT/serve_9b.log
  if [ -n "$spy" ]; then
    kill -INT $spy; wait $spy 2>/dev/null; tail -2 /tmp/spy_9b.log
    python3 bench/pyspy_top.py $OUT/pyspy_9b.json
  fi
fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null
tail -3 $OUT/server_9b.log
[ $ready -eq 0 ] || exit 1
[ $rc -eq 0 ] || { echo "serve_9b: the served bench failed (rc $rc):"; tail -5 $OUT/serve_9b.log; exit 1; }

python3 - $OUT <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
offline, served = json.loads((out / "offline_9b.json").read_text()), json.loads((out / "serve_9b.json").read_text())
B, gen, prompt = 16, offline["config"]["gen_len"], offline["prefill_len"]
tps = offline["batch_tokens_per_s"]["plain"][str(B)]
prefill = offline["prefill_tokens_per_s"]
try:  # the bench tunes the skinny GEMM's block configs first; a server runs triton_linear's table as it is
    from nextn.ops.linear_configs import CONFIGS
    table = {f"{n}x{k}": list(c) for (n, k), c in CONFIGS.items()}
    unlike = {key: {"tuned": v["config"], "server": table.get(key)}
              for key, v in offline.get("linear_configs", {}).items() if v["config"] != table.get(key)}
except Exception as e:  # (no triton: not the device)
    unlike = f"not compared: {type(e).__name__}"
merged = {
    **served,
    "offline_tokens_per_s": tps,
    "served_over_offline": served["output_throughput"] / tps,
    "offline_prefill_tokens_per_s": prefill,
    "offline_estimate_with_prefill_tokens_per_s": B * gen / (B * prompt / prefill + B * gen / tps),
    "offline_batch_outputs_equal_plain": offline["batch_outputs_equal_plain"]["plain"][str(B)],
    "offline_device": offline["device"],
    "offline_tuned_linear_configs_unlike_the_servers": unlike,
    "offline_untuned_tokens_per_s": None,  # (UNTUNED=1: the same bench on the server's configs, --no-tune)
    "offline_command": "nextn bench --random-weights qwen3.5-9b --dtype bfloat16 --spec-k 0 --batch 16 "
    "--prompt-len 512 --prefill-len 512 --gen-len 128 --repeats 1 --max-model-len 1024",
}
if (out / "offline_9b_untuned.json").is_file():
    untuned = json.loads((out / "offline_9b_untuned.json").read_text())
    merged["offline_untuned_tokens_per_s"] = untuned["batch_tokens_per_s"]["plain"][str(B)]
(out / "serve_9b_vs_offline.json").write_text(json.dumps(merged, indent=2) + "\n")
print(f"offline: nextn bench --batch {B}, plain: {tps:.1f} tok/s (decode of {gen} tokens, prefills untimed; "
      f"prefill {prefill:.0f} tok/s at {prompt}; with 16 such prefills ~{merged['offline_estimate_with_prefill_tokens_per_s']:.1f}; "
      f"GEMM configs tuned unlike the server's: {len(unlike) if isinstance(unlike, dict) else unlike})")
print(f"served:  {served['completed']}/{served['num_prompts']} requests at {served['max_concurrency']} streams: "
      f"{served['output_throughput']:.1f} tok/s output, median TTFT {served['median_ttft_ms']:.0f} ms, "
      f"median TPOT {served['median_tpot_ms']:.2f} ms ({served['device']})")
t = served.get("engine_time")
if t:  # where the server's engine spent the run
    print(f"engine:  {t['run_seconds']:.2f} s run, {int(t['steps'])} steps {t['step_seconds']:.2f} s: "
          f"{int(t['prefill_passes'])} prefill passes {t['prefill_seconds']:.2f} s, rounds {t['round_seconds']:.2f} s "
          f"({int(t.get('mixed_steps', 0))} with prompt pieces riding)")
if merged["offline_untuned_tokens_per_s"]:
    print(f"offline on the server's GEMM configs (--no-tune): {merged['offline_untuned_tokens_per_s']:.1f} tok/s")
ratio = merged["served_over_offline"]
print(f"served / offline = {ratio:.3f} (target >= 0.85: {'met' if ratio >= 0.85 else 'NOT met'}) -> {out / 'serve_9b_vs_offline.json'}")
EOF
# the offline bench's plots: the device tool returns 8 files of $OUT, and the JSONs and logs are 6
rm -f $OUT/offline_9b_*.png
echo "serve_9b: done in $(($(date +%s) - t0)) s"
