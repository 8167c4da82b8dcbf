"""The README's main command path, shortened: tokenizer, preprocessing, 2-rank training."""

import re
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env

pytestmark = pytest.mark.integration  # tools/quickstart.sh end to end


# Every line the quickstart prints is one of ours: no other library's warnings, no line
# twice because two ranks said it.
OWN_LINES = re.compile("|".join([
    r"training on [\d,]+ of [\d,]+ documents", r"wrote .+", r" *[\d.]+% \| [\d,]+ docs \| .+",
    r"[\d,]+ documents, [\d,]+ tokens from .+", r"this run: .+", r"model: total .+",
    r"step \d+(/\d+)? \| .+", r"building .+, once per environment, .+", r"done: .+",
    r"nothing left to train: .+", r"data cache: building .+"]))


def quickstart(folder, *overrides: str) -> subprocess.CompletedProcess:
    # No PYTHONWARNINGS: what a user sees is what is checked.
    env = subprocess_env(QUICKSTART_DIR=str(folder), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "tools" / "quickstart.sh"), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [line for line in lines if not OWN_LINES.fullmatch(line)] == [], \
        proc.stdout + proc.stderr
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == len(set(steps)), proc.stdout
    return proc


def test_quickstart_trains_with_decreasing_loss(tmp_path):
    overrides = ["train.steps=40", "train.log_interval=10", "train.eval_interval=20",
                 "train.save_interval=20", "optimizer.warmup_steps=5"]
    proc = quickstart(tmp_path, *overrides)
    train = [float(x) for x in re.findall(r"step \d+/40 \| loss ([\d.]+)", proc.stdout)]
    valid = [float(x) for x in re.findall(r"valid loss ([\d.]+)", proc.stdout)]
    assert len(train) == 4 and len(valid) == 2, proc.stdout
    assert train[-1] < train[0] - 0.5 and valid[1] < valid[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000040"
    assert list((tmp_path / "ckpt" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "data" / "gcide_text_document.idx").is_file()
    # Run again: every step is done, and it says so instead of working in silence.
    again = quickstart(tmp_path, *overrides)
    assert again.stdout.splitlines()[0] == \
        f"nothing left to train: {tmp_path / 'ckpt' / 'iter_0000040'} is at step 40 of " \
        "train.steps=40 (raise train.steps to train on)"
    assert "step" not in again.stdout.split("\n", 1)[1] and again.stderr == ""
