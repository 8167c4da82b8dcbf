"""Preprocessing (megatron_stem.data, tools/preprocess_data.py): documents -> .bin/.idx ->
megatron-core's datasets give back the same token ids, for every input format; bad input
is counted and located; the bytes do not depend on workers, chunking or interruptions."""

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from support.processes import ROOT, subprocess_env
from megatron_stem.data import indexed, prefix_sets
from megatron_stem.data.checks import max_token_id
from megatron_stem.data.indexed import PartWriter, merge, token_dtype
from megatron_stem.data.prefix_sets import contiguous_groups
from megatron_stem.data.preprocess import PreprocessConfig, preprocess
from megatron_stem.data.worker import BadRecord
from megatron_stem.runtime.errors import UserError
from megatron_stem.data.tokenizer import load_tokenizer


# --- helpers -----------------------------------------------------------------------------


def jsonl_bytes(records) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


def write(path: Path, data: bytes) -> Path:
    """Write `data` (uncompressed) to `path`, compressed as its name says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def run(inputs, prefix, sp_model, **kw) -> dict:
    cfg = PreprocessConfig(inputs=[str(i) for i in inputs], output_prefix=str(prefix),
                           tokenizer_type="sentencepiece", tokenizer_model=sp_model,
                           append_eod=kw.pop("append_eod", True), **kw)
    return preprocess(cfg, log=None)


def read_documents(prefix) -> list:
    """Token ids of each document, read back by megatron-core's IndexedDataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


def expected_ids(tok, texts, eod=True) -> list:
    return [tok.encode(t) + ([tok.eod] if eod else []) for t in texts]


def output_bytes(prefix) -> tuple:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tok(sp_model):
    return load_tokenizer("sentencepiece", sp_model)


# --- format and round trips --------------------------------------------------------------


def test_round_trip_through_megatron_gpt_dataset(tmp_path, sp_model, tok, corpus_texts):
    """documents -> .bin/.idx -> BlendedMegatronDatasetBuilder + GPTDataset samples are
    exactly the expected token stream."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    texts = corpus_texts[:400] + corpus_texts[-4:]
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": t} for t in texts))
    stats = run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, workers=2,
                single_prefix=True)
    prefix = stats["outputs"]["text"]
    docs = expected_ids(tok, texts)
    assert read_documents(prefix) == docs
    assert stats["documents"] == len(texts)
    assert stats["tokens"] == sum(map(len, docs))
    assert stats["max_token_id"] == {"text": max(max(d) for d in docs)}

    seq = 64
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=seq, blend=([prefix], None), split="1,0,0",
        tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    ds, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [200, None, None], lambda: True,
                                             config).build()
    assert isinstance(ds, GPTDataset) and len(ds) >= 200
    for i in range(len(ds)):
        # Where megatron says sample i lies in its (shuffled) document order...
        j = ds.shuffle_index[i]
        (b, b_off), (e, e_off) = ds.sample_index[j], ds.sample_index[j + 1]
        stream = [t for k in range(b, e + 1) for t in docs[ds.document_index[k]]]
        ends = np.cumsum([len(docs[ds.document_index[k]]) for k in range(b, e + 1)])
        window = stream[b_off: (ends[-2] if e > b else 0) + e_off + 1]
        # ... the sample holds exactly our tokens.
        sample = ds[i]
        assert sample["tokens"].tolist() == window[:-1]
        assert sample["labels"].tolist() == window[1:]


def test_bos_documents_round_trip_through_preprocessing_and_document_masking(
        tmp_path, sp_model, tok, corpus_texts):
    """--prepend-bos --append-eod writes BOS + text + EOD per document (the official STEM
    code's documents); with document masking every document of a packed sample then
    starts with BOS at position 0 right after the EOD that closed the one before, its
    attention starts there, and only the prediction made at an EOD leaves the loss."""
    from megatron_stem.config import DataConfig, Recipe, TrainConfig
    from megatron_stem.training.batches import Samples, StepBatches, open_datasets
    from workers.common import document_inputs, tiny_model

    texts = corpus_texts[:200]
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": t} for t in texts))
    stats = run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, prepend_bos=True,
                single_prefix=True)
    prefix = stats["outputs"]["text"]
    assert tok.bos is not None and tok.bos != tok.eod
    assert read_documents(prefix) == [[tok.bos] + ids for ids in expected_ids(tok, texts)]
    assert stats["prepend_bos"] is True

    recipe = Recipe(model=tiny_model(vocab_size=tok.vocab_size, seq_length=256),
                    data=DataConfig(prefixes=[prefix], split="1,0,0", reset_position_ids=True,
                                    reset_attention_mask=True, eod_mask_loss=True,
                                    cache_dir=str(tmp_path / "cache")),
                    train=TrainConfig(seed=3))
    train, _ = open_datasets(recipe, tok, Samples(8, 0))
    (batch,) = StepBatches(train, 8, 8, 0, 1, torch.device("cpu")).microbatches(0)
    tokens, positions = batch["tokens"], batch["position_ids"]
    after_eod = torch.zeros_like(tokens, dtype=torch.bool)
    after_eod[:, 1:] = tokens[:, :-1] == tok.eod
    assert after_eod.any()
    assert (tokens[after_eod] == tok.bos).all() and (positions[after_eod] == 0).all()
    assert torch.equal(batch["loss_mask"] == 0, tokens == tok.eod)
    expected = document_inputs(tokens, tok.eod)
    assert torch.equal(positions, expected["position_ids"])
    assert torch.equal(batch["documents"].cu_seqlens_q, expected["documents"].cu_seqlens_q)


def test_same_bytes_as_megatron_builder(tmp_path, sp_model, tok, corpus_texts):
    """What Megatron-LM's preprocess_data.py would write for these documents (megatron-core's
    IndexedDatasetBuilder.add_document), and its add_index merge, byte for byte."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    texts = corpus_texts[:300]
    for i, part in enumerate((texts[:100], [], texts[100:])):  # an empty part too
        write(tmp_path / f"in{i}.jsonl", jsonl_bytes({"text": t} for t in part))
    stats = run(sorted(tmp_path.glob("in*.jsonl")), tmp_path / "ours", sp_model,
                chunk_bytes=4096, single_prefix=True)
    docs = expected_ids(tok, texts)

    dtype = DType.optimal_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert output_bytes(stats["outputs"]["text"]) == output_bytes(tmp_path / "theirs")

    # The streaming merge equals the builder's add_index, including an empty part.
    for name, part in (("a", docs[:7]), ("b", []), ("c", docs[7:20])):
        w = PartWriter(str(tmp_path / name), dtype)
        for d in part:
            w.add(np.array(d), np.array([len(d)]))
        w.close()
    merge([str(tmp_path / n) for n in "abc"], str(tmp_path / "merged"), dtype)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for n in "abc":
        builder.add_index(str(tmp_path / n))
    builder.finalize(str(tmp_path / "ref.idx"))
    assert output_bytes(tmp_path / "merged") == output_bytes(tmp_path / "ref")


