#!/bin/bash
# Issue 49's GPU run: GGUF files of the Qwen3.5-9B and 35B-A3B shapes (random weights, Q8_0, with the
# NextN block and Qwen3.5's vocabulary: bench/write_gguf.py), llama.cpp's llama-bench (pp512, tg128) and
# its MTP speculation (llama-speculative-simple --spec-type draft-mtp; random weights: its acceptance is
# whatever the random head gives) beside `nextn bench` on the same file in the same run (also with FR-Spec:
# the head drafting over 32,768 ids, `frspec` in the JSON), and nextn's own bf16 plain decode of the shape
# (--random-weights) for the Q8_0 / bf16 ratio.
# llama.cpp: .llama/llama-bench.tgz and .llama/llama-spec.tgz (llama-bench and llama-speculative-simple,
# built on the CPU machine with CUDA 13.0's nvcc for sm_90, static ggml; 44 MB each, so one a call beside
# .whl and .tok within the 64 MiB carry) or, without them, built here from .llama/llama.cpp.tgz
# (llama-cpp-python 0.3.36's vendored llama.cpp, trimmed to the CPU and CUDA backends: ~10 min on 16 cores).
# Usage (device tool, carry .whl .tok .llama/llama-bench.tgz): bash bench/gguf_vs_llama.sh [9b] [35b]
# Env: FRSPEC=1 adds the FR-Spec run, PROFILE=1 bench/profile_round.py on the file (each ~100-250 s more),
# BF16=0 skips nextn's bf16 run of the shape (~150 s): a call holds at most two of the three
# (without llama-speculative-simple the MTP line is skipped; a second call carrying llama-spec.tgz runs it)
#   -> $OUT/gguf_<shape>_q8_0.json (nextn's bench fields, gguf_file, quantization, llama_cpp {...})
set -o pipefail
source bench/device_env.sh
LOG=$OUT/log.txt
# nextn must import before minutes go into writing a file (run 144: llguidance was missing)
python3 -c "import gguf, llguidance, nextn.cli" || { echo "gguf_vs_llama: nextn does not import here (carry .llama/whl: bench/device_tree.sh prepare)"; exit 2; }
DISK=/tmp/gguf; mkdir -p $DISK
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $LOG
LLAMA=/tmp/llama/bin; mkdir -p $LLAMA
for tool in bench spec; do  # prebuilt (carried: .llama/llama-bench.tgz, .llama/llama-spec.tgz, 44 MB each)
  [ -f .llama/llama-$tool.tgz ] && tar xzf .llama/llama-$tool.tgz -C $LLAMA
done
if [ ! -x $LLAMA/llama-bench ]; then
  echo "=== building llama.cpp $(date +%T)" | tee -a $LOG
  mkdir -p /tmp/llama && tar xzf .llama/llama.cpp.tgz -C /tmp/llama
  cmake -S /tmp/llama/llama.cpp -B /tmp/llama/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_TYPE=Release > $OUT/llama_cmake.log 2>&1 \
    && cmake --build /tmp/llama/build -j16 --target llama-bench llama-speculative-simple > $OUT/llama_build.log 2>&1 \
    || { echo "llama.cpp build failed"; tail -20 $OUT/llama_build.log; exit 1; }
  LLAMA=/tmp/llama/build/bin
