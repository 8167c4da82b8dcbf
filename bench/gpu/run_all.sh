#!/usr/bin/env bash
# The acceptance run's one-node case (slurm/acceptance.sh's stages, as
# `sbatch slurm/acceptance.sbatch` runs them on a cluster; docs/acceptance.md) on one
# machine's GPUs without SLURM, within 15 minutes: the stages' limits add up to 470 s,
# the 1B recipes' layer shapes cut to 4 layers (d 2048, 32/8 heads, d_ff 8192, vocab
# 128,256, seq 2048; STEM at layers 1 and 3) in 16 sequences a step, the 32k trial one
# sequence a step per GPU, on synthetic tokens. A stage that fails or runs out of time is
# recorded with its fix and the next one runs.
# Writes to $OUT six small files: summary.json, summary.md, measured_vs_predicted.png, the
# refit profile (h100.json or h200.json), plan.txt (the 1B pair on 4 x 8 of those GPUs with
# it) and acceptance.log (every stage's output, the last 256 kB of each). Tokens, caches,
# runs and the stages' own logs go to $WORK (default: a new folder under /tmp). Needs the
# wheels of bench/gpu/prepare.sh in .whl/ (copied with the checkout). Runs on the torch it finds.
#   bash bench/gpu/run_all.sh                    # on the GPU machine
#   DRY_RUN=1 bash bench/gpu/run_all.sh          # here: the same stages at toy sizes on CPU
#   FAIL_STAGE="smoke" ...                       # a stage made to fail (the report's test)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
WORK="${WORK:-$(mktemp -d /tmp/stem_gpu.XXXXXX)}"
REPORT=$OUT
RECIPE=recipes/stem_1b.yaml
BASELINE=recipes/dense_1b.yaml
LONG_RECIPE=recipes/stem_1b_long.yaml
# Seconds per stage: with the machine's start and the wheels' install, within 15 minutes.
declare -A LIMIT=([environment]=60 [data]=30 [smoke]=60 [collectives]=20 [train_dense]=50
                  [train_stem]=60 [checkpoint]=60 [long_context]=35 [stop]=35 [refit]=40
                  [report]=20)
# On one GPU the tables' optimizer state stays there (in CPU memory one rank would carry
# what 32 share), and the checkpoint trial saves the dense model (the STEM one's 40 GB would
# take the stage's minute to write alone).
KNOBS=(model.num_layers=4 train.global_batch_size=16 optimizer.tables.device=accelerator)
STEM_KNOBS=("model.stem_layers=[1,3]")
CHECKPOINT_RECIPE=$BASELINE
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PY="${PYTHON:-python3}"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PROCS=1; HARDWARE=h200; SMOKE=(--dry-run); TINY=(--tiny); STEPS=6; LONG_STEPS=2
    TOKENS=262144
    KNOBS+=(model.hidden_size=64 model.num_attention_heads=4 model.num_query_groups=2
            model.ffn_hidden_size=128 model.vocab_size=4096 model.seq_length=64
            train.micro_batch_size=2 train.dtype=fp32)
    LONG_KNOBS=(model.seq_length=512 train.micro_batch_size=1 train.global_batch_size=1)
    # The limits are the GPU run's; toy sizes on a CPU that other jobs share (the test
    # suite's other worker) can take longer, and what a dry run checks is the stages.
    LIMIT_SCALE=5
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PY=python3
    PROCS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    (( PROCS > 0 )) || PROCS=1
    HARDWARE=auto; SMOKE=(); TINY=(); STEPS=20; LONG_STEPS=3; TOKENS=16777216; LIMIT_SCALE=1
    LONG_KNOBS=("train.global_batch_size=$PROCS")
    export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions  # DeepSpeed's JIT ops
fi
NODES=1
PLAN="--nodes 4 --gpus-per-node 8"

stem_python() { "$PY" "$@"; }
stem_each_node() { "$PY" "$@"; }
# torchrun as a SLURM job's node runs it (slurm/torchrun.py), alone on this machine
stem_ranks() {
    "$PY" slurm/torchrun.py --standalone --nnodes=1 --nproc-per-node="$PROCS" --max-restarts=0 \
        --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 "${@:2}" &
    echo $! >"$WORK/ranks.pid"
    wait $!
}
stem_stop_ranks() { kill -USR1 "$(cat "$WORK/ranks.pid")"; }
stem_end_steps() { :; }  # a rank ends with its torchrun (megatron_stem/runtime/process_lifetime.py)

mkdir -p "$WORK"
echo "work folder $WORK"
# shellcheck source=slurm/acceptance.sh
source slurm/acceptance.sh
