"""gigatoken gives exactly the reference libraries' ids (sentencepiece, tokenizers), and the
native (Arrow) parsing of chunks gives exactly the per-record readers' documents and
skips: on the shipped corpus and on text made to break them."""

import gzip
import json
import random
import re
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.processes import CORPUS
from megatron_stem.data.columns import WHITESPACE, chunk_columns
from megatron_stem.data.encoders import (GigatokenEncoder, ReferenceEncoder, first_difference,
                                         load_encoder)
from megatron_stem.data.preprocess import PreprocessConfig, preprocess
from megatron_stem.data.readers import Skip, find_shards, iter_records, read_chunks
from megatron_stem.runtime.errors import UserError
from megatron_stem.data.tokenizer import load_tokenizer


def _plane_samples() -> str:
    """Characters from each of the 17 Unicode planes: assigned, unassigned, private use,
    noncharacters (no surrogates: they are not text)."""
    chars = []
    for plane in range(17):
        base = plane << 16
        chars += [chr(base + o) for o in (0x0, 0x41, 0x3A9, 0x4E2D, 0xE000, 0xFDD0, 0xFFFD,
                                          0xFFFE, 0xFFFF) if not 0xD800 <= base + o < 0xE000]
    return "".join(chars)


ADVERSARIAL = [
    "", " ", "\t\n\r\x0b\x0c", "\u3000\u2028\xa0\x85", "  leading and trailing  ",
    _plane_samples(),
    "".join(map(chr, range(0x20))) + "\x7f" + "".join(map(chr, range(0x80, 0xA0))),
    "a" * (1 << 20),  # a 1 MB run of one token
    " " * (1 << 20),
    "\U0001F680" * (1 << 18),  # 1 MB of one 4-byte character (byte fallback on every one)
    "ab" * (1 << 19),
    "</s> <s> <unk> <pad> <|endoftext|> [PAD] <|end_of_text|>",  # special tokens' names
    "\ufb01 \u2460 \uff21\uff22 e\u0301 \u212b \u00c5 \u1e9b\u0323",  # normalization bait
    "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 \U0001F469\u200d\U0001F4BB",
    "line\r\nbreaks\rand\nmore", "\x00", "tab\tseparated\tvalues", "\ufeffbom first",
    "12345678901234567890 3.14159 0x1F 1e-9", "日本語のテキストと English mixed",
]


def corpus_texts_all() -> list:
    with gzip.open(CORPUS) as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module", params=["sentencepiece", "huggingface"])
def tokenizer(request, sp_model, hf_tokenizer):
    model = sp_model if request.param == "sentencepiece" else hf_tokenizer
    return load_tokenizer(request.param, model)


@pytest.fixture(scope="module")
def encoders(tokenizer):
    """(gigatoken, reference) encoders of `tokenizer`."""
    encoder, note = load_encoder(tokenizer, "gigatoken")
    assert isinstance(encoder, GigatokenEncoder) and note is None
    return encoder, ReferenceEncoder(tokenizer)


def assert_same_ids(encoders, texts: list) -> None:
    encoder, reference = encoders
    assert first_difference(encoder, reference, texts) is None
    # ... and through Arrow, as the fast path hands texts over.
    flat, lengths = encoder.encode(pa.array(texts, pa.string()).slice(1))
    ref_flat, ref_lengths = reference.encode(texts[1:])
    assert np.array_equal(lengths, ref_lengths) and np.array_equal(flat, ref_flat)


# Minutes of the reference libraries' time on a busy machine: not in the unit subset.
@pytest.mark.integration
def test_same_ids_on_the_shipped_corpus(encoders):
    assert_same_ids(encoders, corpus_texts_all())


@pytest.mark.integration
def test_same_ids_on_adversarial_text(encoders):
    assert_same_ids(encoders, ADVERSARIAL)
    for text in ADVERSARIAL:  # one by one too: nothing depends on the batch's other texts
        assert_same_ids(encoders, ["x", text])


