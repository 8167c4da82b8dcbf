"""Which code a run ran: recorded in every checkpoint (`CODE_VERSION`), so a model can be
traced to the code that trained it, requeues and stages included."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

# Set by slurm/launch.sh: the version of the job's code snapshot (docs/slurm.md).
ENV = "STEM_CODE_VERSION"


def code_version() -> str:
    """The launcher's record of its snapshot, else `git describe --always --dirty` of this
    package's checkout, else "unknown" (an installed copy)."""
    return os.environ.get(ENV) or _checkout_version()


@functools.cache
def _checkout_version() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=30, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
