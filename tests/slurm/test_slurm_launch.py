"""slurm/launch.sh without a cluster: its command line, ranks per node and rendezvous port,
with stand-ins for SLURM's commands, and its bash 4.2 compatibility.

The stand-in `srun` runs the per-node command as node 0 and the stand-in `python` records
what torchrun was asked to run, so a GPU job's variables (which the real two-node test,
a CPU job, cannot have in effect) are checked down to torchrun's `--nproc-per-node`.

Bash before 4.4 takes a bare "${a[@]}" of an empty array for an unset variable under
`set -u` and stops the script (CentOS/RHEL 7 clusters ship bash 4.2). No such bash can be
installed here, and bash 5 has no mode that behaves that way, so the rule is checked on
the script's text: every array that can be empty (filled by `read -a`) is expanded
through the ${a[@]+"${a[@]}"} idiom.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, free_port, subprocess_env

LAUNCH = ROOT / "slurm" / "launch.sh"

STUBS = {
    "scontrol": 'case "$1 $2" in "show hostnames") echo node1 ;; esac',
    # srun's own options (recorded), then the per-node command, run as node 0
    "srun": 'while [[ $1 == --* ]]; do echo "$1" >>"$STEM_TEST_ARGS.srun"; shift; done\n'
            'SLURM_NODEID=0 SLURM_NNODES=$SLURM_JOB_NUM_NODES exec "$@"',
    # torchrun (slurm/torchrun.py): its arguments, path, threads, PYTHONPATH and CUDA's
    # module loading recorded; the data cache's build: its arguments; preprocessing: its
    # arguments; `-c`: the environment's check (slurm/environment.sh), which fails with
    # STEM_TEST_ENV_FAILS
    "python": 'case $1 in *torchrun.py) echo "$1" >"$STEM_TEST_ARGS.script"; shift\n'
              '  printf "%s\\n" "$@" >"$STEM_TEST_ARGS"\n'
              '  echo "$PYTHONPATH" >"$STEM_TEST_ARGS.pythonpath"\n'
              '  echo "$OMP_NUM_THREADS" >"$STEM_TEST_ARGS.threads"; echo torchrun >>"$STEM_TEST_ARGS.order"\n'
              '  echo "${CUDA_MODULE_LOADING-unset}" >"$STEM_TEST_ARGS.module_loading" ;;\n'
              '  *build_data_cache.py) shift; printf "%s\\n" "$@" >"$STEM_TEST_ARGS.cache"\n'
              '  echo cache >>"$STEM_TEST_ARGS.order" ;;\n'
              '  *preprocess_data.py) printf "%s\\n" "$@" >"$STEM_TEST_ARGS.preprocess" ;;\n'
              '  -c) echo "check ${*:5}" >>"$STEM_TEST_ARGS.order"\n'
              '  [[ -n ${STEM_TEST_ENV_FAILS:-} ]] && { echo "$STEM_TEST_ENV_FAILS" >&2; exit 1; }\n'
              '  echo "torch 2.15.0, deepspeed 0.19.8, megatron-core 0.19.2" ;; esac',
    # Apptainer: its options recorded, then the command after the image, run on the host
    "apptainer": 'echo "$@" >"$STEM_TEST_ARGS.apptainer"\n'
                 'while [[ $1 != *.sif ]]; do shift; done; shift; exec "$@"',
}


def _stand_ins(tmp_path: Path, **env: str) -> dict:
    """The environment of a batch script whose SLURM commands, python and apptainer are the
    stand-ins (`STUBS`), recording what they are given under `tmp_path/srun_args*`."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    return {"PATH": f"{stubs}:{os.environ['PATH']}", "HOME": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1",
            "SLURM_JOB_NUM_NODES": "1", "STEM_VENV": str(tmp_path / "venv"),
            "STEM_TEST_ARGS": str(tmp_path / "srun_args"), **env}