def test_first_difference_finds_the_document_and_token(tokenizer):
    class OffByOne(ReferenceEncoder):
        def encode(self, texts):
            flat, lengths = super().encode(texts)
            flat = flat.copy()
            flat[lengths[0] + 2] += 1  # the third token of the second document
            return flat, lengths

    texts = ["first document here", "second document is longer than three tokens"]
    doc, token, ours, theirs = first_difference(OffByOne(tokenizer), ReferenceEncoder(tokenizer),
                                                texts)
    assert (doc, token) == (1, 2) and ours[0] == theirs[0] + 1


# --- the pipeline with each backend ------------------------------------------------------


def _run(tmp_path, inputs, kind, model, backend, **kw):
    return preprocess(PreprocessConfig(
        inputs=[str(i) for i in inputs], output_prefix=str(tmp_path / backend / "out"),
        tokenizer_type=kind, tokenizer_model=model, append_eod=True,
        tokenizer_backend=backend, single_prefix=True, **kw), log=None)


def _outputs(stats) -> tuple:
    prefix = stats["outputs"]["text"]
    return (open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read(),
            stats["skipped"], stats["first_errors"])


ADVERSARIAL_JSONL = b"".join([
    b'{"text": "plain"}\n',
    b'{"text": "lone \\ud800 surrogate"}\n',  # valid JSON, not text: bad_utf8
    b'{"text": "a pair \\ud83d\\ude80 is fine"}\n',
    b'{"text": "low \\udc00 alone"}\n',
    b'{"text": "invalid \xff utf-8"}\n',
    b'{"id": "\xc3\x28", "text": "bad UTF-8 in another field"}\n',
    b'{"text": ""}\n', b'{"text": " \\t\\u3000 "}\n', b'\n', b'   \n',
    b'{"text": "control \\u0000\\u0001\\u001f chars"}\n',
    b'{"text": "raw control \x01 char"}\n',
    b'{"text": 5}\n', b'{"text": null}\n', b'{"title": "no text"}\n', b'[1, 2]\n',
    b'{"text": "two"} {"text": "objects"}\n', b'{"text": "dup", "text": "keys"}\n',
    b'{"text": "spread\n', b'over lines"}\n', b'\xef\xbb\xbf{"text": "bom"}\n',
    b'{"text": "crlf"}\r\n', b'{"text": "nan", "x": NaN}\n', b'{"text": "trailing"} x\n',
] + [json.dumps({"text": t}).encode() + b"\n" for t in ADVERSARIAL if t.strip()])


@pytest.mark.parametrize("workers", [1, 2])
def test_both_backends_write_the_same_bytes_and_skips(tmp_path, tokenizer, workers):
    kind = "sentencepiece" if tokenizer.path.endswith(".model") else "huggingface"
    (tmp_path / "in.jsonl").write_bytes(ADVERSARIAL_JSONL)
    got = {backend: _outputs(_run(tmp_path, [tmp_path / "in.jsonl"], kind, tokenizer.path,
                                  backend, workers=workers, chunk_bytes=300))
           for backend in ("gigatoken", "reference")}
    assert got["gigatoken"] == got["reference"]
    assert got["gigatoken"][2] == {"bad_json": 7, "missing_key": 1, "not_text": 2,
                                   "bad_utf8": 4, "empty": 2}


def test_a_tokenizer_gigatoken_cannot_load_falls_back(tmp_path, corpus_texts):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for t in corpus_texts[:50] for w in t.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>"] + words)},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": corpus_texts[0]}) + "\n")
    with pytest.raises(UserError, match=r"^--tokenizer-backend gigatoken: gigatoken cannot "
                                        r"load .*tokenizer.json \(Unsupported model type"):
        _run(tmp_path, [tmp_path / "in.jsonl"], "huggingface", str(tmp_path), "gigatoken")
    stats = _run(tmp_path, [tmp_path / "in.jsonl"], "huggingface", str(tmp_path), "auto")
    assert stats["documents"] == 1 and stats["tokens"] == len(corpus_texts[0].split()) + 1
    assert stats["this_run"]["tokenizer_backend"] == "reference"


