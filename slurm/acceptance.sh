# The acceptance run's stages (docs/acceptance.md), sourced by its two entry points:
# slurm/acceptance.sbatch (the job's nodes, under SLURM) and bench/gpu/run_all.sh (one
# node, no SLURM). Each stage runs under its own time limit; one that fails or runs out of
# time is recorded and the next one runs. The last, the report, judges what the others
# measured against the step planner's predictions.
#
#   environment   per node: GPUs, driver, CUDA, NCCL, versions, InfiniBand, the JIT ops
#                 built (not built in time: the later stages run the tables' torch kernel)
#   data          the recipes' token files, or synthetic tokens where they are not there yet
#   smoke         per node: the GPU-only paths' correctness (bench/gpu_smoke.py)
#   collectives   the step's collectives at the recipe's sizes, within and across nodes
#   train_dense   the trainer, dense and STEM, at the recipes' shapes: tokens/s, MFU, the
#   train_stem    step's split, memory
#   checkpoint    a background save, then a resume from it: the next step's loss, the wait,
#                 the resume's time and bytes read
#   long_context  a few steps of the 32k stage's recipe: memory
#   stop          SIGUSR1 during a run: a checkpoint, every node stopped for a requeue
#   refit         the single-GPU constants of the planner's profile (calibrate --gpu)
#   report        summary.json, summary.md, measured_vs_predicted.png, the refit profile
#                 (planning/acceptance.py), and the planner's plan with it (plan.txt)
#
# The entry point sets (arrays in parentheses):
#   WORK REPORT          the stages' folder (data, runs, logs/, figures) and the report's
#   NODES PROCS          nodes, and ranks per node
#   HARDWARE             the profile to predict with: h100, h200, a file, or auto
#   RECIPE BASELINE LONG_RECIPE   the STEM recipe, its dense baseline, the 32k stage's;
#   CHECKPOINT_RECIPE    the checkpoint trial's (default: RECIPE)
#   (KNOBS)              overrides of every trial; (STEM_KNOBS) of the STEM recipes' trials
#                        after them; (LONG_KNOBS) of the 32k trial's, last
#   STEPS LONG_STEPS TOKENS       trial steps; synthetic tokens to write if needed
#   (LIMIT)              each stage's limit in seconds, by name; LIMIT_SCALE multiplies them
#   (SMOKE) (TINY)       gpu_smoke.py's and calibrate's options (a CPU: their toy sizes)
#   PLAN                 tools/plan_step.py's cluster for plan.txt (--nodes N --gpus-per-node G)
# and defines:
#   stem_python ARGS...         python in the ranks' environment, on one node
#   stem_each_node ARGS...      python ARGS on every node at once
#   stem_ranks NAME ARGS...     torchrun on every node, a rank per GPU, the ranks running ARGS
#   stem_stop_ranks             SIGUSR1 to the ranks stem_ranks runs in the background
#   stem_end_steps              end what a stage that ran out of time left running
# FAIL_STAGE="name ..." makes those stages fail at once (the report's test).
# Arrays that may be empty expand as ${a[@]+"${a[@]}"} (bash < 4.4 under `set -u`).

set -m  # each stage in a process group of its own, ended whole when it runs out of time
FAR=1000000  # save and evaluation intervals that never fall due
LOG_TAIL_BYTES=262144  # of each stage's output in the report's acceptance.log
KERNEL=deepspeed
mkdir -p "$WORK/logs" "$REPORT"
: >"$WORK/stages.jsonl"
_acc_t0=$SECONDS
acceptance_say() { echo "acceptance: $(( SECONDS - _acc_t0 )) s: $*"; }

