#!/usr/bin/env bash
# The CPU quickstart, end to end on the shipped corpus (data_corpus/, GCIDE):
#   1. train a 4,096-piece SentencePiece tokenizer,
#   2. preprocess the corpus into one .bin/.idx prefix (--single-prefix: a small corpus),
#   3. train recipes/tiny_cpu.yaml (a tiny STEM model) on 2 ranks (data parallel) with
#      periodic validation and checkpoints, TensorBoard logs in runs/quickstart/ckpt.
# Extra arguments are recipe overrides, e.g.  bash tools/quickstart.sh train.steps=50
# QUICKSTART_DIR (default runs/quickstart) is where everything is written; a step whose
# output is there is skipped, and a rerun of a finished run says there is nothing left to train.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${QUICKSTART_DIR:-runs/quickstart}
NPROC=${NPROC:-2}

if [ ! -f "$OUT/tokenizer/gcide.model" ]; then
  "$PY" tools/train_tokenizer.py --input data_corpus/gcide.jsonl.gz \
      --output-prefix "$OUT/tokenizer/gcide" --vocab-size 4096
fi
if [ ! -f "$OUT/data/gcide_text_document.idx" ]; then
  "$PY" tools/preprocess_data.py --input data_corpus/gcide.jsonl.gz --json-keys text \
      --output-prefix "$OUT/data/gcide" --tokenizer-type sentencepiece \
      --tokenizer-model "$OUT/tokenizer/gcide.model" --append-eod --workers "$NPROC" \
      --single-prefix
fi
# torchrun as the sbatch scripts run it (slurm/torchrun.py): a mistake is one line, once
OMP_NUM_THREADS=1 "$PY" slurm/torchrun.py --standalone --nproc_per_node "$NPROC" \
    -m megatron_stem.train --recipe recipes/tiny_cpu.yaml \
    "data.prefixes=[$OUT/data/gcide_text_document]" \
    "data.tokenizer_model=$OUT/tokenizer/gcide.model" "train.save_dir=$OUT/ckpt" "$@"
echo "done: checkpoints in $OUT/ckpt, TensorBoard: tensorboard --logdir $OUT/ckpt/tensorboard"
