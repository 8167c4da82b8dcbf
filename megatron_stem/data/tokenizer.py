"""Tokenizers loaded from local files, behind one small interface.

Used by data preprocessing, the training data pipeline (megatron's dataset builders need
`vocab_size`, `eod`, `pad` and `unique_identifiers`) and the Hugging Face export. Two kinds:

- `sentencepiece`: a SentencePiece `.model` file (what `tools/train_tokenizer.py` writes);
- `huggingface`: a Hugging Face `tokenizer.json` (or a folder holding one). Its special
  tokens come from a `tokenizer_config.json` beside it when there is one, else from the
  usual names (`</s>`, `<|endoftext|>`, `<|end_of_text|>`, ...).

Nothing is ever downloaded. `encode` adds no special tokens: begin/end-of-document tokens
are the caller's decision (`--append-eod` in preprocessing).
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Sequence

from megatron_stem.runtime.errors import UserError


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer(ABC):
    """Text <-> token ids. Special ids are None when the tokenizer has no such token."""

    vocab_size: int
    eod: Optional[int]  # end of document: what --append-eod appends
    bos: Optional[int]
    pad: Optional[int]
    unk: Optional[int]
    path: str  # the file the tokenizer was loaded from

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one call into the native library (much less overhead)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        ...

    @abstractmethod
    def token(self, token_id: int) -> str:
        """The vocabulary entry (piece) of one id."""

    def special_tokens(self) -> dict[str, str]:
        """{"eos_token": "</s>", ...}: the special tokens this tokenizer has, in the names
        of a Hugging Face tokenizer_config.json."""
        ids = {"eos_token": self.eod, "bos_token": self.bos, "pad_token": self.pad,
               "unk_token": self.unk}
        return {name: self.token(i) for name, i in ids.items() if i is not None}

    @property
    def unique_identifiers(self) -> dict:
        """What identifies this tokenizer's output: megatron keys its dataset caches on it.

        The file's hash is included so a retrained model at the same path never reuses
        caches (or preprocessing parts) made with the old one.
        """
        return {"class": type(self).__name__, "path": self.path,
                "sha256": self._sha256, "vocab_size": self.vocab_size}

    def __init__(self, path: str, hashed_files: Sequence[Path]):
        self.path = path
        self._sha256 = "+".join(file_sha256(p) for p in hashed_files)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str):
        import sentencepiece

        model = Path(path)
        if not model.is_file():
            raise UserError(f"{path}: SentencePiece model not found")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as e:
            raise UserError(f"{path}: not a SentencePiece model ({e})") from None
        super().__init__(str(model.resolve()), [model])
        self.vocab_size = self._sp.vocab_size()
        # SentencePiece answers -1 for a special token the model was trained without.
        self.eod, self.bos, self.pad, self.unk = (
            i if i >= 0 else None for i in (self._sp.eos_id(), self._sp.bos_id(),
                                             self._sp.pad_id(), self._sp.unk_id()))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: callers parallelize over processes (preprocessing has one per worker).
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(map(int, ids)))

    def token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


# Special tokens by their usual names, tried in order when no tokenizer_config.json says.
_HF_DEFAULTS = {
    "eos_token": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
    "bos_token": ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
    "unk_token": ("<unk>", "[UNK]"),
}


class HuggingFaceTokenizer(Tokenizer):
    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise UserError("huggingface tokenizers need the `tokenizers` package "
                            "(pip install -r requirements.txt)") from None

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise UserError(f"{path}: Hugging Face tokenizer.json not found")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises plain Exceptions on bad JSON
            raise UserError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
        config_file = file.parent / "tokenizer_config.json"
        config = self._read_config(config_file) if config_file.is_file() else {}
        self.file, self.config = file, config
        super().__init__(str(file.resolve()),
                         [file] + ([config_file] if config_file.is_file() else []))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod, self.bos, self.pad, self.unk = (
            self._special(config, name, config_file)
            for name in ("eos_token", "bos_token", "pad_token", "unk_token"))
        # encode_batch_fast skips computing character offsets we never use (tokenizers>=0.20).
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    @staticmethod
    def _read_config(path: Path) -> dict:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise UserError(f"{path}: expected a JSON object")
        return config

    def _special(self, config: dict, name: str, config_file: Path) -> Optional[int]:
        if config.get(name) is not None:
            token = config[name]
            token = token.get("content") if isinstance(token, dict) else token
            token_id = self._tok.token_to_id(token) if isinstance(token, str) else None
            if token_id is None:
                raise UserError(f"{config_file}: {name} {token!r} is not in the vocabulary")
            return token_id
        for token in _HF_DEFAULTS[name]:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Runs on the tokenizers thread pool unless TOKENIZERS_PARALLELISM=false (which
        # preprocessing workers set: they parallelize over processes).
        return [e.ids for e in self._encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)


def check_fits(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
    """A tokenizer with more ids than the model's vocabulary is another model's: its ids
    would index past the embedding and the STEM tables."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {vocab_size}: not this model's tokenizer (its ids would index "
            "past the embedding and the STEM tables)")


TOKENIZER_TYPES = {"sentencepiece": SentencePieceTokenizer, "huggingface": HuggingFaceTokenizer}
# Megatron-LM's --tokenizer-type names for the same files, so its users' commands keep working.
_MEGATRON_NAMES = {"SentencePieceTokenizer": "sentencepiece",
                   "GPTSentencePieceTokenizer": "sentencepiece",
                   "Llama2Tokenizer": "sentencepiece",
                   "HuggingFaceTokenizer": "huggingface"}


# Where a missing tokenizer file comes from, for errors about one.
WHERE_TO_GET = ("the Llama-3 recipes use meta-llama/Llama-3.2-1B's from the Hugging Face hub: "
                "hf download meta-llama/Llama-3.2-1B tokenizer.json tokenizer_config.json "
                "--local-dir tokenizers/llama3; or train a SentencePiece model with "
                "tools/train_tokenizer.py and set tokenizer_type: sentencepiece")


def load_setting(setting: str, tokenizer_type: str, path: str | os.PathLike) -> Tokenizer:
    """`load_tokenizer` for a config setting: an error names the setting to change, and
    where to get the file when it is missing."""
    try:
        return load_tokenizer(tokenizer_type, path)
    except UserError as e:
        hint = "" if Path(path).exists() else f" ({WHERE_TO_GET})"
        raise UserError(f"{setting}: {e}{hint}") from None


def load_tokenizer(tokenizer_type: str, path: str | os.PathLike) -> Tokenizer:
    """`tokenizer_type` is `sentencepiece` or `huggingface` (or a Megatron-LM alias)."""
    kind = _MEGATRON_NAMES.get(tokenizer_type, tokenizer_type)
    if kind not in TOKENIZER_TYPES:
        known = sorted(TOKENIZER_TYPES) + sorted(_MEGATRON_NAMES)
        raise UserError(f"tokenizer type {tokenizer_type!r}: expected one of {known}")
    return TOKENIZER_TYPES[kind](str(path))
