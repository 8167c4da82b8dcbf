"""Tokenizer files of an export: what `AutoTokenizer.from_pretrained(export)` loads.

The HF tokenizer must encode exactly as training did, decode exactly as the source
library does, add no special tokens training did not (training data gets none but an
optional end-of-document token), and load with no remote code
(`PreTrainedTokenizerFast.from_pretrained(export)`; transformers 5's `AutoTokenizer` builds
the model's config first, so it needs `trust_remote_code`: docs/export.md). So both kinds
ship as a `tokenizer.json` for transformers' built-in fast tokenizer:

- a Hugging Face `tokenizer.json` as it is, with its tokenizer_config.json;
- a SentencePiece `.model` converted by `sentencepiece_json` (checked against sentencepiece
  at export), shipped beside the original `tokenizer.model`.

transformers' decode is told not to "clean up tokenization spaces" (it would turn
`"a ."` into `"a."`): the text comes back as the tokenizer's own decoder gives it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from megatron_stem.data.tokenizer import HuggingFaceTokenizer, Tokenizer, load_tokenizer
from megatron_stem.hf import sentencepiece_json
from megatron_stem.runtime.errors import UserError

_FAST = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}


@dataclass
class TokenizerFiles:
    tokenizer: Tokenizer  # as training loads it: the export's special ids are the same
    files: dict[str, Path]  # name in the export -> file to copy
    config: dict  # tokenizer_config.json
    written: dict[str, str] = field(default_factory=dict)  # name in the export -> its text

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
        return _sentencepiece(path)
    if path.suffix == ".json":
        tok = load_tokenizer("huggingface", path)
        # The config beside it, with the special tokens it leaves unsaid filled in as
        # training found them (by their usual names).
        config = {**tok.config, **_FAST}
        for name, token in tok.special_tokens().items():
            if config.get(name) is None:
                config[name] = token
        return TokenizerFiles(tok, _huggingface_files(tok), config)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    raise UserError(f"{path}: --tokenizer takes a SentencePiece .model or a Hugging Face "
                    "tokenizer.json")


def _sentencepiece(path: Path) -> TokenizerFiles:
    tok = load_tokenizer("sentencepiece", path)
    converted = sentencepiece_json.convert(path)
    sentencepiece_json.check_same(path, converted)
    # sentencepiece never reads "</s>" in text as the control token: neither may the export.
    config = {**_FAST, "split_special_tokens": True, **tok.special_tokens()}
    return TokenizerFiles(tok, {"tokenizer.model": path}, config,
                          {"tokenizer.json": converted.to_str(pretty=True)})


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
    for name, text in tok.written.items():
        (folder / name).write_text(text, encoding="utf-8")
    config = {**tok.config, "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
