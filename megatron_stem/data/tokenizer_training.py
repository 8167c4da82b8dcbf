"""Train a SentencePiece tokenizer on a bounded sample of the corpus.

The sample is a seeded reservoir of `max_docs` documents drawn uniformly from every
document of the inputs (same formats and readers as preprocessing), so memory is bounded
by the sample, not the corpus; the time to read grows with the inputs, so point it at a
few shards of a large corpus. SentencePiece then trains on the sample's lines.

Model: BPE (or unigram) with byte fallback (no unknown characters), digits split, text
kept as is (identity normalization, whitespace preserved: decode(encode(x)) == x), and
the special tokens the model needs at fixed ids: <unk> 0, <s> (bos) 1, </s> (eos, the
end-of-document token) 2, <pad> 3.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional, Sequence, TextIO

from megatron_stem.data.readers import Skip, find_shards, iter_records, read_chunks
from megatron_stem.runtime.errors import UserError

SPECIAL_IDS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}
_MAX_LINE_BYTES = 16384  # SentencePiece drops longer "sentences" (lines) from training


@dataclass
class TokenizerTrainingConfig:
    inputs: list[str]
    output_prefix: str  # writes <prefix>.model and <prefix>.vocab
    vocab_size: int = 32000
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    model_type: Literal["bpe", "unigram"] = "bpe"
    max_docs: int = 200_000
    seed: int = 1234
    threads: int = 1
    user_defined_symbols: list[str] = field(default_factory=list)  # extra special tokens

    def validate(self) -> None:
        if self.vocab_size < 300:  # byte fallback alone takes 256 ids, plus the specials
            raise UserError(f"--vocab-size: {self.vocab_size} is too small (byte fallback "
                            "needs 256 ids; use >= 300)")
        if self.max_docs < 1:
            raise UserError(f"--max-docs: must be >= 1, got {self.max_docs}")
        if self.model_type not in ("bpe", "unigram"):
            raise UserError(f"--model-type: expected bpe or unigram, got {self.model_type!r}")


def sample_documents(inputs: list[str], keys: list[str], max_docs: int, seed: int,
                     exclude: Sequence[str] = ()) -> tuple[list[str], Counter]:
    """A uniform sample (reservoir) of at most `max_docs` texts from all the inputs; every
    key's text counts as a document. Returns the sample and counts (`seen`, skip reasons)."""
    shards, _ = find_shards(inputs, exclude=exclude)
    rng, sample, counts = random.Random(seed), [], Counter()
    for shard in shards:
        for chunk in read_chunks(shard, keys, 8 << 20):
            records = [chunk] if isinstance(chunk, Skip) else iter_records(chunk, keys)
            for record in records:
                if isinstance(record, Skip):
                    counts[record.reason] += record.count
                    continue
                for text in record:
                    seen = counts["seen"]
                    counts["seen"] += 1
                    if seen < max_docs:
                        sample.append(text)
                    elif (j := rng.randrange(seen + 1)) < max_docs:
                        sample[j] = text
    return sample, counts


def train_sentencepiece(cfg: TokenizerTrainingConfig, log: Optional[TextIO] = sys.stderr) -> dict:
    """Sample, train, and write `<prefix>.model`/`.vocab` (atomically) and `<prefix>.json`
    (what it was trained on). Returns that JSON's content."""
    import sentencepiece

    cfg.validate()
    docs, counts = sample_documents(cfg.inputs, cfg.json_keys, cfg.max_docs, cfg.seed,
                                    exclude=[cfg.output_prefix + ".json"])
    if not docs:
        raise UserError(f"--input {' '.join(cfg.inputs)}: no usable documents to train on")
    if log is not None:
        log.write(f"training on {len(docs):,} of {counts['seen']:,} documents\n")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.output_prefix)), exist_ok=True)
    tmp = f"{cfg.output_prefix}.tmp{os.getpid()}"
    sentencepiece.set_random_generator_seed(cfg.seed)
    lines = (line for doc in docs for line in doc.split("\n") if line.strip())
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=tmp, vocab_size=cfg.vocab_size,
            model_type=cfg.model_type, byte_fallback=True, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, character_coverage=0.9995,
            max_sentence_length=_MAX_LINE_BYTES, num_threads=cfg.threads,
            unk_id=SPECIAL_IDS["unk"], bos_id=SPECIAL_IDS["bos"], eos_id=SPECIAL_IDS["eos"],
            pad_id=SPECIAL_IDS["pad"], pad_piece="<pad>",
            user_defined_symbols=cfg.user_defined_symbols, minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size is too high (8000). ... <= 3164."
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp + suffix):
                os.remove(tmp + suffix)
        raise UserError(f"--vocab-size {cfg.vocab_size}: sentencepiece: "
                        f"{str(e).strip().splitlines()[-1]}") from None
    for suffix in (".model", ".vocab"):
        os.replace(tmp + suffix, cfg.output_prefix + suffix)
    info = {"model": cfg.output_prefix + ".model", "config": asdict(cfg),
            "documents_sampled": len(docs), "documents_seen": counts.pop("seen"),
            "skipped": dict(counts), "special_ids": SPECIAL_IDS}
    with open(cfg.output_prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info
