"""What a run logs (training/metrics.py): the per-interval line and scalars, MFU."""

import re

import pytest

from support.processes import tensorboard_steps
from megatron_stem.model.accounting import mfu, training_flops_per_token
from megatron_stem.config import Recipe, TrainConfig
from megatron_stem.training.update import GradNorms
from megatron_stem.training.metrics import Metrics
from megatron_stem.training.profiling import PhaseTimer
from workers.common import tiny_model


class HostTables:
    """The table optimizer's reporting side, with host-resident tables."""

    touched_rows = 7

    def __init__(self):
        self.taken = 0

    def stats(self, wait=True):
        return {"unique_rows": 7}

    def host_stats(self):  # averages since the last call
        self.taken += 1
        return {"prefetch_wait_ms": 1.5, "h2d_bytes": 2 * 2**20, "cache_hit_rate": 0.5}


class Clock:
    """time.perf_counter for the metrics and the CPU phase timer, moved by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def timed_step(metrics, clock, ms: dict[str, float]) -> None:
    """One step's phases, each taking `ms[phase]` milliseconds of the clock."""
    for name, duration in ms.items():
        with metrics.timer.phase(name):
            clock.now += duration / 1e3


PHASE_MS = {"tables_stage": 1.0, "forward_backward": 30.0, "tables_sync": 4.0,
            "backbone_step": 6.0, "tables_step": 2.0}


def test_a_line_and_scalars_every_log_interval_and_at_the_last_step(world1, tmp_path,
                                                                     capsys, monkeypatch):
    """The line splits the step's time into its phases (the host tables' prefetch wait
    moved from fwd/bwd to the exposed table time), next to tokens/s (per rank too) and
    peak memory; time spent validating is not training time."""
    clock = Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    recipe = Recipe(model=tiny_model(),
                    train=TrainConfig(save_dir=str(tmp_path), log_interval=2, steps=3,
                                      global_batch_size=8))
    metrics, tables, norms = Metrics(recipe, first_step=1), HostTables(), GradNorms()
    norms.total, norms.backbone, norms.tables = 0.5, 0.4, 0.3
    lines = []
    for step in (1, 2, 3):
        timed_step(metrics, clock, {k: v * step for k, v in PHASE_MS.items()})
        clock.now += 0.007  # data, logging: in the step's time, in no phase
        metrics.step(step, 2.0, 1e-3, norms, tables)
        lines.append(capsys.readouterr().out)
        with metrics.paused():
            clock.now += 60.0  # validating
    metrics.valid(3, 1.0)
    metrics.valid(3, 1.5, "held_out")
    metrics.close()
    assert lines[0] == "" and tables.taken == 2
    # Steps 1-2: 43 + 86 ms in phases and 7 ms each outside, 8 x 32 tokens each; step 3:
    # 129 + 7 ms (the minute validating counts in neither). One rank: per rank = all.
    expected = {2: ("71.5", "43.5", "9.0", "3.0", "12.0", "3,580"),
                3: ("136.0", "88.5", "18.0", "6.0", "22.5", "1,882")}
    for step, line in zip((2, 3), lines[1:]):
        step_ms, fwd, backbone, tables_step, exposed, tok_s = expected[step]
        assert re.fullmatch(
            rf"step {step}/3 \| loss 2\.0000 \| lr 1\.00e-03 \| grad 0\.500 \(backbone 0\.400, "
            rf"tables 0\.300\) \| rows 7 \| step {step_ms} ms \(fwd/bwd {fwd}, backbone "
            rf"{backbone}, tables {tables_step}, exposed tables {exposed}\) \| {tok_s} tok/s "
            rf"\({tok_s}/rank\) \| prefetch wait 1\.5 ms, h2d 2\.0 MB, cache hits 50\.0% \| "
            r"peak mem \d+\.\d\d GB\n", line), line
    assert capsys.readouterr().out == "step 3 | valid loss 1.0000 | ppl 2.72\n" \
                                      "step 3 | valid held_out loss 1.5000 | ppl 4.48\n"
    for tag in ("train/loss", "tables/unique_rows", "tables/cache_hit_rate",
                "time/tables_exposed_ms", "throughput/tokens_per_s_per_rank"):
        assert tensorboard_steps(tmp_path / "tensorboard", tag) == [2, 3]
    assert tensorboard_steps(tmp_path / "tensorboard", "valid/ppl") == [3]
    assert tensorboard_steps(tmp_path / "tensorboard", "valid/held_out/loss") == [3]


class FakeEvent:
    """torch.cuda.Event as a GPU would answer: `record` stamps the stream's time (here a
    shared clock), `elapsed_time` reads two stamps, `synchronize` is counted."""

    clock, waits = 0.0, 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.stamp = None

    def record(self):
        self.stamp = FakeEvent.clock

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end):
        assert self.stamp is not None and end.stamp is not None, "read before recorded"
        return end.stamp - self.stamp


def test_gpu_phases_are_cuda_events_read_once_at_log_time():
    """On a GPU a phase is a pair of CUDA events, recorded without waiting; the one wait
    is at `take()` (log time), on each phase's last event, never inside a step."""
    timer = PhaseTimer(cuda=True, event_type=FakeEvent)
    for _ in range(4):
        for name, ms in PHASE_MS.items():
            with timer.phase(name):
                FakeEvent.clock += ms
        timer.step_done()
    assert FakeEvent.waits == 0
    assert timer.take() == PHASE_MS
    assert FakeEvent.waits == len(PHASE_MS)
    assert timer.take() == {}


def test_mfu_is_training_flops_over_peak():
    model = tiny_model()
    at_peak = 2 * 1e12 / training_flops_per_token(model)  # tokens/s two 1 TFLOP/s devices do
    assert mfu(at_peak, model, 1e12, 2) == pytest.approx(1.0)
    assert mfu(at_peak / 4, model, 1e12, 2) == pytest.approx(0.25)


def test_wandb_mistakes_are_one_line_naming_the_field(world1, tmp_path, monkeypatch):
    """A W&B project without the package is refused before anything starts; a W&B that
    does not start (no login, not offline) stops every rank in one line."""
    import importlib.util

    from megatron_stem.config import MetricsConfig
    from megatron_stem.runtime.errors import ConfigError
    from megatron_stem.training import wandb_run

    recipe = Recipe(model=tiny_model(), train=TrainConfig(save_dir=str(tmp_path)),
                    metrics=MetricsConfig(wandb_project="stem"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^metrics\.wandb_project: 'stem' needs the wandb "
                                          r"package, which is not installed \(pip install"):
        wandb_run.check_installed(recipe)
    monkeypatch.undo()
    wandb_run.check_installed(recipe)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no netrc, no login
    with pytest.raises(ConfigError, match=r"^metrics\.wandb_project: W&B did not start \(No "
                                          r"API key configured\. .*\); log in \(wandb login, "
                                          r"or WANDB_API_KEY\) or log locally with "
                                          r"WANDB_MODE=offline$"):
        Metrics(recipe, first_step=1)
