"""A damaged checkpoint is refused in one line naming the file, and a resume falls back
to the newest whole one, saying so (`resume_point`, which the trainer's `Checkpointer`
uses).

Each case damages the newest of two real checkpoints (a tiny model's dist checkpoint,
saved through the same Writer as training) the way a full disk, a killed copy or a wrong
`cp` would.
"""

import shutil
import subprocess
import sys

import pytest

from megatron_stem import checkpoint
from megatron_stem.config import ParallelConfig, Recipe
from megatron_stem.runtime.errors import UserError
from megatron_stem.model import build_model
from megatron_stem.checkpoint.finding import resume_point
from megatron_stem.checkpoint.train_state import save_train_state
from support.processes import ROOT, subprocess_env, tool
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


def _flip_bytes(path, at=None):
    """Same size, other contents (8 bytes from `at`, default the middle): what sizes alone
    cannot see."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at:at + 8] = bytes(b ^ 0xA5 for b in data[at:at + 8])
    path.write_bytes(bytes(data))


def _other_models_recipe(path):
    path.write_text(path.read_text().replace("hidden_size: 64", "hidden_size: 32"))


CHANGED = "contents differ from when saved (xxh3_64 checksum; same size: damaged on disk " \
          "or overwritten)"
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
    "bytes flipped in a shard": ("model/__0_0.distcp", _flip_bytes, CHANGED),
    "bytes flipped in the train state": ("train_state.pt", _flip_bytes, CHANGED),
    "COMPLETE holding a JSON list": ("COMPLETE", lambda p: p.write_text('["a", "b"]'),
                                     "damaged (not the JSON object of file sizes and "
                                     "checksums it should be)"),
    "COMPLETE not UTF-8": ("COMPLETE", lambda p: p.write_bytes(b"\xff\xfe{"),
                           "damaged (not the JSON object of file sizes and checksums it "
                           "should be)"),
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
    if name != "COMPLETE" or ending is not None:
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
        (save_dir / f"iter_000000{step}" / "model" / "metadata.json").unlink()
    with pytest.raises(UserError, match=r"run: no whole checkpoint to resume from \(see the "
                                        r"lines above\); move the folder away"):
        resume_point(save_dir, recipe, said.append)
    assert len(said) == 2 and all("metadata.json: missing" in line for line in said)
    assert resume_point(save_dir.parent / "fresh", recipe) is None


@pytest.mark.parametrize("content", [b"", b".\n", b"\x00" * 14, b"\xff\xfeiter_0000002",
                                     b"../other/iter_0000002\n"])
def test_latest_is_only_a_hint(saved, content):
    """An empty, zero-filled (a crash that lost its last write), non-UTF-8 or foreign
    `latest` is ignored in one line: the newest whole checkpoint is taken."""
    save_dir, recipe = saved
    (save_dir / "latest").write_bytes(content)
    said = []
    assert resume_point(save_dir, recipe, said.append) == save_dir / "iter_0000002"
    warning, fallback = said
    assert warning.startswith(f"warning: {save_dir / 'latest'}: ")
    assert warning.endswith(", ignored") and "\n" not in warning
    assert fallback == f"warning: falling back to {save_dir / 'iter_0000002'}, the newest " \
                       "whole checkpoint"
    assert checkpoint.resolve(save_dir, say=said.append) == save_dir / "iter_0000002"


def test_latest_and_complete_are_written_durably(world1, tmp_path, monkeypatch):
    """Each is fsynced before its rename and its folder after it: a node crash leaves the
    old file or the new one, never an empty one."""
    import os

    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(
        f"/proc/self/fd/{fd}")), fsync(fd)))
    _save(tmp_path / "run", 1, Recipe(model=tiny_model()))
    run = tmp_path / "run"
    for name in ("COMPLETE", "latest"):
        marker = run / "iter_0000001.tmp" / name if name == "COMPLETE" else run / name
        assert str(marker) + ".tmp" in synced
    assert synced.count(str(run)) >= 2  # the checkpoint's rename, then latest's
    assert (run / "iter_0000001" / "COMPLETE").is_file()


def test_a_damaged_train_state_is_one_line(world1, tmp_path):
    """A marker from before checksums (sizes only) lets same-size damage through to the
    train state's reader, which says so in one line."""
    from megatron_stem.checkpoint.train_state import load_train_state

    recipe = Recipe(model=tiny_model())
    _save(tmp_path, 1, recipe)
    state = tmp_path / "iter_0000001" / "train_state.pt"
    _flip_bytes(state, at=100)  # in the pickled dictionary
    with pytest.raises(UserError, match=rf"^{state}: damaged \(\w+Error: "):
        load_train_state(state.parent)


@pytest.mark.integration  # tools/to_hf.py as a process
def test_to_hf_and_verify_refuse_same_size_damage_in_one_line(saved, tmp_path, capsys):
    """The export tool read a flipped table shard and wrote wrong weights; now it and
    `verify_checkpoint.py` refuse it, naming the file."""
    save_dir, _ = saved
    shard = save_dir / "iter_0000002" / "model" / "__0_0.distcp"
    assert tool("verify_checkpoint")(["--checkpoint", str(save_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {save_dir / 'iter_0000002'} (")
    _flip_bytes(shard)
    proc = subprocess.run([sys.executable, str(ROOT / "tools/to_hf.py"), "--checkpoint",
                           str(save_dir / "iter_0000002"), "--output", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300,
                          env=subprocess_env(PYTHONWARNINGS="ignore"))
    assert (proc.returncode, proc.stderr) == (2, f"error: {shard}: {CHANGED}\n")
    assert not (tmp_path / "hf").exists()
    assert tool("verify_checkpoint")(["--checkpoint", str(save_dir), "--all"]) == 2
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith(f"ok: {save_dir / 'iter_0000001'} (")
    assert second == f"damaged: {shard}: {CHANGED}"


def test_a_damaged_train_state_is_no_traceback_before_the_run_starts(saved):
    """The quick look at `latest` before a run starts ("already finished?") read a damaged
    train state with a UnicodeDecodeError; now it leaves the checkpoint to the resume,
    which refuses it by its checksum and falls back."""
    from dataclasses import replace

    from megatron_stem.checkpoint.finding import finished_step

    save_dir, recipe = saved
    recipe = replace(recipe, train=replace(recipe.train, save_dir=str(save_dir), steps=2))
    assert finished_step(recipe) == 2
    _flip_bytes(save_dir / "iter_0000002" / "train_state.pt", at=100)
    assert finished_step(recipe) is None
    said = []
    assert resume_point(save_dir, recipe, said.append) == save_dir / "iter_0000001"
    assert said[0].endswith(f"train_state.pt: {CHANGED}")


def test_a_tool_given_a_save_dir_without_a_whole_checkpoint_says_why(saved, tmp_path):
    save_dir, _ = saved
    for step in (1, 2):
        (save_dir / f"iter_000000{step}" / "COMPLETE").unlink()
    with pytest.raises(UserError, match=rf"^{save_dir}: no whole checkpoint \(the newest: "
                                        rf"{save_dir / 'iter_0000002'}: not a complete "):
        checkpoint.resolve(save_dir, say=lambda line: None)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "latest").write_text("iter_0000003\n")
    with pytest.raises(UserError, match=rf"^{lone}: no checkpoint in it \(its latest names "
                                        "none\\)"):
        checkpoint.resolve(lone, say=lambda line: None)
