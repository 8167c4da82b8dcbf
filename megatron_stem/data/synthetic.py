"""Tokens for a trial of a recipe before its data exists: the recipe's own token files when
they are all there, else synthetic ones (the acceptance run's data stage,
docs/acceptance.md).

    python -m megatron_stem.data.synthetic --out DIR --tokens N \
        --recipe R [--recipe R2 ...] [-- overrides]

For each recipe (with the overrides, applied to all) it writes `DIR/<recipe name>.overrides`,
the data overrides its trials add, one per line: none when the recipe's training data and
tokenizer are there; otherwise `data.blend=null` and `data.prefixes=[DIR/synthetic]`,
synthetic documents written once for all recipes: token ids drawn independently from the
Zipf law the step planner's row model uses (`planning/rows.py`'s exponent, over the
model's vocabulary, ranks dealt to ids by a fixed permutation), so the table rows a step
touches follow the planner's count by construction; documents of exponentially
distributed lengths (mean `--document-tokens`), each ended by the tokenizer's
end-of-document id, so document masking finds them. A recipe whose tokenizer file is
missing too gets a 4,096-piece SentencePiece model trained on the shipped corpus
(data_corpus/, seconds): the trainer needs one to load, and its ids are below the model's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from megatron_stem.data.indexed import PartWriter, bin_path, idx_path, token_dtype
from megatron_stem.runtime.errors import UserError, cli

# The planner's fitted exponent (planning/rows.py ZIPF_EXPONENT, which data/ cannot import):
# tests/data/test_synthetic.py holds the two equal.
ZIPF_EXPONENT = 1.115
CORPUS = Path(__file__).resolve().parents[2] / "data_corpus" / "gcide.jsonl.gz"
SMALL_VOCAB = 4096
CHUNK = 1 << 22  # tokens drawn and written at a time


class ZipfIds:
    """Ids in [0, vocab) drawn from Zipf's law (rank k with p ~ k^-exponent), never
    `exclude` (the end-of-document id); ranks dealt to ids by a permutation drawn first."""

    def __init__(self, vocab: int, exclude: int | None, rng: np.random.Generator,
                 exponent: float = ZIPF_EXPONENT):
        ids = np.arange(vocab, dtype=np.int64)
        self.rng = rng
        self.order = rng.permutation(ids[ids != exclude])
        weights = np.arange(1, len(self.order) + 1, dtype=np.float64) ** -exponent
        self.cdf = np.cumsum(weights / weights.sum())

    def draw(self, count: int) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, self.rng.random(count))
        return self.order[np.minimum(ranks, len(self.order) - 1)]


def write_documents(prefix: str, tokens: int, vocab: int, eod: int, document_tokens: int,
                    seed: int = 1234) -> int:
    """Synthetic documents of about `tokens` tokens at `prefix` (module docstring), each
    ended by `eod`; the number of documents."""
    rng = np.random.default_rng(seed)
    ids = ZipfIds(vocab, eod, rng)
    writer = PartWriter(prefix, token_dtype(vocab))
    documents = written = 0
    try:
        while written < tokens:
            n = min(CHUNK, tokens - written)
            lengths = 1 + rng.exponential(document_tokens, size=n // document_tokens + 16
                                          ).astype(np.int64)
            lengths = lengths[np.cumsum(lengths + 1) <= n] if lengths[0] < n else \
                np.array([max(n - 1, 1)])
            body = ids.draw(int(lengths.sum()))
            ends = np.cumsum(lengths + 1) - 1  # where each document's eod goes
            out = np.empty(int(ends[-1]) + 1, dtype=np.int64)
            out[ends] = eod
            mask = np.ones(out.size, dtype=bool)
            mask[ends] = False
            out[mask] = body
            writer.add(out, lengths + 1)
            written += int(out.size)
            documents += len(lengths)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return documents


def _present(path: str) -> bool:
    return os.path.isfile(bin_path(path)) and os.path.isfile(idx_path(path))


def tokenizer_for(recipe, out: Path) -> tuple[str, str, bool]:
    """(type, model file, trained here): the recipe's tokenizer, or one trained on the
    shipped corpus when its file is missing."""
    data = recipe.data
    if os.path.isfile(data.tokenizer_model):
        return data.tokenizer_type, data.tokenizer_model, False
    prefix = out / "corpus_tokenizer"
    if not Path(f"{prefix}.model").is_file():
        from megatron_stem.data.tokenizer_training import (
            TokenizerTrainingConfig,
            train_sentencepiece,
        )

        train_sentencepiece(TokenizerTrainingConfig([str(CORPUS)], str(prefix),
                                                    vocab_size=SMALL_VOCAB), log=None)
    return "sentencepiece", f"{prefix}.model", True


def overrides_for(recipe, out: Path, tokens: int, document_tokens: int) -> list[str]:
    """The data overrides a trial of `recipe` adds (module docstring), writing what they
    name when it is not there yet."""
    from megatron_stem.data.tokenizer import load_tokenizer

    prefixes, _ = recipe.data.training_blend()
    kind, model, trained = tokenizer_for(recipe, out)
    if prefixes and all(_present(p) for p in prefixes) and not trained:
        return []
    tokenizer = load_tokenizer(kind, model)
    if tokenizer.eod is None:
        raise UserError(f"data.tokenizer_model: {model} has no end-of-document token to end "
                        "synthetic documents with")
    vocab = recipe.model.vocab_size
    prefix = out / f"synthetic_{vocab}"
    if not _present(str(prefix)):
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"synthetic_{vocab}.tmp{os.getpid()}"
        documents = write_documents(str(tmp), tokens, vocab, tokenizer.eod, document_tokens)
        for path in (bin_path, idx_path):
            os.replace(path(str(tmp)), path(str(prefix)))
        print(f"synthetic tokens: {tokens:,} in {documents:,} documents over {vocab:,} ids "
              f"at {prefix}", flush=True)
    return ["data.blend=null", f"data.prefixes=[{prefix}]", f"data.tokenizer_type={kind}",
            f"data.tokenizer_model={model}"]


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", required=True, help="folder of the tokens and the overrides")
    ap.add_argument("--recipe", action="append", required=True, help="(repeatable)")
    ap.add_argument("--tokens", type=int, required=True, help="synthetic tokens to write")
    ap.add_argument("--document-tokens", type=int, default=1024,
                    help="mean tokens per synthetic document (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", help="section.field=value, for every recipe")
    args = ap.parse_args(argv)
    from megatron_stem.config import load_recipe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # (the overrides' files, whatever the data)
    for path in args.recipe:
        recipe = load_recipe(path, args.overrides)
        lines = overrides_for(recipe, out, args.tokens, args.document_tokens)
        print(f"{path}: " + (" ".join(lines) if lines else "its own data"), flush=True)
        (out / f"{Path(path).stem}.overrides").write_text("".join(f"{x}\n" for x in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
