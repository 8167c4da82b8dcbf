"""The real `slurm/stem_1b.sbatch` as a 2-node job on a local SLURM cluster.

tests/slurm_cluster.py brings up munged, slurmctld and two slurmd in their own network
namespaces (needs root and Debian's slurm-wlm + munge, which .ci/run installs). The sbatch
file runs unchanged, `--gpus-per-node=8` included (the test nodes advertise 8 GPUs); only
environment knobs and sbatch flags turn it into a CPU job: the tiny recipe, one gloo rank
per node, a few steps, data and tokenizer made from the shipped corpus. Set
STEM_SKIP_SLURM_TESTS=1 to skip (e.g. without root).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env, tensorboard_steps
from slurm_cluster import SlurmCluster, _netns_pids, missing_tools

pytestmark = pytest.mark.integration  # a real two-node SLURM cluster

if os.environ.get("STEM_SKIP_SLURM_TESTS") == "1":
    pytest.skip("STEM_SKIP_SLURM_TESTS=1", allow_module_level=True)

# Steps of the preempted job: the stop must land mid-run (~0.25 s/step on 2 idle cores;
# the stop takes about a second to reach the ranks).
STEPS = 40
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # job states that are final


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests need root (network namespaces); run them through .ci/run "
                    "or set STEM_SKIP_SLURM_TESTS=1")
    if missing_tools():
        pytest.fail(f"missing {', '.join(missing_tools())}: apt-get install -y slurm-wlm munge "
                    "(.ci/run does), or set STEM_SKIP_SLURM_TESTS=1")
    with SlurmCluster(nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def corpus_data(tmp_path_factory, corpus_texts, sp_model):
    """Part of the shipped corpus, tokenized by tools/preprocess_data.py: (prefix, model)."""
    folder = tmp_path_factory.mktemp("slurm_data")
    with open(folder / "docs.jsonl", "w") as f:
        for text in corpus_texts:
            f.write(json.dumps({"text": text}) + "\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"),
                    "--input", str(folder / "docs.jsonl"),
                    "--output-prefix", str(folder / "gcide"), "--tokenizer-type",
                    "sentencepiece", "--tokenizer-model", sp_model, "--append-eod",
                    "--workers", "1"], check=True, capture_output=True, env=subprocess_env())
    return str(folder / "gcide_text_document"), sp_model


def submit(cluster, out: Path, data: tuple[str, str], steps: int,
           *flags: str) -> tuple[str, Path]:
    """sbatch slurm/stem_1b.sbatch as a user would, with CPU knobs; (job id, log file)."""
    log = out / "job.out"
    prefix, tokenizer = data
    env = {
        "STEM_RECIPE": "recipes/tiny_cpu.yaml",
        "STEM_DATA": prefix,
        "STEM_TOKENIZER": tokenizer,
        "STEM_OUTPUT": str(out / "runs"),
        "STEM_PROCS_PER_NODE": "1",
        "STEM_ALLOW_CPU": "1",  # the nodes' GPUs are scheduling tokens: CPU on purpose
        "STEM_OVERRIDES": " ".join([
            f"train.steps={steps}", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_iters=1",
            "train.save_interval=1000", "train.dtype=fp32", "optimizer.tables.kernel=torch",
            "optimizer.warmup_steps=2", "data.split=90,10,0"]),
        "PYTHONWARNINGS": "ignore",
    }
    if sys.prefix != sys.base_prefix:
        env["STEM_VENV"] = sys.prefix
    job = cluster.sbatch("--nodes=2", f"--output={log}", *flags, "slurm/stem_1b.sbatch",
                         env=subprocess_env(**env), cwd=ROOT)
    return job, log


def wait_for_log(cluster, job: str, log: Path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if re.search(pattern, text, re.M):
            return text
        info = cluster.job(job)
        if info.get("JobState") in ENDED:
            pytest.fail(f"job {job} ended ({info.get('JobState')}) before /{pattern}/:\n{text}")
        time.sleep(0.5)
    pytest.fail(f"no /{pattern}/ in the log of job {job} after {timeout:.0f}s:\n"
                f"{log.read_text() if log.exists() else '(no log)'}\n{cluster.logs()}")


def steps_logged(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)/\d+ \| loss", text, re.M)]


def test_preempted_job_checkpoints_requeues_and_resumes(cluster, corpus_data, tmp_path):
    t0 = time.monotonic()
    job, log = submit(cluster, tmp_path, corpus_data, STEPS)
    wait_for_log(cluster, job, log, rf"^step 3/{STEPS} ", timeout=420)
    # What `#SBATCH --signal=B:USR1@300` does near the time limit: USR1 to the batch shell.
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait_job(job, lambda i: i.get("JobState") in ENDED, timeout=600)
    text = log.read_text()
    elapsed = time.monotonic() - t0
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert info["Restarts"] == "1", text

    first, second = re.split(r"^stem: job \d+ \(restart 1\)", text, flags=re.M)
    for run in (first, second):  # both nodes took part, as one world of 2 ranks
        assert "stem: node 0/2 is node1: torchrun with 1 rank(s)" in run
        assert "stem: node 1/2 is node2: torchrun with 1 rank(s)" in run
        assert "world 2 = TP 1 x DP 2" in run

    # The first run trained, got the stop, saved at the step it was in and stopped.
    done = steps_logged(first)
    stop = done[-1]
    assert done == list(range(1, stop + 1)) and 3 <= stop < STEPS, first
    assert f"step {stop} | stop signal: checkpoint saved, exiting for requeue" in first
    assert "stem: node1: ranks stopped by SIGUSR1" in first
    assert "stem: node2: ranks stopped by SIGUSR1" in first
    # The trainer on each node said it saved and stopped to be requeued, so each node's
    # torchrun ended its task with 0 (no srun error during the stop).
    jobs = tmp_path / "runs" / "stem-1b" / "jobs" / job
    assert sorted(p.name for p in jobs.glob("stopped.*")) == ["stopped.0.node1",
                                                               "stopped.0.node2"]
    assert "during the stop" not in first
    assert f"latest checkpoint: iter_{stop:07d}; requeueing job {job} (restart 1" in first
    assert "Traceback" not in text and "FAILED" not in text
    ckpts = tmp_path / "runs" / "stem-1b" / "checkpoints"
    assert (ckpts / f"iter_{stop:07d}" / "COMPLETE").is_file()

    # The requeued run resumed from that checkpoint and continued the step count.
    assert f"resuming from {ckpts / f'iter_{stop:07d}'}" in second
    assert steps_logged(second) == list(range(stop + 1, STEPS + 1)), second
    assert "stem: training finished" in second
    assert (ckpts / "latest").read_text().strip() == f"iter_{STEPS:07d}"

    # One TensorBoard run with every step exactly once, across the requeue.
    assert tensorboard_steps(ckpts / "tensorboard", "train/loss") == list(range(1, STEPS + 1))
    print(f"\npreempted 2-node job: {elapsed:.0f}s, stopped at step {stop}")


def trainer_pids(cluster, node: str) -> list[int]:
    """The training ranks (not torchrun) running in `node`'s namespace."""
    pids = []
    for pid in _netns_pids(cluster.netns(node)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_stem.train" in cmd and not any(b"torchrun" in c for c in cmd):
            pids.append(pid)
    return pids


def test_a_dead_rank_ends_the_job_promptly_with_a_clear_message(cluster, corpus_data, tmp_path):
    job, log = submit(cluster, tmp_path, corpus_data, 2000, "--time=10")
    wait_for_log(cluster, job, log, r"^step 2/", timeout=420)
    pids = trainer_pids(cluster, "node2")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    info = cluster.wait_job(job, lambda i: i.get("JobState") in ENDED, timeout=120)
    took = time.monotonic() - killed
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert took < 60, f"the job took {took:.0f}s to end after a rank died"
    assert "srun: error: node2: task 1: Exited with exit code 1" in text
    assert re.search(r"^stem: FAILED after \d\d:\d\d:\d\d: a training process failed and srun "
                     r"stopped every node", text, re.M), text
    # torchrun names the dead rank: its host and the signal that killed it.
    assert re.search(r"host\s*: node2", text) and "Signal 9 (SIGKILL)" in text, text
    print(f"\nrank killed on node2: job FAILED {took:.0f}s later")
