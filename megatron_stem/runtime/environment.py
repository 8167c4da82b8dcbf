"""What one node offers a run: the acceptance run's first stage, on every node
(docs/acceptance.md).

    python -m megatron_stem.runtime.environment --out DIR [--build-within SECONDS]

Writes `DIR/<host>.json` and prints it on one line: the host, its GPUs (model and count,
from torch; the driver from nvidia-smi), CUDA and NCCL as torch was built with them, the
versions of Python, torch, megatron-core and DeepSpeed, the InfiniBand devices the kernel
lists (/sys/class/infiniband: each port's state and rate), and the JIT ops
(`tools/build_ops.py`'s: DeepSpeed's CPU Adam, the tables' row Adam), built within
`--build-within` seconds or not, in which case the run's tables use the torch kernel
(`optimizer.tables.kernel: torch`), as the record says. The nodes of a job are compared
in the acceptance report: a node unlike the others is named there.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from megatron_stem.runtime import jit_ops
from megatron_stem.runtime.errors import cli

INFINIBAND = Path("/sys/class/infiniband")
PACKAGES = ("torch", "megatron-core", "deepspeed")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def gpus() -> dict:
    """The GPUs torch sees, CUDA and NCCL as torch has them, and the driver."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpus": 0, "cuda": torch.version.cuda, "nccl": None,
                "driver": None}
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = torch.cuda.nccl.version()
    return {"gpu": ", ".join(names), "gpus": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "driver": _driver()}


def infiniband(root: Path = INFINIBAND) -> list[dict]:
    """Each InfiniBand (RDMA) device's ports: name, state (`4: ACTIVE`), rate
    (`400 Gb/sec (4X NDR)`)."""
    out = []
    for device in sorted(root.glob("*")) if root.is_dir() else []:
        for port in sorted((device / "ports").glob("*")):
            def read(name, port=port):
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return None
            out.append({"device": device.name, "port": port.name, "state": read("state"),
                        "rate": read("rate"), "link_layer": read("link_layer")})
    return out


def ops(within: float | None) -> dict:
    """The JIT ops: built (or found), or not, and so the kernel the tables run."""
    if within is not None and not jit_ops.build_all_within(within):
        return {"ops_built": False, "kernel": "torch"}
    return {"ops_built": True, "ops": jit_ops.build_all(), "kernel": "deepspeed"}


def record(within: float | None) -> dict:
    return {"host": socket.gethostname(), **gpus(), "python": platform.python_version(),
            **{p: _version(p) for p in PACKAGES}, "infiniband": infiniband(), **ops(within)}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", required=True, help="folder of the nodes' records")
    ap.add_argument("--build-within", type=float, metavar="SECONDS",
                    help="give the JIT ops' build this long (default: as long as it takes)")
    args = ap.parse_args(argv)
    found = record(args.build_within)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{found['host']}.json").write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
