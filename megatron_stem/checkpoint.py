"""Checkpoint layout, atomic commit, and the model part (megatron dist-checkpointing).

    <save_dir>/
      latest                 "iter_0000200": the newest complete checkpoint
      iter_0000200/
        recipe.yaml          the resolved recipe the model was built from
        CODE_VERSION         the code that saved it (git describe; code_version.py)
        model/               megatron dist checkpoint of StemGPTModel.sharded_state_dict()
        optim/               optimizer states (dense and tables), a dist checkpoint too
        train_state.pt       step, data position, RNG states
        COMPLETE             written last: the other files' sizes and checksums (JSON);
                             a folder without it is not a checkpoint

Dist checkpoints are layout-free: any TP/PP/DP layout loads what any other saved. Every
data-parallel rank writes its share of the replicated tensors (megatron's fully parallel
save strategy), instead of DP rank 0 writing them all (docs/checkpoints.md).
A checkpoint is written into `iter_N.tmp/` and renamed into place only when complete, then
`latest` is replaced atomically and durably, so a crash mid-save never touches the last
good one. `latest` is a hint: a reader that finds it empty, unreadable or naming no
checkpoint folder takes the newest whole one (`hinted`). A checkpoint damaged since (a
missing, truncated or altered file, another model's recipe) is refused in one line naming
the file (`verify`; the checksums: `checksums.py`). Which checkpoint a run resumes from, and
which it keeps, is the trainer's policy: `training/checkpointing.py`.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from megatron_stem import checksums, storage
from megatron_stem.code_version import code_version
from megatron_stem.config import Recipe, from_dict, to_dict, upgrade_saved_recipe
from megatron_stem.errors import UserError
from megatron_stem.mcore_versions import SAVE_THREADS, check_readable

LATEST = "latest"
COMPLETE = "COMPLETE"
RECIPE = "recipe.yaml"
CODE_VERSION = "CODE_VERSION"  # git describe of the code that saved it
MODEL = "model"
_ITER = re.compile(r"^iter_(\d{7,})$")


class NoWholeCheckpoint(UserError):
    """Checkpoint folders, none of them whole."""


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def hint(save_dir: Path) -> tuple[Path | None, str | None]:
    """(the iter_N folder `latest` names, None if it names none; why it is no hint, None
    when it is one or there is no `latest`). `latest` may be empty or zero-filled after a
    crash on storage that lost its last write, or edited by hand."""
    pointer = save_dir / LATEST
    try:
        text = pointer.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer}: unreadable ({type(e).__name__}), ignored"
    if not _ITER.match(text):
        return None, f"{pointer}: holds {text[:40]!r}, not a checkpoint's name, ignored"
    if not (save_dir / text).is_dir():
        return None, f"{pointer}: names {text}, which does not exist"
    return save_dir / text, None


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


def verify(ckpt: Path, recipe=None, contents: bool = True) -> None:
    """Refuse, in one line naming the file, a checkpoint that is not whole: no COMPLETE
    marker, a file missing, of another size, or (`contents`) of other contents than when it
    was saved, an unreadable recipe.yaml, or (given `recipe`) one of another model shape.
    With `contents`, a collective under a process group: the checksums are shared over
    the ranks (`checksums.check_contents`), and all refuse what any one found."""
    if not contents:
        _check_layout(ckpt, recipe)
        return
    problem = None
    try:
        entries = _check_layout(ckpt, recipe)
    except UserError as e:
        problem = str(e)
    problem = checksums.agreed(problem)
    if problem is not None:
        raise UserError(problem)
    checksums.check_contents(ckpt, entries)


def _check_layout(ckpt: Path, recipe) -> dict[str, dict]:
    """`verify` without reading the files' contents; the marker's entries."""
    marker = ckpt / COMPLETE
    if not marker.is_file():
        raise UserError(f"{ckpt}: not a complete megatron-stem checkpoint (no {COMPLETE} marker;"
                        " an interrupted save, or not written by megatron-stem)")
    entries = checksums.read(marker)
    checksums.check_sizes(ckpt, entries)
    if not (ckpt / RECIPE).is_file():
        raise UserError(f"{ckpt}: not a megatron-stem checkpoint (no {RECIPE})")
    try:
        saved = read_recipe(ckpt)
    except Exception as e:  # any parse or schema error: the file is not what we wrote
        raise UserError(f"{ckpt / RECIPE}: unreadable ({str(e).splitlines()[0]})") from None
    if recipe is not None:
        check_same_shape(saved, recipe, ckpt)
    return entries


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
        if exc_type is not None:  # the .tmp folder is left; the last good one is untouched
            # (torch's CheckpointException, what a failed write raises, is a BaseException)
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)) \
                    and storage.full(self.save_dir, exc):
                kept = latest(self.save_dir)
                raise UserError(f"no space left on device while saving {self.final}; "
                                + (f"{kept} is intact" if kept else
                                   f"no earlier checkpoint in {self.save_dir}")) from None
            return False
        _barrier()  # every rank has finished writing its parts
        entries = checksums.record(self.tmp, exclude=RECIPE)  # every rank hashes a share
        if _is_writer():
            checksums.write(self.tmp / COMPLETE, entries)
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            storage.fsync_path(self.save_dir)  # the rename, before `latest` names it
            point_latest(self.save_dir, self.final)
        _barrier()
        return False


def point_latest(save_dir: Path, ckpt: Path) -> None:
    """Make `ckpt` the checkpoint `latest` names, durably (the rename of `ckpt` too)."""
    storage.write_durably(save_dir / LATEST, ckpt.name + "\n")


def save_model(model, folder: Path, background=None) -> None:
    if _is_writer():
        (folder / MODEL).mkdir(exist_ok=True)
    _barrier()
    save_sharded(model.sharded_state_dict(), folder / MODEL, background)


def save_sharded(sharded_state_dict: dict, folder: Path, background=None) -> None:
    """A dist checkpoint of `sharded_state_dict` in `folder`, written now, or planned and
    copied to host memory now and written by `background` (a `BackgroundSave`)."""
    if background is not None:
        background.add(sharded_state_dict, folder)
    else:
        dist_checkpointing.save(sharded_state_dict, str(folder),
                                sharded_strategy=parallel_save_strategy())


def parallel_save_strategy() -> FullyParallelSaveStrategyWrapper | TorchDistSaveShardedStrategy:
    """Megatron's torch_dist save with the writes spread over the data-parallel replicas:
    each tensor shard replicated over DP is written by one of them, chosen to balance the
    bytes per rank (only metadata is exchanged). Without it DP rank 0 writes them all. Each
    rank writes `mcore_versions.SAVE_THREADS` files, whichever megatron-core writes them."""
    _keep_write_results_in_process()
    files = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=SAVE_THREADS)
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return files
    return FullyParallelSaveStrategyWrapper(files, ps.get_data_parallel_group())


def _keep_write_results_in_process() -> None:
    """megatron's file writer returns its results through a queue made for asynchronous
    saves: a multiprocessing manager started with `spawn`, a new interpreter that imports
    the training script again (torch, megatron, DeepSpeed: ~5 s of CPU per rank, and 40%
    of a small test run) at a rank's first save. Our saves are synchronous: the results
    are put and read in this process, so a plain queue does."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_model(model, ckpt: Path, tables: str = "keep", dense_source: bool = False) -> None:
    """Load a checkpoint's weights into `model`, whatever layout it was saved from.

    `tables: reinit` leaves the model's STEM tables as they were built (a fresh run's
    init) instead of loading the checkpoint's. `dense_source`: the checkpoint is the dense
    baseline of this STEM model (`check_same_shape`): each STEM layer's gate and down
    projections are the dense layer's gate half of `linear_fc1` and its `linear_fc2`, its
    up half is dropped, the tables start fresh; every other weight is loaded as it is."""
    sharded = model.sharded_state_dict()
    fresh = {k: sharded.pop(k) for k in list(sharded)
             if _is_table(k) and (tables == "reinit" or dense_source)}
    if dense_source:
        sharded = {k: _from_dense_mlp(v) if _STEM_MLP.search(k) else v
                   for k, v in sharded.items()}
    check_readable(ckpt / MODEL)
    # The dense up halves are never read, which megatron's check that every part of a
    # tensor is read exactly once would refuse.
    state = dist_checkpointing.load(sharded, str(ckpt / MODEL),
                                    validate_access_integrity=not dense_source)
    state.update({k: sh.data for k, sh in fresh.items()})
    model.load_state_dict(state)


