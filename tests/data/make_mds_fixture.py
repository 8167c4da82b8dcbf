"""Writes tests/data/mds/ with MosaicML Streaming's own MDSWriter, and the documents its
own reader decodes from it as tests/data/mds_documents.json (the reference that
tests/test_mds.py holds megatron_stem/data/mds.py to). Needs `mosaicml-streaming` (not a
dependency of this repository); run from the repository root:

    python tests/data/make_mds_fixture.py

Two datasets shaped like ProLong's (princeton-nlp/prolong-data-64K: per sample a packed
`input_ids` and the [start, end) `indices` of its documents, plus `domain` and `length`):
`books/` in two shards under a subfolder with a merged index above it (ProLong's layout),
and `code/`, zstd-compressed, its columns in MDS's dynamic forms (dtype and shape in each
value) with a pickled column, which a reader must skip without unpickling.
"""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from streaming import LocalDataset, MDSWriter
from streaming.base.compression import decompress
from streaming.base.util import merge_index

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "mds"


def samples(rng, count, vocab, length):
    for _ in range(count):
        cuts = np.sort(rng.choice(np.arange(1, length), rng.integers(0, 4), replace=False))
        bounds = np.stack([np.r_[0, cuts], np.r_[cuts, length]], axis=1)
        yield rng.integers(0, vocab, length), bounds


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    rng = np.random.default_rng(0)
    books = OUT / "books" / "proc00-02"
    columns = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32", "domain": "str",
               "length": "int"}
    with MDSWriter(out=str(books), columns=columns, size_limit=1500) as writer:
        for ids, bounds in samples(rng, 6, 128256, 64):
            writer.write({"input_ids": ids.astype(np.uint32),
                          "indices": bounds.astype(np.uint32), "domain": "books",
                          "length": len(ids)})
    merge_index([str(books / "index.json")], str(OUT / "books"))
    code = OUT / "code"
    columns = {"input_ids": "ndarray", "indices": "ndarray:int64", "meta": "pkl"}
    with MDSWriter(out=str(code), columns=columns, compression="zstd") as writer:
        for ids, bounds in samples(rng, 4, 128256, 40):
            writer.write({"input_ids": ids.astype(np.int32), "indices": bounds.astype(np.int64),
                          "meta": {"repo": "x"}})
    expected = {}
    for folder in (books, code):
        for sample in LocalDataset(local=_decompressed(folder)):
            docs = expected.setdefault(str(folder.relative_to(OUT)), [])
            for start, end in np.asarray(sample["indices"]).reshape(-1, 2):
                docs.append(np.asarray(sample["input_ids"])[start:end].tolist())
    (ROOT / "mds_documents.json").write_text(json.dumps(expected))


def _decompressed(folder: Path) -> str:
    """A copy of `folder` with its shards decompressed (LocalDataset reads raw shards)."""
    copy = Path(tempfile.mkdtemp()) / folder.name
    shutil.copytree(folder, copy)
    for shard in json.loads((copy / "index.json").read_text())["shards"]:
        if shard["compression"]:
            raw = decompress(shard["compression"],
                             (copy / shard["zip_data"]["basename"]).read_bytes())
            (copy / shard["raw_data"]["basename"]).write_bytes(raw)
    return str(copy)


if __name__ == "__main__":
    main()
