# Sourced by slurm/*.sbatch: runs megatron-stem training on the job's nodes.
#
# One `torchrun` per node (srun, one task per node), c10d rendezvous on the job's first
# node, one rank per GPU. Stopping and requeueing (what a stop does is the trainer's alone,
# megatron_stem/training/stop.py; this script and slurm/torchrun.py only forward it):
#   - SIGUSR1 to this batch shell (`#SBATCH --signal=B:USR1@300` before the time limit, or
#     `scancel --signal=USR1 --batch JOB` by hand) is forwarded to every rank; the trainer
#     finishes its step, saves a checkpoint and exits, then this script requeues the job;
#     the next run resumes from `<save_dir>/latest` (same step counter, same TensorBoard run).
#   - SIGTERM (scancel, preemption, time limit) also reaches the ranks (SLURM signals them
#     itself); they save if SLURM gives them time. Preempted jobs are requeued by SLURM.
#   - A rank that dies ends the whole job at once (srun --kill-on-bad-exit) with a
#     "stem: FAILED" line; nothing waits for the time limit.
#
# Settings are environment variables (export them, or `sbatch --export=ALL,NAME=value`);
# nodes, time and job name are sbatch flags (`sbatch --nodes=8 --time=12:00:00 ...`):
#   STEM_RECIPE           recipe YAML (each sbatch file sets its default)
#   STEM_DATA             training data: .bin/.idx prefixes, space-separated (data.prefixes)
#   STEM_TOKENIZER        tokenizer model file (data.tokenizer_model)
#   STEM_TOKENIZER_TYPE   sentencepiece or huggingface (data.tokenizer_type)
#   STEM_OVERRIDES        more recipe overrides, space-separated section.field=value
#   STEM_OUTPUT           root folder of runs (default: runs)
#   STEM_RUN_NAME         this run's folder name (default: the job name, sbatch --job-name)
#   STEM_SAVE_DIR         checkpoints + TensorBoard (default: $STEM_OUTPUT/$STEM_RUN_NAME/checkpoints)
#   STEM_PROCS_PER_NODE   ranks per node (default: one per GPU of the node; 1 without GPUs)
#   STEM_VENV, STEM_MODULES, STEM_SETUP, STEM_CONTAINER, STEM_CONTAINER_MOUNTS: the software
#                         environment, as slurm/environment.sh says
#   STEM_MASTER_PORT      rendezvous port on the first node (default: fixed per job id, below
#                         the node's ephemeral port range; see "rendezvous port" below)
#   STEM_SHUTDOWN_TIMEOUT seconds the ranks get to save after a stop signal (default: 600)
#   STEM_BUILD_DATA_CACHE 1: first build the data cache on this node (tools/build_data_cache.py,
#                         nothing to do once built; the 1B stages' sbatch files set it); 0: no
# NCCL_* / TORCH_NCCL_* variables already set are kept (see "NCCL defaults" in
# slurm/job.sh, which sets up what every step of a job shares: environment, layout, code).

STEM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/environment.sh
source "$STEM_ROOT/slurm/environment.sh"

[[ -n ${SLURM_JOB_ID:-} ]] ||
    stem_die "launch.sh runs inside a SLURM batch job: submit with sbatch slurm/<model>.sbatch"

_stem_t0=$SECONDS

# --- signals (first: a stop can come at any time) -------------------------------------------
_stem_stop=0
_stem_requeueing=0
# Forward, and remember to requeue; the ranks decide what a stop does.
_stem_on_usr1() {
    (( _stem_stop )) && return
    _stem_stop=1
    stem_log "SIGUSR1 (time limit near, or a manual stop): every rank saves a checkpoint and stops; then the job is requeued"
    # Every process of the job's steps (torchrun, which forwards it again, and the ranks),
    # not this batch shell.
    scancel --signal=USR1 "$SLURM_JOB_ID" ||
        stem_log "warning: scancel --signal=USR1 $SLURM_JOB_ID failed"
}
_stem_on_term() {
    (( _stem_requeueing )) && return
    stem_log "SIGTERM: SLURM is ending the job (scancel, preemption or time limit); ranks save a checkpoint if there is time"
}
trap _stem_on_usr1 USR1
trap _stem_on_term TERM

# --- the job: environment, layout, folders, code (slurm/job.sh) -------------------------
# shellcheck source=slurm/job.sh
source "$STEM_ROOT/slurm/job.sh"

