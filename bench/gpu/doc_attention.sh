#!/usr/bin/env bash
# Prepared for one H200 (about 3 minutes, most of it compiling FlexAttention): attention
# inside documents at 32k tokens, the 1B head shape (32 query / 8 kv heads of 64, bf16),
# forward+backward of one layer per kernel (SDPA causal without documents, torch's
# flash-attention varlen kernel = what the trainer runs, compiled FlexAttention with a
# document BlockMask, SDPA with a dense mask), for one document, long documents and short
# ones, after checking every kernel's output and gradients against the dense mask on the
# GPU. Needs the wheels of bench/gpu/prepare.sh in .whl/ (copied with the checkout).
#   bash bench/gpu/doc_attention.sh 2>&1 | tee doc_attention.log
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
timeout 500 python3 bench/doc_attention.py --seq 32768 --iters 10
