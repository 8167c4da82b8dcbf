# Sourced by slurm/launch.sh (a training job) and slurm/acceptance.sbatch (the acceptance
# run): what every step of a job shares, set up once in the batch shell.
#
# - the software environment (slurm/environment.sh: STEM_VENV, STEM_MODULES, STEM_SETUP,
#   STEM_CONTAINER, STEM_CONTAINER_MOUNTS), checked by the includer;
# - the layout: nodes, ranks per node (one per GPU; STEM_PROCS_PER_NODE), CPU threads,
#   the rendezvous host and port (STEM_MASTER_PORT), NCCL's defaults;
# - the run's folder, $STEM_OUTPUT/$STEM_RUN_NAME (default runs/<job name>), and the job's
#   in it, jobs/<job id>/, with the copy of the code every step runs (jobs/<id>/code);
# - the recipe overrides the STEM_DATA, STEM_TOKENIZER, STEM_TOKENIZER_TYPE and
#   STEM_OVERRIDES knobs make (`_stem_knobs`);
# - `stem_srun_ranks RDZV_ID ARGS...`: one torchrun per node (slurm/torchrun.py, srun with
#   one task per node, in the container when there is one), one rank per GPU, running ARGS
#   (`-m megatron_stem.train --recipe ...`); `stem_srun_nodes ARGS...`: `python ARGS` once
#   on every node, at once; `stem_srun_one ARGS...`: once, on the first node.
# The includer installs its signal handlers before sourcing this (the environment's set-up
# can take a while, and a stop can come at any time).

STEM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/environment.sh
source "$STEM_ROOT/slurm/environment.sh"

[[ -n ${SLURM_JOB_ID:-} ]] ||
    stem_die "$(basename "${BASH_SOURCE[1]:-job.sh}") runs inside a SLURM batch job: submit with sbatch slurm/<job>.sbatch"
_stem_restart=${SLURM_RESTART_COUNT:-0}

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

# --- the run's folders ------------------------------------------------------------------
_stem_run_dir=$(realpath -m "${STEM_OUTPUT:-runs}/${STEM_RUN_NAME:-${SLURM_JOB_NAME:-stem}}")
_stem_job_dir=$_stem_run_dir/jobs/$SLURM_JOB_ID
mkdir -p "$_stem_job_dir" || stem_die "cannot create $_stem_job_dir"
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

# --- the knobs' recipe overrides ----------------------------------------------------------
# Arrays that may be empty expand as ${a[@]+"${a[@]}"}: bash < 4.4 takes a bare "${a[@]}"
# of an empty array for an unset variable under `set -u` and stops.
_stem_knobs=()
if [[ ${STEM_DATA:-} = *[![:space:]]* ]]; then
    read -r -a _stem_prefixes <<<"$STEM_DATA"
    _stem_list=$(printf '"%s",' ${_stem_prefixes[@]+"${_stem_prefixes[@]}"})
    _stem_knobs+=("data.prefixes=[${_stem_list%,}]")
fi
[[ -n ${STEM_TOKENIZER:-} ]] && _stem_knobs+=("data.tokenizer_model=$STEM_TOKENIZER")
[[ -n ${STEM_TOKENIZER_TYPE:-} ]] && _stem_knobs+=("data.tokenizer_type=$STEM_TOKENIZER_TYPE")
read -r -a _stem_overrides <<<"${STEM_OVERRIDES:-}"
_stem_knobs+=(${_stem_overrides[@]+"${_stem_overrides[@]}"})

# --- the steps ----------------------------------------------------------------------------
# torchrun's options (slurm/torchrun.py is torchrun with a quiet, safe stop; see there).
export STEM_SHUTDOWN_TIMEOUT=${STEM_SHUTDOWN_TIMEOUT:-600}
# shellcheck disable=SC2054  # the commas are torchrun's
_stem_torchrun=(
    --nnodes="$_stem_nnodes" --nproc-per-node="$_stem_procs"
    --rdzv-backend=c10d --rdzv-endpoint="$_stem_master:$_stem_port" --max-restarts=0
    # forwarded to the ranks, which get this long to finish the step, save and exit
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    --shutdown-timeout="$STEM_SHUTDOWN_TIMEOUT"
)
# Run by srun once per node. Node 0 (the first host) hosts the rendezvous store: chosen by
# node id, not by matching host names.
# shellcheck disable=SC2016  # expanded by the per-node bash
_stem_node_cmd='echo "stem: node $SLURM_NODEID/$SLURM_NNODES is $(hostname): torchrun with '"$_stem_procs"' rank(s)"
exec '"$_stem_python_q"' "$0" --rdzv-conf="is_host=$((SLURM_NODEID == 0)),read_timeout=300" "$@"'

# stem_srun_ranks RDZV_ID ARGS...: torchrun on every node (rendezvous RDZV_ID, new for each
# start), its ranks running ARGS; a rank that fails stops every node (--kill-on-bad-exit).
stem_srun_ranks() {
    local id=$1
    shift
    srun --kill-on-bad-exit=1 --nodes="$_stem_nnodes" --ntasks-per-node=1 \
        --cpus-per-task="$_stem_cpus" ${_stem_srun_container[@]+"${_stem_srun_container[@]}"} \
        bash -c "$_stem_node_cmd" "$_stem_code/slurm/torchrun.py" "${_stem_torchrun[@]}" \
        --rdzv-id="$id" "$@"
}

# stem_srun_nodes ARGS...: `python ARGS` once on every node, at once, in the ranks'
# environment; stem_srun_one ARGS...: once, on the first node: a world of one (the batch
# shell's SLURM_NTASKS counts the job's nodes, which torch.distributed would wait for).
stem_srun_nodes() { _stem_srun_python "$_stem_nnodes" "$@"; }
stem_srun_one() { _stem_srun_python 1 "$@"; }
_stem_srun_python() {
    local nodes=$1
    shift
    # --ntasks too: srun would take the batch shell's SLURM_NTASKS (the job's) for it
    srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --cpus-per-task="$_stem_cpus" \
        ${_stem_srun_container[@]+"${_stem_srun_container[@]}"} "${_stem_python[@]}" "$@"
}