_STEM_MLP = re.compile(r"\.mlp\.linear_(gate|down)\.")


def _is_table(key: str) -> bool:
    return key.endswith(".mlp.table.weight")


def _from_dense_mlp(sh):
    """A STEM MLP's gate or down projection (weight or extra state) as the part of the
    dense MLP's checkpointed tensor it starts from. Megatron saves a SwiGLU `linear_fc1`
    as one [2 x ffn, hidden] tensor, the gate rows first (`apply_swiglu_sharded_factory`):
    a gate shard is the same rows of a tensor twice as tall."""
    key = sh.key.replace(".linear_gate.", ".linear_fc1.").replace(".linear_down.", ".linear_fc2.")
    if not sh.key.endswith("linear_gate.weight"):
        return replace(sh, key=key)
    axis = sh.prepend_axis_num
    shape, frags = list(sh.global_shape), list(sh.axis_fragmentations)
    shape[axis] *= 2
    frags[axis] *= 2
    return replace(sh, key=key, global_shape=tuple(shape), axis_fragmentations=tuple(frags))


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


def check_same_shape(saved_recipe, recipe, ckpt: Path, dense_source: bool = False) -> None:
    """A checkpoint whose parameters have other shapes is a user error, not a size-mismatch
    traceback (`parameter_shape`: the fields compared; the others may differ).
    `dense_source`: a STEM model from its dense baseline (`load_model`), the same shape
    but for the STEM layers."""
    saved, wanted = parameter_shape(saved_recipe.model), parameter_shape(recipe.model)
    if dense_source:
        del saved["stem_layers"], wanted["stem_layers"]
    diffs = [f"model.{k}: checkpoint {_shown(saved_recipe.model, k, saved[k])!r}, recipe "
             f"{_shown(recipe.model, k, wanted[k])!r}" for k in saved if saved[k] != wanted[k]]
    if diffs:
        what = "the dense baseline of another shape" if dense_source \
            else "checkpoint is of another model shape"
        raise UserError(f"{Path(ckpt) / RECIPE}: {what} ({'; '.join(diffs)})")


def is_dense_source(saved_recipe, recipe) -> bool:
    """A dense checkpoint starting a STEM model (`load_model`'s `dense_source`)."""
    return recipe.model.is_stem and not saved_recipe.model.is_stem


def _shown(model, key: str, value):
    """A compared value as the recipe gives it (a placement as written, not its layers)."""
    return model.stem_layers if key == "stem_layers" else value
