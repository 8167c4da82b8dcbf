"""Checkpoint layout, atomic commit, and the model part (megatron dist-checkpointing).

    <save_dir>/
      latest                 "iter_0000200": the newest complete checkpoint
      iter_0000200/
        recipe.yaml          the resolved recipe the model was built from
        model/               megatron dist checkpoint of StemGPTModel.sharded_state_dict()
        optim/               optimizer states (dense and tables), a dist checkpoint too
        train_state.pt       step, data position, RNG states
        COMPLETE             written last; a folder without it is not a checkpoint

Dist checkpoints are layout-free: any TP/PP/DP layout loads what any other saved.
A checkpoint is written into `iter_N.tmp/` and renamed into place only when complete, then
`latest` is replaced atomically, so a crash mid-save never touches the last good one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing

from megatron_stem.config import Recipe, from_dict, to_dict
from megatron_stem.errors import UserError

LATEST = "latest"
COMPLETE = "COMPLETE"
RECIPE = "recipe.yaml"
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
    """A checkpoint folder from either a save dir (follows `latest`) or an iter_N folder."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder")
    if not (path / COMPLETE).is_file():
        raise UserError(f"{path}: not a complete megatron-stem checkpoint (no {COMPLETE} marker;"
                        " an interrupted save, or not written by megatron-stem)")
    return path


def latest(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `save_dir`, or None when there is none yet."""
    try:
        return resolve(save_dir) if (Path(save_dir) / LATEST).is_file() else None
    except UserError:
        return None


def read_recipe(ckpt: Path, cls: type = Recipe):
    return from_dict(cls, yaml.safe_load((ckpt / RECIPE).read_text()))


class Writer:
    """Collectively write one checkpoint: `with Writer(save_dir, step, recipe) as folder:`
    every rank saves its parts under `folder`; on a clean exit it is committed."""

    def __init__(self, save_dir: str | Path, step: int, recipe, keep_last: int = 0):
        self.save_dir = Path(save_dir)
        self.final = self.save_dir / iter_name(step)
        self.tmp = self.save_dir / (iter_name(step) + ".tmp")
        self.recipe = recipe
        self.keep_last = keep_last

    def __enter__(self) -> Path:
        if _is_writer():
            self.save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a crashed save
            self.tmp.mkdir()
            (self.tmp / RECIPE).write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
        _barrier()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False  # leave the .tmp folder; the last good checkpoint is untouched
        _barrier()  # every rank has finished writing its parts
        if _is_writer():
            (self.tmp / COMPLETE).write_text("")
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            pointer = self.save_dir / (LATEST + ".tmp")
            pointer.write_text(self.final.name + "\n")
            os.replace(pointer, self.save_dir / LATEST)
            _prune(self.save_dir, self.keep_last)
        _barrier()
        return False


def _prune(save_dir: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in save_dir.iterdir() if _ITER.match(p.name) and (p / COMPLETE).exists())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def save_model(model, folder: Path) -> None:
    if _is_writer():
        (folder / MODEL).mkdir(exist_ok=True)
    _barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(folder / MODEL))


def load_model(model, ckpt: Path) -> None:
    """Load a checkpoint's weights into `model`, whatever layout it was saved from."""
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt / MODEL))
    model.load_state_dict(state)


def check_same_shape(saved_recipe, recipe, ckpt: Path) -> None:
    """A checkpoint of another model shape is a user error, not a size-mismatch traceback."""
    saved, wanted = to_dict(saved_recipe.model), to_dict(recipe.model)
    diffs = [f"model.{k}: checkpoint {saved[k]!r}, recipe {wanted[k]!r}"
             for k in saved if saved[k] != wanted.get(k)]
    if diffs:
        raise UserError(f"{ckpt}: checkpoint is of another model shape ({'; '.join(diffs)})")
