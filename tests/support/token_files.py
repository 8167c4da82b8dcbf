"""Token files the data tests read: random documents as a prefix, or a prefix set with its
manifest, written at numpy speed (hundreds of thousands of documents in a second)."""

import json
import os

import numpy as np

from megatron_stem.data.checks import max_token_id
from megatron_stem.data.indexed import PartWriter, token_dtype
from megatron_stem.data.prefix_sets import MANIFEST, set_record

EOD = 1


def write_prefix(prefix, documents: int, seed: int, vocab_size: int = 512) -> np.ndarray:
    """`documents` documents of 3-39 random ids in [2, vocab_size), each ended by EOD; the
    documents' lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 40, documents) + 1
    tokens = rng.integers(2, vocab_size, int(lengths.sum()))
    tokens[np.cumsum(lengths) - 1] = EOD
    writer = PartWriter(str(prefix), token_dtype(vocab_size))
    writer.add(tokens, lengths)
    writer.close(sync=False)
    return lengths


def write_set(folder, sizes: list[int], seed: int, vocab_size: int = 512) -> int:
    """A prefix set (folder, prefixes, manifest.json with each prefix's largest id) as
    preprocessing writes it; its documents."""
    os.makedirs(folder)
    entries = []
    for i, n in enumerate(sizes):
        name = f"00000-{i:05d}"
        lengths = write_prefix(os.path.join(folder, name), n, seed + i, vocab_size)
        entries.append({"name": name, "documents": n, "tokens": int(lengths.sum()),
                        "max_token_id": max_token_id(os.path.join(folder, name))})
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(set_record({"format": 1}, entries), f)
    return sum(sizes)
