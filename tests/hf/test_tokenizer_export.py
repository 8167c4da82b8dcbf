"""The tokenizer of a Hugging Face export encodes and decodes exactly as the library that
trained on its ids: sentencepiece for a `.model`, `tokenizers` for a `tokenizer.json`.

Each export is what `tools/to_hf.py` writes but the weights (`write_model_files`), loaded
with transformers' `AutoTokenizer` as a user would; texts are a sample of the shipped
corpus and strings chosen to break conversions.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, subprocess_env
from megatron_stem.config import ModelConfig
from megatron_stem.runtime.errors import UserError
from megatron_stem.hf import sentencepiece_json, tokenizer_files
from megatron_stem.hf.export import write_model_files

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

# Whitespace runs, leading/trailing spaces, tabs, newlines, accents, CJK, emoji, control
# characters, and text around (and spelling) special tokens.
ADVERSARIAL = [
    "alpha\nbeta 42 é", "  two  leading spaces", " one leading", "trailing   ", "\ttab\tand\ttabs",
    "\n\nnewlines first\n", "line\r\nbreaks\rand\x0bmore", "naïve café déjà vu — über",
    "東京は日本の首都です。", "中文 和 English 混合", "emoji 🚀🔥 and 👩‍👩‍👧 family",
    "\x00\x01\x07\x1b[31mred",
    "text</s>around<s>special <unk> tokens", "<|endoftext|>gpt<|endoftext|> <pad>",
    "a literal <0x0A> byte piece", "", " ", "    ", "a  .  b ,c", "Don't  stop ; it 's",
    "x" * 300, "1234567890 3.14159 -42",
]
# sentencepiece's unigram segmentation and the `tokenizers` Unigram model's differ on a few
# texts (see docs/export.md): a text spelling a control or byte piece (sentencepiece never
# matches those), and rare near-ties. Checked on these strings, not on the whole corpus.
UNIGRAM_EXCEPTIONS = {"text</s>around<s>special <unk> tokens", "a literal <0x0A> byte piece",
                      "<|endoftext|>gpt<|endoftext|> <pad>"}
MODEL = ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=128,
                    vocab_size=1000, seq_length=1 << 20)


def export_tokenizer(source, folder: Path) -> Path:
    """An export's files but the weights; the HF tokenizer loaded from it as users do."""
    folder.mkdir()
    write_model_files(folder, MODEL, "float32", tokenizer_files.inspect(source))
    return folder


def auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.fixture(scope="module")
def texts(corpus_texts):
    return corpus_texts[::3] + ADVERSARIAL  # 500 dictionary entries (+ the non-ASCII ones)


def assert_same_as_sentencepiece(tok, model: str, texts: list[str], encode_exact=True):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    for text in texts:
        ids = sp.encode(text)
        if encode_exact:
            assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == sp.decode(ids) == text, text
    # Special ids decode as the special tokens, the text around them as sentencepiece has it.
    ids = sp.encode("hello\n") + [sp.eos_id()] + sp.encode("world é")
    assert tok.decode(ids) == "hello\n</s> world é"
    assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids) == "hello\n world é"


def test_sentencepiece_bpe_export_is_sentencepiece(sp_model, texts, tmp_path):
    """The quickstart's kind: BPE with byte fallback, identity normalization."""
    folder = export_tokenizer(sp_model, tmp_path / "hf")
    tok = auto_tokenizer(folder)
    assert (folder / "tokenizer.model").read_bytes() == Path(sp_model).read_bytes()
    assert_same_as_sentencepiece(tok, sp_model, texts)
    assert tok.decode(tok("alpha\nbeta 42 é")["input_ids"]) == "alpha\nbeta 42 é"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory) -> str:
    from megatron_stem.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
    from support.processes import CORPUS

    prefix = tmp_path_factory.mktemp("unigram") / "gcide"
    return train_sentencepiece(TokenizerTrainingConfig(
        inputs=[str(CORPUS)], output_prefix=str(prefix), vocab_size=800, max_docs=600,
        model_type="unigram", threads=1), log=None)["model"]


def test_sentencepiece_unigram_export_decodes_as_sentencepiece(unigram_model, texts, tmp_path):
    tok = auto_tokenizer(export_tokenizer(unigram_model, tmp_path / "hf"))
    assert_same_as_sentencepiece(tok, unigram_model, texts, encode_exact=False)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=unigram_model)
    for text in set(ADVERSARIAL) - UNIGRAM_EXCEPTIONS:
        assert tok(text)["input_ids"] == sp.encode(text), text


def test_sentencepiece_models_it_cannot_reproduce_are_refused(sp_model, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(Path(sp_model).read_bytes())
    proto.trainer_spec.model_type = 3  # WORD
    (tmp_path / "word.model").write_bytes(proto.SerializeToString())
    with pytest.raises(UserError, match="converts BPE and unigram models only"):
        tokenizer_files.inspect(tmp_path / "word.model")
    # A conversion that differs from sentencepiece on a probe is refused, not shipped.
    converted = sentencepiece_json.convert(sp_model)
    converted.decoder = None
    with pytest.raises(UserError, match="cannot convert this SentencePiece model"):
        sentencepiece_json.check_same(sp_model, converted)


@pytest.fixture(scope="module")
def llama3_style(hf_tokenizer, tmp_path_factory) -> Path:
    """The byte-level BPE tokenizer.json with what Llama-3's adds: a post-processor that
    prepends BOS and a tokenizer_config.json asking transformers to clean up spaces."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("llama3_style")
    raw = Tokenizer.from_file(f"{hf_tokenizer}/tokenizer.json")
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.mark.parametrize("kind", ["plain", "llama3_style"])
def test_tokenizer_json_export_is_the_tokenizer(kind, hf_tokenizer, llama3_style, texts, tmp_path):
    from tokenizers import Tokenizer

    source = Path(hf_tokenizer) if kind == "plain" else llama3_style
    raw = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok = auto_tokenizer(export_tokenizer(source / "tokenizer.json", tmp_path / "hf"))
    for text in texts:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok(text)["input_ids"] == raw.encode(text).ids, text  # its own BOS, if any
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False) == text, text
    ids = raw.encode("a<|endoftext|>b <pad> c", add_special_tokens=False).ids
    assert tok.decode(ids) == "a<|endoftext|>b <pad> c"
    assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids) == "ab  c"


def documented_tokenizer_load() -> str:
    """docs/export.md's snippet that loads (and round-trips a text with) an exported tokenizer."""
    text = (ROOT / "docs/export.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                  if "Tokenizer" in b and "AutoModelForCausalLM" not in b]
    assert '"hf/stem_1b"' in snippet
    return snippet


AUTO_WITH_FLAG = """
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True)
print(tok.decode(tok("alpha\\nbeta 42 é")["input_ids"]))
"""


@pytest.mark.integration
def test_exported_tokenizers_load_as_documented_silently_without_a_terminal(
        sp_model, hf_tokenizer, tmp_path):
    """docs/export.md's tokenizer snippet as written (no trust_remote_code), then AutoTokenizer
    with the flag, on both kinds of export, stdin closed: no prompt (it would read EOF and
    print), no made-up URL, no model-type warning, only the round-tripped text."""
    script = []
    for name, source in (("sp", sp_model), ("hf", Path(hf_tokenizer) / "tokenizer.json")):
        folder = repr(str(export_tokenizer(source, tmp_path / name)))
        script += [documented_tokenizer_load().replace('"hf/stem_1b"', folder),
                   AUTO_WITH_FLAG.replace("FOLDER", folder)]
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(script)], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "alpha\nbeta 42 é\n" * 4
    assert proc.stderr == ""