def _run_launch(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    environ = _stand_ins(tmp_path, STEM_RECIPE="recipes/tiny_cpu.yaml",
                         STEM_OUTPUT=str(tmp_path / "runs"), **env)
    args = tmp_path / "srun_args"
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
def test_the_data_cache_is_built_on_the_first_node_before_any_rank_starts(tmp_path):
    proc, args = _run_launch(tmp_path, STEM_BUILD_DATA_CACHE="1", SLURM_JOB_NUM_NODES="4",
                             SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="64",
                             STEM_OVERRIDES="train.steps=3")
    assert proc.returncode == 0, proc.stderr
    record = Path(f"{tmp_path / 'srun_args'}")
    assert Path(f"{record}.order").read_text().splitlines() == [
        "check torch deepspeed megatron.core", "cache", "torchrun"]
    cache = Path(f"{record}.cache").read_text().splitlines()
    recipe = args[args.index("megatron_stem.train") + 1:]
    assert cache == recipe + ["--ranks", "32", "--workers", "64"]  # the run's own settings
    # off by default: other sbatch files do not build
    (tmp_path / "off").mkdir()
    proc, _ = _run_launch(tmp_path / "off")
    assert proc.returncode == 0 and not Path(f"{tmp_path / 'off' / 'srun_args'}.cache").exists()


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


# What SLURM sets in the batch script of a GPU job (the local cluster's SLURM 22.05 for
# --gpus-per-node=8 on 2 nodes: all three), and the forms sites and older SLURMs give.
EIGHT_GPUS = {
    "--gpus-per-node=8": dict(SLURM_GPUS_ON_NODE="8", SLURM_GPUS_PER_NODE="8",
                              SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"),
    "SLURM_GPUS_ON_NODE": dict(SLURM_GPUS_ON_NODE="8"),
    "SLURM_JOB_GPUS": dict(SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"),
    "count": dict(SLURM_GPUS_PER_NODE="8"),
    "gpu:count": dict(SLURM_GPUS_PER_NODE="gpu:8"),
    "type:count": dict(SLURM_GPUS_PER_NODE="h100:8"),
    "gres:type:count": dict(SLURM_GPUS_PER_NODE="gpu:h100:8"),
    "two types": dict(SLURM_GPUS_PER_NODE="a100:4,v100:4"),
    "--gpus=16": dict(SLURM_GPUS="16", SLURM_GPUS_ON_NODE="8", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"),
    # --exclusive gives a job all of a node's GPUs, whatever --gpus-per-node asked
    "--exclusive --gpus-per-node=2": dict(SLURM_GPUS_ON_NODE="8", SLURM_GPUS_PER_NODE="2",
                                          SLURM_JOB_GPUS="0,1,2,3,4,5,6,7"),
}


@pytest.mark.integration
@pytest.mark.parametrize("given", EIGHT_GPUS)
def test_a_gpu_job_runs_one_rank_per_gpu_on_every_node(tmp_path, given):
    proc, args = _run_launch(tmp_path, SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[1-2]",
                             SLURM_JOB_CPUS_PER_NODE="64(x2)", **EIGHT_GPUS[given])
    assert proc.returncode == 0, proc.stderr
    assert "--nnodes=2" in args and "--nproc-per-node=8" in args
    assert "stem: node 0/2 is" in proc.stdout and ": torchrun with 8 rank(s)" in proc.stdout
    assert "2 node(s) x 8 rank(s) (one per GPU: SLURM_" in proc.stdout
    assert (tmp_path / "srun_args.threads").read_text().strip() == "8"  # 64 CPUs / 8 ranks
    # every kernel loaded at start: none loaded lazily while a collective waits for peers
    assert (tmp_path / "srun_args.module_loading").read_text().strip() == "EAGER"


@pytest.mark.integration
@pytest.mark.parametrize("env, procs", [({}, 1), ({"SLURM_GPUS_ON_NODE": "0"}, 1),
                                        ({"SLURM_GPUS_ON_NODE": "8", "STEM_PROCS_PER_NODE": "2"}, 2)])
def test_a_job_without_gpus_runs_one_rank_and_stem_procs_per_node_wins(tmp_path, env, procs):
    proc, args = _run_launch(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert f"--nproc-per-node={procs}" in args
    loading = (tmp_path / "srun_args.module_loading").read_text().strip()
    assert loading == ("EAGER" if env.get("SLURM_GPUS_ON_NODE", "0") != "0" else "unset")


@pytest.mark.integration
@pytest.mark.parametrize("env, line", [
    ({"SLURM_GPUS_PER_NODE": "h100"},
     "SLURM_GPUS_PER_NODE=h100: cannot tell the GPUs per node from it; set STEM_PROCS_PER_NODE"),
    ({"SLURM_GPUS": "4", "SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_NUM_NODES": "2"},
     "SLURM_GPUS=4 on 2 node(s), but 3 on this one: the nodes have different numbers of GPUs; "
     "ask for them with --gpus-per-node"),
    ({"STEM_PROCS_PER_NODE": "0"}, "STEM_PROCS_PER_NODE: expected a positive integer, got '0'"),
])
def test_gpus_that_cannot_be_split_into_ranks_are_one_error_line(tmp_path, env, line):
    proc, args = _run_launch(tmp_path, **env)
    assert proc.returncode == 2 and args == []
    assert proc.stderr.strip().splitlines() == [f"stem: error: {line}"]


FAILING_RANKS = """
import os, pathlib, signal, sys, time
ready = pathlib.Path(sys.argv[1])
if os.environ["LOCAL_RANK"] == "0":
    while not ready.exists():  # rank 1 handles SIGTERM
        time.sleep(0.05)
    sys.exit(3)
def stop(*_):  # as the trainer does: a stop signal ends the step first
    print("rank 1 got SIGTERM", file=sys.stderr, flush=True)
    time.sleep(1)
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
ready.touch()
time.sleep(60)
"""


@pytest.mark.integration  # runs torchrun
def test_torchrun_names_a_failed_rank_before_stopping_the_others(tmp_path):
    """torchrun's own report comes only once the node's other ranks are stopped; by then
    another node's may have come first and srun killed this one (docs/slurm.md)."""
    script = tmp_path / "ranks.py"
    script.write_text(FAILING_RANKS)
    proc = subprocess.run([sys.executable, str(ROOT / "slurm" / "torchrun.py"), "--standalone",
                           "--nproc-per-node=2", str(script), str(tmp_path / "ready")],
                          capture_output=True, text=True,
                          timeout=120, env=subprocess_env())
    said = f"stem: {socket.gethostname()}: rank 0 (local rank 0) failed: exit code 3; " \
           "stopping the node's other ranks"
    assert proc.returncode == 1 and said in proc.stderr, proc.stderr
    assert proc.stderr.index(said) < proc.stderr.index("rank 1 got SIGTERM")


# Slows the agent's closing of the rendezvous (its last use of the store) by 2 s: without an
# order, the host's agent has left by then and this agent logs a failed shutdown.
SLOW_CLOSE = """
import time
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as d
close = d.DynamicRendezvousHandler.shutdown
def slow_close(self):
    time.sleep(2)
    return close(self)
d.DynamicRendezvousHandler.shutdown = slow_close
"""


@pytest.mark.integration  # runs torchrun
def test_after_a_clean_run_the_store_s_host_leaves_last(tmp_path):
    """Two nodes' torchruns (on this machine): the one that is not the store's host ends
    its exit barrier and closes the rendezvous late, and neither logs an error."""
    script = tmp_path / "rank.py"
    script.write_text("print('trained', flush=True)\n")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_CLOSE)
    port = free_port()
    agents = []
    for host in (1, 0):
        env = subprocess_env(**({} if host else {"PYTHONPATH": f"{slow}:{os.environ.get('PYTHONPATH', '')}"}))
        agents.append(subprocess.Popen(
            [sys.executable, str(ROOT / "slurm" / "torchrun.py"), "--nnodes=2",
             "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=clean", f"--rdzv-conf=is_host={host},read_timeout=60", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0 and "trained" in output, output
        logged = [line for line in output.splitlines()  # torch's warning of a heartbeat
                  if "keep-alive heartbeat" not in line]  # late on a busy machine
        assert not re.search(r"error|failed|Traceback", "\n".join(logged), re.I), output


MISTAKEN_RANKS = """
import os, sys
from megatron_stem.runtime.errors import UserError, cli
@cli
def main():
    if os.environ["RANK"] in sys.argv[1].split(","):
        raise UserError(f"data.prefixes: data/x.bin not found (seen by rank {os.environ['RANK']})")
    return 0
sys.exit(main())
"""


@pytest.mark.integration  # runs torchrun
@pytest.mark.parametrize("ranks, said", [
    ("0,1", {"error: data.prefixes: data/x.bin not found (seen by rank 0)",
             # rank 1 was first, and torchrun stopped rank 0 before it could say it
             "error: rank 1: data.prefixes: data/x.bin not found (seen by rank 1)"}),
    ("1", {"error: rank 1: data.prefixes: data/x.bin not found (seen by rank 1)"})])
def test_a_users_mistake_is_one_line_once_without_torchruns_report(tmp_path, ranks, said):
    """Every rank meets it: rank 0 says it; one rank alone: its line, from torchrun's error
    file. One line, no failure report, no traceback."""
    script = tmp_path / "ranks.py"
    script.write_text(MISTAKEN_RANKS)
    proc = subprocess.run([sys.executable, str(ROOT / "slurm" / "torchrun.py"), "--standalone",
                           "--nproc-per-node=2", str(script), ranks],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if not line.startswith(("W", "I")) or line.startswith("error")]
    assert len(lines) == 1 and lines[0] in said, proc.stderr


def test_rank_0_stopped_right_after_saying_the_mistake_is_not_said_again(tmp_path, capsys):
    """Rank 1's mistake ends first, and torchrun stops rank 0 (SIGTERM) after rank 0 said
    its own: its error file tells the wrapper, which neither repeats rank 1's line nor
    takes the stop for a crash."""
    import importlib.util
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    spec = importlib.util.spec_from_file_location("stem_torchrun", ROOT / "slurm" / "torchrun.py")
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)

    def failure(rank, exitcode, said):
        path = tmp_path / f"error-{rank}-{exitcode}-{said}.json"
        if said:
            path.write_text(json.dumps({"message": f"x not found (seen by rank {rank})",
                                        "timestamp": "1"}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                              error_file=str(path))

    stopped_after = {0: failure(0, -15, said=True), 1: failure(1, 2, said=True)}
    assert wrapper._said_user_error(ChildFailedError("ranks.py", stopped_after))
    assert capsys.readouterr().err == ""
    stopped_before = {0: failure(0, -15, said=False), 1: failure(1, 2, said=True)}
    assert wrapper._said_user_error(ChildFailedError("ranks.py", stopped_before))
    assert capsys.readouterr().err == "error: rank 1: x not found (seen by rank 1)\n"
    crashed = {0: failure(0, 1, said=False), 1: failure(1, 2, said=True)}
    assert not wrapper._said_user_error(ChildFailedError("ranks.py", crashed))


def test_arrays_that_can_be_empty_expand_safely_under_bash_4_2():
    text = "".join((ROOT / "slurm" / name).read_text()
                   for name in ("launch.sh", "job.sh", "acceptance.sh"))
    maybe_empty = set(re.findall(r"read -r -a (\w+)", text))
    assert maybe_empty >= {"_stem_prefixes", "_stem_overrides"}
    for name in maybe_empty:
        bare = re.findall(r'(.?)"\$\{' + name + r'\[@\]\}"(.?)', text)
        guarded = [(before, after) for before, after in bare if (before, after) == ("+", "}")]
        assert bare == guarded, f"{name}: expand as ${{{name}[@]+\"${{{name}[@]}}\"}}"


@pytest.mark.integration
def test_a_job_runs_its_first_starts_copy_of_the_code_and_its_requeues_reuse_it(tmp_path):
    """The first start copies the package and launcher into the job's folder and runs that
    copy (PYTHONPATH, torchrun.py); a requeue runs the same copy, not the checkout."""
    version = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    proc, _ = _run_launch(tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "runs" / "stem" / "jobs" / "4242"
    code = job / "code"
    assert (code / "megatron_stem" / "train.py").read_bytes() == \
        (ROOT / "megatron_stem" / "train.py").read_bytes()
    assert (code / "VERSION").read_text().strip() == version
    assert (tmp_path / "srun_args.script").read_text().strip() == f"{code}/slurm/torchrun.py"
    assert (tmp_path / "srun_args.pythonpath").read_text().strip().split(":")[0] == str(code)
    assert str(ROOT) not in (tmp_path / "srun_args.pythonpath").read_text().strip().split(":")
    assert f"stem: code {version} (copied from {ROOT})" in proc.stdout
    assert f"code: {version} in {code}" in (job / "launch.log").read_text()

    (code / "megatron_stem" / "train.py").write_text("# the job's copy\n")  # the same job,
    for name in ("bin", "venv"):  # requeued: its copy runs, as it was
        shutil.rmtree(tmp_path / name)
    proc, _ = _run_launch(tmp_path, SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0, proc.stderr
    assert (code / "megatron_stem" / "train.py").read_text() == "# the job's copy\n"
    assert (tmp_path / "srun_args.pythonpath").read_text().strip().split(":")[0] == str(code)
    assert "(the job's snapshot, reused by restart 1)" in proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize("image", ["nvcr.io#nvidia/pytorch:24.05-py3", "/images/stem.sqsh"])
def test_stem_container_runs_the_ranks_in_a_pyxis_container(tmp_path, image):
    proc, args = _run_launch(tmp_path, STEM_CONTAINER=image, STEM_CONTAINER_MOUNTS="/data")
    assert proc.returncode == 0, proc.stderr
    code = tmp_path / "runs" / "stem" / "jobs" / "4242" / "code"
    srun = (tmp_path / "srun_args.srun").read_text().splitlines()
    assert srun[-3:] == [f"--container-image={image}",
                         f"--container-mounts={tmp_path},{code},/data",
                         f"--container-workdir={tmp_path}"]
    assert args[-1].startswith("train.save_dir=") and not (tmp_path / "srun_args.apptainer").exists()


@pytest.mark.integration
def test_stem_container_runs_the_ranks_in_an_apptainer_image(tmp_path):
    proc, args = _run_launch(tmp_path, STEM_CONTAINER="/images/stem.sif")
    assert proc.returncode == 0, proc.stderr
    code = tmp_path / "runs" / "stem" / "jobs" / "4242" / "code"
    called = (tmp_path / "srun_args.apptainer").read_text().split()
    assert called[:7] == ["exec", "--nv", "--bind", f"{tmp_path},{code}", "--pwd", str(tmp_path),
                          "/images/stem.sif"]
    assert called[7:9] == ["python", f"{code}/slurm/torchrun.py"]
    assert "megatron_stem.train" in args
    assert not any(line.startswith("--container") for line in
                   (tmp_path / "srun_args.srun").read_text().splitlines())


@pytest.mark.integration
@pytest.mark.parametrize("image", ["docker://ghcr.io#me/megatron-stem:0.1.0", "/images/stem.sif"])
def test_the_environment_is_checked_in_the_container_before_any_rank_starts(tmp_path, image):
    proc, _ = _run_launch(tmp_path, STEM_CONTAINER=image, STEM_BUILD_DATA_CACHE="1")
    assert proc.returncode == 0, proc.stderr
    assert f"stem: environment: torch 2.15.0, deepspeed 0.19.8, megatron-core 0.19.2 (the " \
           f"container {image})" in proc.stdout
    order = (tmp_path / "srun_args.order").read_text().splitlines()
    assert order == ["check torch deepspeed megatron.core", "cache", "torchrun"]
    if image.endswith(".sif"):  # the check ran in the image (the stand-in logs its last call)
        assert "/images/stem.sif python" in (tmp_path / "srun_args.apptainer").read_text()
    else:  # on one node, through pyxis: srun's options once for the check, then each step
        srun = (tmp_path / "srun_args.srun").read_text().splitlines()
        assert srun.count(f"--container-image={image}") == 3
        assert srun[:3] == ["--nodes=1", "--ntasks=1", f"--container-image={image}"]


@pytest.mark.integration
@pytest.mark.parametrize("container", ["", "nvcr.io#nvidia/pytorch:24.05-py3"])
def test_an_environment_without_the_requirements_stops_the_job_in_one_line(tmp_path, container):
    proc, args = _run_launch(tmp_path, STEM_CONTAINER=container,
                             STEM_TEST_ENV_FAILS="has torch 2.4.0, outside the supported "
                                                 ">=2.13,<2.16")
    where = f"the container {container}" if container else str(tmp_path / "bin" / "python")
    assert proc.returncode == 2 and args == [] and not (tmp_path / "srun_args.script").exists()
    assert proc.stderr.strip().splitlines() == [
        f"stem: error: {where} has torch 2.4.0, outside the supported >=2.13,<2.16: set "
        "STEM_CONTAINER to an image of containers/Dockerfile, or STEM_VENV (a virtualenv with "
        "requirements.txt installed), STEM_MODULES or STEM_SETUP (docs/install.md)"]


def test_the_supported_torch_is_read_from_pyproject():
    """The check's range is pyproject.toml's (what environment.sh's sed reads)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text), "environment.sh reads this"


PREPROCESS = {"INPUT": "data/raw", "OUTPUT_PREFIX": "data/out", "TOKENIZER_MODEL": "tok.model",
              "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4",
              "SLURM_CPUS_PER_TASK": "16"}


@pytest.mark.integration
@pytest.mark.parametrize("container", ["", "/images/stem.sqsh", "/images/stem.sif"])
@pytest.mark.parametrize("script", ["preprocess.sbatch", "preprocess_merge.sbatch"])
def test_preprocessing_runs_in_the_environment_training_runs_in(tmp_path, container, script):
    """slurm/preprocess*.sbatch through slurm/environment.sh: the same STEM_ settings pick
    plain python, a pyxis image (srun's options) or an Apptainer image."""
    environ = _stand_ins(tmp_path, STEM_CONTAINER=container, STEM_ROOT=str(ROOT),
                         STEM_CONTAINER_MOUNTS="/data", **PREPROCESS)
    proc = subprocess.run(["bash", str(ROOT / "slurm" / script)], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "stem: environment: torch 2.15.0" in proc.stdout
    called = (tmp_path / "srun_args.preprocess").read_text().splitlines()
    assert called[0] == str(ROOT / "tools" / "preprocess_data.py")
    assert called[called.index("--input") + 1] == "data/raw"
    assert ("--merge-only" in called) == (script == "preprocess_merge.sbatch")
    mounts = f"{tmp_path},{ROOT},/data"
    srun = tmp_path / "srun_args.srun"
    if container.endswith(".sqsh"):
        assert srun.read_text().splitlines()[-3:] == [
            f"--container-image={container}", f"--container-mounts={mounts}",
            f"--container-workdir={tmp_path}"]
    elif container:
        assert (tmp_path / "srun_args.apptainer").read_text().split()[:7] == [
            "exec", "--nv", "--bind", mounts, "--pwd", str(tmp_path), container]
    else:
        assert not srun.exists() and not (tmp_path / "srun_args.apptainer").exists()


def test_every_checkpoint_records_the_code_that_saved_it(tmp_path, monkeypatch):
    """The launcher's snapshot version (STEM_CODE_VERSION), else the checkout's."""
    from megatron_stem import checkpoint
    from megatron_stem.config import Recipe
    from workers.common import tiny_model

    version = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("STEM_CODE_VERSION", raising=False)
    with checkpoint.Writer(tmp_path, 1, Recipe(model=tiny_model())):
        pass
    assert (tmp_path / "iter_0000001" / "CODE_VERSION").read_text() == f"{version}\n"
    monkeypatch.setenv("STEM_CODE_VERSION", "v1.2-3-gabcdef0")
    with checkpoint.Writer(tmp_path, 2, Recipe(model=tiny_model())):
        pass
    assert (tmp_path / "iter_0000002" / "CODE_VERSION").read_text() == "v1.2-3-gabcdef0\n"
    checkpoint.verify(tmp_path / "iter_0000002")  # part of what COMPLETE vouches for