FORMATS = ["a.jsonl", "a.json", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "a.txt", "a.txt.gz",
           "a.txt.zst"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_input_format(tmp_path, sp_model, tok, corpus_texts, name):
    # Documents of one line each, so that the .txt format (a line a document) can hold them.
    texts = [t.replace("\n", " ") for t in corpus_texts[:150]] + ["naïve café — 東京 🚀"]
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"text": texts, "id": list(range(len(texts)))})
        pq.write_table(table, tmp_path / name, row_group_size=40)  # several row groups
    elif ".txt" in name:
        write(tmp_path / name, "".join(t + "\n" for t in texts).encode())
    else:
        write(tmp_path / name, jsonl_bytes({"id": i, "text": t} for i, t in enumerate(texts)))
    stats = run([tmp_path / name], tmp_path / "out", sp_model, chunk_bytes=2000,
                single_prefix=True)
    assert read_documents(stats["outputs"]["text"]) == expected_ids(tok, texts)
    assert stats["skipped"] == {} and stats["chunks"] > 1


def test_several_keys_make_aligned_outputs(tmp_path, sp_model, tok):
    records = [{"title": f"Title {i}", "text": f"Body of document {i}."} for i in range(30)]
    records[4] = {"text": "no title here"}  # dropped from both outputs
    write(tmp_path / "in.jsonl", jsonl_bytes(records))
    stats = run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, json_keys=["title", "text"],
                append_eod=False, single_prefix=True)
    kept = records[:4] + records[5:]
    assert stats["outputs"] == {"title": f"{tmp_path}/out_title_document",
                                "text": f"{tmp_path}/out_text_document"}
    for key in ("title", "text"):
        assert read_documents(stats["outputs"][key]) == \
            expected_ids(tok, [r[key] for r in kept], eod=False)
    assert stats["skipped"] == {"missing_key": 1}
    assert stats["first_errors"] == [f"{tmp_path}/in.jsonl:5: missing_key: no key 'title'"]
    # As prefix sets: the keys' prefixes hold the same documents, cut where either key's
    # next part would pass the limit.
    sets = run([tmp_path / "in.jsonl"], tmp_path / "set", sp_model, json_keys=["title", "text"],
               append_eod=False, chunk_bytes=300, prefix_max_tokens=140)
    manifests = {k: manifest_of(sets["outputs"][k]) for k in ("title", "text")}
    cuts = {k: [(p["name"], p["documents"]) for p in m["prefixes"]] for k, m in manifests.items()}
    assert cuts["title"] == cuts["text"]
    assert all(p["tokens"] <= 140 for m in manifests.values() for p in m["prefixes"])
    # The texts (about twice the titles' tokens) decide: the titles alone would make fewer.
    assert len(cuts["text"]) > manifests["title"]["tokens"] // 140 + 1
    for key in ("title", "text"):
        docs = [d for p in sets["prefixes"][key] for d in read_documents(p["prefix"])]
        assert docs == expected_ids(tok, [r[key] for r in kept], eod=False)


def test_token_dtype_follows_vocab_size(tmp_path):
    """uint16 below 65,500 ids (as megatron-core picks), int32 from there: a 70,000-word
    Hugging Face tokenizer round-trips through int32 token files."""
    from megatron.core.datasets.indexed_dataset import DType
    from tokenizers import Tokenizer, models, pre_tokenizers

    for vocab in (1000, 65499, 65500, 128256):
        assert token_dtype(vocab) == DType.optimal_dtype(vocab)
    words = [f"w{i}" for i in range(70000)]
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["<unk>", "</s>"])},
                                    unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    texts = [" ".join(words[i::997][:20]) for i in range(50)] + ["w69999 w65535 w65500"]
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": t} for t in texts))
    stats = preprocess(PreprocessConfig(
        inputs=[str(tmp_path / "in.jsonl")], output_prefix=str(tmp_path / "out"),
        tokenizer_type="huggingface", tokenizer_model=str(tmp_path), append_eod=True,
        single_prefix=True), log=None)
    assert stats["dtype"] == "int32"
    ids = read_documents(stats["outputs"]["text"])
    assert ids[-1] == [69999, 65535, 65500, 70001]
    assert all(max(d[:-1]) >= 0 and d[-1] == 70001 for d in ids)


