"""The suite's torchrun (tests/support/launcher.py): ranks forked from a process that imported the
libraries start as the command's exec'd ranks do."""

import json
import subprocess
import sys

import pytest

from support.processes import WORKERS, free_port, subprocess_env, torchrun

pytestmark = pytest.mark.integration  # torchrun

SCRIPT = WORKERS / "rank_start.py"


def test_a_forked_rank_starts_as_the_commands_exec_d_rank_would(tmp_path):
    log = torchrun(2, SCRIPT.name, tmp_path / "forked", "done")
    assert sorted(log.splitlines()) == ["rank 0 started", "rank 1 started"]
    # The command itself: `python -m torch.distributed.run`, its agent exec'ing the ranks.
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    f"--master_port={free_port()}", str(SCRIPT), str(tmp_path / "exec"),
                    "done"], cwd=WORKERS, env=env, check=True, capture_output=True)
    for rank in (0, 1):
        execd = json.loads((tmp_path / f"exec.{rank}").read_text())
        assert execd["threads"] == 1 and execd["unbuffered"] == [True, True]
        assert json.loads((tmp_path / f"forked.{rank}").read_text()) == execd


def test_a_rank_that_exits_with_a_code_fails_the_launch(tmp_path):
    log = torchrun(2, SCRIPT.name, tmp_path / "report", "3", exit_code=1)
    assert "exitcode  : 3" in log
