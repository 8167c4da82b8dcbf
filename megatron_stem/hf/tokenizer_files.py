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
from dataclasses import dataclass
from pathlib import Path

from megatron_stem.errors import UserError
from megatron_stem.tokenizer import HuggingFaceTokenizer, Tokenizer, load_tokenizer


@dataclass
class TokenizerFiles:
    tokenizer: Tokenizer  # as training loads it: the export's special ids are the same
    files: dict[str, Path]  # name in the export -> file to copy
    config: dict  # tokenizer_config.json

    @property
    def source(self) -> str:
        return self.tokenizer.path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def special_ids(self) -> dict[str, int | None]:
        """bos/eos/pad_token_id for config.json and generation_config.json."""
        t = self.tokenizer
        return {"bos_token_id": t.bos, "eos_token_id": t.eod, "pad_token_id": t.pad}


def inspect(path: str | Path) -> TokenizerFiles:
    """What an export of the tokenizer at `path` writes; a UserError if it is unusable."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.suffix == ".model":
        tok = load_tokenizer("sentencepiece", path)
        return TokenizerFiles(tok, {"tokenizer.model": path},
                              {"tokenizer_class": "SentencePieceBackend",
                               **tok.special_tokens()})
    if path.suffix == ".json":
        tok = load_tokenizer("huggingface", path)
        # The config beside it as it is, with the special tokens it leaves unsaid filled in
        # as training found them (by their usual names).
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.config}
        for name, token in tok.special_tokens().items():
            if config.get(name) is None:
                config[name] = token
        return TokenizerFiles(tok, _huggingface_files(tok), config)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    raise UserError(f"{path}: --tokenizer takes a SentencePiece .model or a Hugging Face "
                    "tokenizer.json")


def _huggingface_files(tok: HuggingFaceTokenizer) -> dict[str, Path]:
    files = {"tokenizer.json": tok.file}
    if tok.config:  # a tokenizer_config.json beside it: ship what goes with it
        for extra in ("special_tokens_map.json", "chat_template.jinja"):
            if (tok.file.parent / extra).is_file():
                files[extra] = tok.file.parent / extra
    return files


def write(tok: TokenizerFiles, folder: Path, model_max_length: int) -> None:
    for name, source in tok.files.items():
        shutil.copyfile(source, folder / name)
    config = {**tok.config, "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
