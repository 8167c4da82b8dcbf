"""A run's checkpoints: where it starts from, what it saves and when, which it keeps.

One `Checkpointer` per run, made by `train.run` once the process group exists:

    checkpointer = Checkpointer(recipe)          # the resume point, agreed by every rank
    model = build_model(...)
    checkpointer.load_weights(model)             # before the engine copies them
    engine, tables, norms = build_engine(model, recipe)
    step = checkpointer.resume(model, engine, tables)
    ...
    checkpointer.save(step, force=stop)          # every train.save_interval, last, on a stop

The weights go in before the engine exists because DeepSpeed (and `TableOptimizer`, for
the tables) takes its fp32 master copy from the model when it is built; a run started
from `train.init_from` without `train.init_optimizer` has no optimizer state that would
put them there later.

A run started from another run's checkpoint (`train.init_from`: the next stage of a
pipeline) is a new run: step 0, its own schedule, data, save_dir and logs. Only the
parameters' shapes must match (`checkpoint.check_same_shape`); the sequence length, RoPE
base and layout (TP, DP, table partition) may change, as on a resume. Its STEM tables are
the checkpoint's or fresh (`train.init_tables`); a STEM run may start from its dense
baseline's checkpoint (fresh tables, the dense up-projections dropped). With
`train.init_optimizer` its optimizer states are loaded as a resume loads them, and their
Adam step count goes on from the source's (`optimizer_steps` in the train state: the
steps the optimizers applied, across stages, a skipped step not among them), so bias
correction does not restart on moments that are not fresh.

This module decides; the layers below write: `megatron_stem/checkpoint.py` (folders,
atomic commit, `latest`, verification; shared with the tools) and `training/state.py`
(optimizer and train state as dist checkpoints).
"""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch.distributed as dist

from megatron_stem import checkpoint
from megatron_stem.background_save import BackgroundSave
from megatron_stem.config import Recipe, load_recipe
from megatron_stem.errors import UserError
from megatron_stem.training.tables.shards import ROW_ORDER, check_row_order
from megatron_stem.training.state import (
    OPTIM,
    OPTIMIZER_STEPS,
    TRAIN_STATE,
    load_optimizers,
    load_train_state,
    optimizer_steps,
    save_optimizers,
    save_train_state,
)


KEPT = "KEPT"  # a checkpoint `prune` leaves: the divergence guard's last good one


class _InFlight(NamedTuple):
    """A checkpoint written in the background, not yet committed."""

    step: int
    background: BackgroundSave
    folder: Path
    writer: ExitStack  # the checkpoint.Writer's exit (its commit) still to call


