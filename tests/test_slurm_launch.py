"""slurm/launch.sh without a cluster: its command line and rendezvous port, with stand-ins
for SLURM's commands, and its bash 4.2 compatibility.

Bash before 4.4 takes a bare "${a[@]}" of an empty array for an unset variable under
`set -u` and stops the script (CentOS/RHEL 7 clusters ship bash 4.2). No such bash can be
installed here, and bash 5 has no mode that behaves that way, so the rule is checked on
the script's text: every array that can be empty (filled by `read -a`) is expanded
through the ${a[@]+"${a[@]}"} idiom.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

LAUNCH = ROOT / "slurm" / "launch.sh"

STUBS = {
    "scontrol": 'case "$1 $2" in "show hostnames") echo node1 ;; esac',
    "srun": 'printf "%s\\n" "$@" >"$STEM_TEST_ARGS"',
    "python": "exit 0",  # launch.sh's "can import torch and deepspeed" check
}


def _run_launch(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    args = tmp_path / "srun_args"
    environ = {"PATH": f"{stubs}:{os.environ['PATH']}", "HOME": str(tmp_path),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1",
               "SLURM_JOB_NUM_NODES": "1", "STEM_RECIPE": "recipes/tiny_cpu.yaml",
               "STEM_OUTPUT": str(tmp_path / "runs"), "STEM_VENV": str(tmp_path / "venv"),
               "STEM_TEST_ARGS": str(args), **env}
    proc = subprocess.run(["bash", "-c", f'source "{LAUNCH}"'], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=60)
    return proc, args.read_text().splitlines() if args.exists() else []


@pytest.mark.integration  # runs the script
def test_without_overrides_the_command_line_ends_with_the_recipe_and_save_dir(tmp_path):
    proc, args = _run_launch(tmp_path, STEM_DATA="  ")
    assert proc.returncode == 0, proc.stderr
    tail = args[args.index("megatron_stem.train") + 1:]
    assert tail == ["--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"),
                    f"train.save_dir={tmp_path / 'runs' / 'stem' / 'checkpoints'}"]


@pytest.mark.integration
def test_the_rendezvous_port_is_per_job_and_outside_the_ephemeral_range(tmp_path):
    # (job 15000 got port 35000 before: inside the usual 32768-60999)
    proc, args = _run_launch(tmp_path, SLURM_JOB_ID="15000", STEM_OVERRIDES="train.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert args[-1] == "train.steps=3"
    port = int(re.search(r"rendezvous node1:(\d+)", proc.stdout)[1])
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not low <= port <= high and 1024 <= port <= 65535
    assert f"--rdzv-endpoint=node1:{port}" in args


def test_arrays_that_can_be_empty_expand_safely_under_bash_4_2():
    text = LAUNCH.read_text()
    maybe_empty = set(re.findall(r"read -r -a (\w+)", text))
    assert maybe_empty >= {"_stem_prefixes", "_stem_overrides"}
    for name in maybe_empty:
        bare = re.findall(r'(.?)"\$\{' + name + r'\[@\]\}"(.?)', text)
        guarded = [(before, after) for before, after in bare if (before, after) == ("+", "}")]
        assert bare == guarded, f"{name}: expand as ${{{name}[@]+\"${{{name}[@]}}\"}}"
