"""Checkpoint layout, atomic commit, and the model part (megatron dist-checkpointing).

    <save_dir>/
      latest                 "iter_0000200": the newest complete checkpoint
      iter_0000200/
        recipe.yaml          the resolved recipe the model was built from
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
A checkpoint damaged since (a missing or truncated file, `latest` naming nothing, another
model's recipe) is refused in one line naming the file, and a resume falls back to the
newest complete one (`resume_point`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from megatron_stem.config import Recipe, from_dict, to_dict, upgrade_saved_recipe
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


def resume_point(save_dir: str | Path, recipe, say: Callable[[str], None] = print
                 ) -> Path | None:
    """The checkpoint a run in `save_dir` resumes from: the one `latest` names, or, when
    that one is damaged or missing, the newest whole one older than it (each refusal and
    the fallback are `say`-ed in one line). None for a save dir without checkpoints."""
    save_dir = Path(save_dir)
    pointer = save_dir / LATEST
    folders = sorted(_iter_folders(save_dir), key=_step_of, reverse=True)
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and (save_dir / named).is_dir():
        older = [p for p in folders if _step_of(p) < _step_of(save_dir / named)]
        folders = [save_dir / named] + older
    elif named is not None:
        say(f"warning: {pointer}: names {named}, which does not exist")
    elif not folders:
        return None
    for ckpt in folders:
        try:
            verify(ckpt, recipe)
        except UserError as e:
            say(f"warning: refusing checkpoint {ckpt.name}: {e}")
            continue
        if ckpt.name != named:
            say(f"warning: falling back to {ckpt}, the newest whole checkpoint")
        return ckpt
    raise UserError(f"{save_dir}: no whole checkpoint to resume from (see the lines above); "
                    "move the folder away, or set another train.save_dir, to start afresh")


def agreed_resume_point(save_dir: str | Path, recipe) -> Path | None:
    """`resume_point` as rank 0 finds it (and says it), the same for every rank."""
    found = [None, None]  # checkpoint, or the error that there is none to resume from
    if _is_writer():
        try:
            found[0] = resume_point(save_dir, recipe, say=lambda line: print(line, flush=True))
        except UserError as e:
            found[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if found[1] is not None:
        raise UserError(found[1])
    return found[0]


def _iter_folders(save_dir: Path) -> list[Path]:
    return [p for p in save_dir.iterdir() if _ITER.match(p.name)] if save_dir.is_dir() else []


def _step_of(folder: Path) -> int:
    match = _ITER.match(folder.name)
    return int(match[1]) if match else -1


def read_recipe(ckpt: Path, cls: type = Recipe):
    return from_dict(cls, upgrade_saved_recipe(yaml.safe_load((ckpt / RECIPE).read_text())))


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
            (self.tmp / COMPLETE).write_text(json.dumps(_file_sizes(self.tmp), indent=0))
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            pointer = self.save_dir / (LATEST + ".tmp")
            pointer.write_text(self.final.name + "\n")
            os.replace(pointer, self.save_dir / LATEST)
            _prune(self.save_dir, self.keep_last)
        _barrier()
        return False


def _file_sizes(folder: Path) -> dict[str, int]:
    """{path relative to `folder`: size} of every file under it but recipe.yaml, which is
    checked by its content (`verify`) and may be edited by hand."""
    return {str(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECIPE}


def _prune(save_dir: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted((p for p in _iter_folders(save_dir) if (p / COMPLETE).exists()), key=_step_of)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


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
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group())


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
        raise UserError(f"{Path(ckpt) / RECIPE}: checkpoint is of another model shape "
                        f"({'; '.join(diffs)})")
