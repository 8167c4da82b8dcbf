"""A run's checkpoints: where it starts from, what it saves and when, which it keeps.

One `Checkpointer` per run, made by `training/loop.py` once the process group exists:

    checkpointer = Checkpointer(recipe)          # the resume point, agreed by every rank
    model = build_model(...)
    checkpointer.load_weights(model)             # before the engine copies them
    engine, tables, update = build_engine(model, recipe)
    step = checkpointer.resume(model, engine, tables)
    ...
    checkpointer.share(read)                     # each step: a save in flight written?
    checkpointer.save(step, force=stop)          # every train.save_interval, last, on a stop

The weights go in before the engine exists because DeepSpeed (and `TableOptimizer`, for
the tables) takes its fp32 master copy from the model when it is built; a run started
from `train.init_from` without `train.init_optimizer` has no optimizer state that would
put them there later. Where the optimizer states follow (a resume), the dense weights come
with them instead (their fp32 masters hold them exactly): a resume reads them once.

A run started from another run's checkpoint (`train.init_from`: the next stage of a
pipeline) is a new run: step 0, its own schedule, data, save_dir and logs. Only the
parameters' shapes must match (`verify.check_same_shape`); the sequence length, RoPE
base and layout (TP, DP, table partition) may change, as on a resume. Its STEM tables are
the checkpoint's or fresh (`train.init_tables`); a STEM run may start from its dense
baseline's checkpoint (fresh tables, the dense up-projections dropped). With
`train.init_optimizer` its optimizer states are loaded as a resume loads them, and their
Adam step count goes on from the source's (`optimizer_steps` in the train state: the
steps the optimizers applied, across stages, a skipped step not among them), so bias
correction does not restart on moments that are not fresh.

The calls come in this order, and the object refuses another (a `RuntimeError`: a bug,
not a user's mistake): `load_weights`, then `resume` (which keeps the model, engine and
tables that `save` writes), then `save` at every step.

This module decides; the modules beside it write (the package's docstring lists one save
and one resume, step by step).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_stem.checkpoint.background import BackgroundSave
from megatron_stem.checkpoint.commit import Writer, point_latest
from megatron_stem.checkpoint.finding import agreed_resume_point, stage_start
from megatron_stem.checkpoint.from_dense import is_dense_source
from megatron_stem.checkpoint.layout import KEPT, iter_name, last_before, prune, read_recipe
from megatron_stem.checkpoint.model_io import load_model, save_model
from megatron_stem.checkpoint.optimizer_io import OPTIM, load_optimizers, save_optimizers
from megatron_stem.checkpoint.shard_writes import ShardWrites
from megatron_stem.checkpoint.train_state import (
    OPTIMIZER_STEPS,
    TRAIN_STATE,
    load_train_state,
    optimizer_steps,
    save_train_state,
)
from megatron_stem.checkpoint.verify import check_same_shape
from megatron_stem.config import Recipe
from megatron_stem.runtime.errors import UserError
from megatron_stem.runtime.host_read import HostRead
from megatron_stem.runtime.parallel import device
from megatron_stem.tables.shards import ROW_ORDER, check_row_order


class _InFlight(NamedTuple):
    """A checkpoint written in the background, not yet committed."""

    step: int
    background: BackgroundSave
    writer: Writer  # its folder (`tmp`) holds the files
    commit: ExitStack  # the Writer's exit (its commit) still to call
    waited: float  # seconds the step waited for it (the copy to host memory)
    started: float  # time.monotonic() when the step went on


class Checkpointer:
    """Save and resume of the model, the DeepSpeed engine's optimizer, the tables'
    optimizer and the train state (step, data position), with the run's policy: resume
    from `latest` or the newest whole checkpoint before it, save every
    `train.save_interval` steps, at the last step and on a stop, keep `train.keep_last`."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.save_dir = Path(recipe.train.save_dir)
        # What starting from a checkpoint costs this rank: seconds and bytes read
        # (checking its share of the checksums, loading); `resume` takes every rank's
        # most (`_read_most`), said on the run's first line.
        self._read = [0.0, 0.0]
        self._read_most: list[float] | None = None
        with self._reading():
            self.resume_from = agreed_resume_point(self.save_dir, recipe)
        if self.resume_from is not None:
            _check_resumable(self.resume_from)
        init_from = recipe.train.init_from
        self.init_from = stage_start(init_from) \
            if self.resume_from is None and init_from else None
        self.dense_source = self.init_from is not None and is_dense_source(
            read_recipe(self.init_from), recipe)
        if self.init_from is not None and recipe.train.init_optimizer:
            _check_has_optimizer(self.init_from)
            if self.dense_source:
                raise UserError(f"train.init_optimizer: {self.init_from} is a dense model's; "
                                "a STEM run starts from its weights only (its up-projections' "
                                "optimizer states have no parameter here): set "
                                "train.init_optimizer=false")
        # Optimizer steps taken before this run's step 1 (by the runs it was initialized
        # from, with their optimizer states): the Adam step is this + the run's step.
        self._weights_loaded = False
        self._parts = None  # (model, engine, tables), given by `resume`
        self._in_flight: _InFlight | None = None  # until every rank has written it
        self._written = None  # this step's "every rank has written it", a HostValue

    def origin(self) -> str:
        """Where the run starts, as its first log line says it: with a checkpoint, how
        long reading it took and the most bytes a rank read (`resume`)."""
        if self.resume_from is not None:
            return f"resuming from {self.resume_from}{self._read_line()}"
        if self.init_from is None:
            return "from scratch"
        what = "weights and optimizer states" if self.recipe.train.init_optimizer \
            else "weights"
        if self.dense_source:
            what = "a dense model's weights: STEM layers' up-projections dropped, fresh tables"
        elif self.recipe.train.init_tables == "reinit" and self.recipe.model.is_stem:
            what += ", fresh tables"
        return f"initialized from {self.init_from} ({what}){self._read_line()}"

    def _read_line(self) -> str:
        if self._read_most is None:  # not read yet
            return ""
        seconds, most = self._read_most
        return f" (read in {seconds:.2f} s, at most {most / 1e9:.2f} GB by a rank)"

    @contextmanager
    def _reading(self):
        """Adds the block's seconds and this process's bytes read to `_read`."""
        began, before = time.monotonic(), _bytes_read()
        try:
            yield
        finally:
            self._read[0] += time.monotonic() - began
            self._read[1] += _bytes_read() - before

    def load_weights(self, model) -> None:
        """The resume point's weights, or `train.init_from`'s, into `model`: a new run
        from a checkpoint keeps or re-initializes its tables (`train.init_tables`), and a
        STEM run from a dense checkpoint starts fresh tables (`load_model`). Where the
        optimizer states follow (`resume`), the dense weights come with their fp32 masters
        and are not read here."""
        with self._reading():
            if self.resume_from is not None:
                check_same_shape(read_recipe(self.resume_from), self.recipe, self.resume_from)
                load_model(model, self.resume_from, dense=False)
            elif self.init_from is not None:
                dense = self.dense_source
                check_same_shape(read_recipe(self.init_from), self.recipe, self.init_from,
                                 dense_source=dense)
                load_model(model, self.init_from, self.recipe.train.init_tables,
                           dense_source=dense, dense=not self.recipe.train.init_optimizer)
        self._weights_loaded = True

    def resume(self, model, engine, tables) -> int:
        """Restore the resume point's optimizer states into `engine` and `tables` (the
        weights are in already), and keep the three for `save`. Returns the step to
        continue from: 0 for a new run."""
        if not self._weights_loaded:
            raise RuntimeError("Checkpointer.resume before load_weights: the engine would "
                               "have copied the model's initial weights")
        self._parts = (model, engine, tables)
        step = 0
        with self._reading():
            if self.resume_from is not None:
                state = load_train_state(self.resume_from)
                check_row_order(state.get("table_row_order"), self.resume_from)
                load_optimizers(model, engine.optimizer, tables, self.resume_from,
                                optimizer_steps(state))
                step = state["step"]
            elif self.init_from is not None and self.recipe.train.init_optimizer:
                source = load_train_state(self.init_from)
                check_row_order(source.get("table_row_order"), self.init_from)
                load_optimizers(model, engine.optimizer, tables, self.init_from,
                                optimizer_steps(source))
        if self.resume_from is not None or self.init_from is not None:
            # the slowest rank's time and the most any rank read (a collective: every
            # rank starts from the same checkpoint)
            most = torch.tensor(self._read, dtype=torch.float64, device=device())
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            self._read_most = most.tolist()
        return step

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
            point_latest(self.save_dir, Path(ckpt))

    def share(self, read) -> None:
        """While a save is written in the background: whether every rank has written it,
        into the step's host read `read` (runtime/host_read.py; a collective: every rank
        calls it), which `save` then commits on."""
        if self._in_flight is not None:
            self._written = self._in_flight.background.written_everywhere(read)

    def save(self, step: int, force: bool = False) -> bool:
        """Save a complete checkpoint of `step` when one is due (or `force`: a stop), on
        every rank together (call it after every step: it also commits a background save
        that every rank had written by the step's `share`); returns whether it saved.

        With `train.async_save` the step waits only while the state is copied to host
        memory; the files are written in the background (`checkpoint/background.py`) and the
        checkpoint committed (COMPLETE, `latest`) at a later step, once every rank's files
        are durable. At most one save is in flight: a save due before the last one is
        written waits for it. A stop or the last step waits for its own save too."""
        train = self.recipe.train
        if self._in_flight is not None:
            written = self._written or self._in_flight.background.written_everywhere(HostRead())
            if written.get():
                self._commit_in_flight()
        self._written = None
        if not (force or step % train.save_interval == 0 or step == train.steps):
            return False
        if self._parts is None:
            raise RuntimeError("Checkpointer.save before resume: it has nothing to save")
        self.wait_for_save(f"step {step} | ")
        began = time.monotonic()
        model, engine, tables = self._parts
        tables.finish()  # an overlapped update: the model's tables complete
        writes = BackgroundSave() if train.async_save else ShardWrites()
        writer = Writer(self.save_dir, step, self.recipe)
        with ExitStack() as stack:
            folder = stack.enter_context(writer)
            save_model(model, folder, writes)
            save_optimizers(model, engine.optimizer, tables, folder, writes)
            if dist.get_rank() == 0:
                writer.record(save_train_state(folder, step, {
                    "consumed_samples": step * train.global_batch_size,
                    "table_row_order": ROW_ORDER, OPTIMIZER_STEPS: tables.step_count}))
            if train.async_save:  # committed once written everywhere
                writes.start()
                now = time.monotonic()
                self._in_flight = _InFlight(step, writes, writer, stack.pop_all(),
                                            now - began, now)
            else:
                writes.write()
                writer.record(writes.finish(folder))
        if not train.async_save:  # committed as the block ended
            self._saved(step, f"in {time.monotonic() - began:.2f} s")
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
        step, background, writer, commit, waited, started = self._in_flight
        self._in_flight = None
        folder = writer.tmp
        try:
            writer.record(background.finish(folder))
        except Exception as e:
            commit.__exit__(type(e), e, e.__traceback__)  # not committed: latest unchanged
            raise UserError(f"{folder}: the checkpoint of step {step} could not be written "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "the last whole checkpoint is still the one `latest` names"
                            ) from None
        commit.close()  # Writer's commit: COMPLETE, then `latest`
        self._saved(step, f"the step waited {waited:.2f} s; written in the background, "
                          f"committed {time.monotonic() - started:.2f} s later")

    def _saved(self, step: int, how: str) -> None:
        """`how`: what the save cost the run (rank 0's: the time its step waited)."""
        if dist.get_rank() == 0:
            prune(self.save_dir, self.recipe.train.keep_last)
            print(f"step {step} | saved {self.save_dir / iter_name(step)} ({how})",
                  flush=True)


def _bytes_read() -> float:
    """Bytes this process has read so far (read calls, cached or not: /proc's rchar; 0
    where /proc has none)."""
    try:
        with open("/proc/self/io") as f:
            return float(next(line.split()[1] for line in f if line.startswith("rchar:")))
    except (OSError, StopIteration):
        return 0.0


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
