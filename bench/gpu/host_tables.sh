#!/usr/bin/env bash
# Prepared for one H200/H100 (about 10 minutes); not yet run on a GPU (the CPU run of the
# same script is in bench/README.md).
# Host-resident against device-resident STEM tables on a 1B-shaped model cut to 4 layers
# (d 2048, 32/8 heads, d_ff 8192, table rows 128,256, seq 2048, STEM at layers 1 and 3),
# bf16, 4 micro-batches of 4 x 2048 tokens of real text per step (the shipped GCIDE
# corpus through a 32k SentencePiece model trained on the fly, so ids stay below 32,000):
#   - gather GB/s against a plain host copy; H2D GB/s of gathered rows against a plain
#     pinned copy (the measured copy bandwidth)
#   - step time host/device, the forward's prefetch wait, bytes moved, cache hit rate
#   - cache hit rates on real text, and training's H2D bytes with the cache
#   bash bench/gpu/host_tables.sh 2>&1 | tee bench_host_tables_gpu.log
set -euo pipefail
cd "$(dirname "$0")/../.."
timeout 580 python bench/host_tables.py --parts gather,step,cache \
    --width 8192 --gather-vocab 131072 --gather-rows 16384 --gather-threads 8 \
    --vocab 32000 --model-vocab 128256 --hidden 2048 --layers 4 --heads 32 --kv-heads 8 \
    --ffn 8192 --stem-layers 1/2 --seq 2048 --micro-batch 4 --global-batch 16 \
    --dtype bf16 --kernel torch --cache-rows 16384 --steps 5 --cache-steps 40
