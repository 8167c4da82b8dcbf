# Sourced by slurm/launch.sh (training) and slurm/preprocess*.sbatch (preprocessing): the
# software environment every step of a job runs in, chosen the same way for both.
#
#   STEM_MODULES          environment modules to `module load` first, space-separated
#   STEM_SETUP            a shell file to source for site settings (conda, NCCL_IB_*, ...)
#   STEM_VENV             a virtualenv to activate (default: none; the Python on PATH)
#   STEM_CONTAINER        run in a container instead: an image for pyxis/enroot (a registry
#                         name such as docker://ghcr.io#you/megatron-stem:0.1.0, or a .sqsh
#                         file: srun --container-image) or an Apptainer/Singularity .sif
#                         (apptainer exec --nv); containers/ builds both
#   STEM_CONTAINER_MOUNTS more host folders for the container, src[:dst] comma-separated
#
# After sourcing: `stem_activate` (before `set -u`: module, conda and site scripts often
# read unset variables), then `stem_container MOUNTS` fills `_stem_python` (the command
# that runs python, in the Apptainer image when there is one), `_stem_srun_container`
# (srun's options for a pyxis image) and `_stem_step` (what starts a one-task step in
# it: srun for pyxis, nothing otherwise), then `stem_check_environment` says in one line
# which torch, DeepSpeed and megatron-core the steps will run, or stops the job there.
# `stem_exec_python ARGS` replaces the script with `python ARGS` in that environment.

stem_log() { echo "stem: $*"; }
stem_die() { echo "stem: error: $*" >&2; exit 2; }

stem_activate() {
    if [[ -n ${STEM_MODULES:-} ]]; then
        type module >/dev/null 2>&1 || source /etc/profile >/dev/null 2>&1
        type module >/dev/null 2>&1 || stem_die "STEM_MODULES is set but this shell has no 'module' command"
        # shellcheck disable=SC2086
        module load $STEM_MODULES || stem_die "STEM_MODULES: 'module load $STEM_MODULES' failed"
    fi
    if [[ -n ${STEM_SETUP:-} ]]; then
        # shellcheck disable=SC1090
        source "$STEM_SETUP" || stem_die "STEM_SETUP: sourcing $STEM_SETUP failed"
    fi
    if [[ -n ${STEM_VENV:-} ]]; then
        [[ -f $STEM_VENV/bin/activate ]] || stem_die "STEM_VENV: $STEM_VENV/bin/activate not found"
        # shellcheck disable=SC1091
        source "$STEM_VENV/bin/activate"
    fi
}

# stem_container MOUNTS: the command lines of a step, in the container STEM_CONTAINER names
# (MOUNTS and STEM_CONTAINER_MOUNTS mounted, the working directory the same), else as is.
stem_container() {
    local mounts="$1${STEM_CONTAINER_MOUNTS:+,$STEM_CONTAINER_MOUNTS}"
    _stem_python=(python)
    _stem_srun_container=()
    _stem_step=()
    if [[ ${STEM_CONTAINER:-} = *.sif ]]; then
        _stem_python=(apptainer exec --nv --bind "$mounts" --pwd "$PWD" "$STEM_CONTAINER" python)
    elif [[ -n ${STEM_CONTAINER:-} ]]; then
        _stem_srun_container=(--container-image="$STEM_CONTAINER" --container-mounts="$mounts"
                              --container-workdir="$PWD")
        _stem_step=(srun --nodes=1 --ntasks=1 "${_stem_srun_container[@]}")
    fi
}

stem_exec_python() {
    exec ${_stem_step[@]+"${_stem_step[@]}"} "${_stem_python[@]}" "$@"
}

# stem_check_environment MODULE...: the Python a step runs (in its container, on one node
# for pyxis) imports MODULEs and has a torch of the supported range (pyproject.toml); one
# line either way, before any step starts.
stem_check_environment() {
    local where=${STEM_CONTAINER:+the container $STEM_CONTAINER}
    [[ -n $where ]] || where=$(command -v python) || stem_die "no python on PATH: set" \
        "STEM_CONTAINER to an image of containers/Dockerfile, or STEM_VENV (a virtualenv" \
        "with requirements.txt installed), STEM_MODULES or STEM_SETUP (docs/install.md)"
    local check='
import importlib.metadata as m, importlib.util as u, re, sys
low, high, names = sys.argv[1], sys.argv[2], sys.argv[3:]
missing = [n for n in names if u.find_spec(n) is None]
if missing:
    sys.exit("cannot import " + ", ".join(missing))
def minor(v): return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", v).groups())
torch = m.version("torch")
if not minor(low) <= minor(torch) < minor(high):
    sys.exit(f"has torch {torch}, outside the supported >={low},<{high}")
print(", ".join(f"{n} {m.version(n)}" for n in ("torch", "deepspeed", "megatron-core")
                if u.find_spec(n.replace("-", ".")) is not None))'
    local range out
    range=$(sed -n 's/.*"torch>=\([0-9.]*\),<\([0-9.]*\)".*/\1 \2/p' "$STEM_ROOT/pyproject.toml")
    [[ -n $range ]] || range="0 999"
    # shellcheck disable=SC2086  # the two bounds
    if out=$(${_stem_step[@]+"${_stem_step[@]}"} "${_stem_python[@]}" -c "$check" $range "$@" 2>&1); then
        stem_log "environment: ${out##*$'\n'} (${where})"
    else
        stem_die "$where ${out##*$'\n'}: set STEM_CONTAINER to an image of containers/Dockerfile," \
            "or STEM_VENV (a virtualenv with requirements.txt installed), STEM_MODULES or STEM_SETUP" \
            "(docs/install.md)"
    fi
}
