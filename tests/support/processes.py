"""The paths and processes every test shares: the repository, a child's environment, a
tool's `main` imported as a user runs it, torchrun over tests/workers/ (launcher.py), and
results made once per test run and shared by the xdist workers."""

import fcntl
import functools
import importlib.util
import os
import pickle
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch

from support import launcher

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "workers"
CORPUS = ROOT / "data_corpus" / "gcide.jsonl.gz"
# Characters the dictionary lacks, so UTF-8 beyond ASCII (and byte fallback) is exercised.
UNICODE_DOCS = ["naïve café, déjà vu — über 東京 🚀", "Ωmega ≤ ∞ ½",
                "  leading  and trailing spaces\n\n ", "tabs\tand\nnewlines\r\nkept"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set in this process by init_distributed (the world1 fixture): a child must not inherit
# them, or it joins (or collides with) this process's rendezvous.
_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra: str) -> dict:
    """This process's environment for a child process, minus its distributed identity."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env.update(extra)
    return env


def tool(name: str):
    """A CLI's main(), imported from tools/ as a user would run it."""
    return tool_main(f"tools/{name}.py")


def tensorboard_steps(folder, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard shows them (it drops what a resumed run purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600, exit_code: int = 0) -> str:
    """Run tests/workers/<script> under torchrun with `nproc` gloo ranks; its stdout (and
    stderr, when `exit_code` is not 0: the run is expected to fail with it); fail the test
    with its log when it exits otherwise. (torchrun's launcher, and its ranks, are forked
    from a process that imported the libraries: tests/support/launcher.py.)"""
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = launcher.torchrun([f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                              str(WORKERS / script), *map(str, args)], env, WORKERS, timeout)
    if proc.returncode != exit_code:
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return proc.stdout + (proc.stderr if exit_code else "")


@functools.cache
def tool_main(path: str):
    """The `main` of a tools/ or bench/ script (a repository path), imported without
    running it."""
    assert (ROOT / path).is_file(), f"{path} does not exist"
    name = "_tool_" + re.sub(r"\W", "_", path)  # tools/x.py and bench/x.py may share a stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model folder's safetensors files, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def merge_rank_dumps(folder: Path) -> dict:
    """Union of the per-rank result dumps written by a worker."""
    merged = {"params": {}, "grads": {}}
    for f in sorted(folder.glob("rank*.pt")):
        dump = torch.load(f)
        for key, value in dump.items():
            if key in ("params", "grads"):
                merged[key].update(value)
            else:
                merged[key] = value
    return merged


def once_per_run(tmp_path_factory, name: str, make):
    """`make(folder)`'s result, made once per test run by whichever xdist worker asks
    first; the others wait for it, then read it. (A session fixture is made once per
    worker.) For work whose result is on disk, read-only to its tests, and pickles."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed making it
            folder.mkdir()
            partial = done.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(make(folder)))
            partial.rename(done)
        return pickle.loads(done.read_bytes())
