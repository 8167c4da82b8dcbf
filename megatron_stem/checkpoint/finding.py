"""Which checkpoint to read: in a save dir, the one `latest` names, or the newest whole one
before it when that one is damaged (each refusal and the fallback said in one line); for
`train.init_from`, a checkpoint folder, a previous stage's run folder or its recipe (where
that recipe's last run saves, recorded by `record_stage`); and whether a run has nothing
left to train. Every rank agrees on rank 0's view of a folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from megatron_stem.checkpoint.layout import (
    COMPLETE,
    LATEST,
    hint,
    iter_folders,
    read_recipe,
    step_of,
)
from megatron_stem.checkpoint.train_state import TRAIN_STATE, load_train_state
from megatron_stem.checkpoint.verify import verify
from megatron_stem.config import Recipe, load_recipe
from megatron_stem.runtime.durable import read_json, write_json
from megatron_stem.runtime.errors import UserError


class NoWholeCheckpoint(UserError):
    """Checkpoint folders, none of them whole."""


def resolve(path: str | Path, say: Callable[[str], None] = print) -> Path:
    """A whole checkpoint folder from either a save dir (`latest`'s, else the newest whole
    one: `newest_whole`) or an iter_N folder, checked whole (`verify`)."""
    path = Path(path)
    if (path / LATEST).exists() or iter_folders(path):
        found = newest_whole(path, say=say)
        if found is None:
            raise UserError(f"{path}: no checkpoint in it (its {LATEST} names none)")
        return found
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder")
    verify(path)
    return path


def latest(save_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names under `save_dir` if it looks whole (sizes only: no
    file is read), else None. For a quick look before a run starts; `newest_whole` decides."""
    named = hint(Path(save_dir))[0]
    if named is None:
        return None
    try:
        verify(named, contents=False)
    except UserError:
        return None
    return named


def newest_whole(save_dir: str | Path, recipe=None, say: Callable[[str], None] = print
                 ) -> Path | None:
    """The checkpoint to read under `save_dir`: the one `latest` names, or, when that one
    is damaged, missing or `latest` is no hint (`hint`), the newest whole one older than it
    (each refusal and the fallback are `say`-ed in one line). None when there is no
    checkpoint folder; an error when none is whole. A collective under a process group
    (every rank calls it; rank 0's view of the folder decides)."""
    save_dir = Path(save_dir)
    named, problem = _from_rank0(hint(save_dir))
    folders = _from_rank0(sorted(iter_folders(save_dir), key=step_of, reverse=True))
    if problem is not None:
        say(f"warning: {problem}")
    if named is not None:
        folders = [named] + [p for p in folders if step_of(p) < step_of(named)]
    elif not folders:
        return None
    refusals = []
    for ckpt in folders:
        try:
            verify(ckpt, recipe)
        except UserError as e:
            say(f"warning: refusing checkpoint {ckpt.name}: {e}")
            refusals.append(str(e))
            continue
        if ckpt != named:
            say(f"warning: falling back to {ckpt}, the newest whole checkpoint")
        return ckpt
    raise NoWholeCheckpoint(f"{save_dir}: no whole checkpoint (the newest: {refusals[0]})")


def _from_rank0(value):
    """Rank 0's `value` on every rank (as is without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Beside a recipe's own `train.save_dir`: where the last run of that recipe saves instead.
STAGE_RECORD_SUFFIX = ".where"


class StagePending(UserError):
    """The stage `train.init_from` names has not finished (or not started): its checkpoints
    will be in `save_dir`; `status` says how far it is."""

    def __init__(self, message: str, save_dir: Path, status: str):
        super().__init__(message)
        self.save_dir, self.status = save_dir, status


def stage_record(recipe_file: str | Path) -> Path:
    """The file that says where runs of `recipe_file` save, beside its own save dir."""
    own = Path(load_recipe(recipe_file).train.save_dir)
    return own.with_name(own.name + STAGE_RECORD_SUFFIX)


def record_stage(recipe_file: str | Path, recipe: Recipe, say: Callable[[str], None] = print
                 ) -> None:
    """Say where this run of `recipe_file` saves, for a next stage whose `train.init_from`
    names the recipe: a run that saves elsewhere than the file says (`STEM_OUTPUT`,
    `STEM_SAVE_DIR`, another job name) leaves `<its save_dir>.where` naming the folder; one
    that saves where the file says removes an older one. A run of other `train.steps` than
    the file's (a trial, a smoke test) is no stage's end and records nothing. Rank 0 only."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    own = load_recipe(recipe_file).train
    if recipe.train.steps != own.steps:
        return
    record, saves = stage_record(recipe_file), Path(recipe.train.save_dir).resolve()
    try:
        if saves == Path(own.save_dir).resolve():
            record.unlink(missing_ok=True)
            return
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json(str(record), {"save_dir": str(saves), "recipe": str(recipe_file),
                                 "job": os.environ.get("SLURM_JOB_ID")})
    except OSError as e:
        say(f"warning: cannot record where this stage saves in {record} ({e.strerror}): a "
            f"next stage finds these checkpoints by train.init_from={saves} only")
        return
    say(f"stage: saving to {saves}; a next stage's train.init_from: {recipe_file} reads it "
        f"({record})")


