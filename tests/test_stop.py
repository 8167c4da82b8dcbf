"""The trainer's one stop-signal handler: SIGTERM stops, SIGUSR1 stops to be requeued and
tells the launcher so (slurm/torchrun.py and slurm/launch.sh read the marker)."""

import os
import signal
from socket import gethostname

import pytest

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
