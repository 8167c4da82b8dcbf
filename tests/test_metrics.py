"""What a run logs (training/metrics.py): the per-interval line and scalars, MFU."""

import re

import pytest

from conftest import tensorboard_steps
from megatron_stem.accounting import mfu, training_flops_per_token
from megatron_stem.config import Recipe, TrainConfig
from megatron_stem.training.update import GradNorms
from megatron_stem.training.metrics import Metrics
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


def test_a_line_and_scalars_every_log_interval_and_at_the_last_step(world1, tmp_path,
                                                                     capsys):
    recipe = Recipe(model=tiny_model(),
                    train=TrainConfig(save_dir=str(tmp_path), log_interval=2, steps=3))
    metrics, tables, norms = Metrics(recipe, first_step=1), HostTables(), GradNorms()
    norms.total, norms.backbone, norms.tables = 0.5, 0.4, 0.3
    lines = []
    for step in (1, 2, 3):
        metrics.step(step, 2.0, 1e-3, norms, tables)
        lines.append(capsys.readouterr().out)
    metrics.valid(3, 1.0)
    metrics.close()
    assert lines[0] == "" and tables.taken == 2
    for step, line in zip((2, 3), lines[1:]):
        assert re.fullmatch(
            rf"step {step}/3 \| loss 2\.0000 \| lr 1\.00e-03 \| grad 0\.500 \(backbone 0\.400, "
            r"tables 0\.300\) \| rows 7 \| [\d,]+ tok/s \| prefetch wait 1\.5 ms, h2d 2\.0 MB, "
            r"cache hits 50\.0% \| mem \d+\.\d\d GB\n", line), line
    assert capsys.readouterr().out == "step 3 | valid loss 1.0000 | ppl 2.72\n"
    for tag in ("train/loss", "tables/unique_rows", "tables/cache_hit_rate"):
        assert tensorboard_steps(tmp_path / "tensorboard", tag) == [2, 3]
    assert tensorboard_steps(tmp_path / "tensorboard", "valid/ppl") == [3]


def test_mfu_is_training_flops_over_peak():
    model = tiny_model()
    at_peak = 2 * 1e12 / training_flops_per_token(model)  # tokens/s two 1 TFLOP/s devices do
    assert mfu(at_peak, model, 1e12, 2) == pytest.approx(1.0)
    assert mfu(at_peak / 4, model, 1e12, 2) == pytest.approx(0.25)
