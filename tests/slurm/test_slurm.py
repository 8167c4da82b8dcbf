"""The real `slurm/stem_1b.sbatch` as a 2-node job on a local SLURM cluster.

tests/support/slurm_cluster.py brings up munged, slurmctld and two slurmd in their own network
namespaces (needs root and Debian's slurm-wlm + munge, which .ci/run installs). The sbatch
file runs unchanged, `--gpus-per-node=8` included (the test nodes advertise 8 GPUs); only
environment knobs and sbatch flags turn it into a CPU job: the tiny recipe, gloo ranks, a
few steps, data and tokenizer made from the shipped corpus. The preempted job runs one rank
per node; the failing one has 2 GPUs per node, so the launcher starts 2 ranks per node
from SLURM's own GPU variables, which share one host copy of the tables per node.
Set STEM_SKIP_SLURM_TESTS=1 to skip (e.g. without root).
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

from support.processes import ROOT, subprocess_env, tensorboard_steps
from support.slurm_cluster import ENDED, _netns_pids

pytestmark = pytest.mark.integration  # a real two-node SLURM cluster

if os.environ.get("STEM_SKIP_SLURM_TESTS") == "1":
    pytest.skip("STEM_SKIP_SLURM_TESTS=1", allow_module_level=True)

# Steps of the preempted job: the stop must land mid-run (~0.25 s/step on 2 idle cores;
# the stop takes about a second to reach the ranks).
STEPS = 40


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
                    "--workers", "1", "--single-prefix"], check=True, capture_output=True, env=subprocess_env())
    return str(folder / "gcide_text_document"), sp_model


def submit(cluster, out: Path, data: tuple[str, str], steps: int, *flags: str,
           overrides: tuple[str, ...] = (), procs_per_node: str | None = "1"
           ) -> tuple[str, Path]:
    """sbatch slurm/stem_1b.sbatch as a user would, with CPU knobs; (job id, log file).
    `procs_per_node` None: as many ranks per node as the job has GPUs (sbatch flags)."""
    log = out / "job.out"
    prefix, tokenizer = data
    env = {
        "STEM_RECIPE": "recipes/tiny_cpu.yaml",
        "STEM_DATA": prefix,
        "STEM_TOKENIZER": tokenizer,
        "STEM_OUTPUT": str(out / "runs"),
        "STEM_ALLOW_CPU": "1",  # the nodes' GPUs are scheduling tokens: CPU on purpose
        "STEM_OVERRIDES": " ".join([
            f"train.steps={steps}", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_iters=1",
            "train.save_interval=1000", "train.dtype=fp32", "optimizer.tables.kernel=torch",
            "optimizer.warmup_steps=2", "data.split=90,10,0", *overrides]),
        "PYTHONWARNINGS": "ignore",
    }
    if procs_per_node is not None:
        env["STEM_PROCS_PER_NODE"] = procs_per_node
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
    # No node's torchrun lost the store before its exit barrier and rendezvous were done
    # (slurm/torchrun.py: the store's host leaves last).
    assert not re.search(r"exit barrier|failed to shutdown the rendezvous|TCPStore", text), text
    ckpts = tmp_path / "runs" / "stem-1b" / "checkpoints"
    assert (ckpts / f"iter_{stop:07d}" / "COMPLETE").is_file()

    # The requeued run resumed from that checkpoint and continued the step count.
    assert f"resuming from {ckpts / f'iter_{stop:07d}'}" in second
    assert steps_logged(second) == list(range(stop + 1, STEPS + 1)), second
    assert "stem: training finished" in second
    assert (ckpts / "latest").read_text().strip() == f"iter_{STEPS:07d}"
    # Both runs ran the job's copy of the code, made by the first, its version recorded.
    version = (jobs / "code" / "VERSION").read_text().strip()
    assert f"stem: code {version} (copied from {ROOT})" in first
    assert f"stem: code {version} (the job's snapshot, reused by restart 1)" in second
    assert (ckpts / f"iter_{STEPS:07d}" / "CODE_VERSION").read_text().strip() == version

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


def shared_host_files(pid: int) -> set[str]:
    """The host-copy files (`model/host_copy.py`, unlinked once mapped) a rank maps."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return set(re.findall(r"/dev/shm/(megatron_stem_\S+) \(deleted\)", maps))


def test_two_ranks_per_node_share_a_host_copy_and_a_dead_rank_ends_the_job(
        cluster, corpus_data, tmp_path):
    """2 nodes x 2 GPUs: the launcher starts a rank per GPU from SLURM's variables, the two
    ranks of a node share one host copy of the tables (`tables.placement: host`; the
    copies' owners of the same rows talk across nodes); then a rank killed on node2 fails
    the whole job within seconds, with one clear line."""
    # --oversubscribe undoes the sbatch file's --exclusive, which would give the job all 8
    # GPUs of each node whatever --gpus-per-node says.
    job, log = submit(cluster, tmp_path, corpus_data, 2000, "--time=10", "--gpus-per-node=2",
                      "--oversubscribe", procs_per_node=None,
                      overrides=("tables.placement=host", "train.micro_batch_size=2"))
    text = wait_for_log(cluster, job, log, r"^step 2/", timeout=420)
    assert "2 node(s) x 2 rank(s) (one per GPU: SLURM_GPUS_ON_NODE=2)" in text, text
    assert "stem: node 1/2 is node2: torchrun with 2 rank(s)" in text
    assert "world 4 = TP 1 x DP 4" in text and "| prefetch wait" in text, text
    node1, node2 = (trainer_pids(cluster, node) for node in ("node1", "node2"))
    assert len(node1) == len(node2) == 2, (node1, node2)
    copies = [{name for pid in pids for name in shared_host_files(pid)} for pids in (node1, node2)]
    for pids, files in zip((node1, node2), copies):  # both ranks map all of their node's copy
        assert files and all(shared_host_files(pid) == files for pid in pids), files
    assert not copies[0] & copies[1], copies  # one copy per node

    os.kill(node2[0], signal.SIGKILL)
    killed = time.monotonic()
    info = cluster.wait_job(job, lambda i: i.get("JobState") in ENDED, timeout=120)
    took = time.monotonic() - killed
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert took < 60, f"the job took {took:.0f}s to end after a rank died"
    assert re.search(r"^srun: error: node\d: task \d: ", text, re.M), text
    assert re.search(r"^stem: FAILED after \d\d:\d\d:\d\d: a training process failed and srun "
                     r"stopped every node", text, re.M), text
    # The first rank said to fail is the dead one: its host, rank and signal (the ranks of
    # node1, whose collectives broke, fail next and may be the ones torchrun reports).
    failed = re.findall(r"^stem: (node\d): rank \d \(local rank \d\) failed: (.*); "
                        r"stopping the node's other ranks$", text, re.M)
    assert failed and failed[0] == ("node2", "Signal 9 (SIGKILL)"), text
    print(f"\nrank killed on node2 (2 nodes x 2 ranks, host tables): job FAILED {took:.0f}s later")
