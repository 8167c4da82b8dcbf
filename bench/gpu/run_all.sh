#!/usr/bin/env bash
# What a user asks first of one H100 or H200, in stages of their own limits (<= 120 s each,
# 480 s in all: with the machine's start and the install, within 15 minutes); a stage that
# fails or runs out of time is recorded and the next one runs:
#   build        DeepSpeed's CPU Adam and the tables' row Adam (tools/build_ops.py --within):
#                not built in time, the later stages run the tables' torch kernel;
#   data         a 4,096-piece tokenizer and the shipped corpus (data_corpus/) tokenized;
#   smoke        the GPU-only paths' correctness (bench/gpu_smoke.py);
#   train_dense  the real trainer (python -m megatron_stem.train, through
#   train_stem   bench/gpu/trainer.py) at the 1B layer shapes cut to 4 layers (d 2048,
#                32/8 heads, d_ff 8192, vocab 128,256, seq 2048), bf16, 30 steps of 16 x 2048
#                tokens: dense, and STEM with two tables (layers 1 and 3) at the recipe's
#                table settings but their state on the GPU (on one GPU the CPU Adam would
#                carry what 32 ranks share); the recipe's 40M-element buckets against the
#                262.7M-parameter embedding and output layer take DeepSpeed's
#                oversized-parameter path. Tokens/s, MFU, peak memory, the step's split,
#                the loss falling;
#   tables_device STEM tables in GPU memory, then in host memory, 10 steps each (tokens/s;
#   tables_host  lazy updates, state in CPU memory, no overlap: what host placement runs);
#   long_context one 32,768-token sequence per step with document masking (micro-batch 1,
#                the dense model): time and memory;
#   refit        the planner's profile of the GPU measured (h100 or h200) refit, and the
#                planner's tables for the 1B pair on 4 x 8 of them.
# A trainer stage asks for the samples of its steps and a tenth more at most (the trainer
# is stopped once it has logged them: no checkpoint or evaluation falls due).
# Writes to $OUT six small files: summary.json (one object per stage: name, status, gpu,
# seconds, limit_s, figures), summary.txt (the same as a table), run_all.log (every stage's
# output, the last 256 kB of each), <profile>.json (the refit profile: h100.json or
# h200.json), plan_today.txt, plan_best.txt. Data, caches, run folders and the stages' own
# logs go to $WORK (default: a new folder under /tmp). Needs the wheels of
# bench/gpu/prepare.sh in .whl/ (carried: ".whl"). Runs on the torch it finds.
#   bash bench/gpu/run_all.sh                    # on the GPU machine
#   DRY_RUN=1 bash bench/gpu/run_all.sh          # here: the same stages at toy sizes on CPU
#   FAIL_STAGE="smoke" ...                       # a stage made to fail (the summary's test)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
WORK="${WORK:-$(mktemp -d /tmp/stem_gpu.XXXXXX)}"
mkdir -p "$OUT" "$WORK/logs"
DATA="$WORK/data"
LOG="$OUT/run_all.log"
LOG_TAIL_BYTES=262144  # of each stage's output in $LOG
COMMON=("data.prefixes=[$DATA/gcide_text_document]" "data.tokenizer_model=$DATA/gcide.model"
        data.tokenizer_type=sentencepiece data.split=99,1,0 optimizer.warmup_steps=5
        train.global_batch_size=16 model.num_layers=4)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PY="${PYTHON:-python3}"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    TINY=(--tiny); SMOKE=(--dry-run); STEPS=6; LONG=512; WORKERS=2
    SHAPE=(model.hidden_size=64 model.num_attention_heads=4 model.num_query_groups=2
           model.ffn_hidden_size=128 model.vocab_size=4096 model.seq_length=64
           train.micro_batch_size=2 train.dtype=fp32)
    # The limits are the GPU run's; toy sizes on a CPU that other jobs share (the test
    # suite's other worker) can take longer, and what a dry run checks is the stages.
    LIMIT_SCALE=5
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PY=python3
    TINY=(); SMOKE=(); STEPS=30; LONG=32768; WORKERS=8; SHAPE=(); LIMIT_SCALE=1
    export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions  # DeepSpeed's JIT ops
fi
# The GPU every stage runs on, and the planner profile it refits (none for another GPU).
IFS=$'\t' read -r PROFILE GPU < <("$PY" bench/gpu/device.py ${TINY[@]+"${TINY[@]}"})
start=$SECONDS
stamp() { echo "[run_all] $(( SECONDS - start )) s: $*" | tee -a "$LOG"; }
stamp "on ${GPU:-an unknown device}; work folder $WORK"

