"""The prepared GPU run (bench/gpu/run_all.sh) at toy sizes on a CPU: every stage it runs
on a lent H100 or H200 runs here too, so the first GPU session spends its minutes
measuring, and what it leaves in $OUT comes back from the lent machine."""

import json
import re
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env

STAGES = ["build", "data", "smoke", "train_dense", "train_stem", "tables_device",
          "tables_host", "long_context", "refit"]
TRAINER = ("tokens_per_s", "mfu", "peak_memory_gb", "step_ms", "split_ms", "loss_first",
           "loss_last")
# What comes back from the lent machine's $OUT (the device's README): at most 8 files,
# each at most 16 MiB, 64 MiB in all.
OUT_FILES, FILE_BYTES, ALL_BYTES = 8, 16 << 20, 64 << 20


def test_the_stages_fit_the_gpu_session():
    script = (ROOT / "bench" / "gpu" / "run_all.sh").read_text()
    limits = dict(re.findall(r"^(?:LOSS_CHECK=\S+ )?(?:stage|train) (\w+) (\d+) ", script, re.M))
    assert list(limits) == STAGES
    # Each within 2 minutes, all of them within 8: with the machine's start (minutes) and
    # the wheels' install, within the session's 15 minutes of device time.
    assert max(map(int, limits.values())) <= 120 and sum(map(int, limits.values())) <= 480


def test_no_gpu_script_names_a_path_of_one_checkout():
    """The scripts run from any checkout, on a machine with no virtualenv: their absolute
    paths are the machine's own (/tmp, /usr/bin/env), never a checkout's."""
    allowed = ("/tmp", "/usr/bin/env", "/dev/null")
    for path in sorted((ROOT / "bench" / "gpu").iterdir()):
        text = path.read_text()
        absolute = re.findall(r"(?<![\w.$}/])/[A-Za-z][\w.-]*(?:/[\w.-]+)*", text)
        assert [p for p in absolute if not p.startswith(allowed)] == [], path.name
    assert ".venv" not in (ROOT / "bench" / "gpu" / "prepare.sh").read_text()


@pytest.mark.integration
def test_the_gpu_script_runs_every_stage_and_goes_on_after_a_failure(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = subprocess_env(DRY_RUN="1", OUT=str(out), WORK=str(work), OMP_NUM_THREADS="1",
                         PYTHON=sys.executable, FAIL_STAGE="tables_device")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_all.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # What comes back: a few small files, the summary among them; the rest stayed in WORK.
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["h200.json", "plan_best.txt", "plan_today.txt",
                                       "run_all.log", "summary.json", "summary.txt"]
    sizes = [p.stat().st_size for p in files]
    assert len(files) <= OUT_FILES and max(sizes) <= FILE_BYTES and sum(sizes) <= ALL_BYTES
    assert (work / "data" / "gcide_text_document").exists() and (work / "runs").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary] == STAGES
    assert all(set(s) == {"name", "status", "gpu", "seconds", "limit_s", "figures"}
               for s in summary)
    assert {s["gpu"] for s in summary} == {"no GPU (a dry run on the CPU)"}
    status = {s["name"]: s["status"] for s in summary}
    assert status.pop("tables_device") == "failed (exit 1)"  # made to fail: the rest ran
    assert set(status.values()) == {"ok"}, status
    figures = {s["name"]: s["figures"] for s in summary}
    for name in ("train_dense", "train_stem", "tables_host", "long_context"):
        assert all(figures[name][k] is not None for k in TRAINER), (name, figures[name])
    for name in ("train_dense", "train_stem"):
        assert figures[name]["steps"] == 6 and figures[name]["loss_falls"], figures[name]
    # The trainer asks for the samples of its steps and a tenth more at most (a run of a
    # million steps had rank 0 index ~16M samples before its first step).
    for name in ("train_dense", "train_stem", "tables_host", "long_context"):
        f, global_batch = figures[name], 1 if name == "long_context" else 16
        assert f["asked_samples"] <= f["steps"] * global_batch * 1.1, (name, f)
        assert f["asked_samples"] == f["asked_steps"] * global_batch, (name, f)
    assert figures["train_stem"]["tables"] == "device/dense/sharded/next_step/accelerator"
    assert figures["tables_host"]["tables"].startswith("host/lazy")
    assert figures["long_context"]["tokens_per_step"] == 512
    table = (out / "summary.txt").read_text()
    assert table.startswith("on no GPU (a dry run on the CPU)\n")
    assert all(name in table for name in STAGES) and "failed (exit 1)" in table
    log = (out / "run_all.log").read_text()
    assert all(f"----- {name}: " in log for name in STAGES)
    # one line per check (a fresh environment also announces its op builds there)
    smoke = re.findall(r"^(?:ok  |FAIL) .*$", (work / "logs" / "smoke.log").read_text(), re.M)
    assert len(smoke) == 5 and all(line.startswith("ok ") for line in smoke), smoke
    assert "predicted step time STEM" in (out / "plan_best.txt").read_text()


def test_the_refit_profile_is_the_measured_gpus():
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        import device
    finally:
        sys.path.pop(0)
    assert device.profile_of("NVIDIA H100 80GB HBM3") == "h100"
    assert device.profile_of("NVIDIA H200") == "h200"
    assert device.profile_of("NVIDIA A100-SXM4-80GB") == ""


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
    assert [trainer.asked_steps(n) for n in (3, 10, 30)] == [3, 11, 33]
