"""megatron-stem checkpoint -> Hugging Face model folder, one tensor at a time: a STEM
model with its model code (remote code), a dense one as transformers' LlamaForCausalLM.

Any checkpoint this project writes converts, whatever TP/PP/DP layout saved it: the model
part is a layout-free dist checkpoint (see `dist_io`). Every tensor of the checkpoint must
be claimed by the name map and every mapped tensor must be present with its expected
shape, so nothing is dropped or invented silently. The export is written into
`<output>.tmp` and renamed into place when complete.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import yaml

from megatron_stem import checkpoint
from megatron_stem.checkpoint.streaming import CheckpointReader
from megatron_stem.config import ModelConfig
from megatron_stem.data.tokenizer import check_fits
from megatron_stem.hf import names, tokenizer_files
from megatron_stem.hf.safetensors_io import (
    Entry,
    ShardWriter,
    plan_shards,
    shard_name,
    write_index,
)
from megatron_stem.model import rope_scaling, row_cache
from megatron_stem.runtime import durable
from megatron_stem.runtime.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportWarning(UserWarning):
    """Worth telling the user, not worth refusing the export for."""

REMOTE_DIR = Path(__file__).resolve().parent / "remote"
# Model-code files that are the training model's own modules.
_SHARED = {"row_cache.py": row_cache, "rope_scaling.py": rope_scaling}
DEFAULT_SHARD_BYTES = 5 * 2**30


def read_model_config(ckpt: Path) -> ModelConfig:
    """The model shape a checkpoint folder was saved with, or a UserError naming the problem."""
    recipe_file = ckpt / checkpoint.RECIPE
    if not recipe_file.is_file() or not (ckpt / checkpoint.MODEL).is_dir():
        raise UserError(f"{ckpt}: not a megatron-stem checkpoint (no {checkpoint.RECIPE} or "
                        f"{checkpoint.MODEL}/)")
    try:
        return checkpoint.read_recipe(ckpt).model
    except (UserError, yaml.YAMLError) as e:
        raise UserError(f"{recipe_file}: {e}") from None


def first_of(items: list[str]) -> str:
    """'x' or 'x (and 3 more)': an error names one culprit and counts the rest."""
    return items[0] + (f" (and {len(items) - 1} more)" if len(items) > 1 else "")


def check_tensors(reader: CheckpointReader, maps: list[names.TensorMap]) -> None:
    """Every checkpoint tensor is mapped and every mapped tensor is there, with its shape."""
    expected = {t.megatron: t.megatron_shape for t in maps}
    where = reader.folder
    missing = sorted(set(expected) - reader.keys())
    if missing:
        raise UserError(f"{where}: missing {first_of(missing)}: the checkpoint does not "
                        "match its recipe.yaml")
    unknown = sorted(reader.keys() - set(expected))
    if unknown:
        raise UserError(f"{where}: no Hugging Face name for {first_of(unknown)}: not a model "
                        "megatron-stem can export")
    for key, shape in expected.items():
        if reader.shape(key) != shape:
            raise UserError(f"{where}: {key} has shape {reader.shape(key)}, the recipe implies "
                            f"{shape}")


def export(checkpoint_dir: str | Path, output: str | Path, dtype: Optional[str] = None,
           tokenizer: Optional[str | Path] = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Convert a checkpoint (a save dir, following `latest`, or an iter_N folder) into an HF
    model folder at `output`. `dtype`: "bf16" or "fp32"; None keeps the stored dtype."""
    ckpt = checkpoint.resolve(checkpoint_dir)
    model = read_model_config(ckpt)
    reader = CheckpointReader(ckpt / checkpoint.MODEL)
    maps = names.tensor_map(model)
    check_tensors(reader, maps)
    tok = tokenizer_files.inspect(tokenizer) if tokenizer else None
    if tok is not None:
        check_fits(tok.tokenizer, model.vocab_size, tok.source)
        if tok.vocab_size < model.vocab_size:
            warnings.warn(f"{tok.source}: the tokenizer has {tok.vocab_size} tokens, fewer than "
                          f"the model's vocab_size {model.vocab_size}", ExportWarning)
    output = Path(output)
    if output.exists():
        raise UserError(f"{output}: already exists; remove it or choose another --output")
    out_dtype = DTYPES[dtype] if dtype else reader.dtype(maps[0].megatron)

    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed export
    tmp.mkdir(parents=True)
    try:
        _write_weights(reader, maps, tmp, out_dtype, max_shard_bytes)
        write_model_files(tmp, model, str(out_dtype).removeprefix("torch."), tok)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        if not durable.full(tmp.parent, e):
            raise
        raise UserError(f"no space left on device writing {output} (about "
                        f"{_export_bytes(reader, maps, out_dtype) / 1e9:.1f} GB); nothing was "
                        "kept: free space, or choose another --output") from None
    tmp.rename(output)
    return output


def _export_bytes(reader: CheckpointReader, maps, dtype: torch.dtype) -> int:
    """What the export's weights take on disk."""
    return sum(math.prod(reader.shape(key)) for key in {m.megatron for m in maps}) * \
        dtype.itemsize


def write_model_files(folder: Path, model: ModelConfig, dtype: str,
                      tok: Optional[tokenizer_files.TokenizerFiles]) -> None:
    """Everything of an export but its weights: config.json, the model code (a STEM
    model's; a dense one is transformers' own Llama) and, with a tokenizer, its files and
    generation_config.json."""
    config = names.hf_config(model, dtype)
    if tok is not None:
        tokenizer_files.write(tok, folder, model.seq_length)
        special = tok.special_ids()
        config.update(special)
        (folder / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in names.REMOTE_FILES if model.is_stem else ():
        shutil.copyfile(_remote_source(name), folder / name)


def _remote_source(name: str) -> Path:
    """The file an export's model-code file `name` is copied from: hf/remote/'s, but the
    modules shared with the training model are copied from model/ (hf/remote/ only
    re-exports them in the package)."""
    return Path(_SHARED[name].__file__) if name in _SHARED else REMOTE_DIR / name


def _write_weights(reader: CheckpointReader, maps: list[names.TensorMap], folder: Path,
                   dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Stream every tensor into shards: read one megatron tensor, write its HF parts."""
    groups = [[Entry(n, s, dtype) for n, s in zip(t.hf, t.hf_shapes)] for t in maps]
    plan = plan_shards(groups, max_shard_bytes)
    shards = [[e for i in members for e in groups[i]] for members in plan]
    for index, members in enumerate(plan):
        with ShardWriter(folder / shard_name(index, len(plan)), shards[index]) as writer:
            for t in (maps[i] for i in members):
                for name, part in zip(t.hf, t.to_hf(reader.read(t.megatron))):
                    writer.write(name, part.to(dtype))
    write_index(folder, shards)
