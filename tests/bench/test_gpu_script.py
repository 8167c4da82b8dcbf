"""The prepared GPU run (bench/gpu/run_all.sh) at toy sizes on a CPU: every stage it runs
on a lent H200 runs here too, so the first GPU session spends its minutes measuring."""

import json
import re
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env

pytestmark = pytest.mark.integration

STAGES = ["build", "data", "smoke", "train_dense", "train_stem", "tables_device",
          "tables_host", "long_context", "refit"]
TRAINER = ("tokens_per_s", "mfu", "peak_memory_gb", "step_ms", "split_ms", "loss_first",
           "loss_last")


def test_the_stages_fit_the_gpu_session():
    script = (ROOT / "bench" / "gpu" / "run_all.sh").read_text()
    limits = dict(re.findall(r"^(?:LOSS_CHECK=\S+ )?(?:stage|train) (\w+) (\d+) ", script, re.M))
    assert list(limits) == STAGES
    # Each within 2 minutes, all of them within the device's 8 minutes.
    assert max(map(int, limits.values())) <= 120 and sum(map(int, limits.values())) <= 480


def test_the_gpu_script_runs_every_stage_and_goes_on_after_a_failure(tmp_path):
    env = subprocess_env(DRY_RUN="1", OUT=str(tmp_path), OMP_NUM_THREADS="1",
                         PYTHON=sys.executable, FAIL_STAGE="tables_device")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_all.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary] == STAGES
    assert all(set(s) == {"name", "status", "seconds", "limit_s", "figures"} for s in summary)
    status = {s["name"]: s["status"] for s in summary}
    assert status.pop("tables_device") == "failed (exit 1)"  # made to fail: the rest ran
    assert set(status.values()) == {"ok"}, status
    figures = {s["name"]: s["figures"] for s in summary}
    for name in ("train_dense", "train_stem", "tables_host", "long_context"):
        assert all(figures[name][k] is not None for k in TRAINER), (name, figures[name])
    for name in ("train_dense", "train_stem"):
        assert figures[name]["steps"] == 6 and figures[name]["loss_falls"], figures[name]
    assert figures["train_stem"]["tables"] == "device/dense/sharded/next_step/accelerator"
    assert figures["tables_host"]["tables"].startswith("host/lazy")
    assert figures["long_context"]["tokens_per_step"] == 512
    table = (tmp_path / "summary.txt").read_text()
    assert all(name in table for name in STAGES) and "failed (exit 1)" in table
    # one line per check (a fresh environment also announces its op builds there)
    smoke = re.findall(r"^(?:ok  |FAIL) .*$", (tmp_path / "smoke.log").read_text(), re.M)
    assert len(smoke) == 5 and all(line.startswith("ok ") for line in smoke), smoke
    assert "predicted step time STEM" in (tmp_path / "plan_best.txt").read_text()


def test_the_trainer_stage_reads_a_gpu_step_line():
    """A GPU's step line carries MFU and, with host tables, their figures (a CPU's has
    neither): the stage reads its figures from either."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        import trainer
    finally:
        sys.path.pop(0)
    line = ("step 30/1000000 | loss 7.1234 | lr 4.00e-04 | grad 0.718 (backbone 0.718, tables "
            "0.003) | rows 474 | step 266.3 ms (fwd/bwd 231.5, backbone 13.0, tables 1.4, "
            "exposed tables 5.0) | 123,846 tok/s (123,846/GPU) | MFU 41.2% | prefetch wait "
            "1.0 ms, h2d 3.0 MB | peak mem 60.65 GB")
    figures = trainer.parse(line)
    assert figures["tokens_per_s"] == 123846 and figures["mfu"] == pytest.approx(0.412)
    assert figures["peak_memory_gb"] == 60.65 and figures["split_ms"]["tables_exposed"] == 5.0
    assert trainer.parse(line.replace(" | MFU 41.2%", ""))["mfu"] is None
    assert trainer.parse("step 30 | saved runs/x/iter_0000030") is None
