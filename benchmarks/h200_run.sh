#!/usr/bin/env bash
# What we run on the H200 (the device tool here): stages by name, each under its own time limit.
#   bash benchmarks/h200_run.sh gputests norms lfm2 losses moe host sweep parity model
#   bash benchmarks/h200_run.sh logprobs famparity fammodel      (issues 16, 17; LOGPROBS_ARGS="--rounds 3": counterbalanced medians)
#   bash benchmarks/h200_run.sh mixtral fammodel   (issue 17: mixtral's step profiled, its experts swept, then the steps)
#   bash benchmarks/h200_run.sh model3        (issue 18: MODEL3_TARGETS="lfm2moerope lfm2rope", three runs each)
#   bash benchmarks/h200_run.sh compiled      (issue 19 item 4; COMPILED_ARGS="--compile-mode reduce-overhead" for CUDA graphs)
#   bash benchmarks/h200_run.sh compiledfuse  (both compile policies side by side, its own CSV)
#   bash benchmarks/h200_run.sh moesplit      (issue 18: the split up backward: GPU tests, per-GEMM TFLOP/s, timings)
#   bash benchmarks/h200_run.sh moedesc       (issue 18: the MoE up/down descriptor knobs: GPU tests, per-GEMM TFLOP/s, timings)
#   bash benchmarks/h200_run.sh multigpu          (on nvidia-h200-x2: issue 21, benchmarks/multi_gpu.py)
# GPUTEST_K="expr" selects gpu tests by pytest -k (e.g. "not test_parity_bf16 or a3b": families' slow cases out).
# A stage's extra arguments come from NORMS_ARGS, LFM2_ARGS, ... (e.g. MOE_ARGS="--where experts=32").
# Results: benchmarks/results/*.csv in the tree, everything packed into $OUT/results.tgz, and the
# whole log in $OUT/log.txt. The GPU image lacks sqlite-utils: the wheels in .whl/ are installed
# offline first (`pip download --no-deps -d .whl sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4
# liger-kernel==0.8.5 trl==1.16.0` fetches them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
unset OUT   # benchmarks write into benchmarks/results; we pack them at the end
LOG="$OUTDIR/log.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export LIGER_RT_TUNING_DB=${LIGER_RT_TUNING_DB:-$PWD/benchmarks/results/hopper_sweep.db}
Q=${QUICK:-}    # QUICK=--quick: the quick cases of every bench stage
B="python3 -m liger_rt.tools.cli bench"   # the harness: liger_rt/tools/bench/ (CSVs in benchmarks/results)
stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T), limit ${secs}s): $*" | tee -a "$LOG"
  timeout "$secs" "$@" 2>&1 | tee -a "$LOG"
  echo "=== $name rc=${PIPESTATUS[0]}" | tee -a "$LOG"
  tar czf "$OUTDIR/results.tgz" benchmarks/results 2>/dev/null   # after every stage: a cut-off run keeps its results
}
runs3() {  # name, seconds, family (norms, moe_experts, ...), csv tag, bench args...: three runs, run 2 timing the
  # arms last to first (counterbalanced); each run's CSV kept as <family>_h200_<tag>_runN.csv; RUNS="2 3" runs a part
  local name=$1 secs=$2 fam=$3 tag=$4 i rev; shift 4
  for i in ${RUNS:-1 2 3}; do
    rev=""; [ $i = 2 ] && rev=--reverse-arms
    stage ${name}_$i $secs $B kernels "$@" $rev
    cp benchmarks/results/${fam}_h200.csv benchmarks/results/${fam}_h200_${tag}_run$i.csv
  done
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$LOG"
for s in "$@"; do
  case $s in
    gputests) stage gputests ${GPUTEST_S:-300} python3 -m pytest -m gpu ${GPUTESTS:-tests/gpu} ${GPUTEST_FLAGS:--q} ${GPUTEST_K:+-k "$GPUTEST_K"} -p no:cacheprovider -rfE ;;
    norms)    stage norms ${NORMS_S:-240} $B kernels --op norms $Q ${NORMS_ARGS:-} ;;
    lfm2)     stage lfm2 200 $B kernels --op lfm2_ops $Q ${LFM2_ARGS:-} ;;
    losses)   stage losses 240 $B kernels --op losses $Q ${LOSSES_ARGS:-} ;;
    moe)      stage moe ${MOE_S:-300} $B kernels --op moe_experts $Q ${MOE_ARGS:-} ;;
    host)     stage host 120 $B host ;;
    dispatch) stage dispatch 60 $B dispatch ;;
    kernels)  stage kernels ${KERNELS_S:-300} $B kernels ${KERNELS_ARGS:---quick} ;;
    sweep)    stage sweep ${SWEEP_S:-420} python3 -m liger_rt.tools.cli sweep --arch hopper ${SWEEP_ARGS:---quick}
              stage export 60 python3 -m liger_rt.tools.cli export benchmarks/results/hopper.jsonl --arch hopper
              stage explain 60 python3 -m liger_rt.tools.cli explain rms_norm --shape rows=16384,hidden=4096 --dtype bf16 ;;
    normsweep)  # the norms (and rope) at the issue's shapes and the model presets' (CUDA-graph timing), then export
              T="python3 -m liger_rt.tools.cli sweep --arch hopper --quick"
              stage sweep_rms ${SWEEP_S:-110} $T --op rms_norm --shape rows=4096,hidden=2048 --shape rows=8192,hidden=2048 \
                --shape rows=65536,hidden=2048 --shape rows=4096,hidden=4096 --shape rows=16384,hidden=4096 \
                --shape rows=65536,hidden=128 --shape rows=131072,hidden=128
              stage sweep_swiglu ${SWEEP_S:-110} $T --op swiglu --shape rows=4096,cols=8192 --shape rows=16384,cols=8192 \
                --shape rows=4096,cols=12288 --shape rows=8192,cols=12288 --shape rows=8192,cols=6144
              stage sweep_ln ${SWEEP_S:-110} $T --op layer_norm --shape rows=4096,hidden=1152 --shape rows=23328,hidden=1152 \
                --shape rows=4096,hidden=2048 --shape rows=65536,hidden=2048 --shape rows=4096,hidden=4096 \
                --shape rows=16384,hidden=4096
              stage sweep_rope ${SWEEP_S:-110} $T --op rope
              stage export 60 python3 -m liger_rt.tools.cli export benchmarks/results/hopper.jsonl --arch hopper ;;
    profile)  stage profile 90 python3 benchmarks/profile_norms.py ;;
    profmoe)  stage profmoe 120 python3 benchmarks/profile_moe.py ${PROFMOE_ARGS:-} ;;   # PROFMOE_ARGS="--tokens 16384 --experts 64"
    moewgrad) stage moewgrad ${MOEWGRAD_S:-300} python3 benchmarks/profile_moe_wgrad.py ${MOEWGRAD_ARGS:-} ;;   # issue 18: wgrad_sorted 0/1/2 (gathered, sorted, sorted+TMA) vs grouped_mm (first: GPUTEST_K=wgrad_variants gputests); MOEWGRAD_ARGS="--desc --shapes 1,2 --csv benchmarks/results/moe_desc_h200.csv": the up/down descriptor knobs
    profflce) stage profflce ${PROFFLCE_S:-240} python3 benchmarks/profile_flce.py ${PROFFLCE_ARGS:-} ;;   # issue 18: FLCE chunk sizes vs torch.compile
    mixtral)  # issue 17: why mixtral-8x7b-2L steps slower than its baseline: the step profile, then the experts
              # at the step's shape (B4 x T2048 = 8192 tokens) swept (triton candidates, grouped_mm, torch), explained
              stage profmix 150 python3 benchmarks/profile_model.py --model mixtral --preset mixtral-8x7b-2L \
                --arms baseline,liger_rt --flags rope=1 --batch 4 --seq 2048 --steps 6 --rows 15
              stage mixsweep ${MIXSWEEP_S:-240} python3 -m liger_rt.tools.cli sweep --arch hopper --op moe_experts \
                --shape experts=8,top_k=2,hidden=4096,intermediate=14336,tokens=8192
              stage mixexplain 30 python3 -m liger_rt.tools.cli explain moe_experts --arch hopper \
                --shape experts=8,top_k=2,hidden=4096,intermediate=14336,tokens=8192 ;;
    profmem)  # what is live at a step's memory peak per arm (issue 19: liger_rt compiled held more than liger_rt eager)
              stage profmem ${PROFMEM_S:-300} python3 benchmarks/profile_memory.py ${PROFMEM_ARGS:-} ;;
    normsqk3) # the per-head q/k norm shapes (hidden 64, 128) against eager, torch.compile, Liger-Kernel, three runs
              # (norms_h200_qk_runN.csv)
              runs3 normsqk ${NORMS_S:-240} norms qk --op rms_norm --where hidden=64,128 ;;
    fwdhost)  # a bench target's forward: host time per arm with real launches, and cProfile of the forwards
              stage fwdhost ${FWDHOST_S:-240} python3 benchmarks/profile_forward_host.py --device cuda \
                ${FWDHOST_ARGS:---target lfm2rope --cprofile tottime} ;;
    flcechunk) # a model step's speed and peak per fused-loss chunk, ABBA (FLCECHUNK_ARGS="--target lfm2rope --chunks 1280,2048")
              stage flcechunk ${FLCECHUNK_S:-300} python3 benchmarks/flce_chunk_step.py ${FLCECHUNK_ARGS:-} ;;
    scstep)   stage scstep ${SCSTEP_S:-200} python3 benchmarks/short_conv_step_shape.py ${SCSTEP_ARGS:-} ;;   # the short conv at the lfm2 step's shape: seq_idx or not, every candidate
    profhost) stage profhost ${PROFHOST_S:-120} python3 benchmarks/profile_host.py ${PROFHOST_ARGS:-} ;;
    profmodel) stage profmodel ${PROFMODEL_S:-200} python3 benchmarks/profile_model.py ${PROFMODEL_ARGS:-} ;;   # host-bound case: PROFMODEL_ARGS="--arms baseline,liger_rt --batch 1 --seq 512 --host"
    parity)   stage parity 300 python3 -m liger_rt.tools.cli parity --model qwen3 --preset qwen3-4b --dtype bf16 --device cuda ;;
    model)    stage model ${MODEL_S:-540} $B model --target ${MODEL_TARGET:-all} $Q ${MODEL_ARGS:-} ;;
    model3)   # issue 18: each of MODEL3_TARGETS (default lfm2moerope) three times, every run in its own process (each
              # run's CSV kept as model_h200_<target>_runN.csv; a target is met by the median of three)
              for t in ${MODEL3_TARGETS:-lfm2moerope}; do
                for i in 1 2 3; do
                  stage model_${t}_$i ${MODEL_S:-150} $B model --target $t ${MODEL_ARGS:-}
                  cp benchmarks/results/model_h200.csv benchmarks/results/model_h200_${t}_run$i.csv
                done
              done ;;
    regs)     stage regs 120 python3 benchmarks/profile_regs.py ;;
    compiled) # issue 19 item 4: model steps, baseline / liger_rt eager and torch.compile'd, Liger-Kernel eager (where
              # it patches the model), counterbalanced, at 4x2048 and the host-bound 1x512; every target at 4x2048
              # first; the CSV is written after each target and shape, so a cut run keeps what finished
              stage compiled ${COMPILED_S:-400} $B model --target ${COMPILED_TARGETS:-qwen3,lfm2,lfm2moe} \
                --shape ${COMPILED_SHAPES:-4x2048,1x512} --compile --steps ${COMPILED_STEPS:-10} --warmup 3 \
                --csv benchmarks/results/model_compiled_h200.csv ${COMPILED_ARGS:-} ;;
    compiledfuse) # the compiled arms under both compile policies in one process, counterbalanced:
              # liger_rt+compile+kernels (every op a custom op) beside liger_rt+compile+fuse (the default: norms,
              # SwiGLU, RoPE traced as torch for inductor to fuse; the fused loss and MoE stay on liger_rt's kernels)
              stage compiledfuse ${COMPILED_S:-400} $B model --target ${COMPILED_TARGETS:-qwen3,lfm2} \
                --shape ${COMPILED_SHAPES:-4x2048} --steps ${COMPILED_STEPS:-10} --warmup 3 \
                --arms baseline,liger_rt,baseline+compile,liger_rt+compile+kernels,liger_rt+compile+fuse \
                --csv benchmarks/results/model_compiled_fuse_h200.csv ${COMPILED_ARGS:-} ;;
    moe3)     # issue 18: the MoE experts at T16384 (both shapes, both routings, every peer) three times, each run's
              # CSV kept as moe_experts_h200_t16384_runN.csv (the 450 TFLOP/s target is a median of three)
              runs3 moe3 ${MOE3_S:-200} moe_experts t16384 --op moe_experts --where tokens=16384 ${MOE3_ARGS:-} ;;
    moewarm)  # a fresh machine spends more than 150 s in the first MoE case (compiles and autotuning; which arm
              # takes it was not measured. H200, 2026-12-03, logs h200_s11_call3/4): pay it once, in its own stage
              # (2026-12-04, h200_s12_call1: these two T512 cases took more than 300 s on a fresh machine)
              stage moewarm ${MOEWARM_S:-420} $B kernels --op moe_experts --where tokens=512 --where routing=uniform \
                --no-compile --out /tmp/moewarm ;;
    moedesc)  # issue 18 (session 14's knobs, first run): the MoE descriptor GPU tests, each GEMM family's TFLOP/s at
              # E64 T16384, then the four up_desc/down_desc combinations at E32 and E64 T16384 (moe_desc_h200.csv)
              stage moedesc_tests ${GPUTEST_S:-240} python3 -m pytest -m gpu tests/gpu/test_moe_experts_gpu.py -q \
                -k "descriptor or every_candidate or wgrad_variants" -p no:cacheprovider -rfE
              stage moedesc_prof 150 python3 benchmarks/profile_moe.py --tokens 16384 --experts 64
              stage moedesc_time ${MOEDESC_S:-300} python3 benchmarks/profile_moe_wgrad.py --desc --shapes 1,2 \
                --csv benchmarks/results/moe_desc_h200.csv ;;
    moesplit) # issue 18 (session 15): the split up backward (up_bwd_split): GPU tests, per-GEMM TFLOP/s at E64
              # T16384 with the split (pointer and TMA dy), then the heuristic against split variants timed
              # (E32 and E64 T16384, moe_split_h200.csv)
              stage moesplit_tests ${GPUTEST_S:-240} python3 -m pytest -m gpu tests/gpu/test_moe_experts_gpu.py -q \
                -k "split or descriptor or every_candidate or wgrad_variants" -p no:cacheprovider -rfE
              for kn in up_bwd_split=1 up_bwd_split=1,down_desc=1; do
                stage moesplit_prof_$kn 120 python3 benchmarks/profile_moe.py --tokens 16384 --experts 64 --set $kn
              done
              stage moesplit_time ${MOESPLIT_S:-300} python3 benchmarks/profile_moe_wgrad.py --shapes 1,2 \
                --variants "${MOESPLIT_VARIANTS:-split:up_bwd_split=1;split_d:up_bwd_split=1,down_desc=1;split_ud:up_bwd_split=1,down_desc=1,up_desc=1}" \
                --csv benchmarks/results/moe_split_h200.csv ;;
    moegrid3) # issue 18: the 12 grid points below T16384 three times (moe_experts_h200_grid_runN.csv); with moe3
              # the 16-point peer grid
              runs3 moegrid ${MOEGRID_S:-200} moe_experts grid --op moe_experts --where tokens=512,2048,4096 --no-compile ;;
    shortconv3) # issue 18: short conv B1 T65536 three times (each run's CSV kept as lfm2_ops_h200_shortconv_runN.csv)
              for i in 1 2 3; do
                stage shortconv$i 90 $B kernels --op lfm2_ops --where op=short_conv --where seq=65536 --no-compile
                cp benchmarks/results/lfm2_ops_h200.csv benchmarks/results/lfm2_ops_h200_shortconv_run$i.csv
              done ;;
    logprobs) stage logprobs ${LOGPROBS_S:-300} python3 -m liger_rt.tools.bench.logprobs $Q ${LOGPROBS_ARGS:-} ;;
    famparity)  # issue 17: the new families' bf16 parity at real (or H200-cut) sizes, every flag that has a row
              for mp in gemma3_text:gemma3-4b mistral:mistral-7b-16L mixtral:mixtral-8x7b-2L qwen2:qwen2.5-7b-14L; do
                stage parity_${mp%%:*} ${FAMPARITY_S:-150} python3 -m liger_rt.tools.cli parity --model ${mp%%:*} \
                  --preset ${mp#*:} --dtype bf16 --device cuda --flags rope=1,fused_linear_cross_entropy=1 --json
              done ;;
    fammodel)   # issue 17: training steps of the new families (baseline, patched, patched, baseline), rope patched
              # like Liger-Kernel patches it; FAMMODELS="model:preset:batch[:seconds] ..." picks families
              # (mixtral: Liger-Kernel's fused MoE autotunes on its first call, 150 s was not enough)
              for mpb in ${FAMMODELS:-gemma3_text:gemma3-4b:2 mistral:mistral-7b-16L:4 mixtral:mixtral-8x7b-2L:4:300 qwen2:qwen2.5-7b-14L:2}; do
                IFS=: read -r m p b secs <<< "$mpb"
                stage model_$p ${secs:-${FAMMODEL_S:-150}} $B model --model $m --preset $p --batch $b --seq 2048 --dtype bf16 \
                  --device cuda --csv benchmarks/results/model_${p}_h200.csv ${FAMMODEL_ARGS:---flags rope=1}
              done ;;
    a1bfull)  # issue 18: the full-depth LFM2-8B-A1B (24 layers) step at B4 x T2048 (A1BFULL_ARGS="--batch 2" if it does not fit)
              stage a1bfull ${A1BFULL_S:-300} $B model --model lfm2_moe --preset lfm2-8b-a1b --seq 2048 --dtype bf16 \
                --device cuda --csv benchmarks/results/model_lfm2-8b-a1b-24L_h200.csv ${A1BFULL_ARGS:---batch 4} ;;
    mixlk)    # issue 17: Liger-Kernel's mixtral arm in its own process with its fused MoE pinned by its own switch
              # (LIGER_FUSED_MOE_AUTOTUNE=0; its first-call autotune at this shape ran past 4 minutes in session 6)
              stage mixlk ${MIXLK_S:-200} env LIGER_FUSED_MOE_AUTOTUNE=0 $B model --model mixtral --preset mixtral-8x7b-2L \
                --batch 4 --seq 2048 --dtype bf16 --device cuda --arms baseline,liger_kernel --flags rope=1 \
                --csv benchmarks/results/model_mixtral-8x7b-2L_lk_h200.csv ;;
    multigpu) # issue 21 items 1-3 on nvidia-h200-x2 (benchmarks/multi_gpu.py); MULTIGPU_PARTS picks parts, MULTIGPU_ARGS adds args
              export NCCL_NVLS_ENABLE=0
              for p in ${MULTIGPU_PARTS:-parity throughput consistency}; do
                stage mg_$p ${MULTIGPU_S:-360} python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --part $p ${MULTIGPU_ARGS:-}
              done ;;
    mgsweep)  # issue 21 item 4: the sharded sweep (issue 20 item 5, docs/cli.md): one GPU and every 2nd case per rank,
              # rank 0 writes one DB; compare its time and rows with `sweep` above (keep the DBs apart:
              # SWEEP_ARGS="--quick --db benchmarks/results/hopper_mgsweep.db"). The ranks exchange results over gloo.
              export NCCL_NVLS_ENABLE=0
              stage mg_sweep ${SWEEP_S:-420} python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m liger_rt.tools.cli sweep --arch hopper ${SWEEP_ARGS:---quick} ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
  esac
done
tar czf "$OUTDIR/results.tgz" benchmarks/results 2>/dev/null
ls -la benchmarks/results | tee -a "$LOG"
