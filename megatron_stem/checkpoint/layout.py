"""A checkpoint on disk: its folder's names, and the run folder around it.

    <save_dir>/
      latest                 "iter_0000200": the newest complete checkpoint (a hint)
      iter_0000200/
        recipe.yaml          the resolved recipe the model was built from
        CODE_VERSION         the code that saved it (git describe; runtime/code_version.py)
        model/               megatron dist checkpoint of StemGPTModel.sharded_state_dict()
        optim/               optimizer states (dense and tables), a dist checkpoint too
        train_state.pt       step, data position, RNG states
        COMPLETE             written last: the other files' sizes and checksums (JSON);
                             a folder without it is not a checkpoint
        KEPT                 (optional) kept from pruning by the divergence guard
      iter_0000300.tmp/      a save in progress (or one that crashed): never read

`latest` may be empty or zero-filled after a crash on storage that lost its last write, or
edited by hand: `hint` says when it is no hint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from megatron_stem.config import Recipe, from_dict, upgrade_saved_recipe

LATEST = "latest"
COMPLETE = "COMPLETE"
RECIPE = "recipe.yaml"
CODE_VERSION = "CODE_VERSION"  # git describe of the code that saved it
MODEL = "model"
KEPT = "KEPT"  # a checkpoint `prune` leaves: the divergence guard's last good one
_ITER = re.compile(r"^iter_(\d{7,})$")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


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


def iter_folders(save_dir: Path) -> list[Path]:
    """The iter_N folders under `save_dir` (whole or not), in no order."""
    return [p for p in save_dir.iterdir() if _ITER.match(p.name)] if save_dir.is_dir() else []


def step_of(folder: Path) -> int:
    match = _ITER.match(folder.name)
    return int(match[1]) if match else -1


def read_recipe(ckpt: Path, cls: type = Recipe):
    return from_dict(cls, upgrade_saved_recipe(yaml.safe_load((ckpt / RECIPE).read_text())))


def prune(save_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all), and
    those the divergence guard kept (`KEPT`)."""
    if keep_last <= 0:
        return
    done = sorted((p for p in iter_folders(save_dir)
                   if (p / COMPLETE).exists()), key=step_of)
    for old in done[:-keep_last]:
        if not (old / KEPT).exists():
            shutil.rmtree(old, ignore_errors=True)


def last_before(save_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint of a step before `step` (None: there is none)."""
    done = [p for p in iter_folders(save_dir)
            if (p / COMPLETE).exists() and step_of(p) < step]
    return max(done, key=step_of) if done else None
