#!/bin/bash
# One device call on the H200: tune the skinny GEMM, kernel tests at real shapes, the benches.
# Usage (device tool): bash bench/run_h200.sh [stages...]
#   stages: tune tests engine profile profile35b profilesampled (9B rounds greedy, T = 0.7, T = 0.7 with top-k 20 and
#   top-p 0.8; plain and K = 3; baseprofilesampled: the same from .base/) prefill prefill4k bench9b bench9bquick (K = 1, 3, 8, one repeat) batch9b benchdefault bench35b
#   FP8 weights against bf16 (9B): fp8 (its GPU tests alone: fp8tests); 35B-A3B in FP8 (bench35b for bf16): fp8_35b;
#   FP8 K/V and the p_min gate: kvfp8 pmin gate (the fused gated draft's tests, then pmin); the gate greedy and
#   sampled (T = 0.7, 100 seeds) at K = 3, 6: pminsampled; at 0, 0.5, 0.999 on two prompts (a skipped step's cost): pminbound
#   the MoE decode kernels' tests: moe; their block sizes: moesweep; a graph of MoE blocks replayed alone / back to back /
#   pipelined, PDL off and on: pdlprobe; a GEMM's time against the memory its weight copies span: tlbprobe;
#   the skinny GEMM with PDL off and on: pdlsweep; the step with PDL off per kernel module (35B-A3B, 9B): pdlattr;
#   the GDN step before / after a change: gdnsweep; a GEMM after its first weight rows were read into L2
#   (evict_last) and 56 MB streamed past them: l2probe;
#   the sampling (one-program and chunked) and greedy accept kernels' tests: sample; softmax and argmax over 248,320 columns in split rows
#   against torch's: widesoftmax; a draw there through the chunked kernels against torch's ops: widesample; CUDA-core GEMVs against the skinny GEMM: gemvvar
#   FP8 and bf16 skinny dots, wgmma against mma.sync (x-major) at 1, 4, 9 rows: xmdot; a CUDA (NVRTC) FP8 GEMV: cudafp8
#   tensor parallelism (nvidia-h200-x2): tptests ar (the IPC all-reduce's tests) tp27b tp35b
#   a change against its base in one run: base35b runs bench35b's command from .base/ (carried, git-ignored:
#   `mkdir -p .base && git archive BASE | tar x -C .base`), into $OUT/base_qwen3.5-35b-a3b.json; base35b and var35b
#   (a variant's tree in .var/, carried the same way) run it from those trees
set -o pipefail
source bench/device_env.sh
LOG=$OUT/log.txt
bench35b() {  # the 35B-A3B bench into $1, from the current directory's nextn (stages bench35b and base35b)
  timeout 300 python3 -m nextn.cli bench --random-weights qwen3.5-35b-a3b --device cuda --dtype bfloat16 \
    --spec-k 1 3 --acceptance-profile 0.85,0.75,0.65 --json "$1"
}
profilesampled() {  # the 9B shape's rounds, greedy and sampled, into $1 (stages profilesampled, baseprofilesampled)
  timeout 300 python3 bench/profile_round.py --preset qwen3.5-9b --k 3 --sampled 0.7 0.7,20,0.8 --plain-sampled \
    --out "$1"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee $LOG
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $LOG
for stage in "$@"; do
  echo "=== $stage $(date +%T)" | tee -a $LOG
  case $stage in
    tune) timeout 90 python3 bench/tune_linear.py --out $OUT/tune.json 2>&1 | grep -E "BEST|Error|error" | tee -a $LOG ;;
    tests) timeout 150 python3 -m pytest -q -x -m gpu tests/test_kernels.py 2>&1 | tail -25 | tee -a $LOG ;;
    sample) timeout 200 python3 -m pytest -q -x tests/test_sample_kernel.py tests/test_sample_wide.py 2>&1 | tail -8 | tee -a $LOG ;;
    engine) timeout 200 python3 -m pytest -q -x tests/test_step.py tests/test_rounds.py tests/test_batching.py 2>&1 \
               | tail -25 | tee -a $LOG ;;
    profile) for m in "--model nextn/default_model" "--preset qwen3.5-9b"; do timeout 120 python3 bench/profile_round.py \
               $m --k 3 --out $OUT/profile_round_$(basename ${m##* }).json 2>&1 | grep -v Warn | head -45 | tee -a $LOG; done ;;
    profile35b) timeout 150 python3 bench/profile_round.py --preset qwen3.5-35b-a3b --k 3 \
               --out $OUT/profile_round_qwen3.5-35b-a3b.json 2>&1 | grep -v Warn | head -45 | tee -a $LOG ;;
    profilesampled) profilesampled $OUT/profile_sampled_qwen3.5-9b.json 2>&1 | grep -v Warn | head -90 | tee -a $LOG ;;
    baseprofilesampled) [ -d .base/nextn ] || { echo "$stage: no .base/nextn (git archive REV | tar x -C .base)" \
                 | tee -a $LOG; continue; }
               (cd .base && PYTHONPATH=$PWD:${PYTHONPATH#*:} profilesampled $OUT/base_profile_sampled_qwen3.5-9b.json) 2>&1 \
                 | grep -v Warn | head -90 | tee -a $LOG ;;
    prefill) for p in qwen3.5-9b qwen3.5-35b-a3b; do timeout 150 python3 bench/profile_prefill.py --preset $p \
               --out $OUT/prefill_$p.json 2>&1 | grep -v Warn | grep -v '^  *[0-9.]* *us .*nvjet_sm90_tst_64x8' | head -80 | tee -a $LOG; done ;;
    prefill4k) timeout 100 python3 bench/profile_prefill.py --preset qwen3.5-9b --prompt-len 4096 \
               --out $OUT/prefill4k_qwen3.5-9b.json 2>&1 | grep -v Warn | head -40 | tee -a $LOG ;;
    batch9b) timeout 300 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 \
               --spec-k 3 --repeats 1 --batch 1 2 4 8 16 32 --prefill-len 4096 --acceptance-profile 0.85,0.75,0.65 \
               --json $OUT/batch_qwen3.5-9b.json 2>&1 | grep -v '^ ' | tail -40 | tee -a $LOG ;;
    bench9b) timeout 420 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 \
               --acceptance-profile 0.85,0.75,0.65 --json $OUT/bench_qwen3.5-9b.json 2>&1 | grep -v '^ ' | tail -40 | tee -a $LOG ;;
    bench9bquick) timeout 240 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 \
               --spec-k 1 3 8 --repeats 1 --acceptance-profile 0.85,0.75,0.65 --json $OUT/bench_qwen3.5-9b.json 2>&1 \
               | grep -v '^ ' | tail -20 | tee -a $LOG ;;
    # (10 repeats: sampled runs draw with seeds 0..9; one seed's acceptance spreads by ~0.08)
    benchdefault) timeout 200 python3 -m nextn.cli bench --model nextn/default_model --device cuda --dtype bfloat16 \
               --prompt-file nextn/engine/rounds.py --temperature 0.7 --spec-k 1 2 3 4 8 --repeats 10 \
               --json $OUT/bench_default_model.json 2>&1 | grep -v "^ " | tail -40 | tee -a $LOG ;;
    bench35b) bench35b $OUT/bench_qwen3.5-35b-a3b.json 2>&1 | grep -v '^ ' | tail -40 | tee -a $LOG ;;
    base35b|var35b) d=.${stage%35b}
               [ -d $d/nextn ] || { echo "$stage: no $d/nextn (git archive REV | tar x -C $d)" | tee -a $LOG; continue; }
               (cd $d && PYTHONPATH=$PWD:${PYTHONPATH#*:} bench35b $OUT/${stage%35b}_qwen3.5-35b-a3b.json) 2>&1 \
                 | grep -v '^ ' | tail -40 | tee -a $LOG ;;
    kvfp8) timeout 200 python3 -m pytest -q -x tests/test_kv_fp8.py tests/test_cache.py 2>&1 | tail -15 | tee -a $LOG
           for kv in auto fp8; do timeout 200 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda \
             --dtype bfloat16 --kv-cache-dtype $kv --spec-k 3 --prompt-len 8192 --gen-len 128 --repeats 1 \
             --json $OUT/kv${kv}_qwen3.5-9b.json 2>&1 | grep -v '^ ' | tail -12 | tee -a $LOG; done ;;
    pmin) timeout 200 python3 -m nextn.cli bench --model nextn/default_model --device cuda --dtype bfloat16 \
             --prompt-file nextn/engine/scheduler.py --spec-k 6 --p-min 0 0.5 --json $OUT/pmin_default_model.json \
             2>&1 | grep -v '^ ' | tail -12 | tee -a $LOG ;;
    # the gate near 1 (draft 1 cut in almost every round: one head step run, K - 1 skipped) prices a skipped step
    pminbound) for f in scheduler rounds; do timeout 150 python3 -m nextn.cli bench --model nextn/default_model \
             --device cuda --dtype bfloat16 --prompt-file nextn/engine/$f.py --spec-k 6 --p-min 0 0.5 0.999 \
             --json $OUT/pmin_bound_default_model_$f.json 2>&1 | grep -v '^ ' | tail -14 | tee -a $LOG; done ;;
    pminsampled) timeout 300 python3 -m nextn.cli bench --model nextn/default_model --device cuda --dtype bfloat16 \
             --prompt-file nextn/engine/scheduler.py --spec-k 3 6 --p-min 0 0.5 --temperature 0.7 --repeats 100 \
             --json $OUT/pmin_sampled_default_model.json 2>&1 | grep -v '^ ' | tail -24 | tee -a $LOG ;;
    fp8|fp8tests) timeout 150 python3 -m pytest -q -x tests/test_fp8.py -k "skinny or chained or triton" 2>&1 | tail -8 \
               | tee -a $LOG; [ $stage = fp8tests ] && continue
         # FP8 weights against bf16 on the 9B shape, same run: plain decode both, spec == plain K=1..8 under FP8
         timeout 150 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 \
           --spec-k 1 --repeats 1 --json $OUT/bf16_qwen3.5-9b.json 2>&1 | grep -v '^ ' | tail -12 | tee -a $LOG
         timeout 300 python3 -m nextn.cli bench --random-weights qwen3.5-9b --device cuda --dtype bfloat16 \
           --quantization fp8 --acceptance-profile 0.85,0.75,0.65 --json $OUT/fp8_qwen3.5-9b.json 2>&1 \
           | grep -v '^ ' | tail -30 | tee -a $LOG
         python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); \
           print('fp8/bf16 plain decode', b['decode_tokens_per_s']/a['decode_tokens_per_s'], \
           'fp8 roofline', b.get('roofline_fraction'), 'bf16 roofline', a.get('roofline_fraction'))" \
           $OUT/bf16_qwen3.5-9b.json $OUT/fp8_qwen3.5-9b.json | tee -a $LOG ;;
    fp8_35b) timeout 300 python3 -m nextn.cli bench --random-weights qwen3.5-35b-a3b --device cuda --dtype bfloat16 \
               --quantization fp8 --spec-k 1 3 --acceptance-profile 0.85,0.75,0.65 \
               --json $OUT/fp8_qwen3.5-35b-a3b.json 2>&1 | grep -v '^ ' | tail -20 | tee -a $LOG ;;
    gate) timeout 150 python3 -m pytest -q -x tests/test_draft_kernel.py 2>&1 | tail -8 | tee -a $LOG ;;
    gdnsweep) # bench/prev_triton_gdn.py: a copy of the module before the change under test (not committed)
               timeout 100 python3 bench/gdn_sweep.py --tokens 1 4 --block-v 32 --warps 4 --kernel bench/prev_triton_gdn.py \
                 --label before --out $OUT/gdn_sweep_before.json 2>&1 | grep -v Warn | tail -4 | tee -a $LOG
               timeout 100 python3 bench/gdn_sweep.py --tokens 1 4 --block-v 16 32 --warps 4 --label after \
                 --out $OUT/gdn_sweep_after.json 2>&1 | grep -v Warn | tail -8 | tee -a $LOG ;;
    moesweep) timeout 200 python3 bench/moe_step_sweep.py --out $OUT/moe_step_sweep.json 2>&1 | grep -v Warn | tail -45 \
               | tee -a $LOG ;;
    gemvvar) timeout 400 python3 bench/gemv_variants.py --out $OUT/gemv_variants.json 2>&1 | grep -v Warn | tail -120 \
               | tee -a $LOG ;;
    xmdot) timeout 450 python3 bench/fp8_dot_variants.py --rows 1 4 9 --modes bf16 "f16 chain" "bf16 xm" "f16 chain xm" \
             "bf16 tile xm" --out $OUT/fp8_dot_variants.json 2>&1 | grep -v Warn | tail -80 | tee -a $LOG ;;
    cudafp8) (which nvcc || echo "no nvcc"; ls -d /usr/local/cuda* 2>/dev/null) | tee -a $LOG
             timeout 400 python3 bench/cuda_fp8_probe.py --out $OUT/cuda_fp8_probe.json 2>&1 | grep -v Warn | tail -100 \
               | tee -a $LOG ;;
    pdlsweep) timeout 150 python3 bench/pdl_sweep.py --out $OUT/pdl_sweep.json 2>&1 | grep -v Warn | tail -12 | tee -a $LOG ;;
    pdlattr) timeout 480 python3 bench/pdl_attribution.py --preset qwen3.5-35b-a3b qwen3.5-9b \
               --out $OUT/pdl_attribution.json 2>&1 | grep -v Warn | tail -20 | tee -a $LOG ;;
    l2probe) timeout 150 python3 bench/l2_prefetch_probe.py --out $OUT/l2_prefetch_probe.json 2>&1 | grep -v Warn \
               | tail -14 | tee -a $LOG ;;
    widesoftmax) timeout 150 python3 bench/wide_softmax_probe.py --out $OUT/wide_softmax_probe.json 2>&1 | grep -v Warn \
               | tee -a $LOG ;;
    widesample) timeout 200 python3 bench/wide_sample_probe.py --out $OUT/wide_sample_probe.json 2>&1 | grep -v Warn \
               | tee -a $LOG ;;
    tlbprobe) timeout 150 python3 bench/tlb_probe.py --out $OUT/tlb_probe.json 2>&1 | grep -v Warn | tail -20 | tee -a $LOG ;;
    pdlprobe) timeout 150 python3 bench/pdl_graph_probe.py --out $OUT/pdl_graph_probe.json 2>&1 | grep -v Warn | tee -a $LOG ;;
    moe) timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_fp8.py -k "moe or router" 2>&1 | tail -8 | tee -a $LOG ;;
    ar) timeout 150 python3 -m pytest -v -x -o faulthandler_timeout=60 tests/test_allreduce.py tests/test_tp.py \
          -k "allreduce or all_reduce or tp2_tokens" 2>&1 | grep -v "^ " | tail -20 | tee -a $LOG ;;
    tptests) timeout 300 python3 -m pytest -v -x -o faulthandler_timeout=90 tests/test_tp.py 2>&1 | grep -v "^ " \
               | tail -40 | tee -a $LOG ;;
    tp27b|tp35b) p=qwen3.5-27b; [ $stage = tp35b ] && p=qwen3.5-35b-a3b
               # plain decode at TP=1 and TP=2 (same random weights); spec == plain K=1..8 at TP=2
               for n in 1 2; do ks="1"; [ $n = 2 ] && ks="1 2 3 4 5 6 7 8"
                 timeout 175 python3 -m nextn.cli bench --random-weights $p --device cuda --dtype bfloat16 \
                   --tensor-parallel-size $n --spec-k $ks --repeats 1 --gen-len 96 --json $OUT/tp${n}_$p.json \
                   2>&1 | grep -v '^ ' | tail -30 | tee -a $LOG
               done
               python3 bench/tp_compare.py $OUT/tp1_$p.json $OUT/tp2_$p.json --out $OUT/tp_$p.json | tee -a $LOG ;;
  esac
  rc=$?  # a stage's last pipeline (pipefail): 124 / 137 when its timeout ended it
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    # a hang (run 93: one kernel hung every later stage that ran it, 600 s lost) would likely repeat
    echo "=== $stage timed out (rc $rc): the remaining stages are skipped" | tee -a $LOG
    break
  fi
done
echo "=== end $(date +%T)" | tee -a $LOG
tar czf $OUT/triton_cache.tgz -C /tmp/triton_cache .
(cd $OUT && ls *.png >/dev/null 2>&1 && tar cf plots.tar *.png && rm -f *.png)  # at most 8 files come back
ls -la $OUT
