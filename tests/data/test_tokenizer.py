"""megatron_stem.data.tokenizer (local SentencePiece / Hugging Face files) and the tokenizer
trainer (tools/train_tokenizer.py)."""

import json
import subprocess
import sys

import pytest

from support.processes import CORPUS, ROOT, UNICODE_DOCS
from megatron_stem.data.tokenizer_training import (SPECIAL_IDS, TokenizerTrainingConfig,
                                                   sample_documents)
from megatron_stem.runtime.errors import UserError
from megatron_stem.data.tokenizer import load_tokenizer


def test_sentencepiece_interface_and_round_trip(sp_model, corpus_texts):
    tok = load_tokenizer("sentencepiece", sp_model)
    assert tok.vocab_size == 1000
    assert (tok.eod, tok.bos, tok.pad) == (SPECIAL_IDS["eos"], SPECIAL_IDS["bos"],
                                           SPECIAL_IDS["pad"])
    texts = corpus_texts[:50] + UNICODE_DOCS
    batch = tok.encode_batch(texts)
    assert batch == [tok.encode(t) for t in texts]
    # Identity normalization, whitespace kept and byte fallback: text survives exactly.
    assert [tok.decode(ids) for ids in batch] == texts
    assert all(0 <= i < tok.vocab_size for ids in batch for i in ids)
    assert json.loads(json.dumps(tok.unique_identifiers))["vocab_size"] == 1000


def test_megatron_tokenizer_names(sp_model):
    for name in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"):
        assert load_tokenizer(name, sp_model).encode("a word") == \
            load_tokenizer("sentencepiece", sp_model).encode("a word")


def test_huggingface_tokenizer_json(hf_tokenizer, corpus_texts, tmp_path):
    tok = load_tokenizer("huggingface", hf_tokenizer)  # the folder
    same = load_tokenizer("HuggingFaceTokenizer", f"{hf_tokenizer}/tokenizer.json")
    assert tok.vocab_size == same.vocab_size == 600
    # No tokenizer_config.json: special tokens found by their usual names.
    assert (tok.eod, tok.bos, tok.pad) == (0, 0, 1)  # GPT-2 style: <|endoftext|> for both
    texts = corpus_texts[:50] + UNICODE_DOCS
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert [tok.decode(tok.encode(t)) for t in texts] == texts

    # A tokenizer_config.json beside it decides.
    (tmp_path / "tokenizer.json").write_text(open(f"{hf_tokenizer}/tokenizer.json").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<pad>"}, "bos_token": None, "pad_token": "<|endoftext|>"}))
    tok = load_tokenizer("huggingface", tmp_path)
    assert (tok.eod, tok.pad) == (1, 0)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</nope>"}))
    with pytest.raises(UserError, match=r"tokenizer_config.json: eos_token '</nope>' is not"):
        load_tokenizer("huggingface", tmp_path)


def test_bad_tokenizer_files_name_the_file(tmp_path, sp_model):
    with pytest.raises(UserError, match=r"^/nope/x.model: SentencePiece model not found$"):
        load_tokenizer("sentencepiece", "/nope/x.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(UserError, match=r"junk.model: not a SentencePiece model"):
        load_tokenizer("sentencepiece", junk)
    with pytest.raises(UserError, match=r"tokenizer.json not found"):
        load_tokenizer("huggingface", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match=r"tokenizer.json: not a Hugging Face tokenizer.json"):
        load_tokenizer("huggingface", tmp_path)
    with pytest.raises(UserError, match=r"tokenizer type 'gpt2': expected one of"):
        load_tokenizer("gpt2", sp_model)


def test_sample_is_bounded_uniform_and_seeded(tmp_path):
    docs = [{"text": f"document number {i}"} for i in range(1000)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:600]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[600:])
                                      + "{bad json\n")
    sample, counts = sample_documents([str(tmp_path)], ["text"], 100, seed=7)
    again, _ = sample_documents([str(tmp_path)], ["text"], 100, seed=7)
    assert len(sample) == 100 and sample == again
    assert counts == {"seen": 1000, "bad_json": 1}
    # Drawn from everywhere, not the first 100 documents.
    assert max(int(t.split()[-1]) for t in sample) > 600


@pytest.mark.integration
def test_train_tokenizer_cli(tmp_path):
    prefix = tmp_path / "tok" / "gcide"
    proc = subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", "--input", str(CORPUS),
         "--output-prefix", str(prefix), "--vocab-size", "800", "--max-docs", "2000",
         "--workers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vocab 800, eod (</s>) 2, bos 1, pad 3; trained on 2,000 of 31,560" in proc.stdout
    tok = load_tokenizer("sentencepiece", f"{prefix}.model")
    assert tok.decode(tok.encode("The quick brown fox.")) == "The quick brown fox."
    info = json.loads((tmp_path / "tok" / "gcide.json").read_text())
    assert info["documents_sampled"] == 2000 and info["config"]["vocab_size"] == 800

    proc = subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", "--input", str(tmp_path / "none*.jsonl"),
         "--output-prefix", str(prefix)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --input {tmp_path}/none*.jsonl: the pattern matches no file"]


def test_vocab_too_large_for_the_sample_is_a_user_error(tmp_path):
    from megatron_stem.data.tokenizer_training import train_sentencepiece

    (tmp_path / "a.txt").write_text("tiny corpus\nof two lines\n")
    with pytest.raises(UserError, match=r"--vocab-size 5000: sentencepiece: .*Vocabulary size"):
        train_sentencepiece(TokenizerTrainingConfig(
            inputs=[str(tmp_path / "a.txt")], output_prefix=str(tmp_path / "t"),
            vocab_size=5000), log=None)
    assert not list(tmp_path.glob("t*"))
