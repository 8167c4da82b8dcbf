"""A damaged checkpoint is refused in one line naming the file, and a resume falls back
to the newest whole one, saying so (`resume_point`, which the trainer's `Checkpointer`
uses).

Each case damages the newest of two real checkpoints (a tiny model's dist checkpoint,
saved through the same Writer as training) the way a full disk, a killed copy or a wrong
`cp` would.
"""

import shutil

import pytest

from megatron_stem import checkpoint
from megatron_stem.config import ParallelConfig, Recipe
from megatron_stem.errors import UserError
from megatron_stem.model import build_model
from megatron_stem.training.checkpointing import resume_point
from megatron_stem.training.state import save_train_state
from workers.common import tiny_model


def _save(save_dir, step, recipe):
    with checkpoint.Writer(save_dir, step, recipe) as folder:
        checkpoint.save_model(build_model(recipe.model, ParallelConfig()), folder)
        save_train_state(folder, step, {})


@pytest.fixture
def saved(world1, tmp_path):
    """(save dir with whole checkpoints of steps 1 and 2, its recipe)"""
    recipe = Recipe(model=tiny_model())
    for step in (1, 2):
        _save(tmp_path / "run", step, recipe)
    return tmp_path / "run", recipe


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def _other_models_metadata(path):
    other = path.parents[3] / "other"
    _save(other, 1, Recipe(model=tiny_model(hidden_size=32, num_attention_heads=2)))
    shutil.copy(other / "iter_0000001" / "model" / ".metadata", path)


def _other_models_recipe(path):
    path.write_text(path.read_text().replace("hidden_size: 64", "hidden_size: 32"))


DAMAGES = {  # file of the newest checkpoint, what happens to it, the line's end
    "missing shard": ("model/__0_0.distcp", lambda p: p.unlink(),
                      "missing (the checkpoint was saved with it)"),
    "truncated shard": ("model/__0_1.distcp", _truncate, "100 bytes, {size} when saved "
                        "(truncated or overwritten)"),
    "truncated train state": ("train_state.pt", _truncate, "100 bytes, {size} when saved "
                              "(truncated or overwritten)"),
    "another model's metadata": ("model/.metadata", _other_models_metadata,
                                 "bytes, {size} when saved (truncated or overwritten)"),
    "another model's recipe": ("recipe.yaml", _other_models_recipe,
                               "checkpoint is of another model shape (model.hidden_size: "
                               "checkpoint 32, recipe 64)"),
    "no COMPLETE marker": ("COMPLETE", lambda p: p.unlink(), None),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_and_the_run_falls_back(saved, damage):
    save_dir, recipe = saved
    name, spoil, ending = DAMAGES[damage]
    newest = save_dir / "iter_0000002"
    file = newest / name
    size = file.stat().st_size if file.exists() else 0
    spoil(file)
    said = []
    assert resume_point(save_dir, recipe, said.append) == save_dir / "iter_0000001"
    refusal, fallback = said
    assert refusal.startswith(f"warning: refusing checkpoint iter_0000002: {newest}")
    if name != "COMPLETE":
        assert refusal.startswith(f"warning: refusing checkpoint iter_0000002: {file}: ")
    if ending is not None:
        assert refusal.endswith(ending.format(size=size))
    assert fallback == f"warning: falling back to {save_dir / 'iter_0000001'}, the newest " \
                      "whole checkpoint"


def test_latest_naming_a_missing_folder_falls_back_to_the_newest(saved):
    save_dir, recipe = saved
    (save_dir / "latest").write_text("iter_0000009\n")
    said = []
    assert resume_point(save_dir, recipe, said.append) == save_dir / "iter_0000002"
    assert said == [f"warning: {save_dir / 'latest'}: names iter_0000009, which does not exist",
                    f"warning: falling back to {save_dir / 'iter_0000002'}, the newest whole "
                    "checkpoint"]


def test_a_whole_checkpoint_resumes_silently_and_nothing_whole_is_an_error(saved):
    save_dir, recipe = saved
    said = []
    assert resume_point(save_dir, recipe, said.append) == save_dir / "iter_0000002"
    assert said == []
    for step in (1, 2):
        (save_dir / f"iter_000000{step}" / "model" / "common.pt").unlink()
    with pytest.raises(UserError, match=r"run: no whole checkpoint to resume from \(see the "
                                        r"lines above\); move the folder away"):
        resume_point(save_dir, recipe, said.append)
    assert len(said) == 2 and all("common.pt: missing" in line for line in said)
    assert resume_point(save_dir.parent / "fresh", recipe) is None