def test_verify_tokenizer_stops_a_run_on_a_difference(tmp_path, sp_model, monkeypatch):
    (tmp_path / "in.jsonl").write_bytes(b"".join(
        json.dumps({"text": f"document number {i}"}).encode() + b"\n" for i in range(50)))
    original = GigatokenEncoder.encode

    def wrong_on_the_fifth(self, texts):
        flat, lengths = original(self, texts)
        if len(lengths) >= 5:
            flat = flat.copy()
            flat[int(lengths[:4].sum())] += 1
        return flat, lengths

    monkeypatch.setattr(GigatokenEncoder, "encode", wrong_on_the_fifth)
    with pytest.raises(UserError) as error:
        _run(tmp_path, [tmp_path / "in.jsonl"], "sentencepiece", sp_model, "auto")
    message = str(error.value)
    assert "\n" not in message and re.search(
        r"^--verify-tokenizer: gigatoken's ids differ from the reference library's for "
        r".*\.model on 'text' of document 5 of .*in.jsonl chunk 0 at token 0 .*; rerun with "
        r"--tokenizer-backend reference$", message), message
    # Nothing was kept: neither the parts tokenized meanwhile nor a record of them.
    assert not list((tmp_path / "auto").glob("out.parts/*/0*"))
    # Small N: a difference after the first N documents is not looked for.
    stats = _run(tmp_path, [tmp_path / "in.jsonl"], "sentencepiece", sp_model, "auto",
                 verify_docs=4)
    assert stats["documents"] == 50


def test_the_check_runs_while_the_workers_tokenize(tmp_path, sp_model, monkeypatch):
    """The reference library encodes the run's first documents while every worker already
    tokenizes a chunk (its time is not the run's start-up), and no chunk is recorded
    before the check has passed."""
    from megatron_stem.data import worker

    (tmp_path / "in.jsonl").write_bytes(b"".join(
        json.dumps({"text": f"document number {i}"}).encode() + b"\n" for i in range(400)))
    started, tokenize = threading.Semaphore(0), worker.tokenize_chunk

    def tokenize_counted(*args, **kw):
        started.release()
        return tokenize(*args, **kw)

    reference_encode = ReferenceEncoder.encode

    def encode_once_both_workers_run(self, texts):
        for _ in range(2):
            assert started.acquire(timeout=30), "the check ran before the workers started"
        assert not list(tmp_path.glob("auto/out.parts/*/0*.json")), "recorded unchecked"
        return reference_encode(self, texts)

    monkeypatch.setattr(worker, "tokenize_chunk", tokenize_counted)
    monkeypatch.setattr(ReferenceEncoder, "encode", encode_once_both_workers_run)
    stats = _run(tmp_path, [tmp_path / "in.jsonl"], "sentencepiece", sp_model, "auto",
                 workers=2, chunk_bytes=2000)
    assert stats["documents"] == 400 and stats["chunks"] > 4


# --- native parsing vs the per-record readers --------------------------------------------


def _both_ways(path, keys=("text",), chunk_bytes=1 << 20):
    """Per chunk: (native documents and skips or None, per-record documents and skips)."""
    shards, _ = find_shards([str(path)])
    for chunk in read_chunks(shards[0], keys, chunk_bytes):
        assert not isinstance(chunk, Skip)
        records = list(iter_records(chunk, keys))
        per_record = ([[r[i] for r in records if not isinstance(r, Skip)]
                       for i in range(len(keys))], [r for r in records if isinstance(r, Skip)])
        columns = chunk_columns(chunk, keys)
        native = None if columns is None else ([c.to_pylist() for c in columns.texts],
                                               columns.skips)
        yield native, per_record


def test_native_parsing_takes_clean_chunks_and_agrees(tmp_path, corpus_texts):
    lines = [json.dumps({"id": i, "text": t}, ensure_ascii=i % 2 == 0).encode()
             for i, t in enumerate(corpus_texts)]
    lines[7] = b'{"id": 7, "text": ""}'  # empty and blank texts stay on the fast path
    lines[9] = b'{"text": " \\u3000\\n", "id": 9}'
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    chunks = list(_both_ways(tmp_path / "in.jsonl", chunk_bytes=50_000))
    assert len(chunks) > 3
    for native, per_record in chunks:
        assert native == per_record
    assert chunks[0][1][1] == [Skip(8, "empty", "'text' is empty"),
                               Skip(10, "empty", "'text' is empty")]


