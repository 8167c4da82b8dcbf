"""Tokenizer files of an export: a SentencePiece `.model` or a Hugging Face `tokenizer.json`.

The HF tokenizer must encode exactly as training did, and add no special tokens (training
data gets none but an optional end-of-document token). So a SentencePiece model is shipped
as itself with transformers' `SentencePieceBackend`, which calls the sentencepiece library:
`LlamaTokenizer` would convert it to a BPE tokenizer with Llama's whitespace rules, which
silently re-tokenizes unigram models (and some BPE ones) differently.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_stem.errors import UserError

# Special tokens of a tokenizer.json without a tokenizer_config.json, by their usual names.
_USUAL = {"eos_token": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
          "bos_token": ("<|begin_of_text|>", "<s>", "<bos>"),
          "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
          "unk_token": ("<unk>", "[UNK]")}


@dataclass
class TokenizerFiles:
    source: Path
    vocab_size: int
    files: dict[str, Path]  # name in the export -> file to copy
    config: dict = field(default_factory=dict)  # tokenizer_config.json
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None


def inspect(path: str | Path) -> TokenizerFiles:
    """What an export of the tokenizer at `path` writes; a UserError if it is unusable."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    if path.suffix == ".model":
        return _sentencepiece(path)
    if path.suffix == ".json":
        return _huggingface(path)
    raise UserError(f"{path}: --tokenizer takes a SentencePiece .model or a Hugging Face "
                    "tokenizer.json")


def _sentencepiece(path: Path) -> TokenizerFiles:
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise UserError(f"{path}: not a SentencePiece model ({e})") from None
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
    config = {"tokenizer_class": "SentencePieceBackend"}
    config.update({f"{k}_token": sp.id_to_piece(i) for k, i in ids.items() if i >= 0})
    # SentencePiece answers -1 for a special token the model was trained without.
    known = {k: (i if i >= 0 else None) for k, i in ids.items()}
    return TokenizerFiles(path, sp.get_piece_size(), {"tokenizer.model": path}, config,
                          known["bos"], known["eos"], known["pad"])


def _huggingface(path: Path) -> TokenizerFiles:
    import tokenizers

    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises plain Exceptions on bad JSON
        raise UserError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
    files = {"tokenizer.json": path}
    beside = path.parent / "tokenizer_config.json"
    if beside.is_file():
        try:
            config = json.loads(beside.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{beside}: not valid JSON ({e})") from None
        for extra in ("special_tokens_map.json", "chat_template.jinja"):
            if (path.parent / extra).is_file():
                files[extra] = path.parent / extra
    else:
        vocab = tok.get_vocab(with_added_tokens=True)
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, candidates in _USUAL.items():
            found = next((t for t in candidates if t in vocab), None)
            if found is not None:
                config[name] = found

    def token_id(name: str) -> Optional[int]:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken written out in full
            token = token.get("content")
        return tok.token_to_id(token) if isinstance(token, str) else None

    return TokenizerFiles(path, tok.get_vocab_size(with_added_tokens=True), files, config,
                          token_id("bos_token"), token_id("eos_token"), token_id("pad_token"))


def check_vocab(tok: TokenizerFiles, vocab_size: int) -> None:
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"{tok.source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size "
            f"is {vocab_size}: not this model's tokenizer (its ids would index past the "
            "embedding and the STEM tables)")


def write(tok: TokenizerFiles, folder: Path, model_max_length: int) -> None:
    for name, source in tok.files.items():
        shutil.copyfile(source, folder / name)
    config = {**tok.config, "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
