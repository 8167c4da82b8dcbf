#!/usr/bin/env bash
# Prepared for one H200/H100 (fits in ~10 minutes): tokens/s and MFU of a 1B-shaped model
# (d 2048, 32/8 heads, d_ff 8192, vocab 128,256, seq 2048) cut to 4 layers, STEM at
# layers 1 and 3 (1/2) against the dense baseline, bf16, through the real engine and
# table optimizer.
#   bash bench/gpu/train_1b_shape.sh 2>&1 | tee bench_gpu.log
set -euo pipefail
cd "$(dirname "$0")/../.."
python bench/train_throughput.py --hidden 2048 --layers 4 --heads 32 --kv-heads 8 \
    --ffn 8192 --vocab 128256 --seq 2048 --micro-batch 4 --global-batch 16 --dtype bf16 \
    --placements none,1/2 --updates lazy,dense --steps 5