fi
# libcublas.so.13 from the toolkit or from torch's nvidia wheels
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13/lib') for p in nvidia.__path__))" 2>/dev/null):$LD_LIBRARY_PATH
$LLAMA/llama-bench --version 2>&1 | head -2 | tee -a $LOG
preset_of() { case $1 in 9b) echo qwen3.5-9b ;; 35b) echo qwen3.5-35b-a3b ;; esac; }
for shape in "${@:-9b}"; do
  preset=$(preset_of $shape)
  file=$DISK/${shape}_q8_0.gguf
  echo "=== $shape write $(date +%T)" | tee -a $LOG
  timeout 300 python3 bench/write_gguf.py --preset $preset --type q8_0 --tokenizer .tok/qwen3.5 --out $file 2>&1 | tail -2 | tee -a $LOG
  ls -la $file | tee -a $LOG
  echo "=== $shape llama-bench $(date +%T)" | tee -a $LOG
  timeout 180 $LLAMA/llama-bench -m $file -p 512 -n 128 -ngl 99 -fa 1 -r 3 -o json > $OUT/llama_bench_$shape.json 2> $OUT/llama_bench_$shape.err
  tail -3 $OUT/llama_bench_$shape.err | tee -a $LOG
  echo "=== $shape llama.cpp MTP $(date +%T)" | tee -a $LOG
  [ -x $LLAMA/llama-speculative-simple ] && timeout 120 $LLAMA/llama-speculative-simple -m $file -ngl 99 -fa on --spec-type draft-mtp --spec-draft-n-max 3 \
    -p "def fibonacci(n):" -n 128 --temp 0 > $OUT/llama_spec_$shape.log 2>&1
  grep -E "decoded|accept" $OUT/llama_spec_$shape.log 2>/dev/null | tee -a $LOG
  echo "=== $shape nextn $(date +%T)" | tee -a $LOG
  timeout 300 python3 -m nextn.cli bench --model $file --device cuda --dtype bfloat16 --spec-k 3 \
    --acceptance-profile 0.85,0.75,0.65 --repeats 1 --json $OUT/nextn_$shape.json 2>&1 | grep -v '^ ' | tail -12 | tee -a $LOG
  # FR-Spec (FRSPEC=1): the head drafts over 32,768 ids (random weights: the first ones; a real model's most
  # frequent). Off by default: each nextn bench on the 9B file takes ~280 s (~95 of them tuning), and three
  # do not fit a 600 s call (run 165 lost its bf16 run so)
  [ "${FRSPEC:-0}" = 1 ] && timeout 240 python3 -m nextn.cli bench --model $file --device cuda --dtype bfloat16 --spec-k 3 \
    --draft-vocab-size 32768 --acceptance-profile 0.85,0.75,0.65 --repeats 1 --json $OUT/nextn_frspec_$shape.json 2>&1 \
    | grep -v '^ ' | tail -3 | tee -a $LOG
  # PROFILE=1: a round on the file by kernel (the Q8_0 rounds cost ~0.1 of a plain step more beyond their
  # steps than bf16's: run 165's round_overhead 0.099 at zero acceptance, bf16's 0.01-0.02 on the H200)
  [ "${PROFILE:-0}" = 1 ] && timeout 200 python3 bench/profile_round.py --model $file --k 3 \
    --out $OUT/profile_round_$shape.json 2>&1 | tail -25 | tee -a $LOG
  [ "${BF16:-1}" = 1 ] && timeout 240 python3 -m nextn.cli bench --random-weights $preset --device cuda --dtype bfloat16 --spec-k 0 \
    --repeats 1 --json $OUT/nextn_bf16_$shape.json 2>&1 | grep -v '^ ' | tail -4 | tee -a $LOG
  python3 - "$OUT" "$shape" "$file" <<'PY' | tee -a $LOG
import json, re, sys
from pathlib import Path
out, shape, file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
nextn = json.loads((out / f"nextn_{shape}.json").read_text())
bf16_file = out / f"nextn_bf16_{shape}.json"  # BF16=0 skips that run
bf16 = json.loads(bf16_file.read_text()) if bf16_file.exists() else {}
frspec_file = out / f"nextn_frspec_{shape}.json"
frspec = json.loads(frspec_file.read_text()) if frspec_file.exists() else {}
runs = json.loads((out / f"llama_bench_{shape}.json").read_text() or "[]")
tg = next((r for r in runs if r.get("n_gen") == 128 and not r.get("n_prompt")), {})
pp = next((r for r in runs if r.get("n_prompt") == 512 and not r.get("n_gen")), {})
spec_log = out / f"llama_spec_{shape}.log"
spec_text = spec_log.read_text() if spec_log.exists() else ""
spec = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", spec_text)
accept = re.search(r"accept\s+=\s+([\d.]+)%", spec_text)
llama = {"version": f"{tg.get('build_commit')} ({tg.get('build_number')}), llama-cpp-python 0.3.36's vendored source",
         "tg128_tokens_per_s": tg.get("avg_ts"), "pp512_tokens_per_s": pp.get("avg_ts"),
         "spec_tokens_per_s": float(spec[1]) if spec else None, "spec_accept_percent": float(accept[1]) if accept else None,
         "flags": "-ngl 99 -fa 1 -r 3; MTP: --spec-type draft-mtp --spec-draft-n-max 3 --temp 0"}
plain, spec_k3 = nextn.get("decode_tokens_per_s"), (nextn.get("profile_tokens_per_s") or {}).get("3")
result = {**nextn, "gguf_file": Path(file).name, "quantization": "q8_0", "llama_cpp": llama,
          "nextn_bf16_plain_tokens_per_s": bf16.get("decode_tokens_per_s"),
          "frspec": {k: frspec.get(k) for k in ("draft_vocab_size", "profile_tokens_per_s", "profile_spec_speedup",
                                                "draft_cost_ratio", "profile_equals_plain")},
          "ratios": {"plain_over_llama_tg128": plain / llama["tg128_tokens_per_s"] if plain and tg else None,
                     "q8_0_over_bf16_plain": plain / bf16["decode_tokens_per_s"] if plain and bf16.get("decode_tokens_per_s") else None,
                     "profile_spec_k3_over_llama_tg128": spec_k3 / llama["tg128_tokens_per_s"] if spec_k3 and tg else None,
                     "frspec_profile_spec_k3_over_llama_tg128": (frspec.get("profile_tokens_per_s") or {}).get("3", 0)
                     / llama["tg128_tokens_per_s"] if frspec and tg else None},
          "command": "bash bench/gguf_vs_llama.sh " + shape}
(out / f"gguf_{shape}_q8_0.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({"shape": shape, "llama_cpp": llama, "nextn_plain": plain, "nextn_bf16_plain": result["nextn_bf16_plain_tokens_per_s"],
                  "profile_spec": nextn.get("profile_tokens_per_s"), **result["ratios"]}))
PY
  rm -f $file
done
