#!/usr/bin/env bash
# Preprocess a sharded corpus on a SLURM cluster: an array job tokenizes the input files in
# parallel across nodes, then one job merges the parts into the final .bin/.idx.
#
#   INPUT='/data/fineweb-edu/*.parquet' OUTPUT_PREFIX=/data/tokens/fineweb-edu \
#   TOKENIZER_TYPE=sentencepiece TOKENIZER_MODEL=/data/tok/stem.model \
#   EXTRA_ARGS='--append-eod' slurm/preprocess.sh 16 --partition=cpu --cpus-per-task=64
#
# Run it from the repository root. The first argument is the number of array tasks
# (default 8): each takes every 16th input file and uses the CPUs SLURM gives it. Further
# arguments are sbatch options for both jobs (they override the #SBATCH lines). A failed,
# preempted or cancelled task resumes where it stopped when resubmitted (`scontrol
# requeue`, or run this script again: finished files are skipped). Logs go to logs/.
set -euo pipefail
tasks=${1:-8}
shift || true
mkdir -p logs
array=$(sbatch --parsable "$@" --array=0-$((tasks - 1)) slurm/preprocess.sbatch)
merge=$(sbatch --parsable "$@" --dependency=afterok:"${array%%;*}" \
    slurm/preprocess_merge.sbatch)
echo "array job $array ($tasks tasks), merge job $merge (runs when all tasks succeed)"
