"""Checkpoint layout, atomic commit, and the model part (megatron dist-checkpointing).

    <save_dir>/
      latest                 "iter_0000200": the newest complete checkpoint
      iter_0000200/
        recipe.yaml          the resolved recipe the model was built from
        CODE_VERSION         the code that saved it (git describe; code_version.py)
        model/               megatron dist checkpoint of StemGPTModel.sharded_state_dict()
        optim/               optimizer states (dense and tables), a dist checkpoint too
        train_state.pt       step, data position, RNG states
        COMPLETE             written last: the other files' sizes (JSON); a folder
                             without it is not a checkpoint

Dist checkpoints are layout-free: any TP/PP/DP layout loads what any other saved. Every
data-parallel rank writes its share of the replicated tensors (megatron's fully parallel
save strategy), instead of DP rank 0 writing them all (docs/checkpoints.md).
A checkpoint is written into `iter_N.tmp/` and renamed into place only when complete, then
`latest` is replaced atomically, so a crash mid-save never touches the last good one.
A checkpoint damaged since (a missing or truncated file, another model's recipe) is
refused in one line naming the file (`verify`). Which checkpoint a run resumes from, and
which it keeps, is the trainer's policy: `training/checkpointing.py`.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from megatron_stem.code_version import code_version
from megatron_stem.config import Recipe, from_dict, to_dict, upgrade_saved_recipe
from megatron_stem.errors import UserError

LATEST = "latest"
COMPLETE = "COMPLETE"
RECIPE = "recipe.yaml"
CODE_VERSION = "CODE_VERSION"  # git describe of the code that saved it
MODEL = "model"
_ITER = re.compile(r"^iter_(\d{7,})$")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from either a save dir (follows `latest`) or an iter_N folder,
    checked whole (see `verify`)."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder")
    verify(path)
    return path


def latest(save_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names under `save_dir` if it is whole, else None."""
    try:
        return resolve(save_dir) if (Path(save_dir) / LATEST).is_file() else None
    except UserError:
        return None


def verify(ckpt: Path, recipe=None) -> None:
    """Refuse, in one line naming the file, a checkpoint that is not whole: no COMPLETE
    marker, a file missing or of another size than when it was saved, an unreadable
    recipe.yaml, or (given `recipe`) one of another model shape."""
    marker = ckpt / COMPLETE
    if not marker.is_file():
        raise UserError(f"{ckpt}: not a complete megatron-stem checkpoint (no {COMPLETE} marker;"
                        " an interrupted save, or not written by megatron-stem)")
    try:
        sizes = json.loads(marker.read_text() or "{}")  # empty: saved before sizes were kept
    except ValueError:
        raise UserError(f"{marker}: damaged (not the JSON list of files it should be)") from None
    for name, size in sizes.items():
        file = ckpt / name
        if not file.is_file():
            raise UserError(f"{file}: missing (the checkpoint was saved with it)")
        if file.stat().st_size != size:
            raise UserError(f"{file}: {file.stat().st_size} bytes, {size} when saved "
                            "(truncated or overwritten)")
    if not (ckpt / RECIPE).is_file():
        raise UserError(f"{ckpt}: not a megatron-stem checkpoint (no {RECIPE})")
    try:
        saved = read_recipe(ckpt)
    except Exception as e:  # any parse or schema error: the file is not what we wrote
        raise UserError(f"{ckpt / RECIPE}: unreadable ({str(e).splitlines()[0]})") from None
    if recipe is not None:
        check_same_shape(saved, recipe, ckpt)


def iter_folders(save_dir: Path) -> list[Path]:
    """The iter_N folders under `save_dir` (whole or not), in no order."""
    return [p for p in save_dir.iterdir() if _ITER.match(p.name)] if save_dir.is_dir() else []


def step_of(folder: Path) -> int:
    match = _ITER.match(folder.name)
    return int(match[1]) if match else -1


def read_recipe(ckpt: Path, cls: type = Recipe):
    return from_dict(cls, upgrade_saved_recipe(yaml.safe_load((ckpt / RECIPE).read_text())))


