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
# NCCL_* / TORCH_NCCL_* variables already set are kept (see "NCCL defaults" below).

STEM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/environment.sh
source "$STEM_ROOT/slurm/environment.sh"

[[ -n ${SLURM_JOB_ID:-} ]] ||
    stem_die "launch.sh runs inside a SLURM batch job: submit with sbatch slurm/<model>.sbatch"

_stem_t0=$SECONDS
_stem_restart=${SLURM_RESTART_COUNT:-0}

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

# --- software environment (slurm/environment.sh; before `set -u`) ---------------------
stem_activate
set -uo pipefail
# This checkout's code runs, whatever copy of megatron_stem the environment has installed.
export PYTHONPATH=$STEM_ROOT${PYTHONPATH:+:$PYTHONPATH}

# --- layout: nodes, ranks, rendezvous --------------------------------------------------
_stem_nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# The GPUs of each node, from the first of SLURM's variables that names any (this is the
# batch step's node; every node runs as many ranks):
#   SLURM_GPUS_ON_NODE   8                  the count (SLURM sets it for --gpus-per-node,
#                                           --gres=gpu:8 and --gpus alike)
#   SLURM_JOB_GPUS       0,1,2,3,4,5,6,7    their indices
#   SLURM_GPUS_PER_NODE  8, h100:8, gpu:h100:8, a100:4,v100:4   --gpus-per-node as written
# Not CUDA_VISIBLE_DEVICES: one exported from the submitting shell says nothing of the job.
_stem_gpus=0
if [[ -n ${SLURM_GPUS_ON_NODE:-} && $SLURM_GPUS_ON_NODE != 0 ]]; then
    _stem_gpus_from="SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE"
    _stem_gpus=$SLURM_GPUS_ON_NODE
