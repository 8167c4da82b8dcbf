"""A model to edit: input ids (+ optional per-layer STEM ids) -> logits, with readable and
writable STEM table rows. Two implementations, one contract:

- `MegatronBackend`: a megatron-stem checkpoint, loaded in this process at TP=PP=1
  (whatever layout saved it: dist checkpoints are layout-free) through the model builder
  and `checkpoint.load_model`; edits are saved as a new checkpoint (`checkpoint.Writer`).
- `HFBackend`: a Hugging Face export, loaded with `AutoModelForCausalLM` and
  `trust_remote_code`; edits are saved as a new HF folder.

`stem_ids` has the semantics of the model seam (`model/gpt.py`): [b, s] for every STEM
layer or [num_layers, b, s] with one row per global layer. Logits cover the real
vocabulary only (megatron's TP padding columns are not tokens).
"""

from __future__ import annotations

import inspect
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_stem.config import ModelConfig
from megatron_stem.runtime.errors import UserError


class Backend(ABC):
    kind: str
    source: Path
    config: ModelConfig

    def __init__(self):
        self.edited_layers: set[int] = set()

    # --- what each implementation provides ---------------------------------------------

    @abstractmethod
    def logits(self, input_ids: torch.Tensor,
               stem_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[b, s, vocab_size] fp32 logits of a right-padded batch (causal: padding after a
        sequence never changes its positions)."""

    @abstractmethod
    def table(self, layer: int) -> torch.Tensor:
        """STEM layer `layer`'s table [vocab_size, ffn_hidden_size], the live tensor."""

    @abstractmethod
    def _up_projection(self, layer: int) -> tuple[torch.nn.Module, Callable]:
        """Dense layer `layer`'s module whose forward computes W_up x, and a function of
        that module's output giving W_up x as [b, s, ffn] fp32."""

    @abstractmethod
    def save(self, output: Path) -> Path:
        """Write the model as it is now (with its edits) as a new checkpoint/folder."""

    def close(self) -> None:
        pass

    # --- shared ------------------------------------------------------------------------

    @property
    def stem_layers(self) -> list[int]:
        return self.config.stem_layer_indices

    def up_projections(self, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each dense layer's up-projection output W_up x at every position, [b, s, ffn]:
        what a STEM layer's table row stands in for."""
        captured, hooks = {}, []
        for i in range(self.config.num_layers):
            if i in self.stem_layers:
                continue
            module, read = self._up_projection(i)

            def hook(module, args, output, i=i, read=read):
                captured[i] = read(output)
            hooks.append(module.register_forward_hook(hook))
        try:
            self.logits(input_ids)
        finally:
            for h in hooks:
                h.remove()
        return captured

    def read_rows(self, layer: int, ids) -> torch.Tensor:
        """Rows of `ids` in STEM layer `layer`, an fp32 copy [len(ids), ffn]."""
        rows = self.table(layer)[torch.as_tensor(ids, dtype=torch.long)]
        return rows.to("cpu", torch.float32, copy=True)

    def write_rows(self, layer: int, ids, rows: torch.Tensor) -> None:
        table = self.table(layer)
        with torch.no_grad():
            table[torch.as_tensor(ids, dtype=torch.long)] = rows.to(table.device, table.dtype)
        self.edited_layers.add(layer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------------------------------
# megatron
# ---------------------------------------------------------------------------------------

_owned_worlds = 0  # MegatronBackends that started the process group and will end it


def _join_world() -> bool:
    """Start a single-process megatron world unless one exists; True if we started it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_stem.config import ParallelConfig
    from megatron_stem.runtime.parallel import init_distributed

    global _owned_worlds
    joined = parallel_state.model_parallel_is_initialized()
    if (dist.get_world_size() if joined else int(os.environ.get("WORLD_SIZE", "1"))) != 1:
        raise UserError("model editing and analysis run in one process; start them with "
                        "python, not torchrun")
    if joined:
        if _owned_worlds:
            _owned_worlds += 1
            return True
        return False  # someone else's world (a test, a notebook): leave it to them
    init_distributed(ParallelConfig())
    _owned_worlds += 1
    return True


def _leave_world() -> None:
    from megatron_stem.runtime.parallel import destroy_distributed

    global _owned_worlds
    _owned_worlds -= 1
    if _owned_worlds == 0:
        destroy_distributed()


class MegatronBackend(Backend):
    kind = "megatron"

    def __init__(self, path: str | Path):
        from megatron_stem import checkpoint
        from megatron_stem.checkpoint.streaming import CheckpointReader
        from megatron_stem.config import ParallelConfig
        from megatron_stem.hf import names
        from megatron_stem.hf.export import read_model_config
        from megatron_stem.model import build_model

        super().__init__()
        self.source = checkpoint.resolve(path)
        self.config = read_model_config(self.source)
        self.recipe = checkpoint.read_recipe(self.source)
        # Computed in fp32 whatever is stored (a bf16 checkpoint loads into fp32 exactly);
        # `save` writes the stored dtype back.
        self.stored_dtype = CheckpointReader(self.source / checkpoint.MODEL).dtype(
            names.tensor_map(self.config)[0].megatron)
        self._owns_world = _join_world()
        try:
            self.net = build_model(self.config, ParallelConfig())
            checkpoint.load_model(self.net, self.source)
        except BaseException:
            self.close()
            raise
        self.net.eval()

    def logits(self, input_ids, stem_ids=None):
        from megatron_stem.runtime.parallel import device

        # build_model placed the model on the accelerator where there is one; callers hold
        # CPU tensors.
        on = device()
        with torch.no_grad():
            out = self.net(input_ids.to(on), None, None,
                           stem_ids=None if stem_ids is None else stem_ids.to(on))
        return out[..., :self.config.vocab_size].float().cpu()

    def _layer(self, layer: int):
        return self.net.decoder.layers[layer]

    def table(self, layer):
        return self._layer(layer).mlp.table.weight.data

    def _up_projection(self, layer):
        ffn = self.config.ffn_hidden_size
        fc1 = self._layer(layer).mlp.linear_fc1  # [gate; up] fused (names.py: "halves")
        # (output, bias) with output [s, b, 2 ffn] -> the up half as [b, s, ffn]
        return fc1, lambda output: output[0][..., ffn:].transpose(0, 1).float().cpu()

    def save(self, output):
        from megatron_stem import checkpoint

        output = Path(output)
        if output.exists():
            raise UserError(f"{output}: already exists; remove it or choose another --output")
        step = int(self.source.name.split("_")[-1]) if self.source.name.startswith("iter_") \
            else 0
        self.net.to(self.stored_dtype)
        try:
            writer = checkpoint.Writer(output, step, self.recipe)
            with writer as folder:
                writer.record(checkpoint.save_model(self.net, folder))
        finally:
            self.net.to(torch.float32)
        return output / checkpoint.iter_name(step)

    def close(self):
        if getattr(self, "_owns_world", False):
            self._owns_world = False
            _leave_world()


# ---------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------


def _table_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.table.weight"


class HFBackend(Backend):
    kind = "hf"

    def __init__(self, path: str | Path):
        from megatron_stem.hf import names
        from megatron_stem.hf.import_model import read_hf_config

        super().__init__()
        self.source = Path(path)
        if not self.source.is_dir():
            raise UserError(f"{self.source}: no such Hugging Face model folder")
        self.config = names.model_config(read_hf_config(self.source),
                                         str(self.source / "config.json"))
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise UserError("Hugging Face models need transformers "
                            "(pip install -r requirements.txt)") from None
        # fp32 compute whatever the stored dtype; `save` casts back to it.
        self.net = AutoModelForCausalLM.from_pretrained(
            self.source, trust_remote_code=True, dtype=torch.float32).eval()
        self._takes_stem_ids = "stem_ids" in inspect.signature(self.net.forward).parameters

    def logits(self, input_ids, stem_ids=None):
        kwargs = {}
        if stem_ids is not None:
            if not self._takes_stem_ids:
                raise UserError(f"{self.source}: its modeling_stem.py predates `stem_ids`; "
                                "export the model again (tools/to_hf.py) for inference-time "
                                "remaps")
            kwargs["stem_ids"] = stem_ids
        with torch.no_grad():
            out = self.net(input_ids=input_ids, use_cache=False, **kwargs)
        return out.logits.float()

    def table(self, layer):
        return self.net.model.layers[layer].mlp.table.weight.data

    def _up_projection(self, layer):
        return self.net.model.layers[layer].mlp.up_proj, lambda output: output.float()

    def save(self, output):
        """A copy of the source folder (config, tokenizer, remote code, index untouched)
        whose safetensors files holding edited tables are rewritten, tensor by tensor, in
        the stored dtype. Written to `<output>.tmp`, renamed when complete."""
        from megatron_stem.hf.safetensors_io import ShardedReader, ShardWriter

        output = Path(output)
        if output.exists():
            raise UserError(f"{output}: already exists; remove it or choose another --output")
        tmp = output.with_name(output.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        reader = ShardedReader(self.source)
        edited = {_table_name(i): i for i in self.edited_layers}
        files = {reader.file_of(name) for name in edited}
        shutil.copytree(self.source, tmp, ignore=lambda d, names: [
            n for n in names if Path(d) == self.source and n in files])
        for file in sorted(files):
            entries = [reader.entry(n) for n in reader.names_in(file)]
            with ShardWriter(tmp / file, entries) as writer:
                for e in entries:
                    tensor = self.table(edited[e.name]) if e.name in edited else reader.read(e.name)
                    writer.write(e.name, tensor.to(e.dtype))
        tmp.rename(output)
        return output


# ---------------------------------------------------------------------------------------
# Opening models and their tokenizers
# ---------------------------------------------------------------------------------------


def add_model_arguments(parser) -> None:
    """--checkpoint | --hf, --tokenizer, --tokenizer-type: the model a CLI opens with
    `open_backend` and `open_tokenizer`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="megatron-stem save dir or iter_N checkpoint folder")
    source.add_argument("--hf", help="Hugging Face export folder (tools/to_hf.py)")
    parser.add_argument("--tokenizer", help="SentencePiece .model or tokenizer.json (default: "
                                            "the checkpoint recipe's, or the one an HF export "
                                            "ships)")
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"])


def open_backend(checkpoint: Optional[str] = None, hf: Optional[str] = None) -> Backend:
    """The model at a megatron-stem checkpoint (a save dir or iter_N) or an HF folder."""
    if (checkpoint is None) == (hf is None):
        raise UserError("give exactly one of --checkpoint and --hf")
    return MegatronBackend(checkpoint) if checkpoint is not None else HFBackend(hf)


def open_tokenizer(backend: Backend, path: Optional[str] = None, kind: Optional[str] = None):
    """The tokenizer at `path` (kind by its name unless given), else the one the model
    names: a checkpoint's recipe (`data.tokenizer_*`), or the files an HF export ships."""
    from megatron_stem.data.tokenizer import check_fits, load_tokenizer

    if path is None:
        if backend.kind == "megatron":
            data = backend.recipe.data
            if not data.tokenizer_model:
                raise UserError(f"{backend.source}: its recipe names no tokenizer "
                                "(data.tokenizer_model); pass --tokenizer")
            path, kind = data.tokenizer_model, kind or data.tokenizer_type
        elif (backend.source / "tokenizer.json").is_file():
            path, kind = str(backend.source / "tokenizer.json"), kind or "huggingface"
        elif (backend.source / "tokenizer.model").is_file():
            path, kind = str(backend.source / "tokenizer.model"), kind or "sentencepiece"
        else:
            raise UserError(f"{backend.source}: ships no tokenizer; pass --tokenizer")
    kind = kind or ("sentencepiece" if str(path).endswith(".model") else "huggingface")
    tokenizer = load_tokenizer(kind, path)
    check_fits(tokenizer, backend.config.vocab_size, str(path))
    return tokenizer
