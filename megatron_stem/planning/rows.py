"""How many distinct table rows a step touches: a Zipf law fitted on real text.

The table path's cost follows distinct ids, not tokens: the rows one rank's micro-batches
touch (`rank_rows`), their union over data parallel (`union_rows`, what `lazy` updates and
exchanges), and one micro-batch's (`microbatch_rows`, what host placement stages). Token
ids follow Zipf's law, p(k) ~ k^-s for the k-th most frequent id, so the expected number
of distinct ids among n tokens over a vocabulary V is

    E[distinct] = sum_k 1 - (1 - p(k))^n.

Text is burstier than independent draws (a document repeats its words), so `s` is fitted
to the distinct counts of real text windows, not to the frequency table: `fit_exponent`
measures distinct ids in random windows of `seq` tokens (whole sequences, as training
reads them) for several token counts and picks the `s` whose curve matches best. The
default below was fitted on the shipped corpus (data_corpus/gcide.jsonl.gz) through a
32k SentencePiece BPE model (tools/train_tokenizer.py --vocab-size 32000):
`python -m megatron_stem.planning.rows --tokenizer <model>` re-fits it.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

# Fitted as the module docstring says (32k BPE on GCIDE, 2.09M tokens, windows of 2048
# tokens, 8k..1M tokens): rms error 2.7% over those counts (docs/tables.md).
ZIPF_EXPONENT = 1.115


def zipf_probabilities(vocab: int, exponent: float) -> np.ndarray:
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    weights = ranks ** -exponent
    return weights / weights.sum()


def expected_distinct(tokens: float, vocab: int, exponent: float = ZIPF_EXPONENT) -> float:
    """Expected distinct ids among `tokens` Zipf-distributed draws over `vocab` ids."""
    if tokens <= 0:
        return 0.0
    p = zipf_probabilities(vocab, exponent)
    # 1 - (1-p)^n without cancellation for tiny p
    return float(-np.expm1(tokens * np.log1p(-p)).sum())


def fit_exponent(distinct_by_tokens: dict[int, float], vocab: int) -> tuple[float, float]:
    """The exponent (0.8..1.6, step 0.005) whose expected distinct counts best match
    measured ones (least squares on log counts); returns (exponent, rms relative error)."""
    best = (math.nan, math.inf)
    for s in np.arange(0.80, 1.60, 0.005):
        err = [math.log(expected_distinct(n, vocab, s) / d)
               for n, d in distinct_by_tokens.items()]
        rms = math.sqrt(sum(e * e for e in err) / len(err))
        if rms < best[1]:
            best = (float(s), rms)
    return best[0], math.expm1(best[1])


def measure_distinct(ids: np.ndarray, seq: int, token_counts: list[int], samples: int = 8,
                     seed: int = 0) -> dict[int, float]:
    """Mean distinct ids in `token_counts` tokens made of random windows of `seq` ids."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in token_counts:
        windows = max(1, n // seq)
        counts = []
        for _ in range(samples):
            starts = rng.integers(0, ids.size - seq, windows)
            picked = ids[(starts[:, None] + np.arange(seq)[None]).ravel()]
            counts.append(np.unique(picked).size)
        out[windows * seq] = float(np.mean(counts))
    return out


def corpus_ids(tokenizer_model: str, corpus: str) -> np.ndarray:
    """The corpus as one stream of ids, end-of-document (2) between documents."""
    import gzip
    import json

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    with gzip.open(corpus, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    return np.fromiter((i for piece in sp.encode(texts) for i in piece + [2]), dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description="Fit the Zipf exponent of distinct ids")
    ap.add_argument("--tokenizer", required=True, help="a SentencePiece .model")
    ap.add_argument("--corpus", default="data_corpus/gcide.jsonl.gz")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    ids = corpus_ids(args.tokenizer, args.corpus)
    vocab = int(ids.max()) + 1
    measured = measure_distinct(ids, args.seq, [8192, 32768, 131072, 524288, 1048576])
    s, err = fit_exponent(measured, vocab)
    print(f"{ids.size:,} tokens, vocab {vocab:,}: exponent {s:.3f} (rms error {err:.1%})")
    for n, d in measured.items():
        print(f"  {n:>9,} tokens: {d:>8.0f} distinct, model {expected_distinct(n, vocab, s):>8.0f}")


if __name__ == "__main__":
    main()