# --- bad input ---------------------------------------------------------------------------


def bad_jsonl() -> tuple[bytes, list]:
    """Lines 2..8 are bad in every way the issue lists; the rest are good documents."""
    good = [f"good document {i}" for i in range(5)]
    lines = [json.dumps({"text": good[0]}).encode(),
             b'{"text": "unterminated',                      # 2 bad_json
             json.dumps({"body": "wrong key"}).encode(),     # 3 missing_key
             b'{"text": "caf\xe9 latin-1"}',                 # 4 bad_utf8 (not UTF-8)
             json.dumps({"text": "   "}).encode(),           # 5 empty
             json.dumps({"text": 42}).encode(),              # 6 not_text
             b'{"text": "lone \\ud800 surrogate"}',          # 7 bad_utf8 (escaped)
             b'[1, 2]',                                      # 8 bad_json (not an object)
             b"",                                            # 9 blank: not a record
             json.dumps({"text": good[1]}).encode(),
             json.dumps({"text": good[2]}).encode()]
    return b"\n".join(lines) + b"\n", good[:3]


def test_bad_records_are_counted_located_and_skipped(tmp_path, sp_model, tok):
    data, good = bad_jsonl()
    bad = write(tmp_path / "in" / "bad.jsonl", data)
    # A gzip file cut in its middle: its first documents are kept, the break is reported.
    lines = [f"truncated file line {i}" for i in range(2000)]
    full = gzip.compress(jsonl_bytes({"text": t} for t in lines))
    trunc = tmp_path / "in" / "cut.jsonl.gz"
    trunc.write_bytes(full[: len(full) // 2])

    stats = run([tmp_path / "in"], tmp_path / "out", sp_model, single_prefix=True)
    assert stats["skipped"] == {"bad_json": 2, "missing_key": 1, "not_text": 1, "bad_utf8": 2,
                                "empty": 1, "read_error": 1}
    log = Path(stats["errors_log"]).read_text().splitlines()
    assert log[:7] == [
        f"{bad}:2: bad_json: Unterminated string starting at (column 10)",
        f"{bad}:3: missing_key: no key 'text'",
        f"{bad}:4: bad_utf8: invalid UTF-8 byte at column 14",
        f"{bad}:5: empty: 'text' is empty",
        f"{bad}:6: not_text: 'text' is int, not a string",
        f"{bad}:7: bad_utf8: 'text' has an unpaired surrogate at character 6",
        f"{bad}:8: bad_json: expected a JSON object, got list"]
    assert len(log) == 8 and log[7].startswith(f"{trunc}:")
    assert "read_error: file ends early or is corrupt (Compressed file ended" in log[7]
    broken_at = int(log[7].split(":")[1])
    docs = read_documents(stats["outputs"]["text"])
    # Every complete line before the break made it; nothing after it, nothing invented.
    assert docs == expected_ids(tok, good + lines[: broken_at - 1])
    assert 0 < broken_at - 1 < len(lines)
    assert stats["first_errors"] == log


@pytest.mark.parametrize("line,reason", [(2, "bad_json"), (5, "empty")])
def test_on_error_fail_stops_with_file_and_line(tmp_path, sp_model, line, reason):
    data, _ = bad_jsonl()
    rows = [b'{"text": "ok"}'] * (line - 1) + [data.split(b"\n")[line - 1]]
    bad = write(tmp_path / "bad.jsonl", b"\n".join(rows) + b"\n")
    with pytest.raises(BadRecord, match=rf"^{bad}:{line}: {reason}: .*\(--on-error fail"):
        run([bad], tmp_path / "out", sp_model, on_error="fail")
    assert not (tmp_path / "out_text_document.bin").exists()


@pytest.mark.integration
def test_cli_errors_are_one_line(tmp_path, sp_model):
    data, _ = bad_jsonl()
    write(tmp_path / "bad.jsonl", data)
    common = ["--output-prefix", tmp_path / "out", "--tokenizer-type", "sentencepiece",
              "--tokenizer-model", sp_model, "--workers", "1"]
    cases = [
        (["--input", tmp_path / "bad.jsonl", "--on-error", "fail", *common],
         f"error: {tmp_path}/bad.jsonl:2: bad_json: Unterminated string starting at (column "
         "10) (--on-error fail; --on-error skip counts and skips these)"),
        (["--input", tmp_path / "missing.jsonl", *common],
         f"error: --input {tmp_path}/missing.jsonl: no such file or folder"),
        (["--input", tmp_path / "bad.jsonl", *common[:-3], "/nope.model"],
         "error: /nope.model: SentencePiece model not found"),
        (["--input", tmp_path / "bad.jsonl", "--json-keys", "a/b", *common],
         "error: --json-keys: 'a/b': use letters, digits, '_', '.', '-'"),
        (["--input", tmp_path / "bad.jsonl", "--prefix-max-tokens", "1.5e9.", *common],
         "error: --prefix-max-tokens: expected a whole number such as 20e9, got '1.5e9.'"),
        (["--input", tmp_path / "bad.jsonl", "--prefix-max-documents", "2**31", *common],
         "error: --prefix-max-documents: must be a whole number in 1..2147483647 "
         "(megatron-core holds document ids as int32), got 2147483648"),
    ]
    for args, message in cases:
        proc = cli(*args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == message
        assert "Traceback" not in proc.stderr


def test_parquet_without_the_column_or_unreadable(tmp_path, sp_model, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b", "c"]}), tmp_path / "x.parquet")
    (tmp_path / "z.parquet").write_bytes(b"PAR1 this is not parquet")
    write(tmp_path / "y.jsonl", jsonl_bytes([{"text": "fine"}]))
    stats = run([tmp_path / "x.parquet", tmp_path / "y.jsonl", tmp_path / "z.parquet"],
                tmp_path / "out", sp_model, single_prefix=True)
    assert stats["skipped"] == {"missing_key": 3, "read_error": 1}
    assert stats["first_errors"][0] == \
        f"{tmp_path}/x.parquet: missing_key: no column 'text' (columns: content)"
    assert stats["first_errors"][1].startswith(
        f"{tmp_path}/z.parquet: read_error: not a readable Parquet file")
    assert read_documents(stats["outputs"]["text"]) == expected_ids(tok, ["fine"])


def test_multi_member_gzip_multi_frame_zstd_and_truncated_zstd(tmp_path, sp_model, tok):
    import zstandard

    texts = [f"line {i} of a compressed file" for i in range(300)]
    first, second = jsonl_bytes({"text": t} for t in texts[:100]), \
        jsonl_bytes({"text": t} for t in texts[100:])
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(first) + gzip.compress(second))
    zst = zstandard.ZstdCompressor()
    (tmp_path / "b.jsonl.zst").write_bytes(zst.compress(first) + zst.compress(second))
    cut = zst.compress(first + second)
    (tmp_path / "c.jsonl.zst").write_bytes(cut[: len(cut) * 2 // 3])
    stats = run([tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst", tmp_path / "c.jsonl.zst"],
                tmp_path / "out", sp_model, single_prefix=True)
    (error,) = stats["first_errors"]
    assert error.startswith(f"{tmp_path}/c.jsonl.zst:")
    assert "read_error: file ends early or is corrupt (zstd stream ended" in error
    kept = int(error.split(":")[1]) - 1
    assert read_documents(stats["outputs"]["text"]) == expected_ids(tok, texts * 2 + texts[:kept])


# --- determinism, resume, arrays ---------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory, corpus_texts):
    """Six shards of mixed formats and sizes, about 1,500 documents, and two empty files."""
    folder = tmp_path_factory.mktemp("shards")
    texts = corpus_texts
    cuts = [0, 300, 310, 700, 900, 1300, len(texts)]
    names = ["00.jsonl.gz", "01.jsonl", "02.jsonl.zst", "03.jsonl", "04.txt", "05.jsonl.gz"]
    for name, lo, hi in zip(names, cuts, cuts[1:]):
        part = texts[lo:hi]
        if name.endswith(".txt"):
            write(folder / name, "".join(t.replace("\n", " ") + "\n" for t in part).encode())
        else:
            write(folder / name, jsonl_bytes({"text": t} for t in part))
    write(folder / "06.jsonl", b"")
    write(folder / "07.jsonl.gz", b"")
    return folder


@pytest.fixture(scope="module")
def reference(shards, sp_model, tmp_path_factory):
    """The uninterrupted run's output, one worker, the reference library (sentencepiece)."""
    stats = run([shards], tmp_path_factory.mktemp("ref") / "out", sp_model, workers=1,
                tokenizer_backend="reference", single_prefix=True)
    return output_bytes(stats["outputs"]["text"])


def test_same_bytes_whatever_workers_chunking_and_backend(shards, reference, sp_model,
                                                         tmp_path):
    for workers, chunk, backend in ((2, None, "gigatoken"), (3, 3000, "gigatoken"),
                                    (1, 1 << 30, "gigatoken"), (2, 3000, "reference")):
        stats = run([shards], tmp_path / f"w{workers}_{chunk}_{backend}" / "out", sp_model,
                    workers=workers, chunk_bytes=chunk, tokenizer_backend=backend,
                    single_prefix=True)
        assert output_bytes(stats["outputs"]["text"]) == reference, (workers, chunk, backend)
        assert stats["this_run"]["tokenizer_backend"] == backend
    assert stats["shards"] == 8


@pytest.mark.integration
@pytest.mark.parametrize("how", ["kill the job", "terminate"])
def test_killed_run_resumes_to_the_same_bytes(shards, reference, sp_model, tmp_path, how):
    prefix = tmp_path / "out"
    args = ["--input", shards, "--output-prefix", prefix, "--tokenizer-type", "sentencepiece",
            "--tokenizer-model", sp_model, "--append-eod", "--workers", "1",
            "--chunk-size-mb", "0.002", "--single-prefix"]
    proc = subprocess.Popen([sys.executable, "tools/preprocess_data.py", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    parts = Path(f"{prefix}.parts")
    deadline = time.monotonic() + 60
    while len(list(parts.glob("*/0*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    if how == "kill the job":  # every process at once, as when a node dies
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    else:  # scancel, preemption: stops cleanly, recording the chunks being worked on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    assert not Path(f"{prefix}_text_document.idx").exists(), "the run ended before the kill"
    finished = len(list(parts.glob("*/0*.json")))
    assert finished >= 3

    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert output_bytes(f"{prefix}_text_document") == reference
    stats = json.loads(Path(f"{prefix}.stats.json").read_text())
    assert stats["this_run"]["chunks_resumed"] >= finished - 1  # one may lack its manifest
    assert not parts.exists() and not list(tmp_path.glob("*.tmp*"))
    # Once finished, a rerun has nothing to do.
    proc = cli(*args)
    assert proc.returncode == 0 and "nothing to do: the outputs are up to date" in proc.stdout


def test_fix_a_bad_shard_and_resume(shards, reference, sp_model, tmp_path):
    """--on-error fail stops at a bad file; fixing it and rerunning redoes only that file."""
    inputs = tmp_path / "in"
    shutil.copytree(shards, inputs)
    good = (inputs / "03.jsonl").read_bytes()
    (inputs / "03.jsonl").write_bytes(good + b"{oops\n")
    with pytest.raises(BadRecord, match=r"03.jsonl:201: bad_json"):
        run([inputs], tmp_path / "out", sp_model, on_error="fail", chunk_bytes=10_000,
            single_prefix=True)
    (inputs / "03.jsonl").write_bytes(good)
    stats = run([inputs], tmp_path / "out", sp_model, on_error="fail", chunk_bytes=10_000,
                single_prefix=True)
    assert stats["this_run"]["shards_resumed"] >= 3
    assert output_bytes(stats["outputs"]["text"]) == reference


def test_parts_reach_the_disk_before_their_records(tmp_path, sp_model, monkeypatch):
    """Each part is synced to disk before the manifest that marks it complete, and by the
    main thread: no worker waits on the disk while it could tokenize."""
    synced = []
    fsync = os.fsync

    def recorded_fsync(fd):
        synced.append((threading.current_thread() is threading.main_thread(),
                       os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": f"document {i}"} for i in range(300)))
    stats = run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, workers=2,
                chunk_bytes=1000, tokenizer_backend="gigatoken")
    assert all(main for main, _ in synced)
    names = [name for _, name in synced]
    manifests = [i for i, name in enumerate(names) if re.fullmatch(r"\d{6}\.json\.tmp\d*", name)]
    assert len(manifests) == stats["chunks"] > 4
    for i in manifests:
        chunk = names[i][:6]
        assert {f"{chunk}_text.bin", f"{chunk}_text.idx"} <= set(names[:i]), names[i]


def test_a_gigatoken_run_starts_lean(tmp_path, sp_model):
    """Its workers are threads, and nothing else is started either (a lock of
    multiprocessing's starts its resource tracker, a Python process of its own); JSON
    Lines need no Arrow compute (its import is 0.05 s of CPU, holding the GIL)."""
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": f"document {i}"} for i in range(50)))
    script = ("import glob, sys\n"
              "from megatron_stem.data.preprocess import PreprocessConfig, preprocess\n"
              "preprocess(PreprocessConfig(inputs=[sys.argv[1]], output_prefix=sys.argv[2], "
              "tokenizer_type='sentencepiece', tokenizer_model=sys.argv[3], workers=2, "
              "tokenizer_backend='gigatoken'), log=None)\n"
              "print(sum(len(open(f).read().split()) "
              "for f in glob.glob('/proc/self/task/*/children')))\n"
              "print('pyarrow.compute' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.jsonl"),
                           str(tmp_path / "out"), str(sp_model)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "False"]  # child processes, Arrow compute imported


def manifest_of(folder) -> dict:
    return json.loads((Path(folder) / "manifest.json").read_text())


def joined_bytes(folder, tmp_path, record=None) -> tuple:
    """The bytes of a prefix set's (or group file's) prefixes concatenated in its order:
    what the one-file layout holds for the same documents."""
    names = [p["name"] for p in (record or manifest_of(folder))["prefixes"]]
    joined = tmp_path / f"joined{len(list(tmp_path.glob('joined*')))}"
    merge([str(Path(folder) / n) for n in names], str(joined), np.uint16)
    return output_bytes(joined)


def test_contiguous_groups_balance_bytes():
    groups = contiguous_groups([30, 10, 10, 10, 29, 1], 3)
    assert groups == [range(0, 1), range(1, 4), range(4, 6)]  # 31 / 33 / 32 bytes (+1 each)
    assert contiguous_groups([5], 3) == [range(0, 0), range(0, 1), range(1, 1)]
    assert contiguous_groups([0, 0, 0, 0], 2) == [range(0, 2), range(2, 4)]
    sizes = list(np.random.default_rng(0).integers(0, 1000, 200))
    groups = contiguous_groups(sizes, 7)
    assert [i for g in groups for i in g] == list(range(200))
    assert max(sum(sizes[i] + 1 for i in g) for g in groups) < sum(sizes) / 7 + 1000


def test_prefix_set_is_the_single_prefix_cut_at_the_limits(shards, reference, sp_model,
                                                           tmp_path):
    """Prefixes closed before a part would take them past a limit, whole parts only, and
    their documents in manifest order are the one-file output byte for byte."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for limits in ({"prefix_max_tokens": 9000}, {"prefix_max_documents": 150},
                   {"prefix_max_tokens": 1}):
        out = tmp_path / "_".join(f"{k}{v}" for k, v in limits.items())
        stats = run([shards], out / "out", sp_model, chunk_bytes=3000, keep_parts=True,
                    **limits)
        folder = Path(stats["outputs"]["text"])
        manifest = manifest_of(folder)
        assert manifest.keys() == {"format", "dtype", "tokenizer", "append_eod", "documents",
                                   "tokens", "prefixes"}
        assert (manifest["format"], manifest["dtype"], manifest["append_eod"]) == \
            (1, "uint16", True)
        assert manifest["tokenizer"] == {k: stats["tokenizer"][k]
                                         for k in ("class", "sha256", "vocab_size")}
        assert (manifest["documents"], manifest["tokens"]) == (1504, stats["tokens"])
        assert joined_bytes(folder, tmp_path) == reference
        names = [p["name"] for p in manifest["prefixes"]]
        assert names == [f"00000-{i:05d}" for i in range(len(names))]
        assert sorted(os.listdir(folder)) == sorted(
            ["manifest.json", "group-00000-of-00001.json"]
            + [f"{n}.{e}" for n in names for e in ("bin", "idx")])
        assert stats["prefixes"]["text"] == [
            {"prefix": str(folder / p["name"]), "documents": p["documents"],
             "tokens": p["tokens"], "max_token_id": p["max_token_id"]}
            for p in manifest["prefixes"]]
        # Every id read once, by the task that wrote the prefix: the full check.
        assert [p["max_token_id"] for p in manifest["prefixes"]] == \
            [max_token_id(str(folder / p["name"])) for p in manifest["prefixes"]]
        assert stats["max_token_id"] == {"text": max(p["max_token_id"]
                                                     for p in manifest["prefixes"])}
        # Each prefix is whole parts: the parts' sizes, in order, cut where the next
        # part would pass a limit.
        parts = [json.loads(m.read_text()) for d in sorted(Path(f"{out}/out.parts").iterdir())
                 if d.is_dir() for m in sorted(d.glob("0*.json"))]
        parts = [(c["documents"], c["tokens"]["text"]) for c in parts if c["documents"]]
        max_docs = limits.get("prefix_max_documents", 2 ** 30)
        max_tokens = limits.get("prefix_max_tokens", 20e9)
        for prefix in manifest["prefixes"]:
            ds = IndexedDataset(str(folder / prefix["name"]))
            assert len(ds) == prefix["documents"]
            assert int(ds.sequence_lengths.sum()) == prefix["tokens"]
            docs = tokens = n = 0
            while (docs, tokens) != (prefix["documents"], prefix["tokens"]):
                docs, tokens, n = docs + parts[n][0], tokens + parts[n][1], n + 1
            assert n == 1 or (docs <= max_docs and tokens <= max_tokens), prefix
            if n < len(parts):
                assert docs + parts[n][0] > max_docs or tokens + parts[n][1] > max_tokens
            parts = parts[n:]
        assert parts == []
    assert len(manifest["prefixes"]) > 20  # one per part at prefix_max_tokens 1


def test_array_groups_then_merge(shards, reference, sp_model, tmp_path):
    """Each task writes its own contiguous run of the files as prefixes, usable once it
    ends; --merge-only then lists them in manifest.json, copying nothing."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "out"
    folder = tmp_path / "out_text_document"
    first = run([shards], prefix, sp_model, num_groups=3, group_index=0,
                prefix_max_tokens=20_000)
    group = json.loads((folder / "group-00000-of-00003.json").read_text())
    assert first["prefixes"]["text"][0]["prefix"] == str(folder / "00000-00000")
    assert sum(len(IndexedDataset(p["prefix"])) for p in first["prefixes"]["text"]) == \
        group["documents"] > 0
    assert not list(Path(f"{prefix}.parts").glob("*/done.json"))  # its parts are gone
    with pytest.raises(UserError, match=r"^2 of 3 groups are not finished, e.g. group 1: "
                       r".*/group-00001-of-00003.json is missing; run every"):
        run([shards], prefix, sp_model, merge_only=True, prefix_max_tokens=20_000)
    for g in (1, 2):
        stats = run([shards], prefix, sp_model, num_groups=3, group_index=g,
                    prefix_max_tokens=20_000)
        assert stats["group"] == [g, 3] and stats["this_run"]["documents"] > 0
    with pytest.raises(UserError, match=r"^3 of 3 .* group 0: .* is from other inputs or "
                       r"settings \(--merge-only takes the tasks' flags\), or a prefix"):
        run([shards], prefix, sp_model, merge_only=True)  # other limits
    copies = []
    with mock.patch.object(indexed, "_copy", lambda *a: copies.append(a)):
        stats = run([shards], prefix, sp_model, merge_only=True, prefix_max_tokens=20_000)
    assert copies == [] and stats["this_run"]["documents"] == 0
    assert stats["documents"] == 1504
    assert joined_bytes(folder, tmp_path) == reference
    groups = [json.loads((folder / f"group-0000{g}-of-00003.json").read_text())
              for g in range(3)]
    assert manifest_of(folder)["prefixes"] == [p for g in groups for p in g["prefixes"]]
    assert not Path(f"{prefix}.parts").exists()
    # A requeued task with nothing left, and the merge once done, do nothing; a prefix
    # lost meanwhile is missed by the merge, and a rerun of its task makes it again.
    again = run([shards], prefix, sp_model, num_groups=3, group_index=1, prefix_max_tokens=20_000)
    assert again["this_run"]["groups_resumed"] == 1 and again["this_run"]["chunks_processed"] == 0
    assert run([shards], prefix, sp_model, merge_only=True,
               prefix_max_tokens=20_000).get("up_to_date")
    lost = folder / f"{manifest_of(folder)['prefixes'][-1]['name']}.idx"
    lost.unlink()
    with pytest.raises(UserError, match=r"^1 of 3 groups are not finished, e.g. group 2: "):
        run([shards], prefix, sp_model, merge_only=True, prefix_max_tokens=20_000)
    run([shards], prefix, sp_model, num_groups=3, group_index=2, prefix_max_tokens=20_000)
    run([shards], prefix, sp_model, merge_only=True, prefix_max_tokens=20_000)
    assert joined_bytes(folder, tmp_path) == reference


def test_single_prefix_groups_then_merge(shards, reference, sp_model, tmp_path):
    prefix = tmp_path / "out"
    for g in range(3):
        run([shards], prefix, sp_model, num_groups=3, group_index=g, single_prefix=True)
    stats = run([shards], prefix, sp_model, merge_only=True, single_prefix=True)
    assert output_bytes(stats["outputs"]["text"]) == reference
    assert stats["prefixes"] == {"text": [{"prefix": f"{prefix}_text_document",
                                           "documents": 1504, "tokens": stats["tokens"]}]}


def test_requeued_task_keeps_its_finished_prefixes(shards, reference, sp_model, tmp_path,
                                                   monkeypatch):
    """A task killed while writing its prefixes (here: an error after two) writes only the
    others when rerun; a prefix left half-written is redone, stale files are removed."""
    merged = []

    def two_then_fail(parts, out, dtype):
        if len(merged) == 2:
            Path(f"{out}.bin").write_bytes(b"half a prefix")
            raise OSError("killed")
        merged.append(Path(out).name)
        return merge(parts, out, dtype)

    monkeypatch.setattr(prefix_sets, "merge", two_then_fail)
    with pytest.raises(OSError, match="killed"):
        run([shards], tmp_path / "out", sp_model, prefix_max_tokens=10_000)
    folder = tmp_path / "out_text_document"
    assert sorted(os.listdir(folder)) == [".tmp-00000-00002.bin", "00000-00000.bin",
                                          "00000-00000.idx", "00000-00001.bin",
                                          "00000-00001.idx"]
    (folder / "00000-00099.bin").write_bytes(b"stale")  # from an earlier run
    merged.clear()
    monkeypatch.setattr(prefix_sets, "merge", lambda *a: merged.append(Path(a[1]).name)
                        or merge(*a))
    stats = run([shards], tmp_path / "out", sp_model, prefix_max_tokens=10_000)
    names = [p["name"] for p in manifest_of(folder)["prefixes"]]
    assert merged == [f".tmp-{n}" for n in names[2:]] and len(names) > 3
    assert stats["this_run"]["chunks_processed"] == 0
    assert joined_bytes(folder, tmp_path) == reference
    assert not (folder / "00000-00099.bin").exists()
    assert not list(folder.glob(".tmp*"))


def test_a_task_removes_each_prefix_s_parts_once_it_is_written(shards, reference, sp_model,
                                                               tmp_path, monkeypatch):
    """So that its parts and its prefixes never both hold its share of the corpus. Killed
    after two prefixes, then rerun with other limits (the released parts are needed
    again): the files whose parts are gone are tokenized again, and the bytes are right."""
    parts = tmp_path / "out.parts"
    merge_calls = []

    def two_then_fail(part_list, out, dtype):
        merge_calls.append(len(list(parts.glob("*/*.bin"))))  # parts left before each
        if len(merge_calls) == 3:
            raise OSError("killed")
        return merge(part_list, out, dtype)

    monkeypatch.setattr(prefix_sets, "merge", two_then_fail)
    with pytest.raises(OSError, match="killed"):
        run([shards], tmp_path / "out", sp_model, prefix_max_tokens=10_000)
    assert merge_calls[0] > merge_calls[1] > merge_calls[2]
    monkeypatch.undo()
    stats = run([shards], tmp_path / "out", sp_model, prefix_max_tokens=15_000)
    assert 0 < stats["this_run"]["chunks_processed"] < stats["chunks"]
    assert joined_bytes(tmp_path / "out_text_document", tmp_path) == reference


def test_prefix_limits_are_checked(tmp_path, sp_model):
    for field, value, message in (
            ("prefix_max_documents", 2 ** 31, r"--prefix-max-documents: must be a whole number "
             r"in 1..2147483647 \(megatron-core holds document ids as int32\), got 2147483648"),
            ("prefix_max_tokens", 0, r"--prefix-max-tokens: must be a whole number >= 1, got 0"),
            ("prefix_max_tokens", 1.5, r"--prefix-max-tokens: .* got 1.5")):
        with pytest.raises(UserError, match=f"^{message}$"):
            run([tmp_path], tmp_path / "out", sp_model, **{field: value})


def test_resumable_merge_continues_where_it_was_killed(tmp_path, monkeypatch):
    """--single-prefix's merge journals its progress: killed after k parts (with half of
    the next part copied), a rerun copies only the rest and writes the same bytes."""
    rng = np.random.default_rng(0)
    parts = []
    for i in range(7):
        w = PartWriter(str(tmp_path / f"p{i}"), np.uint16)
        lengths = rng.integers(1, 50, size=i % 3 * 5)  # some parts are empty
        w.add(rng.integers(0, 60000, size=lengths.sum()), lengths)
        w.close()
        parts.append(str(tmp_path / f"p{i}"))
    merge(parts, str(tmp_path / "whole"), np.uint16)
    monkeypatch.setattr(indexed, "_JOURNAL_BYTES", 0)  # a record after every part
    append, appended = indexed._append, []

    def killed_after_four(prefix, out):
        if len(appended) == 4:
            out.write(b"\x01" * 11)  # part of the next part, not recorded
            raise KeyboardInterrupt
        appended.append(prefix)
        return append(prefix, out)

    monkeypatch.setattr(indexed, "_append", killed_after_four)
    with pytest.raises(KeyboardInterrupt):
        indexed.merge_resumable(parts, str(tmp_path / "out"), np.uint16)
    assert not (tmp_path / "out.bin").exists()
    assert json.loads((tmp_path / "out.merge.json").read_text())["parts"] == 4
    appended.clear()
    monkeypatch.setattr(indexed, "_append", lambda p, out: appended.append(p) or append(p, out))
    indexed.merge_resumable(parts, str(tmp_path / "out"), np.uint16)
    assert appended == parts[4:]
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "whole")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"p{i}.{e}" for i in range(7) for e in ("bin", "idx")]
        + [f"{n}.{e}" for n in ("whole", "out") for e in ("bin", "idx")])
    # Other parts (or sizes) make the journal stale: a fresh merge, not a resumed one.
    appended.clear()
    (tmp_path / "out.merge.json").write_text(json.dumps({"source": "other", "parts": 5,
                                                         "bytes": 99}))
    indexed.merge_resumable(parts[:3], str(tmp_path / "out"), np.uint16)
    assert appended == parts[:3]


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["prefix set", "single prefix"])
def test_slurm_scripts_run_without_slurm(shards, reference, sp_model, tmp_path, layout):
    """slurm/preprocess.sbatch as SLURM would run it (array tasks, then the merge task)."""
    extra = "--append-eod" + (" --single-prefix" if layout == "single prefix" else "")
    env = subprocess_env(INPUT=str(shards), OUTPUT_PREFIX=str(tmp_path / "out"),
                         TOKENIZER_TYPE="sentencepiece", TOKENIZER_MODEL=str(sp_model),
                         EXTRA_ARGS=extra, SLURM_CPUS_PER_TASK="1",
                         **({"STEM_VENV": sys.prefix} if sys.prefix != sys.base_prefix else {}))
    for task in ("0", "1"):
        subprocess.run(["bash", "slurm/preprocess.sbatch"], cwd=ROOT, check=True, env={
            **env, "SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_COUNT": "2"},
            capture_output=True, timeout=120)
    folder = tmp_path / "out_text_document"
    if layout == "prefix set":  # each task's prefixes are there before the merge
        assert sorted(p.name for p in folder.glob("*.json")) == \
            ["group-00000-of-00002.json", "group-00001-of-00002.json"]
    subprocess.run(["bash", "slurm/preprocess_merge.sbatch"], cwd=ROOT, check=True, env=env,
                   capture_output=True, timeout=120)
    if layout == "prefix set":
        assert [p["name"] for p in manifest_of(folder)["prefixes"]] == \
            ["00000-00000", "00001-00000"]
        assert joined_bytes(folder, tmp_path) == reference
    else:
        assert output_bytes(folder) == reference


@pytest.mark.parametrize("single_prefix", [True, False])
def test_outputs_among_the_inputs_are_not_read_back(tmp_path, sp_model, tok, single_prefix):
    # The input shares the output's name: it is read; our outputs beside it are not (the
    # prefix set's folder holds JSON files).
    write(tmp_path / "out.jsonl", jsonl_bytes([{"text": "only document"}]))
    for _ in range(2):  # the second run sees out.stats.json (a .json) in the input folder
        stats = run([tmp_path], tmp_path / "out", sp_model, keep_parts=True,
                    single_prefix=single_prefix)
    assert stats["shards"] == 1
    (prefix,) = stats["prefixes"]["text"]
    assert read_documents(prefix["prefix"]) == expected_ids(tok, ["only document"])


def test_a_failed_chunk_leaves_its_file_unfinished(tmp_path, sp_model, monkeypatch):
    """A chunk fails while another of the same file is still running: the run stops with
    the chunk's error, and the file is not marked done (a rerun redoes the chunk)."""
    from megatron_stem.data import worker

    tokenize = worker.tokenize_chunk

    def second_lingers_last_fails(chunk, *args, **kw):
        if chunk.index == 2:
            time.sleep(0.2)
            raise BadRecord("in.jsonl:150: bad_json: made up")
        time.sleep(1.0 if chunk.index == 1 else 0)  # finishes after the failure is seen
        return tokenize(chunk, *args, **kw)

    monkeypatch.setattr(worker, "tokenize_chunk", second_lingers_last_fails)
    write(tmp_path / "in.jsonl", jsonl_bytes({"text": f"document {i}"} for i in range(200)))
    with pytest.raises(BadRecord, match="made up"):
        run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, workers=3, chunk_bytes=2000,
            tokenizer_backend="gigatoken")
    assert not list(tmp_path.glob("out.parts/*/done.json"))
    monkeypatch.undo()
    stats = run([tmp_path / "in.jsonl"], tmp_path / "out", sp_model, chunk_bytes=2000)
    assert stats["documents"] == 200 and stats["this_run"]["chunks_resumed"] == 2
