"""`sbatch slurm/acceptance.sbatch` end to end on the local two-node SLURM cluster
(tests/support/slurm_cluster.py), a CPU job at toy shapes: every stage runs on both nodes
through the same launcher as the stage jobs, one made to fail on purpose is reported with
its fix while the rest run, and the report's refit profile is one the planner and
`--check` take. Set STEM_SKIP_SLURM_TESTS=1 to skip (e.g. without root)."""

import json
import os
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env
from support.slurm_cluster import ENDED

pytestmark = pytest.mark.integration  # a real two-node SLURM cluster

if os.environ.get("STEM_SKIP_SLURM_TESTS") == "1":
    pytest.skip("STEM_SKIP_SLURM_TESTS=1", allow_module_level=True)

STAGES = ["environment", "data", "smoke", "collectives", "train_dense", "train_stem",
          "checkpoint", "long_context", "stop", "refit"]
TOY = ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
       "model.ffn_hidden_size=128", "model.vocab_size=4096", "model.seq_length=64",
       "model.num_layers=4", "train.micro_batch_size=2", "train.global_batch_size=8",
       "train.dtype=fp32"]


@pytest.fixture(scope="module")
def acceptance(cluster, sp_model, tmp_path_factory):
    """The acceptance job on 2 nodes x 1 rank, `smoke` made to fail: (job info, its log,
    the report's folder)."""
    out = tmp_path_factory.mktemp("acceptance")
    log = out / "job.out"
    env = {"STEM_OUTPUT": str(out / "runs"), "STEM_ALLOW_CPU": "1", "STEM_PROCS_PER_NODE": "1",
           "STEM_HARDWARE": "h100", "STEM_TOKENIZER": sp_model,
           "STEM_TOKENIZER_TYPE": "sentencepiece", "STEM_OVERRIDES": " ".join(TOY),
           "STEM_LONG_OVERRIDES": "model.seq_length=256 train.micro_batch_size=1 "
                                  "train.global_batch_size=2",
           "FAIL_STAGE": "smoke", "PYTHONWARNINGS": "ignore"}
    if sys.prefix != sys.base_prefix:
        env["STEM_VENV"] = sys.prefix
    job = cluster.sbatch("--nodes=2", "--time=60", f"--output={log}", "slurm/acceptance.sbatch",
                         env=subprocess_env(**env), cwd=ROOT)
    info = cluster.wait_job(job, lambda i: i.get("JobState") in ENDED, timeout=1500)
    return info, log.read_text(), out / "runs" / "acceptance"


def test_every_stage_runs_on_both_nodes_and_a_failed_one_is_reported_with_its_fix(acceptance):
    info, log, report = acceptance
    summary = json.loads((report / "summary.json").read_text())
    # The verdict is a fail (a CPU against an H100's predictions, and the failed stage):
    # the job's exit says so, for a stage chained behind it with afterok.
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log
    assert summary["verdict"] == "fail" and f"done: fail; the report is in {report}" in log
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert list(status) == STAGES, log
    assert status.pop("smoke") == "failed (exit 1)"  # made to fail: the rest ran
    assert set(status.values()) == {"ok"}, (status, (report / "acceptance.log").read_text())
    smoke = next(s for s in summary["stages"] if s["name"] == "smoke")
    assert smoke["fix"].startswith("a GPU-only path gave wrong numbers") and \
        smoke["fix"].endswith(f"its log: {report / 'work' / 'logs' / 'smoke.log'}")
    assert any(line.startswith("smoke: a GPU-only path") for line in summary["to_do"])
    # Both nodes, one world: their environments, a collective across them, the stop's
    # markers of each.
    assert sorted(r["host"] for r in summary["environment"]) == ["node1", "node2"]
    checks = {(c["stage"], c["name"]): c for c in summary["checks"]}
    assert checks["environment", "nodes reported: 2 of 2"]["verdict"] == "ok"
    across = [c for c in summary["checks"] if c["stage"] == "collectives"]
    assert across and all(c["name"].endswith("2 ranks (world)") and c["measured"] > 0
                          and c["predicted"] > 0 for c in across), across
    stop = json.loads((report / "work" / "stop.json").read_text())
    assert stop["markers"] == ["stopped.node1", "stopped.node2"] and stop["exit_code"] == 0
    assert checks["stop", "SIGUSR1: checkpoint saved, every node stopped for a requeue"][
        "verdict"] == "ok"
    assert checks["checkpoint", "the resumed run's next loss equals the uninterrupted one's"][
        "verdict"] == "ok"
    for stage in ("train_dense", "train_stem", "long_context"):
        for name in ("tokens/s", "forward/backward", "peak memory"):
            c = checks[stage, name]
            assert c["measured"] > 0 and c["predicted"] > 0 and c["ratio"] > 0, c
    assert checks["train_stem", "loss falls"]["verdict"] == "ok"
    # The trials' checkpoints are gone, their logs kept.
    assert not list((report / "work" / "runs").glob("*/iter_*"))
    assert (report / "work" / "logs" / "train_stem.trainer.log").is_file()


def test_the_report_is_a_table_a_picture_and_a_profile_the_planner_takes(acceptance):
    _, _, report = acceptance
    md = (report / "summary.md").read_text()
    assert md.startswith("# Acceptance run: fail\n")
    assert "| stage | check | measured | predicted | ratio | verdict | refit predicts |" in md
    assert "## What to do" in md and "| node2 |" in md
    assert (report / "measured_vs_predicted.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "----- smoke" in (report / "acceptance.log").read_text()
    profile = report / "h100.json"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["profile"]["file"] == "h100.json" and "mfu" in summary["profile"]["changes"]
    assert "predicted step time STEM" in (report / "plan.txt").read_text()
    env = subprocess_env()
    plan = subprocess.run([sys.executable, "tools/plan_step.py", "--recipe",
                           "recipes/stem_1b_pretrain.yaml", "--nodes", "4", "--profile",
                           str(profile)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert plan.returncode == 0 and "predicted step time" in plan.stdout, plan.stderr
    # --check plans with it too: the STEM trial's recipe as it ran (its synthetic tokens).
    stem = json.loads((report / "work" / "train_stem.json").read_text())
    check = subprocess.run([sys.executable, "-m", "megatron_stem.train", "--recipe",
                            stem["recipe"], *stem["overrides"], "--check", "--nodes", "2",
                            "--gpus-per-node", "1", "--hardware", str(profile)],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"hardware: {profile} (--hardware {profile})" in check.stdout
    assert "memory per GPU:" in check.stdout and "all checks passed" in check.stdout
