"""Checkpoints: every save, resume and read of one lives in this package.

One save (`Checkpointer.save`, at a step that is due; every rank together):
 1. `commit.Writer` makes `iter_N.tmp/` and writes `recipe.yaml` and `CODE_VERSION` (rank 0);
 2. `model_io.save_model`: the model's weights, a megatron dist checkpoint in `model/`,
    written through `strategy.parallel_save_strategy` (each replicated tensor by one
    data-parallel rank);
 3. `optimizer_io.save_optimizers`: the dense (DeepSpeed ZeRO) and the tables' optimizer
    states in `optim/`, sharded like the parameters they belong to (the tables' rows in
    one order for every layout: `tables/states.py`);
 4. `train_state.save_train_state` (rank 0): step, data position, RNG, optimizer steps;
 5. with `train.async_save`, 2-4 are planned and copied to host memory now and written by
    `background.BackgroundSave`'s thread; the commit waits for a later step;
 6. the commit (`Writer.__exit__`): every rank's files hashed (`checksums`), COMPLETE
    written, the folder renamed into place, `latest` replaced, each durably; then
    `layout.prune` keeps the newest `train.keep_last`.

One resume (`training/loop.py`):
 1. `Checkpointer(recipe)`: `finding.agreed_resume_point`, the checkpoint `latest` names
    or the newest whole one before it (`verify`: COMPLETE, sizes, checksums, recipe),
    agreed by every rank; else `train.init_from` (`finding.stage_start`);
 2. `Checkpointer.load_weights`: `verify.check_same_shape`, then `model_io.load_model`
    (from a dense baseline: `from_dense`), before the engine copies the weights;
 3. `Checkpointer.resume`: `train_state.load_train_state` (step, row order),
    `optimizer_io.load_optimizers` into the engine and the tables; returns the step.

Folders and names: `layout`. Reading a model checkpoint one tensor at a time (the Hugging
Face converters): `streaming`. Names a tool or a test needs are importable from here;
the modules import each other only downward, never through this file.
"""

from megatron_stem.checkpoint.commit import Writer, point_latest
from megatron_stem.checkpoint.finding import (
    NoWholeCheckpoint,
    finished_step,
    latest,
    newest_whole,
    resolve,
    resume_point,
    stage_start,
)
from megatron_stem.checkpoint.from_dense import is_dense_source
from megatron_stem.checkpoint.layout import (
    COMPLETE,
    LATEST,
    MODEL,
    RECIPE,
    iter_folders,
    iter_name,
    read_recipe,
    step_of,
)
from megatron_stem.checkpoint.model_io import load_model, save_model, save_sharded
from megatron_stem.checkpoint.strategy import parallel_save_strategy
from megatron_stem.checkpoint.verify import check_same_shape, parameter_shape, verify

__all__ = [
    "Writer", "point_latest", "NoWholeCheckpoint", "finished_step", "latest", "newest_whole",
    "resolve", "resume_point", "stage_start", "is_dense_source", "COMPLETE", "LATEST", "MODEL",
    "RECIPE", "iter_folders", "iter_name", "read_recipe", "step_of", "load_model",
    "save_model", "save_sharded", "parallel_save_strategy", "check_same_shape",
    "parameter_shape", "verify",
]
