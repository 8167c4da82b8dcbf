import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600) -> str:
    """Run tests/workers/<script> under torchrun with `nproc` gloo ranks; fail with its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(WORKERS / script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=WORKERS, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return proc.stdout


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


@pytest.fixture(scope="session")
def world1():
    """megatron parallel state for a single in-process rank (TP=PP=DP=1)."""
    from megatron_stem.config import ParallelConfig
    from megatron_stem.parallel import destroy_distributed, init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    yield
    destroy_distributed()
