"""Checkpoints: every save, resume and read of one lives in this package.

One save (`Checkpointer.save`, at a step that is due; every rank together):
 1. `commit.Writer` makes `iter_N.tmp/` and writes `recipe.yaml` and `CODE_VERSION` (rank 0);
 2. `model_io.save_model`: the model's weights, a megatron dist checkpoint in `model/`,
    planned through `strategy.parallel_save_strategy` (each replicated tensor written by
    one data-parallel rank);
 3. `optimizer_io.save_optimizers`: the optimizer states in `optim/`, each rank its own:
    its ZeRO partition of the dense states as boxes of the parameters' tensors
    (`zero_state`), its rows of the tables' (the rows in one order for every layout:
    `tables/states.py`); no gather;
 4. `train_state.save_train_state` (rank 0): step, data position, RNG, optimizer steps;
 5. `shard_writes.ShardWrites` writes 2-3: each rank its files, hashed as written and
    fsynced (`checksums.HashedStream`), now (a synchronous save), or with `train.async_save`
    from one host copy by `background.BackgroundSave`'s thread, the commit at a later step;
 6. the commit (`Writer.__exit__`): the folders fsynced, COMPLETE lists every rank's files
    with the sizes and checksums their writers recorded (no file read), the folder renamed
    into place, `latest` replaced, each durably; then `layout.prune` keeps the newest
    `train.keep_last`.

One resume (`training/loop.py`):
 1. `Checkpointer(recipe)`: `finding.agreed_resume_point`, the checkpoint `latest` names
    or the newest whole one before it (`verify`: COMPLETE, sizes, checksums shared over
    the ranks, pickles read by an allow-listed unpickler (`unpickling`), recipe), agreed by
    every rank; else `train.init_from` (`finding.stage_start`);
 2. `Checkpointer.load_weights`: `verify.check_same_shape`, then `model_io.load_model`
    (from a dense baseline: `from_dense`), before the engine copies the weights: the
    tables' only on a resume (the dense weights come with their fp32 masters, step 3);
 3. `Checkpointer.resume`: `train_state.load_train_state` (step, row order),
    `optimizer_io.load_optimizers` into the live engine and tables, each rank reading its
    own partition and rows (`strategy.parallel_load_strategy`: what several ranks need is
    read by one and sent to the others), the dense weights set from their masters;
    returns the step.

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
