"""`train_state.pt`: the step, the data position, the CPU generator's state and the
optimizers' step count, as numbers and tensors only, read without unpickling any object."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from megatron_stem.checkpoint.checksums import write_file
from megatron_stem.checkpoint.unpickling import UNSUPPORTED, damaged
from megatron_stem.runtime.errors import UserError

TRAIN_STATE = "train_state.pt"
# In the train state: the steps the optimizers have applied (their Adam step count), across
# the stages a run was initialized from with its optimizer states (`train.init_optimizer`);
# a step the divergence guard skipped is not one. Checkpoints saved before it was written
# hold `STEPS_BEFORE` (the source run's steps) instead.
OPTIMIZER_STEPS = "optimizer_steps"
STEPS_BEFORE = "optimizer_steps_before"


def optimizer_steps(state: dict) -> int:
    """The optimizers' step count a train state resumes them at."""
    return state.get(OPTIMIZER_STEPS, state.get(STEPS_BEFORE, 0) + state["step"])


def save_train_state(folder: Path, step: int, extra: dict) -> dict[str, dict]:
    """`step`, the CPU generator's state and `extra`: numbers and tensors only, which
    `load_train_state` reads without unpickling any object. Written durably; returns its
    entry for COMPLETE (`commit.Writer.record`)."""
    state = {"step": step, "rng_cpu": torch.get_rng_state(), **extra}
    bad = {k: type(v).__name__ for k, v in state.items()
           if not isinstance(v, (int, float, torch.Tensor))}
    if bad:
        raise TypeError(f"train state: numbers and tensors only, got {bad}")
    data = io.BytesIO()
    torch.save(state, data)
    return {TRAIN_STATE: write_file(folder / TRAIN_STATE, data.getvalue())}


def load_train_state(ckpt: Path) -> dict:
    """The train state of `ckpt`, read with `weights_only=True`: a checkpoint may come from
    a shared folder or a download, and unpickling an object can run any code. A file that
    holds one (no version of this project wrote any) is refused in one line, and so is a
    damaged one (checkpoints saved before checksums were kept do not catch that earlier)."""
    path = ckpt / TRAIN_STATE
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = UNSUPPORTED.search(str(e))
        if found is None and "weights_only" not in str(e):
            raise damaged(path, e) from None
        what = f"a Python object ({found[1]})" if found else "a Python object"
        raise UserError(f"{path}: refused: it holds {what}, not only the numbers and "
                        "tensors of a train state, and loading it could run code (this "
                        "project never writes one: the file was made or altered elsewhere)"
                        ) from None
    except Exception as e:  # a damaged zip or pickle stream: zip, UTF-8 and EOF errors
        raise damaged(path, e) from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(f"{path}: damaged (no step in it)")
    return state
