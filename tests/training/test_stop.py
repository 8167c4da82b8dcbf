"""The trainer's one stop-signal handler: SIGTERM stops, SIGUSR1 stops to be requeued and
tells the launcher so (slurm/torchrun.py and slurm/launch.sh read the marker)."""

import os
import signal
import re
import subprocess
import sys
import time
from socket import gethostname

import pytest

from support.processes import ROOT, free_port, subprocess_env
from megatron_stem.training.stop import StopSignal


@pytest.fixture
def handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_only_a_sigusr1_stop_leaves_the_requeue_marker(world1, handlers, tmp_path,
                                                       monkeypatch):
    monkeypatch.setenv("STEM_STOP_MARKER", str(tmp_path / "stopped"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    stop = StopSignal()
    assert not stop.requested()

    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested() and not stop.requeue
    stop.report()
    assert not any(tmp_path.iterdir())

    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a later SIGTERM does not take the requeue back
    assert stop.requested() and stop.requeue
    stop.report()
    assert [p.name for p in tmp_path.iterdir()] == [f"stopped.{gethostname()}"]


def test_other_local_ranks_leave_no_marker(world1, handlers, tmp_path, monkeypatch):
    monkeypatch.setenv("STEM_STOP_MARKER", str(tmp_path / "stopped"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    stop = StopSignal()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.requested() and stop.requeue
    stop.report()
    assert not any(tmp_path.iterdir())


@pytest.mark.integration  # torchrun
def test_a_stop_in_the_first_second_saves_and_asks_for_the_requeue(toy_data, hf_tokenizer,
                                                                   tmp_path):
    """The real `torchrun -m megatron_stem.train` with 2 ranks, each sent SIGUSR1 a second
    after it started (still importing torch): before, both died by the signal's default
    action, with no checkpoint and no requeue code."""
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                         STEM_STOP_MARKER=str(tmp_path / "stopped"))
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "megatron_stem.train",
         "--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"data.prefixes=[{toy_data}]",
         "data.tokenizer_type=huggingface", f"data.tokenizer_model={hf_tokenizer}",
         f"train.save_dir={tmp_path / 'ckpt'}", "train.steps=5"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = _children(agent.pid, 2)
    time.sleep(1.0)
    for rank in ranks:
        rank.send_signal(signal.SIGUSR1)
    log, _ = agent.communicate(timeout=300)
    assert "exitcode  : 99" in log, log[-3000:]  # torchrun's report of each rank's exit
    assert "step 1 | stop signal: checkpoint saved, exiting for requeue" in log
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000001\n"
    assert [p.name for p in tmp_path.glob("stopped.*")] == [f"stopped.{gethostname()}"]


def _children(pid: int, count: int, timeout: float = 60) -> list:
    """The first `count` child processes of `pid`, once they exist."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children()
        if len(children) >= count:
            return children[:count]
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started fewer than {count} children")


@pytest.mark.integration  # torchrun
def test_ranks_end_when_their_torchrun_agent_is_killed(toy_data, hf_tokenizer, tmp_path):
    """The real `torchrun -m megatron_stem.train`, its agent killed (SIGKILL: it cannot
    stop its ranks): before, the ranks went on unsupervised."""
    import psutil

    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "megatron_stem.train",
         "--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"data.prefixes=[{toy_data}]",
         "data.tokenizer_type=huggingface", f"data.tokenizer_model={hf_tokenizer}",
         f"train.save_dir={tmp_path / 'ckpt'}"],
        env=subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks = _children(agent.pid, 2)
    time.sleep(1.0)
    agent.kill()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    for rank in alive:
        rank.kill()
    assert alive == []
    said = agent.communicate(timeout=30)[1]  # the ranks' stderr, once they closed it too
    for rank in (0, 1):  # the pid is not known to a rank orphaned before it could watch
        assert re.search(rf"rank {rank}: its launcher( \(pid {agent.pid}\))? is gone; "
                         "exiting", said), said


RANK_CODE = ("import os, sys, time; time.sleep(1.0); "
             "print('parent', os.getppid(), file=sys.stderr, flush=True); "
             "from megatron_stem.runtime import process_lifetime; "
             "process_lifetime.exit_with_parent('rank 3', launched=True); time.sleep(60)")


@pytest.mark.integration  # a process of its own
def test_a_rank_orphaned_before_it_could_watch_its_launcher_ends_too(tmp_path):
    """An agent killed in its rank's first moments (a loaded node): the rank's parent is
    already PID 1 (or this machine's subreaper) when it starts watching, and that is no
    launcher: it ends at once."""
    import psutil

    err = tmp_path / "stderr"
    started = subprocess.run(  # the shell, its parent, exits at once
        ["sh", "-c", f'"{sys.executable}" -c "{RANK_CODE}" 2>"{err}" & echo $!'],
        capture_output=True, text=True, timeout=30, env=subprocess_env(), cwd=ROOT)
    psutil.Process(int(started.stdout)).wait(timeout=20)  # not its 60 s: it ended itself
    assert err.read_text().endswith("\nrank 3: its launcher is gone; exiting\n")


SUBREAPER = """\
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as `tini -s` does
shell = subprocess.run(["sh", "-c", sys.argv[2] + " & echo $!"], capture_output=True,
                       text=True)  # the rank's launcher: gone at once
rank, start = int(shell.stdout), time.monotonic()
pid, status = os.waitpid(rank, 0)  # reparented here, so this process reaps it
print(os.getpid(), os.waitstatus_to_exitcode(status), round(time.monotonic() - start))
"""


@pytest.mark.integration  # processes of their own
def test_a_rank_reparented_to_a_subreaper_ends_and_a_path_is_no_launcher(tmp_path):
    """Under a subreaper (`tini -s`, `systemd --user`) an orphan's new parent is not PID
    1: the rank still ends at once, its parent being no launcher, though the subreaper's
    program lies under a folder named torch (`/opt/torch/.venv/bin/python3`: a launcher is
    matched by what it runs, not by a word in a path)."""
    python = tmp_path / "opt" / "torch" / ".venv" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    script = tmp_path / "torch_jobs" / "run_torch.py"
    script.parent.mkdir()
    script.write_text(SUBREAPER)
    err = tmp_path / "stderr"
    rank = f'"{sys.executable}" -c "{RANK_CODE}" 2>"{err}"'
    done = subprocess.run([str(python), str(script), "--", rank], capture_output=True,
                          text=True, timeout=60, env=subprocess_env(), cwd=ROOT)
    subreaper, code, seconds = map(int, done.stdout.split())
    assert (code, seconds < 30) == (1, True), done
    assert err.read_text() == f"parent {subreaper}\nrank 3: its launcher is gone; exiting\n"


def test_a_launcher_is_what_runs_torchrun_not_a_word_in_a_path():
    from megatron_stem.runtime.process_lifetime import launcher_command

    launchers = [  # (command line, process name)
        (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc_per_node=8", "-m",
          "megatron_stem.train"], "torchrun"),  # the command, through its `#!` line
        (["python", "-m", "torch.distributed.run", "--nnodes=4"], "python"),
        (["python3.12", "-u", "-Wignore::DeprecationWarning", "-m", "torch.distributed.run"],
         "python3.12"),
        (["python3", "-um", "torch.distributed.run"], "python3"),
        (["python3", "/opt/code/slurm/torchrun.py", "--nnodes=4"], "python3"),  # ours
        (["python3", "-c", "from multiprocessing.forkserver import main"], "torchrun"),
    ]
    others = [
        (["/opt/torch/.venv/bin/python3", "train.py"], "python3"),
        (["/home/torchrun/bin/python", "job.py"], "python"),
        (["python3", "-X", "dev", "-m", "megatron_stem.train"], "python3"),
        (["python3", "-c", "import torch.distributed.run"], "python3"),
        (["/sbin/tini", "-s", "--", "torchrun", "--nnodes=4"], "tini"),
        (["/usr/lib/systemd/systemd", "--user"], "systemd"),
        ([], "bash"),
    ]
    assert [launcher_command(*c) for c in launchers] == [True] * len(launchers)
    assert [launcher_command(*c) for c in others] == [False] * len(others)


@pytest.mark.integration  # a process of its own
def test_a_thread_left_running_does_not_keep_a_finished_process_alive():
    code = ("import threading, time; from megatron_stem.runtime import process_lifetime; "
            "threading.Thread(target=time.sleep, args=(600,)).start(); "
            "print('done', flush=True); process_lifetime.exit_soon(3, grace_s=1)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(), cwd=ROOT)
    assert (proc.returncode, proc.stdout) == (3, "done\n")
    assert time.monotonic() - start < 30