# stage NAME COMMAND...: COMMAND (a program or a function of this file) under LIMIT[NAME]
# seconds (times LIMIT_SCALE), its output in $WORK/logs/NAME.log, its status recorded in
# $WORK/stages.jsonl; a failure is said and returned, not fatal.
stage() {
    local name=$1 began=$SECONDS rc=0 status=ok own="$WORK/logs/$1.log" pid watchdog
    local limit=${LIMIT[$1]:?no time limit for stage $1}
    shift
    acceptance_say "$name (limit $(( limit * LIMIT_SCALE )) s)"
    rm -f "$own.timeout"
    if [[ " ${FAIL_STAGE:-} " == *" $name "* ]]; then
        echo "made to fail (FAIL_STAGE)" >"$own"
        rc=1
    else
        ( "$@" ) >"$own" 2>&1 &
        pid=$!
        ( sleep $(( limit * LIMIT_SCALE )); touch "$own.timeout"; kill -KILL -- "-$pid" ) \
            >/dev/null 2>&1 &
        watchdog=$!
        wait "$pid" 2>/dev/null || rc=$?
        kill -KILL -- "-$watchdog" 2>/dev/null
        wait "$watchdog" 2>/dev/null
    fi
    if [[ -f $own.timeout ]]; then
        status=timeout
        stem_end_steps
    elif (( rc )); then
        status="failed (exit $rc)"
    fi
    printf '{"name": "%s", "status": "%s", "seconds": %d, "limit_s": %d}\n' "$name" \
        "$status" $(( SECONDS - began )) $(( limit * LIMIT_SCALE )) >>"$WORK/stages.jsonl"
    [[ $status == ok ]] || { acceptance_say "$name: $status"; tail -n 5 "$own"; }
    return $rc
}

# trial_args NAME RECIPE STEPS OVERRIDES...: into _acc_args, the trainer's arguments of a
# trial of RECIPE's first STEPS steps (docs/acceptance.md): the knobs', the data stage's
# overrides, `train.steps` a tenth and one beyond STEPS (the data of those samples, a
# schedule that does not end in the trial), no save or evaluation due, a line each step.
trial_args() {
    local name=$1 recipe=$2 steps=$3 data=() stem=() overrides
    shift 3
    overrides="$WORK/data/$(basename "$recipe" .yaml).overrides"
    [[ -f $overrides ]] && mapfile -t data <"$overrides"
    [[ $recipe == "$BASELINE" ]] || stem=(${STEM_KNOBS[@]+"${STEM_KNOBS[@]}"})
    _acc_args=(--recipe "$recipe" ${KNOBS[@]+"${KNOBS[@]}"} ${stem[@]+"${stem[@]}"}
               ${data[@]+"${data[@]}"}
               "optimizer.tables.kernel=$KERNEL" "optimizer.warmup_steps=$(( steps / 4 + 1 ))"
               "train.steps=$(( steps + 1 + steps / 10 ))" "train.save_interval=$FAR"
               "train.eval_interval=$FAR" train.log_interval=1
               "train.save_dir=$WORK/runs/$name" "$@")
}

# trial NAME RECIPE STEPS [--no-loss-check] OVERRIDES...: the trainer's first STEPS steps
# on every rank, then the figures its log gives ($WORK/NAME.json).
trial() {
    local name=$1 recipe=$2 steps=$3 check=() rc
    shift 3
    [[ ${1:-} == --no-loss-check ]] && { check=(--no-loss-check); shift; }
    trial_args "$name" "$recipe" "$steps" "$@"
    stem_ranks "$name" -m megatron_stem.train "${_acc_args[@]}" --stop-after "$steps" 2>&1 |
        tee "$WORK/logs/$name.trainer.log"
    rc=${PIPESTATUS[0]}
    stem_python -m megatron_stem.training.trial figures --log "$WORK/logs/$name.trainer.log" \
        --steps "$steps" --out "$WORK/$name.json" ${check[@]+"${check[@]}"} "${_acc_args[@]}" ||
        return
    return "$rc"
}

# checkpoint_trial RECIPE: run A saves at step 3 in the background and goes on to step 4;
# run B resumes from that save and runs step 4; their step 4 losses are compared.
checkpoint_trial() {
    local rc=0 a="$WORK/logs/checkpoint.uninterrupted.log" b="$WORK/logs/checkpoint.resumed.log"
    trial_args checkpoint "$1" 4 train.save_interval=3 train.async_save=true
    stem_ranks checkpoint_a -m megatron_stem.train "${_acc_args[@]}" --stop-after 4 2>&1 | tee "$a"
    (( PIPESTATUS[0] )) && rc=1
    stem_ranks checkpoint_b -m megatron_stem.train "${_acc_args[@]}" --stop-after 4 2>&1 | tee "$b"
    (( PIPESTATUS[0] )) && rc=1
    stem_python -m megatron_stem.training.trial checkpoint --uninterrupted "$a" --resumed "$b" \
        --step 4 --out "$WORK/checkpoint.json" "${_acc_args[@]}" || return
    return "$rc"
}

