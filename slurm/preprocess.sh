#!/usr/bin/env bash
# Preprocess a sharded corpus on a SLURM cluster: an array job tokenizes the input files in
# parallel across nodes, each task writing its own prefixes, then a small job lists them all.
#
#   INPUT='/data/fineweb-edu/*.parquet' OUTPUT_PREFIX=/data/tokens/fineweb-edu \
#   TOKENIZER_TYPE=sentencepiece TOKENIZER_MODEL=/data/tok/stem.model \
#   EXTRA_ARGS='--append-eod' slurm/preprocess.sh 16 --partition=cpu --cpus-per-task=64
#
# Run it from the repository root. The first argument is the number of array tasks
# (default 8): task i takes the i-th of that many contiguous runs of the input files (about
# equal bytes each), uses the CPUs SLURM gives it, and writes that run's prefixes into the
# prefix set $OUTPUT_PREFIX_<key>_document/ (usable as soon as the task ends). The second
# job starts when every task succeeded and writes the set's manifest.json and the stats: it
# copies nothing. With EXTRA_ARGS='--single-prefix' the tasks only tokenize and the second
# job merges everything into one $OUTPUT_PREFIX_<key>_document.bin/.idx (for small
# corpora; resumable). Further arguments are sbatch options for both jobs (they override
# the #SBATCH lines). A failed, preempted or cancelled job resumes where it stopped when
# resubmitted (`scontrol requeue`, or run this script again: finished work is skipped).
# Logs go to logs/.
set -euo pipefail
tasks=${1:-8}
shift || true
mkdir -p logs
array=$(sbatch --parsable "$@" --array=0-$((tasks - 1)) slurm/preprocess.sbatch)
merge=$(sbatch --parsable "$@" --dependency=afterok:"${array%%;*}" \
    slurm/preprocess_merge.sbatch)
echo "array job $array ($tasks tasks), manifest job $merge (runs when all tasks succeed)"
