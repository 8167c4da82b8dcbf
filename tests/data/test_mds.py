"""Pre-tokenized MDS shards (ProLong's format) into Megatron token files: the reader
against MosaicML Streaming's own reader, and the converter end to end."""

import json

import numpy as np
import pytest

from support.processes import ROOT, tool_main
from megatron_stem.data import mds
from megatron_stem.runtime.errors import UserError

# Written by MosaicML Streaming's MDSWriter, with the documents its own reader decodes
# (tests/fixtures/make_mds_fixture.py): ProLong-like books in two shards under a merged
# index, and zstd-compressed code in MDS's dynamic forms with a pickled column.
FIXTURE = ROOT / "tests" / "fixtures" / "mds"
EXPECTED = json.loads((ROOT / "tests" / "fixtures" / "mds_documents.json").read_text())
LLAMA3_VOCAB, LLAMA3_EOD = 128256, 128001


def test_the_reader_decodes_what_mosaicml_streaming_wrote():
    found = mds.shards([FIXTURE])
    # The merged index lists its subfolder's shards again: each is read once.
    assert [str(s.path.relative_to(FIXTURE.resolve())) for s in found] == [
        "books/proc00-02/shard.00000.mds", "books/proc00-02/shard.00001.mds",
        "code/shard.00000.mds.zstd"]
    books = [d.tolist() for s in found[:2] for d in mds.documents(s)]
    code = [d.tolist() for d in mds.documents(found[2])]
    assert books == EXPECTED["books/proc00-02"] and code == EXPECTED["code"]
    # Without bounds a sample is one document: the same tokens, the fixture's documents
    # covering each sample.
    whole = [d for s in found[:2] for d in mds.documents(s, bounds=None)]
    assert len(whole) == 6
    assert np.concatenate(whole).tolist() == sum(EXPECTED["books/proc00-02"], [])


@pytest.fixture(scope="module")
def llama3_sized_tokenizer(tmp_path_factory) -> str:
    """A tokenizer.json with Llama-3's vocabulary size and end-of-text id (ids only)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(LLAMA3_VOCAB)}
    vocab["<|end_of_text|>"] = LLAMA3_EOD
    del vocab[f"t{LLAMA3_EOD}"]
    folder = tmp_path_factory.mktemp("llama3_sized")
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    return str(folder / "tokenizer.json")


def convert(tmp_path, tokenizer, *extra):
    return tool_main("tools/mds_to_megatron.py")([
        "--input", str(FIXTURE), "--output-prefix", str(tmp_path / "prolong" / "train"),
        "--tokenizer-type", "huggingface", "--tokenizer-model", tokenizer, *extra])


def test_the_converter_writes_each_document_with_its_end_of_text(tmp_path, capsys,
                                                                 llama3_sized_tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert convert(tmp_path, llama3_sized_tokenizer, "--append-eod") == 0
    prefix = tmp_path / "prolong" / "train_text_document"
    dataset = IndexedDataset(str(prefix))
    expected = EXPECTED["books/proc00-02"] + EXPECTED["code"]
    assert len(dataset) == len(expected) == 30
    assert [dataset[i].tolist() for i in range(len(dataset))] == \
        [doc + [LLAMA3_EOD] for doc in expected]
    assert dataset[0].dtype == np.int32  # Llama-3's vocabulary does not fit uint16
    assert sorted(p.name for p in prefix.parent.iterdir()) == \
        ["train_text_document.bin", "train_text_document.idx"]
    assert f"wrote {prefix}.bin/.idx: 30 documents, {sum(map(len, expected)) + 30:,} tokens " \
           "from 3 shards" in capsys.readouterr().out


def test_ids_of_another_tokenizer_are_refused_and_nothing_is_left(tmp_path, capsys,
                                                                  hf_tokenizer):
    assert convert(tmp_path, hf_tokenizer) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"error: {FIXTURE.resolve()}/books/proc00-02/shard.00000.mds: token id 127898 is not " \
        "below the tokenizer's vocabulary of 600: these shards were tokenized with another " \
        "tokenizer"
    assert not list((tmp_path / "prolong").iterdir())  # no part, no half-written pair


def test_shards_without_the_columns_say_which(tmp_path):
    shard = mds.shards([FIXTURE / "code"])[0]
    with pytest.raises(UserError, match=r"shard\.00000\.mds\.zstd: no column 'tokens' \(it "
                                        r"has indices, input_ids, meta\)"):
        list(mds.documents(shard, tokens="tokens"))
    with pytest.raises(UserError, match=r"column 'meta' is encoded as pkl, not as an ndarray"):
        list(mds.documents(shard, tokens="meta"))
    with pytest.raises(UserError, match=r"^--input: no index\.json \(an MDS dataset\) under "):
        mds.shards([tmp_path])