# stage NAME LIMIT COMMAND...: COMMAND under LIMIT seconds (times LIMIT_SCALE), its output in
# $WORK/logs/NAME.log (its end in $LOG), recorded in the summary; a failure is said and
# returned, not fatal.
stage() {
    local name=$1 limit=$2 began=$SECONDS rc=0 status=ok own="$WORK/logs/$1.log"
    shift 2
    stamp "$name (limit $limit s)"
    if [[ " ${FAIL_STAGE:-} " == *" $name "* ]]; then
        echo "made to fail (FAIL_STAGE)" > "$own"
        rc=1
    else
        timeout --kill-after=10 $(( limit * LIMIT_SCALE )) "$@" > "$own" 2>&1 || rc=$?
    fi
    if (( rc == 124 || rc == 137 )); then
        status=timeout
    elif (( rc )); then
        status="failed (exit $rc)"
    fi
    { echo "----- $name: $status"; tail -c "$LOG_TAIL_BYTES" "$own"; } >> "$LOG"
    "$PY" bench/gpu/summary.py record "$OUT" "$WORK" "$name" "$status" $(( SECONDS - began )) \
        "$limit" "$GPU"
    [[ "$status" == ok ]] || { stamp "$name: $status"; tail -n 5 "$own"; }
    return $rc
}
# train NAME LIMIT STEPS RECIPE OVERRIDES...: a stage of the real trainer (bench/gpu/trainer.py)
train() {
    local name=$1 limit=$2 steps=$3 recipe=$4
    shift 4
    stage "$name" "$limit" "$PY" bench/gpu/trainer.py --recipe "$recipe" --steps "$steps" \
        ${LOSS_CHECK:+"$LOSS_CHECK"} --figures "$WORK/$name.json" -- "${COMMON[@]}" \
        ${SHAPE[@]+"${SHAPE[@]}"} "optimizer.tables.kernel=$KERNEL" \
        "train.save_dir=$WORK/runs/$name" "$@"
}

KERNEL=deepspeed
stage build 60 "$PY" tools/build_ops.py --within $(( 50 * LIMIT_SCALE )) || KERNEL=torch
stage data 25 bash -c "set -e
    '$PY' tools/train_tokenizer.py --input data_corpus/gcide.jsonl.gz \
        --output-prefix '$DATA/gcide' --vocab-size 4096
    '$PY' tools/preprocess_data.py --input data_corpus/gcide.jsonl.gz --json-keys text \
        --output-prefix '$DATA/gcide' --tokenizer-type sentencepiece \
        --tokenizer-model '$DATA/gcide.model' --append-eod --workers $WORKERS"
stage smoke 80 "$PY" bench/gpu_smoke.py ${SMOKE[@]+"${SMOKE[@]}"} --kernel "$KERNEL"
STEM=("model.stem_layers=[1,3]")
train train_dense 60 "$STEPS" recipes/dense_1b.yaml
train train_stem 75 "$STEPS" recipes/stem_1b.yaml "${STEM[@]}" optimizer.tables.device=accelerator
HOST=("${STEM[@]}" optimizer.tables.update=lazy tables.overlap=none)
train tables_device 40 10 recipes/stem_1b.yaml "${HOST[@]}"
train tables_host 45 10 recipes/stem_1b.yaml "${HOST[@]}" tables.placement=host
LOSS_CHECK=--no-loss-check train long_context 40 3 recipes/dense_1b.yaml data.reset_position_ids=true \
    data.reset_attention_mask=true data.eod_mask_loss=true "model.seq_length=$LONG" \
    train.micro_batch_size=1 train.global_batch_size=1
PROFILE_FILE="$OUT/${PROFILE:-none}.json"
PAIR="--recipe recipes/stem_1b.yaml --baseline recipes/dense_1b.yaml --nodes 4 --gpus-per-node 8"
PAIR+=" --hardware ${PROFILE:-none} --profile $PROFILE_FILE"
stage refit 55 bash -c "set -e
    [[ -n '$PROFILE' ]] || { echo 'no published planner profile for ${GPU:-this device}'; exit 3; }
    '$PY' -m megatron_stem.planning.calibrate --gpu '$PROFILE' ${TINY[*]} --kernel $KERNEL \
        --out '$PROFILE_FILE'
    '$PY' tools/plan_step.py $PAIR > '$OUT/plan_today.txt'
    '$PY' tools/plan_step.py $PAIR --choose best > '$OUT/plan_best.txt'"

"$PY" bench/gpu/summary.py table "$OUT"
stamp "done; results in $OUT"
