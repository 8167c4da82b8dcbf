"""The prepared GPU run (bench/gpu/run_all.sh) at toy sizes on a CPU: every stage it runs
on a lent H200 runs here too, so the first GPU session spends its minutes measuring."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.integration


def test_the_gpu_script_runs_at_toy_sizes_and_fits_its_time(tmp_path):
    script = (ROOT / "bench" / "gpu" / "run_all.sh").read_text()
    # Each command fits the device's 600 s per command, all of them its 8 minutes.
    timeouts = [int(t) for t in re.findall(r"^\s*limit (\d+) ", script, re.M)]
    assert timeouts and max(timeouts) <= 600 and sum(timeouts) <= 480, timeouts
    env = subprocess_env(DRY_RUN="1", OUT=str(tmp_path), OMP_NUM_THREADS="1",
                         PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_all.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one line per check (a fresh environment also announces its op builds there)
    smoke = re.findall(r"^(?:ok  |FAIL) .*$", (tmp_path / "smoke.txt").read_text(), re.M)
    assert len(smoke) == 5 and all(line.startswith("ok ") for line in smoke), smoke
    for name in ("h200.json", "components.txt", "node.txt", "plan_today.txt", "plan_best.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "predicted step time STEM" in (tmp_path / "plan_best.txt").read_text()
    components = (tmp_path / "components.txt").read_text()
    assert components.count("step boundary, last backward to the next step's first lookup") == 2
    assert "per rank, model" in (tmp_path / "node.txt").read_text()
