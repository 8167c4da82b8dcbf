"""The train state (`train_state.pt`: step, data position, RNG state) is read without
unpickling objects (`torch.load(weights_only=True)`): a checkpoint folder from a shared
filesystem or a download could otherwise run code at resume."""

import pathlib

import pytest
import torch

from megatron_stem.runtime.errors import UserError
from megatron_stem.checkpoint.train_state import TRAIN_STATE, load_train_state, save_train_state


def test_a_train_state_written_by_earlier_versions_still_loads(tmp_path):
    # What every earlier version wrote (checkpoint/checkpointer.py's call, train_state.py's torch.save).
    rng = torch.get_rng_state()
    torch.save({"step": 12, "rng_cpu": rng, "consumed_samples": 96}, tmp_path / TRAIN_STATE)
    state = load_train_state(tmp_path)
    assert state.keys() == {"step", "rng_cpu", "consumed_samples"}
    assert (state["step"], state["consumed_samples"]) == (12, 96)
    assert torch.equal(state["rng_cpu"], rng)


def test_the_train_state_round_trips_and_holds_numbers_and_tensors_only(tmp_path):
    save_train_state(tmp_path, 7, {"consumed_samples": 56})
    state = load_train_state(tmp_path)
    assert (state["step"], state["consumed_samples"]) == (7, 56)
    assert torch.equal(state["rng_cpu"], torch.get_rng_state())
    with pytest.raises(TypeError, match=r"numbers and tensors only, got \{'data': 'dict'\}"):
        save_train_state(tmp_path, 7, {"data": {"epoch": 1}})


class _Touch:
    """A pickled object that, when loaded, creates a file: what an attacker's would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def test_a_train_state_holding_an_object_is_refused_without_running_it(tmp_path):
    ran = tmp_path / "ran"
    torch.save({"step": 3, "rng_cpu": torch.get_rng_state(), "x": _Touch(ran)},
               tmp_path / TRAIN_STATE)
    with pytest.raises(UserError) as refused:
        load_train_state(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / TRAIN_STATE}: refused: it holds a Python object (getattr), not only "
        "the numbers and tensors of a train state, and loading it could run code (this "
        "project never writes one: the file was made or altered elsewhere)")
    assert not ran.exists()
