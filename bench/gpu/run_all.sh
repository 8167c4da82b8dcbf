#!/usr/bin/env bash
# Everything the planner needs from one H200, in one run of under 8 minutes (the stages'
# limits add up to 480 s):
#  0. a correctness smoke of the GPU-only paths (bench/gpu_smoke.py: bf16 through DeepSpeed,
#     the tables' state on the GPU, next_step against none, host placement's staging);
#  1. refit the `h200` profile's single-GPU constants (achieved MFU of the forward/backward
#     at the 1B layer shapes in bf16, the GEMM efficiency curve at the model's own linear
#     layers, HBM, pinned and pageable host<->device copies, the host's row Adam, DRAM and
#     gather rates; NVLink and InfiniBand stay published);
#  2. dense vs STEM steps at the 1B layer shapes cut to 4 layers (d 2048, 32/8 heads,
#     d_ff 8192, vocab 128,256, seq 2048, STEM at layers 1 and 3: two tables of
#     128,256 x 8,192), 4 micro-batches of 4 x 2048 real-text tokens, the tables' state in
#     CPU memory and on the GPU (`next_step`), each part of the step timed (forward/
#     backward, the backbone's reduction and step, the row gradients' collection, their
#     exchange, the norm, the tables' Adam and publication) next to the refit planner's
#     prediction, and the step boundary (the end of the last backward to the next step's
#     first table lookup, wall time) with its prediction;
#  3. the tables' row Adam at a 1B shard's size as 8 concurrent ranks of 2 threads on the
#     host's 16 cores, against the node model built from the host's own rates;
#  4. the planner's tables for the 1B pair on 4 x 8 H200 with the refit constants.
# Writes to $OUT: h200.json (the fitted profile), components.txt, node.txt, plan_today.txt,
# plan_best.txt. Needs the wheels of bench/gpu/prepare.sh in .whl/ (carried: ".whl").
#   bash bench/gpu/run_all.sh                    # on the GPU machine
#   DRY_RUN=1 bash bench/gpu/run_all.sh          # here: the same steps at toy sizes on CPU
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PY="${PYTHON:-python3}"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    TINY=(--tiny); PRESET=tiny; STEPS=1; SMOKE=(--dry-run); NODE=2,1
    # The limits are the GPU run's; toy sizes on a CPU that other jobs share (the test
    # suite's other worker) can take longer, and what a dry run checks is the steps.
    LIMIT_SCALE=5
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PY=python3
    TINY=(); PRESET=gpu-1b; STEPS=2; SMOKE=(); NODE=8,2; LIMIT_SCALE=1
    export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions  # DeepSpeed's JIT ops
fi
PROFILE="$OUT/h200.json"
start=$SECONDS
stamp() { echo "[run_all] $(( SECONDS - start )) s: $*"; }
limit() { local seconds=$1; shift; timeout $(( seconds * LIMIT_SCALE )) "$@"; }

# DeepSpeed's CPU Adam JIT-builds on first use (about a minute); without it the tables
# run the torch kernel and the profile keeps the torch rate for both.
stamp "building DeepSpeed cpu_adam and the tables' row Adam"
KERNEL=deepspeed
limit 90 "$PY" -c "from megatron_stem import ops; ops.load_cpu_adam(); ops.load_row_adam()" \
    > "$OUT/cpu_adam_build.log" 2>&1 || { KERNEL=torch; stamp "cpu_adam unavailable: torch kernel"; }

stamp "smoke: the GPU-only paths"
limit 120 "$PY" bench/gpu_smoke.py "${SMOKE[@]}" \
    2> "$OUT/smoke.err" | tee "$OUT/smoke.txt" || { tail -20 "$OUT/smoke.err"; exit 1; }

stamp "refitting the h200 profile and its GEMM curve"
limit 60 "$PY" -m megatron_stem.planning.calibrate --gpu h200 "${TINY[@]}" \
    --kernel "$KERNEL" --out "$PROFILE" > "$OUT/calibrate.log" 2>&1 \
    || { tail -20 "$OUT/calibrate.log"; exit 1; }
cat "$PROFILE"

stamp "dense vs STEM steps, each part timed; the step boundary, CPU and GPU state"
limit 110 "$PY" bench/plan_calibration.py --preset "$PRESET" --dp 1 --steps "$STEPS" \
    --variants dense,device/dense/sharded/next_step/cpu,device/dense/sharded/next_step/accelerator \
    --segment --kernel "$KERNEL" \
    --profile "$PROFILE" 2> "$OUT/components.err" | tee "$OUT/components.txt"

stamp "the tables' row Adam as concurrent ranks ($NODE processes,threads)"
limit 40 "$PY" bench/plan_calibration.py --node-model "$NODE" --preset "$PRESET" \
    2> "$OUT/node.err" | tee "$OUT/node.txt"

stamp "the planner on 4 x 8 H200 with the refit constants"
PAIR=(--recipe recipes/stem_1b.yaml --baseline recipes/dense_1b.yaml --nodes 4
      --gpus-per-node 8 --hardware h200 --profile "$PROFILE")
limit 10 "$PY" tools/plan_step.py "${PAIR[@]}" > "$OUT/plan_today.txt"
limit 10 "$PY" tools/plan_step.py "${PAIR[@]}" --choose best > "$OUT/plan_best.txt"
tail -n 1 "$OUT/plan_today.txt" "$OUT/plan_best.txt"
stamp "done; results in $OUT"