def stage_start(init_from: str) -> Path:
    """The checkpoint `train.init_from` names: a checkpoint folder as it is (an iter_N, or
    what tools/from_hf.py wrote), or the previous stage by its run folder (a save_dir) or its
    recipe (its last run's save dir, `record_stage`, else the recipe's train.save_dir): that
    run's last complete checkpoint (`latest`, or the newest whole one before it), refused
    (`StagePending`) while the stage has not trained its train.steps (its recipe's, else
    those its checkpoint's recipe.yaml records)."""
    try:
        return _stage_start(init_from)
    except StagePending as e:
        raise StagePending(f"train.init_from: {e}", e.save_dir, e.status) from None
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None


def _stage_start(init_from: str) -> Path:
    source, steps = Path(init_from), None
    if source.suffix in (".yaml", ".yml"):
        previous = load_recipe(source)
        recorded = read_json(str(stage_record(source)))
        source = Path(recorded["save_dir"] if recorded else previous.train.save_dir)
        steps = previous.train.steps
        if not source.is_dir():
            raise StagePending(f"{init_from}: its run folder {source} does not exist: that "
                               "stage has not started", source, "not started yet")
    if (source / COMPLETE).is_file() or not source.is_dir():
        return resolve(source)  # a checkpoint folder, named as it is
    try:
        ckpt = resume_point(source, None, say=lambda line: print(line, flush=True))
    except UserError:
        raise UserError(f"{init_from}: {source} holds no whole checkpoint (each one refused "
                        "above)") from None
    if ckpt is None:
        raise StagePending(f"{init_from}: {source} holds no checkpoint: that stage has not "
                           "saved one", source, "no checkpoint yet")
    if not (ckpt / TRAIN_STATE).is_file():
        return ckpt  # weights only (an import): no steps to have finished
    step = load_train_state(ckpt)["step"]
    steps = steps if steps is not None else read_recipe(ckpt).train.steps
    if step < steps:
        raise StagePending(f"{init_from}: that stage has not finished: its last complete "
                           f"checkpoint, {ckpt}, is at step {step} of its train.steps={steps} "
                           f"(train it to the end, or name {ckpt} to start from it as it is)",
                           source, f"at step {step} of {steps}")
    return ckpt


def finished_step(recipe: Recipe) -> Optional[int]:
    """The step of a run already trained to `train.steps` (said on rank 0), else None.
    Read before the process group exists: a finished run starts nothing."""
    ckpt = latest(recipe.train.save_dir)
    if ckpt is None or not (ckpt / TRAIN_STATE).is_file():
        return None
    try:
        step = load_train_state(ckpt)["step"]
    except UserError:  # damaged: the resume refuses it and says so
        return None
    if step < recipe.train.steps:
        return None
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"nothing left to train: {ckpt} is at step {step} of train.steps="
              f"{recipe.train.steps} (raise train.steps to train on)", flush=True)
    return step


def resume_point(save_dir: str | Path, recipe, say: Callable[[str], None] = print
                 ) -> Path | None:
    """The checkpoint a run in `save_dir` resumes from: the one `latest` names, or, when
    that one is damaged or missing or `latest` is no hint, the newest whole one older than
    it (`newest_whole`: each refusal and the fallback are `say`-ed in one line).
    None for a save dir without checkpoints. A collective under a process group."""
    try:
        return newest_whole(save_dir, recipe, say)
    except NoWholeCheckpoint:
        raise UserError(f"{save_dir}: no whole checkpoint to resume from (see the lines "
                        "above); move the folder away, or set another train.save_dir, to "
                        "start afresh") from None


def agreed_resume_point(save_dir: str | Path, recipe) -> Path | None:
    """`resume_point`, the same for every rank (rank 0 says what it finds); every rank
    checks its share of the checksums."""
    quiet = dist.is_initialized() and dist.get_rank() != 0
    return resume_point(save_dir, recipe,
                        say=(lambda line: None) if quiet else lambda line: print(line, flush=True))
