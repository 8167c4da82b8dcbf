#!/usr/bin/env bash
# The newest supported versions, checked in their own environment (not part of CI: it
# downloads a CUDA build of torch, several GB): Python 3.12, for which requirements.txt pins
# torch 2.15 and megatron-core 0.19 (everything else as on 3.11). It runs the unit tests,
# the parallel-parity tests and the quickstart, and prints the quickstart's validation
# losses beside those of the Python 3.11 pins.
#   bash tools/check_compat.sh
# COMPAT_PYTHON (default python3.12) is the interpreter, COMPAT_ENV (default .venv-compat)
# the environment; the last run's result is in docs/development.md, "Supported versions".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${COMPAT_PYTHON:-python3.12}
ENV=${COMPAT_ENV:-.venv-compat}
LOG=$ENV/check_compat.log

# A machine whose pip.conf caps torch at the releases it holds on disk (a `constraint =`
# line) would refuse 2.15: this environment's installs read no pip configuration file. The
# caller's own environment and CI keep theirs.
export PIP_CONFIG_FILE=/dev/null
if [ ! -x "$ENV/bin/python" ]; then
    "$PYTHON" -m venv "$ENV"
fi
"$ENV/bin/pip" install -q -r requirements.txt pytest pytest-xdist -e .
{
    echo "$("$ENV/bin/python" -c 'import sys; from importlib.metadata import version as v
print(f"Python {sys.version.split()[0]}, torch {v("torch")}, megatron-core {v("megatron-core")}, deepspeed {v("deepspeed")}")')"
    "$ENV/bin/python" tools/build_ops.py
    status=0
    tests() {  # NAME PYTEST-ARGS...: the whole output kept beside the log, its last line shown
        local name=$1
        shift
        "$ENV/bin/python" -m pytest -q -n 2 -p no:cacheprovider "$@" > "$ENV/pytest-$name.log" 2>&1 ||
            status=1
        echo "$name tests: $(grep -E '^[0-9]+ (passed|failed)|^(FAILED|ERROR) ' "$ENV/pytest-$name.log" |
            tail -1) (output: $ENV/pytest-$name.log)"
    }
    tests unit -m "not integration"
    tests parity tests/model/test_parallel_parity.py
    out=$ENV/quickstart
    rm -rf "$out"
    PYTHON="$ENV/bin/python" QUICKSTART_DIR="$out" bash tools/quickstart.sh > "$out.log" 2>&1 || status=1
    echo "quickstart validation losses: $(grep -oE 'valid loss [0-9.]+' "$out.log" |
        awk '{print $3}' | paste -sd' ') (Python 3.11 pins: 5.1476 4.7186 4.5649; output: $out.log)"
    exit $status
} 2>&1 | tee "$LOG"
