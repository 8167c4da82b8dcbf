"""Loading a checkpoint runs no code from it: every pickle torch or megatron-core would
unpickle from a checkpoint folder (a dist checkpoint's `.metadata`, the objects inside its
shards, `common.pt`) is read first by an allow-listed unpickler, and one that names
anything but data is refused in one line naming the file, on every path that reads a
checkpoint; the command such a pickle carries never runs.

Each crafted checkpoint is a real one (a tiny model saved through the same Writer as
training) with one pickle replaced by one that calls `os.system`, its COMPLETE entry
updated to match, as anyone handing out a checkpoint could."""

import io
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megatron_stem import checkpoint
from megatron_stem.checkpoint import checksums, unpickling
from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.checkpoint.train_state import save_train_state
from megatron_stem.config import ParallelConfig, Recipe, TrainConfig
from megatron_stem.model import build_model
from megatron_stem.runtime.errors import UserError
from support.processes import tool
from workers.common import tiny_model


class _Run:
    """Unpickled, runs `command` in a shell: what an attacker's pickle would do."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _recorded_again(ckpt: Path, *names: str) -> None:
    entries = checksums.read(ckpt / checkpoint.COMPLETE)
    entries.update({name: checksums.entry_of(ckpt / name) for name in names})
    checksums.write(ckpt / checkpoint.COMPLETE, entries)


def _index(ckpt: Path, command: str) -> str:
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(_Run(command)))
    return "model/.metadata"


def _object_in_a_shard(ckpt: Path, command: str) -> str:
    """A layer's `_extra_state` object pointed at a crafted pickle appended to its shard
    (the index rewritten with its own, allowed, classes)."""
    folder = ckpt / "model"
    index = pickle.loads((folder / ".metadata").read_bytes())
    key = next(k for k, v in index.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata))
    where = next(i for i in index.storage_data if i.fqn == key)
    info = index.storage_data[where]
    crafted = io.BytesIO()
    torch.save([_Run(command)], crafted)  # as megatron-core saves an object
    crafted = crafted.getvalue()
    shard = folder / info.relative_path
    index.storage_data[where] = replace(info, offset=shard.stat().st_size, length=len(crafted))
    with open(shard, "ab") as f:
        f.write(crafted)
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    _recorded_again(ckpt, "model/.metadata")
    return f"model/{info.relative_path}"


def _common_state(ckpt: Path, command: str) -> str:
    torch.save({"content": _Run(command)}, ckpt / "model" / "common.pt")
    return "model/common.pt"


CRAFTED = {".metadata": _index, "an object in a shard": _object_in_a_shard,
           "common.pt": _common_state}
REFUSED = ("refused: loading it would call posix.system, which can run any code (a "
           "checkpoint holds data only there: the file was made or altered elsewhere)")


@pytest.fixture
def saved(world1, tmp_path):
    """(the save dir of a whole checkpoint of step 1, its folder, its recipe)"""
    recipe = Recipe(model=tiny_model(), train=TrainConfig(save_dir=str(tmp_path / "run")))
    with checkpoint.Writer(tmp_path / "run", 1, recipe) as folder:
        checkpoint.save_model(build_model(recipe.model, ParallelConfig()), folder)
        save_train_state(folder, 1, {})
    return tmp_path / "run", tmp_path / "run" / "iter_0000001", recipe


def _craft(ckpt: Path, where: str, marker: Path) -> Path:
    name = CRAFTED[where](ckpt, f"touch {marker}")
    _recorded_again(ckpt, name)
    return ckpt / name


def test_a_whole_index_reads_as_torch_reads_it(saved):
    _, ckpt, _ = saved
    index = ckpt / "model" / ".metadata"
    assert unpickling.read_metadata(index) == pickle.loads(index.read_bytes())
    checkpoint.verify(ckpt)


@pytest.mark.parametrize("where", CRAFTED)
def test_a_crafted_pickle_is_refused_unrun_wherever_it_is(saved, where, tmp_path):
    _, ckpt, _ = saved
    marker = tmp_path / "ran"
    crafted = _craft(ckpt, where, marker)
    with pytest.raises(UserError) as refused:
        checkpoint.verify(ckpt)
    assert str(refused.value) == f"{crafted}: {REFUSED}"
    assert not marker.exists()


def test_resume_and_init_from_refuse_it_in_one_line(saved, tmp_path, capsys):
    save_dir, ckpt, recipe = saved
    marker = tmp_path / "ran"
    crafted = _craft(ckpt, ".metadata", marker)
    with pytest.raises(UserError, match=rf"^{save_dir}: no whole checkpoint to resume from"):
        Checkpointer(recipe)  # the trainer's resume
    assert capsys.readouterr().out.splitlines()[0] == \
        f"warning: refusing checkpoint {ckpt.name}: {crafted}: {REFUSED}"
    stage = replace(recipe, train=replace(recipe.train, save_dir=str(tmp_path / "next"),
                                          init_from=str(ckpt)))
    with pytest.raises(UserError) as refused:
        Checkpointer(stage)
    assert str(refused.value) == f"train.init_from: {crafted}: {REFUSED}"
    assert not marker.exists()


@pytest.mark.parametrize("command", ["to_hf", "edit_knowledge", "verify_checkpoint"])
def test_the_tools_refuse_it_in_one_line(saved, tmp_path, capsys, command):
    """tools/to_hf.py, tools/edit_knowledge.py and tools/verify_checkpoint.py --all, as a
    user runs them."""
    save_dir, ckpt, _ = saved
    marker = tmp_path / "ran"
    crafted = _craft(ckpt, ".metadata", marker)
    edits = tmp_path / "edits.yaml"
    edits.write_text("- {source: [4], target: [6]}\n")
    args = {"to_hf": ["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")],
            "edit_knowledge": ["--checkpoint", str(ckpt), "--edits", str(edits), "--prompt", "a"],
            "verify_checkpoint": ["--checkpoint", str(save_dir), "--all"]}[command]
    assert tool(command)(args) == 2
    said = capsys.readouterr()
    if command == "verify_checkpoint":
        assert said.out == f"damaged: {crafted}: {REFUSED}\n"
    else:
        assert said.err == f"error: {crafted}: {REFUSED}\n"
    assert not marker.exists() and not (tmp_path / "hf").exists()
