"""`python -m megatron_stem.train` with a stand-in tokenizer, for the SLURM test.

    STEM_TRAIN_MODULE=slurm_train (with tests/workers on PYTHONPATH)

Same arguments and exit codes as the real CLI; only the tokenizer differs: the test data is
pre-tokenized, so megatron's dataset only needs the vocabulary size and special ids.
"""

import argparse
import sys

from train_worker import VocabOnlyTokenizer

from megatron_stem.config import load_recipe
from megatron_stem.errors import cli
from megatron_stem.train import EXIT_REQUEUE, run


@cli
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    result = run(recipe, VocabOnlyTokenizer(recipe.model.vocab_size))
    return EXIT_REQUEUE if result["preempted"] else 0


if __name__ == "__main__":
    sys.exit(main())