elif [[ -n ${SLURM_JOB_GPUS:-} ]]; then
    _stem_gpus_from="SLURM_JOB_GPUS=$SLURM_JOB_GPUS"
    IFS=, read -r -a _stem_ids <<<"$SLURM_JOB_GPUS"
    _stem_gpus=${#_stem_ids[@]}
elif [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then
    _stem_gpus_from="SLURM_GPUS_PER_NODE=$SLURM_GPUS_PER_NODE"
    IFS=, read -r -a _stem_kinds <<<"$SLURM_GPUS_PER_NODE"
    for _stem_kind in ${_stem_kinds[@]+"${_stem_kinds[@]}"}; do  # [type:]count
        [[ ${_stem_kind##*:} =~ ^[0-9]+$ ]] || { _stem_gpus=; break; }
        _stem_gpus=$(( _stem_gpus + ${_stem_kind##*:} ))
    done
fi
[[ $_stem_gpus =~ ^[0-9]+$ ]] ||
    stem_die "$_stem_gpus_from: cannot tell the GPUs per node from it; set STEM_PROCS_PER_NODE"
# `--gpus=N` spreads N GPUs over the nodes as it can (4 on 2 nodes may be 3 + 1), while
# torchrun starts as many ranks on every node: refuse a spread that gives this node other
# than its share.
if [[ -z ${STEM_PROCS_PER_NODE:-} && -z ${SLURM_GPUS_PER_NODE:-} && ${SLURM_GPUS:-} =~ ^([^:]*:)?[0-9]+$ ]] &&
    (( ${SLURM_GPUS##*:} != _stem_gpus * _stem_nnodes )); then
    stem_die "SLURM_GPUS=$SLURM_GPUS on $_stem_nnodes node(s), but $_stem_gpus on this one:" \
        "the nodes have different numbers of GPUs; ask for them with --gpus-per-node"
fi
if [[ -n ${STEM_PROCS_PER_NODE:-} ]]; then
    [[ $STEM_PROCS_PER_NODE =~ ^[1-9][0-9]*$ ]] ||
        stem_die "STEM_PROCS_PER_NODE: expected a positive integer, got '$STEM_PROCS_PER_NODE'"
    _stem_procs=$STEM_PROCS_PER_NODE
    _stem_procs_from="STEM_PROCS_PER_NODE"
elif (( _stem_gpus > 0 )); then
    _stem_procs=$_stem_gpus
    _stem_procs_from="one per GPU: $_stem_gpus_from"
else
    _stem_procs=1
    _stem_procs_from="no GPUs"
fi
# CPUs of the smallest node (SLURM_JOB_CPUS_PER_NODE looks like "64(x2),32").
_stem_cpus=$(tr ',' '\n' <<<"${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}" | sed 's/(.*//' | sort -n | head -n1)
_stem_master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# The rendezvous port: the same for every restart of a job, and outside the kernel's
# ephemeral range (any process's outgoing connection may hold a port there).
read -r _stem_eph_lo _stem_eph_hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null ||
    { _stem_eph_lo=32768; _stem_eph_hi=60999; }
if (( _stem_eph_lo - 20000 >= 1000 )); then
    _stem_port=$(( 20000 + SLURM_JOB_ID % (_stem_eph_lo - 20000) ))
elif (( 65535 - _stem_eph_hi >= 1000 )); then
    _stem_port=$(( _stem_eph_hi + 1 + SLURM_JOB_ID % (65535 - _stem_eph_hi) ))
else
    _stem_port=$(( 10000 + SLURM_JOB_ID % 10000 ))
fi
_stem_port=${STEM_MASTER_PORT:-$_stem_port}

# --- NCCL defaults (a site's own settings win) -----------------------------------------
# A failed or hung collective aborts the process instead of hanging until the time limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Every CUDA kernel loaded at start, not at its first launch (CUDA's lazy loading, the
# default since 12.2): loading a kernel can wait for the kernels running, and a collective's
# kernel waits for its peers, so a side stream's first launch while an all-gather runs can
# stall a rank until its peers time out (CUDA guide, "Lazy Loading", concurrent execution).
# Costs start-up time and device memory for kernels never launched.
(( _stem_gpus > 0 )) && export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
# Network selection (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX, ...) is the site's:
# set it in STEM_SETUP. CPU threads: the node's CPUs shared by its ranks.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( _stem_cpus / _stem_procs > 0 ? _stem_cpus / _stem_procs : 1 ))}
export PYTHONUNBUFFERED=1

# --- folders and the training command --------------------------------------------------
# Arrays that may be empty expand as ${a[@]+"${a[@]}"}: bash < 4.4 takes a bare "${a[@]}"
# of an empty array for an unset variable under `set -u` and stops.
_stem_recipe=${STEM_RECIPE:?set STEM_RECIPE to a recipe YAML}
[[ -f $_stem_recipe || $_stem_recipe = /* ]] || _stem_recipe=$STEM_ROOT/$_stem_recipe
[[ -f $_stem_recipe ]] || stem_die "STEM_RECIPE: $STEM_RECIPE not found (relative paths are from $PWD or $STEM_ROOT)"
_stem_run_dir=$(realpath -m "${STEM_OUTPUT:-runs}/${STEM_RUN_NAME:-${SLURM_JOB_NAME:-stem}}")
_stem_save_dir=$(realpath -m "${STEM_SAVE_DIR:-$_stem_run_dir/checkpoints}")
_stem_job_dir=$_stem_run_dir/jobs/$SLURM_JOB_ID
mkdir -p "$_stem_save_dir" "$_stem_job_dir" || stem_die "cannot create $_stem_save_dir and $_stem_job_dir"
_stem_stdout=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p')
[[ -n $_stem_stdout ]] && ln -sfn "$_stem_stdout" "$_stem_job_dir/slurm.out"

# --- the code this job runs, and where -------------------------------------------------
# A job that runs for days runs one version of the code: its first start copies the
# checkout's package and launcher into the job's folder (jobs/<id>/code), its requeues
# (SLURM_RESTART_COUNT > 0) run that copy again, whatever the checkout holds by then (a
# `git pull`, an edit). The version (git describe --always --dirty of the checkout when
# copied) is in the job's log and in every checkpoint (its CODE_VERSION file).
_stem_code=$_stem_job_dir/code
if [[ ! -f $_stem_code/VERSION ]]; then
    (( _stem_restart > 0 )) &&
        stem_log "warning: restart $_stem_restart of job $SLURM_JOB_ID has no code snapshot in $_stem_code: taking the checkout's code now"
    rm -rf "$_stem_code.tmp" && mkdir -p "$_stem_code.tmp" &&
        tar -C "$STEM_ROOT" --exclude=__pycache__ -cf - megatron_stem slurm | tar -C "$_stem_code.tmp" -xf - &&
        { git -C "$STEM_ROOT" describe --always --dirty 2>/dev/null || echo "unknown (not a git checkout)"; } \
            >"$_stem_code.tmp/VERSION" &&
        mv "$_stem_code.tmp" "$_stem_code" ||
        stem_die "cannot copy the code of $STEM_ROOT to $_stem_code"
    _stem_code_from="copied from $STEM_ROOT"
else
    _stem_code_from="the job's snapshot, reused by restart $_stem_restart"
fi
export STEM_CODE_VERSION; STEM_CODE_VERSION=$(cat "$_stem_code/VERSION")
export PYTHONPATH=$_stem_code${PYTHONPATH#"$STEM_ROOT"}  # instead of the live checkout
# The ranks' command: python itself, or in a container (srun's options for pyxis).
stem_container "$PWD,$_stem_code"
printf -v _stem_python_q '%q ' "${_stem_python[@]}"  # for the per-node command line
# -----------------------------------------------------------------------------------------

_stem_args=(--recipe "$_stem_recipe" "train.save_dir=$_stem_save_dir")
if [[ ${STEM_DATA:-} = *[![:space:]]* ]]; then
    read -r -a _stem_prefixes <<<"$STEM_DATA"
    _stem_list=$(printf '"%s",' ${_stem_prefixes[@]+"${_stem_prefixes[@]}"})
    _stem_args+=("data.prefixes=[${_stem_list%,}]")
fi
[[ -n ${STEM_TOKENIZER:-} ]] && _stem_args+=("data.tokenizer_model=$STEM_TOKENIZER")
[[ -n ${STEM_TOKENIZER_TYPE:-} ]] && _stem_args+=("data.tokenizer_type=$STEM_TOKENIZER_TYPE")
read -r -a _stem_overrides <<<"${STEM_OVERRIDES:-}"
_stem_args+=(${_stem_overrides[@]+"${_stem_overrides[@]}"})

# torchrun's options (slurm/torchrun.py is torchrun with a quiet, safe stop; see there).
export STEM_SHUTDOWN_TIMEOUT=${STEM_SHUTDOWN_TIMEOUT:-600}
export STEM_STOP_MARKER=$_stem_job_dir/stopped.$_stem_restart
rm -f "$STEM_STOP_MARKER".*
# shellcheck disable=SC2054  # the commas are torchrun's
_stem_torchrun=(
    --nnodes="$_stem_nnodes" --nproc-per-node="$_stem_procs"
    --rdzv-backend=c10d --rdzv-endpoint="$_stem_master:$_stem_port"
    --rdzv-id="$SLURM_JOB_ID-$_stem_restart" --max-restarts=0
    # forwarded to the ranks, which get this long to finish the step, save and exit
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    --shutdown-timeout="$STEM_SHUTDOWN_TIMEOUT"
    -m megatron_stem.train "${_stem_args[@]}"
)
# Run by srun once per node. Node 0 (the first host) hosts the rendezvous store: chosen by
# node id, not by matching host names.
# shellcheck disable=SC2016  # expanded by the per-node bash
_stem_node_cmd='echo "stem: node $SLURM_NODEID/$SLURM_NNODES is $(hostname): torchrun with '"$_stem_procs"' rank(s)"
exec '"$_stem_python_q"' "$0" --rdzv-conf="is_host=$((SLURM_NODEID == 0)),read_timeout=300" "$@"'

_stem_latest() { cat "$_stem_save_dir/latest" 2>/dev/null || echo "none"; }

{
    echo "=== $(date '+%F %T') job $SLURM_JOB_ID restart $_stem_restart on $SLURM_JOB_NODELIST"
    echo "cwd: $PWD"
    echo "checkout: $STEM_ROOT ($(git -C "$STEM_ROOT" describe --always --dirty 2>/dev/null || echo 'not a git checkout'))"
    echo "code: $STEM_CODE_VERSION in $_stem_code ($_stem_code_from)"
    echo "container: ${STEM_CONTAINER:-none}"
    echo "python: $(command -v python)"
    echo "command: srun ${_stem_srun_container[*]} ... ${_stem_python[*]} $_stem_code/slurm/torchrun.py ${_stem_torchrun[*]}"
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
    srun --kill-on-bad-exit=1 --nodes="$_stem_nnodes" --ntasks-per-node=1 \
        --cpus-per-task="$_stem_cpus" ${_stem_srun_container[@]+"${_stem_srun_container[@]}"} \
        bash -c "$_stem_node_cmd" "$_stem_code/slurm/torchrun.py" "${_stem_torchrun[@]}" &
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