class Checkpointer:
    """Save and resume of the model, the DeepSpeed engine's optimizer, the tables'
    optimizer and the train state (step, data position), with the run's policy: resume
    from `latest` or the newest whole checkpoint before it, save every
    `train.save_interval` steps, at the last step and on a stop, keep `train.keep_last`."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.save_dir = Path(recipe.train.save_dir)
        self.resume_from = agreed_resume_point(self.save_dir, recipe)
        if self.resume_from is not None:
            _check_resumable(self.resume_from)
        init_from = recipe.train.init_from
        self.init_from = stage_start(init_from) \
            if self.resume_from is None and init_from else None
        self.dense_source = self.init_from is not None and checkpoint.is_dense_source(
            checkpoint.read_recipe(self.init_from), recipe)
        if self.init_from is not None and recipe.train.init_optimizer:
            _check_has_optimizer(self.init_from)
            if self.dense_source:
                raise UserError(f"train.init_optimizer: {self.init_from} is a dense model's; "
                                "a STEM run starts from its weights only (its up-projections' "
                                "optimizer states have no parameter here): set "
                                "train.init_optimizer=false")
        # Optimizer steps taken before this run's step 1 (by the runs it was initialized
        # from, with their optimizer states): the Adam step is this + the run's step.
        self._parts = None  # (model, engine, tables), given by `resume`
        self._in_flight: _InFlight | None = None  # until every rank has written it

    def origin(self) -> str:
        """Where the run starts, as its first log line says it."""
        if self.resume_from is not None:
            return f"resuming from {self.resume_from}"
        if self.init_from is None:
            return "from scratch"
        what = "weights and optimizer states" if self.recipe.train.init_optimizer \
            else "weights"
        if self.dense_source:
            what = "a dense model's weights: STEM layers' up-projections dropped, fresh tables"
        elif self.recipe.train.init_tables == "reinit" and self.recipe.model.is_stem:
            what += ", fresh tables"
        return f"initialized from {self.init_from} ({what})"

    def load_weights(self, model) -> None:
        """The resume point's weights, or `train.init_from`'s, into `model`: a new run
        from a checkpoint keeps or re-initializes its tables (`train.init_tables`), and a
        STEM run from a dense checkpoint starts fresh tables (`checkpoint.load_model`)."""
        if self.resume_from is not None:
            checkpoint.check_same_shape(checkpoint.read_recipe(self.resume_from), self.recipe,
                                        self.resume_from)
            checkpoint.load_model(model, self.resume_from)
        elif self.init_from is not None:
            dense = self.dense_source
            checkpoint.check_same_shape(checkpoint.read_recipe(self.init_from), self.recipe,
                                        self.init_from, dense_source=dense)
            checkpoint.load_model(model, self.init_from, self.recipe.train.init_tables,
                                  dense_source=dense)

    def resume(self, model, engine, tables) -> int:
        """Restore the resume point's optimizer states into `engine` and `tables` (the
        weights are in already), and keep the three for `save`. Returns the step to
        continue from: 0 for a new run."""
        self._parts = (model, engine, tables)
        if self.resume_from is not None:
            state = load_train_state(self.resume_from)
            check_row_order(state.get("table_row_order"), self.resume_from)
            load_optimizers(model, engine.optimizer, tables, self.resume_from,
                            optimizer_steps(state))
            return state["step"]
        if self.init_from is not None and self.recipe.train.init_optimizer:
            source = load_train_state(self.init_from)
            check_row_order(source.get("table_row_order"), self.init_from)
            load_optimizers(model, engine.optimizer, tables, self.init_from,
                            optimizer_steps(source))
        return 0

    def keep_before(self, step: int) -> str | None:
        """The divergence guard's pin (training/guard.py): the newest checkpoint before
        `step` (the last good one before a skipped step or a loss spike), kept from
        pruning (marked by rank 0); its path, None when there is none."""
        good = last_before(self.save_dir, step)
        if good is None:
            return None
        if dist.get_rank() == 0:
            (good / KEPT).write_text(f"kept by the divergence guard: the last checkpoint "
                                     f"before step {step}\n")
        return str(good)

    def rewind(self, ckpt: str) -> None:
        """Point `latest` at `ckpt`: a rerun resumes from it (rank 0 writes)."""
        if dist.get_rank() == 0:
            checkpoint.point_latest(self.save_dir, Path(ckpt))

    def save(self, step: int, force: bool = False) -> bool:
        """Save a complete checkpoint of `step` when one is due (or `force`: a stop), on
        every rank together (call it after every step: it also commits a background save
        that every rank has written); returns whether it saved.

        With `train.async_save` the step waits only while the state is copied to host
        memory; the files are written in the background (`background_save.py`) and the
        checkpoint committed (COMPLETE, `latest`) at a later step, once every rank's files
        are durable. At most one save is in flight: a save due before the last one is
        written waits for it. A stop or the last step waits for its own save too."""
        train = self.recipe.train
        if self._in_flight is not None and self._in_flight.background.written_everywhere():
            self._commit_in_flight()
        if not (force or step % train.save_interval == 0 or step == train.steps):
            return False
        self.wait_for_save(f"step {step} | ")
        model, engine, tables = self._parts
        tables.finish()  # an overlapped update: the model's tables complete
        background = BackgroundSave() if train.async_save else None
        with ExitStack() as stack:
            folder = stack.enter_context(checkpoint.Writer(self.save_dir, step, self.recipe))
            checkpoint.save_model(model, folder, background)
            save_optimizers(model, engine.optimizer, tables, folder, background)
            if dist.get_rank() == 0:
                save_train_state(folder, step, {
                    "consumed_samples": step * train.global_batch_size,
                    "table_row_order": ROW_ORDER, OPTIMIZER_STEPS: tables.step_count})
            if background is not None:  # committed once written (`_commit_in_flight`)
                background.start()
                self._in_flight = _InFlight(step, background, folder, stack.pop_all())
        if background is None:
            self._saved(step)
        elif force or step == train.steps:
            self.wait_for_save()
        return True

    def wait_for_save(self, say: str = "") -> None:
        """Commit the background save in flight, if any, once written (saying so after
        `say` when this rank has to wait for it)."""
        if self._in_flight is None:
            return
        if say and not self._in_flight.background.written_here() and dist.get_rank() == 0:
            print(f"{say}waiting for the checkpoint of step {self._in_flight.step} to be "
                  "written", flush=True)
        self._commit_in_flight()

    def _commit_in_flight(self) -> None:
        step, background, folder, writer = self._in_flight
        self._in_flight = None
        try:
            background.finish(folder)
        except Exception as e:
            writer.__exit__(type(e), e, e.__traceback__)  # not committed: latest unchanged
            raise UserError(f"{folder}: the checkpoint of step {step} could not be written "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "the last whole checkpoint is still the one `latest` names"
                            ) from None
        writer.close()  # checkpoint.Writer's commit: COMPLETE, then `latest`
        self._saved(step)

    def _saved(self, step: int) -> None:
        if dist.get_rank() == 0:
            prune(self.save_dir, self.recipe.train.keep_last)
            print(f"step {step} | saved {self.save_dir / checkpoint.iter_name(step)}",
                  flush=True)


def _has_optimizer(ckpt: Path) -> bool:
    return (ckpt / OPTIM).is_dir() and (ckpt / TRAIN_STATE).is_file()


def _check_resumable(ckpt: Path) -> None:
    if not _has_optimizer(ckpt):
        raise UserError(f"{ckpt}: holds model weights only (an import or an export source), "
                        "not a run to resume: start a new run from it with "
                        f"train.init_from={ckpt} and another train.save_dir")


def _check_has_optimizer(ckpt: Path) -> None:
    if not _has_optimizer(ckpt):
        raise UserError(f"train.init_optimizer: {ckpt} holds model weights only (an import "
                        "or an export source), no optimizer states to start from; set "
                        "train.init_optimizer=false to start a fresh optimizer from its weights")


def stage_start(init_from: str) -> Path:
    """The checkpoint `train.init_from` names: a checkpoint folder as it is (an iter_N, or
    what tools/from_hf.py wrote), or the previous stage by its run folder (a save_dir) or its
    recipe (whose train.save_dir is the run folder): that run's last complete checkpoint
    (`latest`, or the newest whole one before it), refused while the stage has not trained
    its train.steps (its recipe's, else those its checkpoint's recipe.yaml records)."""
    try:
        return _stage_start(init_from)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None


def _stage_start(init_from: str) -> Path:
    source, steps = Path(init_from), None
    if source.suffix in (".yaml", ".yml"):
        previous = load_recipe(source)
        source, steps = Path(previous.train.save_dir), previous.train.steps
        if not source.is_dir():
            raise UserError(f"{init_from}: its run folder {source} does not exist: that stage "
                            "has not started")
    if (source / checkpoint.COMPLETE).is_file() or not source.is_dir():
        return checkpoint.resolve(source)  # a checkpoint folder, named as it is
    try:
        ckpt = resume_point(source, None, say=lambda line: print(line, flush=True))
    except UserError:
        raise UserError(f"{init_from}: {source} holds no whole checkpoint (each one refused "
                        "above)") from None
    if ckpt is None:
        raise UserError(f"{init_from}: {source} holds no checkpoint: that stage has not saved one")
    if not (ckpt / TRAIN_STATE).is_file():
        return ckpt  # weights only (an import): no steps to have finished
    step = load_train_state(ckpt)["step"]
    steps = steps if steps is not None else checkpoint.read_recipe(ckpt).train.steps
    if step < steps:
        raise UserError(f"{init_from}: that stage has not finished: its last complete "
                        f"checkpoint, {ckpt}, is at step {step} of its train.steps={steps} "
                        f"(train it to the end, or name {ckpt} to start from it as it is)")
    return ckpt


def finished_step(recipe: Recipe) -> Optional[int]:
    """The step of a run already trained to `train.steps` (said on rank 0), else None.
    Read before the process group exists: a finished run starts nothing."""
    ckpt = checkpoint.latest(recipe.train.save_dir)
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
    it (`checkpoint.newest_whole`: each refusal and the fallback are `say`-ed in one line).
    None for a save dir without checkpoints. A collective under a process group."""
    try:
        return checkpoint.newest_whole(save_dir, recipe, say)
    except checkpoint.NoWholeCheckpoint:
        raise UserError(f"{save_dir}: no whole checkpoint to resume from (see the lines "
                        "above); move the folder away, or set another train.save_dir, to "
                        "start afresh") from None


def agreed_resume_point(save_dir: str | Path, recipe) -> Path | None:
    """`resume_point`, the same for every rank (rank 0 says what it finds); every rank
    checks its share of the checksums."""
    quiet = dist.is_initialized() and dist.get_rank() != 0
    return resume_point(save_dir, recipe,
                        say=(lambda line: None) if quiet else lambda line: print(line, flush=True))


def prune(save_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all), and
    those the divergence guard kept (`KEPT`)."""
    if keep_last <= 0:
        return
    done = sorted((p for p in checkpoint.iter_folders(save_dir)
                   if (p / checkpoint.COMPLETE).exists()), key=checkpoint.step_of)
    for old in done[:-keep_last]:
        if not (old / KEPT).exists():
            shutil.rmtree(old, ignore_errors=True)


def last_before(save_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint of a step before `step` (None: there is none)."""
    done = [p for p in checkpoint.iter_folders(save_dir)
            if (p / checkpoint.COMPLETE).exists() and checkpoint.step_of(p) < step]
    return max(done, key=checkpoint.step_of) if done else None