class Writer:
    """Collectively write one checkpoint: `with Writer(save_dir, step, recipe) as folder:`
    every rank saves its parts under `folder`; on a clean exit it is committed."""

    def __init__(self, save_dir: str | Path, step: int, recipe):
        self.save_dir = Path(save_dir)
        self.final = self.save_dir / iter_name(step)
        self.tmp = self.save_dir / (iter_name(step) + ".tmp")
        self.recipe = recipe

    def __enter__(self) -> Path:
        if _is_writer():
            self.save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a crashed save
            self.tmp.mkdir()
            (self.tmp / RECIPE).write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            (self.tmp / CODE_VERSION).write_text(code_version() + "\n")
        _barrier()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False  # leave the .tmp folder; the last good checkpoint is untouched
        _barrier()  # every rank has finished writing its parts
        if _is_writer():
            (self.tmp / COMPLETE).write_text(json.dumps(_file_sizes(self.tmp), indent=0))
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            pointer = self.save_dir / (LATEST + ".tmp")
            pointer.write_text(self.final.name + "\n")
            os.replace(pointer, self.save_dir / LATEST)
        _barrier()
        return False


def _file_sizes(folder: Path) -> dict[str, int]:
    """{path relative to `folder`: size} of every file under it but recipe.yaml, which is
    checked by its content (`verify`) and may be edited by hand."""
    return {str(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECIPE}


def save_model(model, folder: Path) -> None:
    if _is_writer():
        (folder / MODEL).mkdir(exist_ok=True)
    _barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(folder / MODEL),
                            sharded_strategy=parallel_save_strategy())


def parallel_save_strategy() -> FullyParallelSaveStrategyWrapper | None:
    """Megatron's torch_dist save with the writes spread over the data-parallel replicas:
    each tensor shard replicated over DP is written by one of them, chosen to balance the
    bytes per rank (only metadata is exchanged). Without it DP rank 0 writes them all."""
    _keep_write_results_in_process()
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group())


def _keep_write_results_in_process() -> None:
    """megatron's file writer returns its results through a queue made for asynchronous
    saves: a multiprocessing manager started with `spawn`, a new interpreter that imports
    the training script again (torch, megatron, DeepSpeed: ~5 s of CPU per rank, and 40%
    of a small test run) at a rank's first save. Our saves are synchronous: the results
    are put and read in this process, so a plain queue does."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_model(model, ckpt: Path) -> None:
    """Load a checkpoint's weights into `model`, whatever layout it was saved from."""
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt / MODEL))
    model.load_state_dict(state)


def parameter_shape(model) -> dict:
    """What decides the shapes (and the set) of a model's parameters, by recipe field:
    `seq_length`, `rotary_base`, `norm_eps` and `init_std` do not, so a run at another
    sequence length or RoPE base loads the same checkpoint."""
    return {"hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.kv_heads, "ffn_hidden_size": model.ffn_hidden_size,
            "vocab_size": model.vocab_size,
            "make_vocab_size_divisible_by (padded vocab)": model.padded_vocab_size,
            "untie_embeddings": model.untie_embeddings,
            "stem_layers": model.stem_layer_indices}


def check_same_shape(saved_recipe, recipe, ckpt: Path) -> None:
    """A checkpoint whose parameters have other shapes is a user error, not a size-mismatch
    traceback (`parameter_shape`: the fields compared; the others may differ)."""
    saved, wanted = parameter_shape(saved_recipe.model), parameter_shape(recipe.model)
    diffs = [f"model.{k}: checkpoint {_shown(saved_recipe.model, k, saved[k])!r}, recipe "
             f"{_shown(recipe.model, k, wanted[k])!r}" for k in saved if saved[k] != wanted[k]]
    if diffs:
        raise UserError(f"{Path(ckpt) / RECIPE}: checkpoint is of another model shape "
                        f"({'; '.join(diffs)})")


def _shown(model, key: str, value):
    """A compared value as the recipe gives it (a placement as written, not its layers)."""
    return model.stem_layers if key == "stem_layers" else value
