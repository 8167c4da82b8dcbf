"""Hugging Face model folder (a megatron-stem export, or a dense LlamaForCausalLM) ->
megatron-stem checkpoint. A Llama becomes a dense model (`stem_layers: none`) of the same
shape: tied embeddings as `untie_embeddings: false`, its RoPE base and llama3 scaling.

Writes `<save_dir>/iter_N/` in the project's layout (recipe.yaml, a model dist checkpoint,
COMPLETE, `latest`), one tensor at a time, so `checkpoint.load_model` loads it at any
TP/PP layout, e.g. to continue training. Only the model part is written: there is no
optimizer state or train_state.pt, so a run starts its optimizer and data order afresh.

Tensors are stored in the dtype of the HF weights: exporting the import again gives the
same HF tensors bit for bit. Vocab padding rows (which HF does not have) are zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_stem import checkpoint
from megatron_stem.checkpoint.streaming import write_checkpoint
from megatron_stem.config import Recipe
from megatron_stem.hf import names
from megatron_stem.hf.export import first_of
from megatron_stem.hf.safetensors_io import ShardedReader
from megatron_stem.runtime.errors import UserError


def read_hf_config(hf_dir: Path) -> dict:
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise UserError(f"{hf_dir}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(config_file.read_text())
    except ValueError as e:
        raise UserError(f"{config_file}: not valid JSON ({e})") from None


def check_tensors(reader: ShardedReader, maps: list[names.TensorMap], model, where: Path):
    expected = {n: s for t in maps for n, s in zip(t.hf, t.hf_shapes)}
    present = reader.names()
    if not model.untie_embeddings:
        present.discard("lm_head.weight")  # some HF writers keep the tied copy
    missing = sorted(set(expected) - present)
    if missing:
        raise UserError(f"{where}: missing tensor {first_of(missing)} for the shape in "
                        "config.json")
    unknown = sorted(present - set(expected))
    if unknown:
        raise UserError(f"{where}: tensor {first_of(unknown)} is not part of a megatron-stem "
                        "model")
    for name, shape in expected.items():
        if reader.entry(name).shape != shape:
            raise UserError(f"{where}: {name} has shape {reader.entry(name).shape}, config.json "
                            f"implies {shape}")


def import_hf(hf_dir: str | Path, save_dir: str | Path, step: int = 0) -> Path:
    """Convert the HF folder `hf_dir` into checkpoint `iter_<step>` under `save_dir`."""
    hf_dir = Path(hf_dir)
    model = names.model_config(read_hf_config(hf_dir), str(hf_dir / "config.json"))
    maps = names.tensor_map(model)
    reader = ShardedReader(hf_dir)
    check_tensors(reader, maps, model, hf_dir)
    save_dir = Path(save_dir)
    if (save_dir / checkpoint.iter_name(step)).exists():
        raise UserError(f"{save_dir / checkpoint.iter_name(step)}: already exists; choose "
                        "another --save-dir or --step")

    def producer(t: names.TensorMap):
        return lambda: t.to_megatron([reader.read(n) for n in t.hf]).contiguous()

    tensors = {t.megatron: (t.megatron_shape, reader.entry(t.hf[0]).dtype, producer(t))
               for t in maps}
    with checkpoint.Writer(save_dir, step, Recipe(model=model)) as folder:
        write_checkpoint(folder / checkpoint.MODEL, tensors, extra_state_keys(maps))
    return save_dir / checkpoint.iter_name(step)


def extra_state_keys(maps: list[names.TensorMap]) -> list[str]:
    """megatron checkpoints an `_extra_state` object beside the weight of each decoder
    linear layer (not the output layer's); loading expects them."""
    return [t.megatron.removesuffix("weight") + "_extra_state" for t in maps
            if t.megatron.split(".")[-2].startswith("linear_")]
