"""The profiler window (training/profiling.py): a trace that loads, on the chosen ranks
only, the CUDA memory snapshot's calls at the window's ends (their logic on CPU, the
allocator a stand-in), and the recipe's mistakes refused in one line."""

import json

import pytest
import torch

from megatron_stem.config import ProfileConfig, load_recipe
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.training.profiling import PhaseTimer, ProfilerWindow, check_ranks

from support.processes import ROOT


class MemoryHistory:
    """What the window calls of torch.cuda.memory, recorded."""

    def __init__(self):
        self.calls = []

    def _record_memory_history(self, enabled="all", max_entries=0):
        self.calls.append(("record", enabled, max_entries))

    def _dump_snapshot(self, path):
        self.calls.append(("dump", path))


def run_steps(window: ProfilerWindow, steps: int, marks: list) -> None:
    timer = PhaseTimer()
    weight = torch.randn(64, 64, requires_grad=True)
    for step in range(1, steps + 1):
        window.before(step)
        marks.append((step, len(window.memory.calls) if window.memory else 0))
        with timer.phase("forward_backward"):
            (weight @ weight).sum().backward()
        with timer.phase("tables_step"):
            weight.data.add_(weight.grad, alpha=-1e-3)
        window.after(step)


def test_a_window_writes_a_trace_that_loads_and_a_memory_snapshot(tmp_path):
    config = ProfileConfig(start_step=2, steps=2, ranks=[0, 3], dir=str(tmp_path / "p"))
    memory, marks = MemoryHistory(), []
    window = ProfilerWindow(config, rank=3, save_dir=str(tmp_path), memory=memory)
    run_steps(window, 4, marks)
    (trace,) = window.written[:-1]
    assert trace.parent == tmp_path / "p" and trace.name.startswith("rank3.")
    assert trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace format
    names = [e.get("name", "") for e in events]
    steps = sorted({n for n in names if n.startswith("ProfilerStep#")})
    assert len(steps) == 2  # the window's two steps, nothing before or after
    assert names.count("forward_backward") == 2 and names.count("tables_step") == 2
    # History recorded from just before step 2 to just after step 3, then dumped.
    snapshot = str(tmp_path / "p" / "memory_rank3_steps2-3.pickle")
    assert memory.calls == [("record", "all", 1_000_000), ("dump", snapshot),
                            ("record", None, 0)]
    assert marks == [(1, 0), (2, 1), (3, 1), (4, 3)]
    assert window.written[-1] == tmp_path / "p" / "memory_rank3_steps2-3.pickle"


def test_ranks_not_chosen_and_runs_resumed_past_the_window_trace_nothing(tmp_path):
    config = ProfileConfig(start_step=1, steps=1, ranks=[0])
    window = ProfilerWindow(config, rank=1, save_dir=str(tmp_path), memory=MemoryHistory())
    run_steps(window, 2, [])
    assert window.written == [] and not (tmp_path / "profile").exists()
    resumed = ProfilerWindow(config, rank=0, save_dir=str(tmp_path), memory=MemoryHistory())
    for step in (5, 6):  # a run resumed at step 4
        resumed.before(step)
        resumed.after(step)
    resumed.close()
    assert resumed.written == [] and resumed.memory.calls == []


def test_a_run_stopped_inside_the_window_keeps_what_it_traced(tmp_path):
    config = ProfileConfig(start_step=1, steps=5, ranks=[0])
    memory = MemoryHistory()
    window = ProfilerWindow(config, rank=0, save_dir=str(tmp_path), memory=memory)
    run_steps(window, 2, [])
    window.close()  # the stop signal after step 2
    assert [p.name for p in window.written][-1] == "memory_rank0_steps1-2.pickle"
    assert json.loads(window.written[0].read_text())["traceEvents"]


def test_windows_and_ranks_that_cannot_be_are_one_line_errors(tmp_path):
    recipe = ROOT / "recipes" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe, ["profile.start_step=299", "profile.steps=3"])
    assert str(e.value) == ("command line: profile.start_step=299: the window, steps "
                            "299-301, ends after the last step (train.steps=300)")
    assert load_recipe(recipe, ["profile.start_step=298"]).profile.last_step == 300
    with pytest.raises(ConfigError, match=r"^profile\.ranks: rank 2 is not in this run's "
                                          r"world of 2 ranks \(0-1\)$"):
        check_ranks(ProfileConfig(start_step=1, ranks=[0, 2]), world_size=2)
    check_ranks(ProfileConfig(start_step=0, ranks=[7]), world_size=2)  # off: not checked
