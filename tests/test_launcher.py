"""The suite's torchrun (tests/launcher.py): ranks forked from a process that imported the
libraries start as the command's exec'd ranks would."""

import json
import subprocess
import sys

import pytest

from conftest import WORKERS, subprocess_env, torchrun

pytestmark = pytest.mark.integration  # torchrun

SCRIPT = WORKERS / "rank_start.py"


def test_a_forked_rank_starts_as_a_new_interpreter_would(tmp_path):
    out = tmp_path / "report"
    log = torchrun(2, SCRIPT.name, out, "done")
    assert sorted(log.splitlines()) == ["rank 0 started", "rank 1 started"]
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-u", str(SCRIPT), str(out), "done"], cwd=WORKERS,
                   env=env, check=True, capture_output=True)
    fresh = json.loads((tmp_path / "report.alone").read_text())
    assert fresh["threads"] == 1 and fresh["unbuffered"] == [True, True]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"report.{rank}").read_text()) == fresh


def test_a_rank_that_exits_with_a_code_fails_the_launch(tmp_path):
    log = torchrun(2, SCRIPT.name, tmp_path / "report", "3", exit_code=1)
    assert "exitcode  : 3" in log
