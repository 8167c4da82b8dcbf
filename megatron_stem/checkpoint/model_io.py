"""The model's weights in a checkpoint (`iter_N/model/`): a megatron dist checkpoint of
`sharded_state_dict()`, layout-free (any TP/PP/DP layout loads what any other saved), every
data-parallel rank writing its share of the replicated tensors and reading its share back
(strategy.py). `save_sharded` and `load_sharded` write and read any dist checkpoint of the
save (the optimizer states' too)."""

from __future__ import annotations

from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_stem.checkpoint.commit import barrier, is_writer
from megatron_stem.checkpoint.from_dense import STEM_MLP, from_dense_mlp
from megatron_stem.checkpoint.layout import MODEL
from megatron_stem.checkpoint.shard_writes import ShardWrites
from megatron_stem.checkpoint.strategy import parallel_load_strategy
from megatron_stem.runtime.mcore_versions import check_readable


def save_model(model, folder: Path, writes: ShardWrites | None = None) -> dict[str, dict]:
    """The model's weights into the checkpoint `folder` (`save_sharded`); what this rank
    wrote now, for its `Writer.record`."""
    if is_writer():
        (folder / MODEL).mkdir(exist_ok=True)
    barrier()
    written = save_sharded(model.sharded_state_dict(), folder / MODEL, writes)
    return {f"{MODEL}/{name}": entry for name, entry in written.items()}


def save_sharded(sharded_state_dict: dict, folder: Path, writes: ShardWrites | None = None
                 ) -> dict[str, dict]:
    """A dist checkpoint of `sharded_state_dict` in `folder`: planned into `writes` (a
    save's `ShardWrites`, which its caller writes and finishes), or written now; what this
    rank wrote now, {name under `folder`: entry}, hashed as it was written (`Writer.record`
    takes it rather than read the files again)."""
    if writes is not None:
        writes.add(sharded_state_dict, folder)
        return {}
    now = ShardWrites()
    now.add(sharded_state_dict, folder)
    now.write()
    return now.finish(folder)


def load_sharded(sharded_state_dict: dict, folder: Path, **options) -> dict:
    """`sharded_state_dict`'s tensors from the dist checkpoint `folder`, each rank reading
    its share (`strategy.parallel_load_strategy`); tensors are loaded into the state
    dict's own where a rank reads them itself."""
    check_readable(folder)
    return dist_checkpointing.load(sharded_state_dict, str(folder),
                                   sharded_strategy=parallel_load_strategy(), **options)


def load_model(model, ckpt: Path, tables: str = "keep", dense_source: bool = False,
               dense: bool = True) -> None:
    """Load a checkpoint's weights into `model`, whatever layout it was saved from.

    `tables: reinit` leaves the model's STEM tables as they were built (a fresh run's
    init) instead of loading the checkpoint's. `dense_source`: the checkpoint is the dense
    baseline of this STEM model (`check_same_shape`): each STEM layer's gate and down
    projections are the dense layer's gate half of `linear_fc1` and its `linear_fc2`, its
    up half is dropped, the tables start fresh; every other weight is loaded as it is.
    `dense=False` reads the tables' weights only: the dense parameters' come with their
    optimizer's fp32 masters (`optimizer_io.load_optimizers`), which hold them exactly."""
    def unread(key: str, sh) -> bool:  # left as the model holds it
        if _is_table(key):
            return tables == "reinit" or dense_source
        return not dense and isinstance(sh, (ShardedTensor, ShardedTensorFactory))

    sharded = model.sharded_state_dict()
    fresh = {k: sharded.pop(k) for k in list(sharded) if unread(k, sharded[k])}
    if dense_source:
        sharded = {k: from_dense_mlp(v) if STEM_MLP.search(k) else v
                   for k, v in sharded.items()}
    # The dense up halves are never read, which megatron's check that every part of a
    # tensor is read exactly once would refuse.
    state = load_sharded(sharded, ckpt / MODEL, validate_access_integrity=not dense_source)
    state.update({k: sh.data for k, sh in fresh.items()})
    model.load_state_dict(state)


def _is_table(key: str) -> bool:
    return key.endswith(".mlp.table.weight")
