#!/usr/bin/env bash
# The benchmark suite on a GPU machine (H100 or H200; NVIDIA), stage by stage, each under its own time limit:
#
#   bash benchmarks/run.sh gputests norms gated_mlp losses logprobs lfm2 moe models compiled host
#   QUICK=--quick bash benchmarks/run.sh norms moe         # the quick cases only
#   REPEATS=3 bash benchmarks/run.sh gated_mlp norms     # three counterbalanced runs of each family
#   ROUNDS=3 bash benchmarks/run.sh moe                  # three counterbalanced rounds in one process (one compile)
#   STEP_TIME_ARGS="--run lfm2moerope --gaps" bash benchmarks/run.sh profile/step_time   # a benchmarks/profile/ script
#
# Stages (a stage's extra arguments come from <STAGE>_ARGS, its time limit in seconds from <STAGE>_S):
#   gputests   pytest -m gpu tests/gpu (GPUTESTS: other paths; GPUTEST_K: a -k expression), outcomes to gputests.txt;
#              GPUTESTS_DONE: the gputests.txt files of earlier calls at the same commit, whose PASSED tests this run
#              leaves out (a suite longer than one call's limit runs on where the last call was cut)
#   norms gated_mlp losses logprobs lfm2 moe    the kernel families (benchmarks/bench_*.py); REPEATS=3 runs each
#              three times, the second with the arms timed last to first (logprobs: --rounds 3, alternating within);
#              ROUNDS=3 measures each case three times within one run (--rounds 3), paying compiles and the
#              peers' autotuning once (the MoE family's first cases take minutes of them on a fresh machine)
#   models     model training steps, eager (bench_models.py; MODELS_ARGS="--run qwen3,lfm2")
#   compiled   the same with torch.compile arms at B4 x T2048 and the host-bound B1 x T512 (REPEATS=3: three processes)
#   families   the other model families' steps (gemma3, mistral, mixtral, qwen2)
#   maxseq     the longest trainable sequence per arm (bench_models.py --max-seq; MAXSEQ_ARGS="--run qwen3
#              --arms baseline,liger_rt --time-limit 240"); each probe a fresh process, rows appended per arm
#   host       host cost of a call (GPU) and of a dispatch decision
#   sweep      liger-tune sweep of this GPU's arch (SWEEP_ARGS, default --quick), exported to $OUT/sweep_ARCH.jsonl
#   parity     liger-tune parity of qwen3-4b in bf16; famparity: the other families
#   multigpu   benchmarks/multi_gpu.py on every GPU of the machine (MULTIGPU_PARTS); mgsweep: the sharded sweep
#   profile/NAME   benchmarks/profile/NAME.py (arguments from NAME_ARGS, e.g. MOE_GEMMS_ARGS="--tokens 16384")
#
# Everything goes to $OUT (default /tmp/liger_rt_bench), outside the repository: log.txt (the whole log),
# stages.txt (each stage's exit status), data/*.csv (the dataset rows of this run only), tuning.db (the sweep's
# DB) and the multi-GPU CSVs.  Add this run's rows to the repository's dataset with
#   for f in OUT/data/*.csv; do tail -n +2 "$f" >> benchmarks/data/$(basename "$f"); done
# Wheels in .whl/ (e.g. `pip download --no-deps -d .whl sqlite-utils sqlite-fts4 click-default-group liger-kernel
# trl`; tests/gpu/test_trl_gpu.py also needs datasets, dill and multiprocess) are installed first, offline, each
# only where the image cannot import it (an image's own pyarrow or pandas is never shadowed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/liger_rt_bench}; mkdir -p "$OUT/data"
LOG="$OUT/log.txt"
missing=()
for w in .whl/*.whl; do   # a wheel's import name: its distribution name (field 1 of the file name), lower case
  [ -e "$w" ] || continue
  m=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  PYTHONPATH= python3 -c "import $m" 2>/dev/null || missing+=("$w")
done
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export LIGER_RT_TUNING_DB=${LIGER_RT_TUNING_DB:-$OUT/tuning.db}
Q=${QUICK:-}
D="--data $OUT/data"
CLI="python3 -m liger_rt.tools.cli"

stage() {  # name, seconds, command...: logged, timed out after the seconds, its exit status kept
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T), limit ${secs}s): $*" | tee -a "$LOG"
  timeout "$secs" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc" | tee -a "$LOG"
  echo "$name $rc" >> "$OUT/stages.txt"
}

family() {  # name, seconds, script, args...: a kernel family's bench, REPEATS times (default once), every other run
            # timing the arms last to first (--reverse-arms), so the runs are counterbalanced
  local name=$1 secs=$2 script=$3; shift 3
  for r in $(seq 1 "${REPEATS:-1}"); do
    stage "$name${REPEATS:+_r$r}" "$secs" python3 "$script" $Q $D $( ((r % 2 == 0)) && echo --reverse-arms) \
      ${ROUNDS:+--rounds $ROUNDS} "$@"
  done
}

gputests_header() {
  python3 -c "import torch, triton, transformers as tf
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'
v = f'torch {torch.__version__}, Triton {triton.__version__}, transformers {tf.__version__}'
print(f'# pytest -m gpu on {gpu} ({v})'
      ', commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)')" 2>&1
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'GPUs', torch.cuda.device_count())" 2>&1 | tee -a "$LOG"
ARCH=${ARCH:-$($CLI doctor --json 2>/dev/null \
  | python3 -c "import json, sys; print(json.load(sys.stdin)['arch']['name'])" 2>/dev/null || echo hopper)}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 1)
export NCCL_NVLS_ENABLE=0     # NCCL's NVLink multicast (NVLS) off: not every multi-GPU host supports it

for s in "$@"; do
  case $s in
    gputests)  # every test's outcome also goes to $OUT/gputests.txt under a header line (GPU, versions, commit),
               # the form benchmarks/data/gputests/ keeps
               gputests_header > "$OUT/gputests.txt"
               # one argument per line (pytest's @file): --deselect and the node id of each test that passed before
               : > "$OUT/gputests_done.args"
               for f in ${GPUTESTS_DONE:-}; do
                 sed -n 's/^\([^ ]*::[^ ]*\) PASSED.*/--deselect\n\1/p' "$f" >> "$OUT/gputests_done.args"
               done
               [ -s "$OUT/gputests_done.args" ] && echo "# continued: $(( $(wc -l < "$OUT/gputests_done.args") / 2 )) tests" \
                 "that passed in ${GPUTESTS_DONE} left out" >> "$OUT/gputests.txt"
               stage gputests "${GPUTESTS_S:-600}" bash -c "python3 -m pytest -m gpu ${GPUTESTS:-tests/gpu} -v \
                 ${GPUTEST_K:+-k '$GPUTEST_K'} -p no:cacheprovider -rfE --durations=30 @'$OUT/gputests_done.args' \
                 | tee -a '$OUT/gputests.txt' | grep -v PASSED; exit \${PIPESTATUS[0]}" ;;
    norms)     family norms "${NORMS_S:-300}" benchmarks/bench_norms.py ${NORMS_ARGS:-} ;;
    gated_mlp) family gated_mlp "${GATED_MLP_S:-200}" benchmarks/bench_gated_mlp.py ${GATED_MLP_ARGS:-} ;;
    losses)    family losses "${LOSSES_S:-300}" benchmarks/bench_losses.py ${LOSSES_ARGS:-} ;;
    logprobs)  stage logprobs "${LOGPROBS_S:-300}" python3 benchmarks/bench_logprobs.py $Q $D \
                 ${REPEATS:+--rounds $REPEATS} ${LOGPROBS_ARGS:-} ;;
    lfm2)      family lfm2 "${LFM2_S:-200}" benchmarks/bench_lfm2_ops.py ${LFM2_ARGS:-} ;;
    moe)       # a fresh machine pays its compiles and autotuning in the first MoE cases (minutes): give it time
               family moe "${MOE_S:-600}" benchmarks/bench_moe.py ${MOE_ARGS:-} ;;
    models)    stage models "${MODELS_S:-600}" python3 benchmarks/bench_models.py ${Q:+--quick} $D ${MODELS_ARGS:-} ;;
    compiled)  for r in $(seq 1 "${REPEATS:-1}"); do      # REPEATS=3: three processes, three runs per arm pair
                 stage "compiled${REPEATS:+_r$r}" "${COMPILED_S:-600}" python3 benchmarks/bench_models.py --compile \
                   --run "${COMPILED_RUNS:-qwen3,lfm2,lfm2moe}" --shape "${COMPILED_SHAPES:-4x2048,1x512}" \
                   --steps 10 --warmup 3 $D ${COMPILED_ARGS:-}
               done ;;
    families)  stage families "${FAMILIES_S:-600}" python3 benchmarks/bench_models.py --run families \
                 ${Q:+--quick} $D ${FAMILIES_ARGS:-} ;;
    maxseq)    stage maxseq "${MAXSEQ_S:-600}" python3 benchmarks/bench_models.py --max-seq $D ${MAXSEQ_ARGS:-} ;;
    host)      stage host "${HOST_S:-150}" python3 benchmarks/bench_host.py $D ${HOST_ARGS:-}
               stage dispatch 60 python3 benchmarks/bench_host.py --dispatch $D ;;
    sweep)     stage sweep "${SWEEP_S:-420}" $CLI sweep --arch "$ARCH" ${SWEEP_ARGS:---quick}
               stage export 60 $CLI export "$OUT/sweep_$ARCH.jsonl" --arch "$ARCH"
               stage explain 60 $CLI explain rms_norm --shape rows=16384,hidden=4096 --dtype bf16 ;;
    parity)    stage parity "${PARITY_S:-300}" $CLI parity --model qwen3 --preset qwen3-4b --dtype bf16 --device cuda ;;
    famparity) for mp in gemma3_text:gemma3-4b mistral:mistral-7b-16L mixtral:mixtral-8x7b-2L qwen2:qwen2.5-7b-14L; do
                 stage "parity_${mp%%:*}" "${FAMPARITY_S:-150}" $CLI parity --model "${mp%%:*}" --preset "${mp#*:}" \
                   --dtype bf16 --device cuda --flags rope=1,fused_linear_cross_entropy=1 --json
               done ;;
    multigpu)  for p in ${MULTIGPU_PARTS:-parity throughput consistency}; do
                 stage "multigpu_$p" "${MULTIGPU_S:-360}" python3 -m torch.distributed.run --standalone \
                   --nproc-per-node "$NGPU" benchmarks/multi_gpu.py --part "$p" --out "$OUT/multigpu" ${MULTIGPU_ARGS:-}
               done ;;
    mgsweep)   # one DB written by rank 0, every rank sweeping its share of the cases; compare with `sweep`
               stage mgsweep "${SWEEP_S:-420}" env LIGER_RT_TUNING_DB="$OUT/tuning_sharded.db" python3 -m \
                 torch.distributed.run --standalone --nproc-per-node "$NGPU" -m liger_rt.tools.cli sweep \
                 --arch "$ARCH" ${SWEEP_ARGS:---quick} ;;
    profile/*) name=$(basename "${s%.py}"); var="$(echo "$name" | tr a-z A-Z)_ARGS"
               stage "$s" "${PROFILE_S:-300}" python3 "benchmarks/profile/$name.py" ${!var:-} ;;
    *)         echo "unknown stage $s; stages: gputests norms gated_mlp losses logprobs lfm2 moe models compiled" \
                 "families maxseq host sweep parity famparity multigpu mgsweep profile/NAME" | tee -a "$LOG" ;;
  esac
done
echo "stages (name rc):" | tee -a "$LOG"; cat "$OUT/stages.txt" 2>/dev/null | tee -a "$LOG"
wc -l "$OUT"/data/*.csv 2>/dev/null | tee -a "$LOG"