# stop_trial RECIPE: SIGUSR1 to the ranks once they logged step 2; what they left.
stop_trial() {
    local pid rc log="$WORK/logs/stop.trainer.log"
    trial_args stop "$1" 50
    export STEM_STOP_MARKER=$WORK/stop/stopped
    mkdir -p "$WORK/stop" && rm -f "$STEM_STOP_MARKER".*
    stem_ranks stop -m megatron_stem.train "${_acc_args[@]}" >"$log" 2>&1 &
    pid=$!
    until grep -q '^step 2/' "$log" 2>/dev/null; do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    stem_stop_ranks
    wait "$pid"
    rc=$?
    cat "$log"
    stem_python -m megatron_stem.training.trial stop --log "$log" --exit-code "$rc" \
        --markers "$STEM_STOP_MARKER" --nodes "$NODES" --out "$WORK/stop.json"
}

# report: the report's files, then the planner with the refit profile (plan.txt).
report() {
    local profile=""
    stem_python -m megatron_stem.planning.acceptance --work "$WORK" --out "$REPORT" \
        --nodes "$NODES" --gpus-per-node "$PROCS" --hardware "$HARDWARE" || return
    for f in "$REPORT/"*.json; do [[ $(basename "$f") == summary.json ]] || profile=$f; done
    # shellcheck disable=SC2086  # PLAN: --nodes N --gpus-per-node G
    stem_python tools/plan_step.py --recipe "$RECIPE" --baseline "$BASELINE" $PLAN \
        --profile "$profile" >"$REPORT/plan.txt"
}

stage environment stem_each_node -m megatron_stem.runtime.environment --out "$WORK/environment" \
    --build-within $(( LIMIT[environment] * LIMIT_SCALE * 3 / 4 ))
if ! ls "$WORK/environment/"*.json >/dev/null 2>&1 ||
    grep -q '"ops_built": false' "$WORK/environment/"*.json; then
    KERNEL=torch  # (said in the report's table of nodes)
fi
stage data stem_python -m megatron_stem.data.synthetic --out "$WORK/data" --tokens "$TOKENS" \
    --recipe "$RECIPE" --recipe "$BASELINE" --recipe "$LONG_RECIPE" ${KNOBS[@]+"${KNOBS[@]}"}
stage smoke stem_each_node bench/gpu_smoke.py ${SMOKE[@]+"${SMOKE[@]}"} --kernel "$KERNEL"
stage collectives stem_ranks collectives -m megatron_stem.planning.collectives --recipe "$RECIPE" \
    --hardware "$HARDWARE" --out "$WORK/collectives.json" ${KNOBS[@]+"${KNOBS[@]}"} \
    ${STEM_KNOBS[@]+"${STEM_KNOBS[@]}"}
stage train_dense trial train_dense "$BASELINE" "$STEPS"
stage train_stem trial train_stem "$RECIPE" "$STEPS"
stage checkpoint checkpoint_trial "${CHECKPOINT_RECIPE:-$RECIPE}"
stage long_context trial long_context "$LONG_RECIPE" "$LONG_STEPS" --no-loss-check \
    train.init_from=null train.init_optimizer=false ${LONG_KNOBS[@]+"${LONG_KNOBS[@]}"}
stage stop stop_trial "$BASELINE"
stage refit stem_python -m megatron_stem.planning.calibrate --gpu "$HARDWARE" \
    ${TINY[@]+"${TINY[@]}"} --kernel "$KERNEL" --out "$WORK/refit.json"
stage report report

for _acc_log in "$WORK/logs/"*.log; do
    [[ $_acc_log == *.trainer.log || $_acc_log == *.uninterrupted.log || $_acc_log == *.resumed.log ]] ||
        { echo "----- $(basename "$_acc_log" .log)"; tail -c "$LOG_TAIL_BYTES" "$_acc_log"; }
done >"$REPORT/acceptance.log"
_acc_verdict=$(sed -n 's/^ *"verdict": "\([a-z]*\)",$/\1/p' "$REPORT/summary.json" 2>/dev/null | head -n1)
acceptance_say "done: ${_acc_verdict:-no report}; the report is in $REPORT"