# --- the training command ---------------------------------------------------------------
_stem_recipe=${STEM_RECIPE:?set STEM_RECIPE to a recipe YAML}
[[ -f $_stem_recipe || $_stem_recipe = /* ]] || _stem_recipe=$STEM_ROOT/$_stem_recipe
[[ -f $_stem_recipe ]] || stem_die "STEM_RECIPE: $STEM_RECIPE not found (relative paths are from $PWD or $STEM_ROOT)"
_stem_save_dir=$(realpath -m "${STEM_SAVE_DIR:-$_stem_run_dir/checkpoints}")
mkdir -p "$_stem_save_dir" || stem_die "cannot create $_stem_save_dir"
_stem_args=(--recipe "$_stem_recipe" "train.save_dir=$_stem_save_dir"
            ${_stem_knobs[@]+"${_stem_knobs[@]}"})
export STEM_STOP_MARKER=$_stem_job_dir/stopped.$_stem_restart
rm -f "$STEM_STOP_MARKER".*

_stem_latest() { cat "$_stem_save_dir/latest" 2>/dev/null || echo "none"; }

{
    echo "=== $(date '+%F %T') job $SLURM_JOB_ID restart $_stem_restart on $SLURM_JOB_NODELIST"
    echo "cwd: $PWD"
    echo "checkout: $STEM_ROOT ($(git -C "$STEM_ROOT" describe --always --dirty 2>/dev/null || echo 'not a git checkout'))"
    echo "code: $STEM_CODE_VERSION in $_stem_code ($_stem_code_from)"
    echo "container: ${STEM_CONTAINER:-none}"
    echo "python: $(command -v python)"
    echo "command: srun ${_stem_srun_container[*]} ... ${_stem_python[*]} $_stem_code/slurm/torchrun.py ${_stem_torchrun[*]} --rdzv-id=$SLURM_JOB_ID-$_stem_restart -m megatron_stem.train ${_stem_args[*]}"
    env | grep -E '^(STEM_|NCCL_|TORCH_NCCL_|OMP_NUM_THREADS|CUDA_(VISIBLE_DEVICES|MODULE_LOADING)|SLURM_(JOB_|GPUS|CPUS|NNODES|RESTART))' | sort
} >>"$_stem_job_dir/launch.log"

stem_log "job $SLURM_JOB_ID (restart $_stem_restart) $(date '+%F %T'): $_stem_nnodes node(s) x $_stem_procs rank(s) ($_stem_procs_from) on $SLURM_JOB_NODELIST, rendezvous $_stem_master:$_stem_port"
stem_log "recipe $_stem_recipe | checkpoints $_stem_save_dir (latest: $(_stem_latest)) | job files $_stem_job_dir"
stem_log "code $STEM_CODE_VERSION ($_stem_code_from)${STEM_CONTAINER:+ | container $STEM_CONTAINER}"
(( _stem_stop )) || stem_check_environment torch deepspeed megatron.core

# --- the data cache: built here, before any rank starts, so that no rank waits for rank 0
# under the process groups' timeout (docs/data.md, "Training data at scale") ----------
if [[ ${STEM_BUILD_DATA_CACHE:-0} == 1 ]] && (( ! _stem_stop )); then
    stem_log "data cache: tools/build_data_cache.py on one node with $_stem_cpus CPUs"
    # On one node, in the ranks' environment (container included), with the job's code.
    srun --nodes=1 --ntasks=1 --cpus-per-task="$_stem_cpus" \
        ${_stem_srun_container[@]+"${_stem_srun_container[@]}"} "${_stem_python[@]}" \
        "$STEM_ROOT/tools/build_data_cache.py" "${_stem_args[@]}" \
        --ranks $(( _stem_nnodes * _stem_procs )) --workers "$_stem_cpus" ||
        (( _stem_stop )) || stem_die "building the data cache failed (see above)"
fi

# --- run ---------------------------------------------------------------------------------
_stem_rc=0
if (( ! _stem_stop )); then  # (a stop during the set-up: nothing to save, just requeue)
    stem_srun_ranks "$SLURM_JOB_ID-$_stem_restart" -m megatron_stem.train "${_stem_args[@]}" &
    _stem_srun=$!
    # `wait` returns early whenever a trapped signal arrives: keep waiting while srun lives.
    while kill -0 "$_stem_srun" 2>/dev/null; do
        wait "$_stem_srun"
        _stem_rc=$?
    done
    wait "$_stem_srun" 2>/dev/null
    _stem_r=$?
    (( _stem_r != 127 )) && _stem_rc=$_stem_r
fi

_stem_elapsed=$(date -u -d "@$(( SECONDS - _stem_t0 ))" +%T)
# A stop asked for through this script, or SIGUSR1 sent to the job steps directly (the
# trainer leaves a marker per node once its ranks saved and stopped to be requeued).
compgen -G "$STEM_STOP_MARKER.*" >/dev/null && _stem_stop=1
if (( _stem_stop )); then
    (( _stem_rc )) && stem_log "warning: srun exited with code $_stem_rc during the stop (see above); resuming from the last complete checkpoint"
    stem_log "stopped after $_stem_elapsed; latest checkpoint: $(_stem_latest); requeueing job $SLURM_JOB_ID (restart $(( _stem_restart + 1 )) resumes from the latest checkpoint)"
    _stem_requeueing=1
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        stem_log "error: scontrol requeue $SLURM_JOB_ID failed (submitted with --no-requeue?); resubmit the same command to resume from $(_stem_latest)"
        exit 1
    fi
    exit 0
elif (( _stem_rc == 0 )); then
    stem_log "training finished after $_stem_elapsed; latest checkpoint: $(_stem_latest)"
    exit 0
elif (( _stem_rc == 2 )); then  # a user's mistake, said in one line above (errors.py)
    stem_log "stopped after $_stem_elapsed by the error above (in the recipe, its files or the" \
        "environment; --check finds most before a job): fix it and resubmit"
    exit 2
else
    stem_log "FAILED after $_stem_elapsed: a training process failed and srun stopped every node (exit code $_stem_rc)." \
        "The first 'stem: <node>: rank N ... failed' line above names the rank that failed first (the others failed in its broken collectives; its Traceback is above too)." \
        "Resubmitting resumes from the latest checkpoint: $(_stem_latest)"
    exit "$_stem_rc"
fi