@pytest.mark.parametrize("line", [line for line in ADVERSARIAL_JSONL.split(b"\n")[1:25]])
def test_native_parsing_never_disagrees_with_the_per_record_readers(tmp_path, line):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "first"}\n' + line + b'\n{"text": "last"}\n')
    for native, per_record in _both_ways(tmp_path / "in.jsonl"):
        assert native is None or native == per_record


def test_native_parquet_agrees(tmp_path, corpus_texts):
    texts = corpus_texts[:300]
    texts[5], texts[6] = "", "\u2003"
    pq.write_table(pa.table({"title": [t[:10] for t in texts], "text": texts}),
                   tmp_path / "in.parquet", row_group_size=50)
    chunks = list(_both_ways(tmp_path / "in.parquet", ("title", "text"), chunk_bytes=1))
    assert len(chunks) == 6 and all(native is not None for native, _ in chunks)
    for native, per_record in chunks:
        assert native == per_record
    pq.write_table(pa.table({"text": [b"binary"] * 3}), tmp_path / "bytes.parquet")
    assert [native for native, _ in _both_ways(tmp_path / "bytes.parquet")] == [None]


def test_blank_means_what_python_calls_whitespace():
    assert set(WHITESPACE) == {c for c in map(chr, range(0x110000)) if c.isspace()}


def test_native_parsing_finds_the_blank_texts_python_finds(tmp_path):
    """Blank texts are found by their first byte, then by Python on a head of 256 bytes
    (then on the whole text): whitespace runs across that head, characters cut by it,
    non-blank characters that share a first byte with whitespace ones."""
    rng = random.Random(0)
    near = "b\u00e9\u00a9\u2019\u1681\u3001\u4e2d\U0001F680"  # first bytes of blanks
    texts = [pad * n + c for pad in (" ", "\u3000", "\n\u2003") for n in (1, 85, 86, 128, 300)
             for c in ("", "b", "\u00e9", "\u3000", "\u2019")]
    texts += ["".join(rng.choice(WHITESPACE + near) for _ in range(rng.randint(1, 300)))
              for _ in range(1000)]
    texts += ["".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 400)))
              for _ in range(300)]
    (tmp_path / "in.jsonl").write_bytes(b"".join(
        json.dumps({"text": t}, ensure_ascii=i % 2 == 0).encode() + b"\n"
        for i, t in enumerate(texts)))
    chunks = list(_both_ways(tmp_path / "in.jsonl", chunk_bytes=20_000))
    assert len(chunks) > 3 and all(native is not None for native, _ in chunks)
    for native, per_record in chunks:
        assert native == per_record
    skipped = sum(len(native[1]) for native, _ in chunks)
    assert skipped == sum(t.isspace() for t in texts) > 300


def test_a_reloaded_encoder_gives_the_same_ids(tokenizer, corpus_texts):
    """The encoder reloads itself when memory grows (its cache): here after every batch."""
    encoder, _ = load_encoder(tokenizer, "gigatoken")
    encoder.cache_limit = -1 << 40
    reference = ReferenceEncoder(tokenizer)
    for i in range(0, 600, 200):
        assert first_difference(encoder, reference, corpus_texts[i:i + 200]) is None
    assert encoder.reloads == 3


def test_native_txt_agrees(tmp_path, corpus_texts):
    lines = [t.replace("\n", " ") for t in corpus_texts[:300]]
    lines[3:8] = ["", "  \t", "\r", "crlf line\r", "two\r\r"]
    lines[9] = "\u3000 not blank to the per-record reader either"
    (tmp_path / "in.txt").write_bytes("\n".join(lines).encode() + b"\n\n \n")
    (tmp_path / "end.txt").write_bytes(b"no newline at the end")
    for name in ("in.txt", "end.txt"):
        chunks = list(_both_ways(tmp_path / name, chunk_bytes=5000))
        assert all(native is not None for native, _ in chunks)
        for native, per_record in chunks:
            assert native == per_record
    (tmp_path / "bad.txt").write_bytes(b"fine\nnot \xff utf-8\n")
    assert [native for native, _ in _both_ways(tmp_path / "bad.txt")] == [None]
