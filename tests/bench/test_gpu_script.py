"""The prepared GPU run (bench/gpu/run_all.sh: the acceptance run's one-node case) at toy
sizes on a CPU: every stage it runs on an H100 or H200 runs here too, so the first GPU
session spends its minutes measuring, and what it leaves in $OUT comes back from the lent
machine. The multi-node case is tests/slurm/test_slurm_acceptance.py."""

import json
import re
import socket
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env

STAGES = ["environment", "data", "smoke", "collectives", "train_dense", "train_stem",
          "checkpoint", "long_context", "stop", "refit"]
TRAINER = ("tokens_per_s", "mfu", "peak_memory_gb", "state_memory_gb", "model_memory_gb",
           "step_ms", "split_ms", "loss_first", "loss_last")
# What a GPU machine that hands back only a few small files returns of $OUT: at most 8
# files, each at most 16 MiB, 64 MiB in all.
OUT_FILES, FILE_BYTES, ALL_BYTES = 8, 16 << 20, 64 << 20


def limits(script: str) -> dict[str, int]:
    """The stages' time limits an entry point declares (`declare -A LIMIT=(...)`)."""
    declared = re.search(r"declare -A LIMIT=\((.*?)\)", (ROOT / script).read_text(), re.S)[1]
    return {name: int(s) for name, s in re.findall(r"\[(\w+)\]=(\d+)", declared)}


def test_the_stages_fit_the_gpu_session_and_the_cluster_s_20_minutes():
    one_node = limits("bench/gpu/run_all.sh")
    assert list(one_node) == STAGES + ["report"]
    # Each within 2 minutes, all of them within 8: with the machine's start (minutes) and
    # the wheels' install, within the session's 15 minutes of device time.
    assert max(one_node.values()) <= 120 and sum(one_node.values()) <= 480
    # The cluster's: within the job's 20 minutes, with a minute for its set-up.
    cluster = limits("slurm/acceptance.sbatch")
    assert list(cluster) == STAGES + ["report"] and sum(cluster.values()) <= 19 * 60
    assert "#SBATCH --time=00:20:00" in (ROOT / "slurm" / "acceptance.sbatch").read_text()


def test_one_copy_of_the_stages():
    """The one-node case defines how its steps start; the stages are slurm/acceptance.sh's."""
    text = (ROOT / "bench" / "gpu" / "run_all.sh").read_text()
    assert "source slurm/acceptance.sh" in text and not re.search(r"^\s*stage ", text, re.M)
    assert "acceptance.sh" in (ROOT / "slurm" / "acceptance.sbatch").read_text()


def test_no_gpu_script_names_a_path_of_one_checkout():
    """The scripts run from any checkout, on a machine with no virtualenv: their absolute
    paths are the machine's own (/tmp, /usr/bin/env), never a checkout's."""
    allowed = ("/tmp", "/usr/bin/env", "/dev/null")
    for path in [*sorted((ROOT / "bench" / "gpu").iterdir()), ROOT / "slurm" / "acceptance.sh"]:
        text = path.read_text()
        absolute = re.findall(r"(?<![\w.$}/])/[A-Za-z][\w.-]*(?:/[\w.-]+)*", text)
        assert [p for p in absolute if not p.startswith(allowed)] == [], path.name
    assert ".venv" not in (ROOT / "bench" / "gpu" / "prepare.sh").read_text()


@pytest.mark.integration
def test_the_gpu_script_runs_every_stage_and_goes_on_after_a_failure(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = subprocess_env(DRY_RUN="1", OUT=str(out), WORK=str(work), OMP_NUM_THREADS="1",
                         PYTHON=sys.executable, FAIL_STAGE="refit")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_all.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # What comes back: a few small files, the report among them; the rest stayed in WORK.
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["acceptance.log", "h200.json",
                                       "measured_vs_predicted.png", "plan.txt",
                                       "summary.json", "summary.md"]
    sizes = [p.stat().st_size for p in files]
    assert len(files) <= OUT_FILES and max(sizes) <= FILE_BYTES and sum(sizes) <= ALL_BYTES
    assert (work / "data" / "synthetic_4096.bin").exists() and (work / "runs").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == STAGES
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status.pop("refit") == "failed (exit 1)"  # made to fail: the rest ran
    assert set(status.values()) == {"ok"}, (status, (out / "acceptance.log").read_text())
    assert summary["to_do"][0].startswith("refit: the single-GPU constants")
    figures = {name: json.loads((work / f"{name}.json").read_text())
               for name in ("train_dense", "train_stem", "long_context")}
    for name, f in figures.items():
        assert all(f[k] is not None for k in TRAINER), (name, f)
    for name in ("train_dense", "train_stem"):
        assert figures[name]["steps"] == 6 and figures[name]["loss_falls"], figures[name]
        # the data of its steps and a tenth and one more, at most (a run of a million
        # steps had rank 0 index ~16M samples before its first step)
        assert figures[name]["asked_samples"] == 7 * 16, figures[name]
    assert figures["train_stem"]["tables"] == "device/dense/sharded/next_step/accelerator"
    assert figures["train_dense"]["tables"] is None
    assert figures["long_context"]["tokens_per_step"] == 512
    # The recipes' tokenizer is not there: one trained on the shipped corpus, its eod
    # ending the synthetic documents.
    assert "data.tokenizer_model=" + str(work / "data" / "corpus_tokenizer.model") in \
        figures["train_stem"]["overrides"]
    checkpoint = json.loads((work / "checkpoint.json").read_text())
    assert checkpoint["loss_equal"] and checkpoint["loss_resumed"] is not None
    stop = json.loads((work / "stop.json").read_text())
    assert stop["requeue"] and stop["markers"] == [f"stopped.{socket.gethostname()}"]
    md = (out / "summary.md").read_text()
    assert md.startswith("# Acceptance run: fail\n") and "| refit | failed (exit 1) |" in md
    assert all(f"----- {name}" in (out / "acceptance.log").read_text() for name in STAGES)
    # one line per check (a fresh environment also announces its op builds there)
    smoke = re.findall(r"^(?:ok  |FAIL) .*$", (work / "logs" / "smoke.log").read_text(), re.M)
    assert len(smoke) == 5 and all(line.startswith("ok ") for line in smoke), smoke
    assert "predicted step time STEM" in (out / "plan.txt").read_text()
