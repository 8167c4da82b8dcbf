"""The README's main command path, shortened: tokenizer, preprocessing, 2-rank training."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.integration  # tools/quickstart.sh end to end


def test_quickstart_trains_with_decreasing_loss(tmp_path):
    env = subprocess_env(QUICKSTART_DIR=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "quickstart.sh"), "train.steps=40",
         "train.log_interval=10", "train.eval_interval=20", "train.save_interval=20",
         "optimizer.warmup_steps=5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = [float(x) for x in re.findall(r"step \d+/40 \| loss ([\d.]+)", proc.stdout)]
    valid = [float(x) for x in re.findall(r"valid loss ([\d.]+)", proc.stdout)]
    assert len(train) == 4 and len(valid) == 2, proc.stdout
    assert train[-1] < train[0] - 0.5 and valid[1] < valid[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000040"
    assert list((tmp_path / "ckpt" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "data" / "gcide_text_document.idx").is_file()
