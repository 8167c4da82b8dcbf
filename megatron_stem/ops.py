"""DeepSpeed's JIT-compiled ops: built once per environment, in one folder, announced.

DeepSpeed compiles its C++ ops (CPU Adam; on CPU also its shared-memory collectives) the
first time they load, a minute or two each, under `$TORCH_EXTENSIONS_DIR`. The folder is
keyed by the CPU model (ops are built with -march=native: a home directory shared by nodes
of different CPUs would otherwise load illegal code) and by the environment (two virtual
environments, or two torch/DeepSpeed versions, would otherwise rebuild each other's ops).
Every load goes through `load`, which says what it builds before a cold build starts and
nothing when the op is already there. `tools/build_ops.py` builds them ahead of time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Optional


def _cpu_model() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def extensions_dir() -> Path:
    """`$TORCH_EXTENSIONS_DIR` when set, else ~/.cache/torch_extensions/<key>, the key
    hashing the CPU model, this environment and its torch and DeepSpeed versions."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    key = "|".join([_cpu_model(), sys.prefix, platform.python_version(),
                    metadata.version("torch"), metadata.version("deepspeed")])
    return Path.home() / ".cache" / "torch_extensions" / hashlib.sha1(key.encode()).hexdigest()[:10]


def use_extensions_dir() -> Path:
    """Point torch's JIT builds (ours and DeepSpeed's own) at `extensions_dir()`, built by
    this environment's ninja (`environment_ninja_first`)."""
    folder = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    environment_ninja_first()
    return folder


def environment_ninja_first() -> None:
    """Put this environment's ninja (DeepSpeed's dependency, next to the interpreter)
    first on PATH. torch runs whichever `ninja` PATH finds first at every load, even of a
    built op, and ninja versions keep their build logs in formats that do not read each
    other's (1.12 changed its hash): a process of an activated environment (slurm/launch.sh
    activates one) and one of the same environment run by path (`.venv/bin/python`, the
    system's ninja first) rebuilt the ops in turn, a minute each time."""
    bin_dir = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (bin_dir / "ninja").is_file() and path.split(os.pathsep)[0] != str(bin_dir):
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), path]) if path else str(bin_dir)


def _speaks() -> bool:
    """One process per node announces a build (the others wait on the same build lock)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def _ask_cpuinfo_once() -> None:
    """DeepSpeed's CPU op builders ask py-cpuinfo for the CPU's architecture and SIMD width
    at every load, even of a built op, twice (`cpu_arch`, `simd_width`), and py-cpuinfo
    answers from a new Python process: 1.1 s a question, 2-7 s of each rank's start. The
    answer cannot change within a process: ask once."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    ask = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info():
        return copy.deepcopy(ask())

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info


# torch's build lock (`FileBaton`: a file created exclusively, removed when the build ends)
# is waited for forever by every later load when its build was killed. Our loads write the
# lock's owner in it (`_owned_baton`) and remove a lock whose owner is gone; a lock with no
# owner (another program's build) is judged by its age: older than this only when its build
# was killed (a build takes a few minutes).
STALE_LOCK_S = 30 * 60
# Another rank's load holds the lock while ninja checks a built op is up to date: well under
# a second, seconds on a loaded node. A lock still there after this is a build: said.
QUIET_WAIT_S = 10.0


class _BuildDied(Exception):
    """The build this load waited for was killed; its lock is removed: load again."""


def _running(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed and not yet reaped, does not)."""
    if Path("/proc/self/stat").exists():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _dead_owner(lock: Path) -> Optional[int]:
    """The PID that wrote `lock` when it is a process of this host that no longer runs;
    None for a live owner, another host's, or none recorded."""
    try:
        host, pid = lock.read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return None
    return pid if host == socket.gethostname() and not _running(pid) else None


def _owned_baton():
    """torch's `FileBaton` with its owner ("host pid") written in the lock it takes, and a
    wait that ends when that owner dies (torch's waits for the file forever)."""
    from torch.utils.file_baton import FileBaton

    class OwnedBaton(FileBaton):
        def try_acquire(self) -> bool:
            if not super().try_acquire():
                return False
            Path(self.lock_file_path).write_text(f"{socket.gethostname()} {os.getpid()}")
            return True

        def wait(self) -> None:
            lock = Path(self.lock_file_path)
            while lock.exists():
                if _dead_owner(lock) is not None:
                    lock.unlink(missing_ok=True)
                    raise _BuildDied(lock)
                time.sleep(self.wait_seconds)

    return OwnedBaton


def _use_owned_batons() -> None:
    from torch.utils import cpp_extension

    if not getattr(cpp_extension.FileBaton, "owned", False):
        cpp_extension.FileBaton = _owned_baton()
        cpp_extension.FileBaton.owned = True


def _clear_stale_lock(lock: Path, what: str) -> None:
    """Remove `lock` when its build died; say why a load waits when one is running."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    dead = _dead_owner(lock)
    if dead is not None or age > STALE_LOCK_S:
        try:
            lock.unlink()
        except FileNotFoundError:  # another rank of the node removed it: it says so
            return
        by = f"process {dead}, gone" if dead is not None else f"{age / 60:.0f} min ago"
        print(f"removed {lock}, left by {by}: a build of {what} that did not finish; "
              "building again", flush=True)
        return
    waited = 0.0
    while lock.exists() and waited < QUIET_WAIT_S:
        time.sleep(0.1)
        waited += 0.1
    if lock.exists() and _speaks():
        print(f"waiting for another process's build of {what} (its lock {lock} is "
              f"{age + waited:.0f} s old: delete it if no build is running)", flush=True)


def load(builder, what: str):
    """`builder.load()` from the one folder, announced when it has to compile first; a
    build it waits for that dies is taken over."""
    _ask_cpuinfo_once()
    _use_owned_batons()
    folder = use_extensions_dir()
    _clear_stale_lock(folder / builder.name / "lock", what)
    if not (folder / builder.name / f"{builder.name}.so").is_file() and _speaks():
        print(f"building {what}, once per environment, ~1-2 min (into {folder})", flush=True)
    try:
        return builder.load()
    except _BuildDied:  # its lock is removed
        print(f"the build of {what} this load waited for died; building again", flush=True)
        return builder.load()


def build_all_within(seconds: float) -> bool:
    """`build_all` in a child process given `seconds`. False, with one line, when it did
    not finish: the child and its compilers are killed (the locks they held name a dead
    owner, which the next load removes) and the caller runs the torch kernel."""
    child = subprocess.Popen([sys.executable, "-c", "from megatron_stem import ops; ops.build_all()"],
                             start_new_session=True)
    try:
        if child.wait(timeout=seconds) == 0:
            return True
        reason = f"failed (exit {child.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        reason = f"did not finish in {seconds:.0f} s"
    print(f"the ops' build {reason}: this run uses the torch kernel "
          "(optimizer.tables.kernel: torch)", flush=True)
    return False


def load_cpu_adam():
    """DeepSpeed's CPU Adam op (the table optimizer's kernel and DeepSpeedCPUAdam's)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return load(CPUAdamBuilder(), "DeepSpeed CPU Adam")


ROW_ADAM_SOURCE = Path(__file__).parent / "csrc" / "row_adam.cpp"


def load_row_adam():
    """The STEM tables' row-indexed CPU Adam (csrc/row_adam.cpp): DeepSpeed's Adam
    arithmetic, compiled from DeepSpeed's own sources with its flags, on chosen rows in
    place."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class RowAdamBuilder(CPUAdamBuilder):
        NAME = "stem_row_adam"

        def __init__(self):
            super().__init__()
            self.name = self.NAME

        def absolute_name(self):
            return f"megatron_stem.ops.{self.NAME}"

        def sources(self):  # includes DeepSpeed's kernel source (its Step_* templates)
            return [str(ROW_ADAM_SOURCE)]

        def include_paths(self):
            return [*super().include_paths(), "csrc/adam"]

    return load(RowAdamBuilder(), "the STEM tables' row Adam")


def _shm_comm_builder():
    """DeepSpeed's shared-memory collectives, which its CPU backend loads on every start;
    None where the accelerator has none (GPUs)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def start_deepspeed(cpu_adam: bool) -> None:
    """Before `deepspeed.initialize`: load the ops DeepSpeed itself will load from the one
    folder, announced (`cpu_adam`: for an offloaded DeepSpeedCPUAdam), and start its
    communication backend on the process group already running, without the line DeepSpeed
    prints on every rank when its shared-memory op loads."""
    import deepspeed.comm
    from deepspeed.accelerator import get_accelerator

    use_extensions_dir()
    _ask_cpuinfo_once()  # DeepSpeed loads its ops again in `initialize`
    if cpu_adam:
        load_cpu_adam()
    builder = _shm_comm_builder()
    if builder is not None:
        load(builder, "DeepSpeed shared-memory collectives")
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.comm.init_distributed(get_accelerator().communication_backend_name())


def build_all() -> list[str]:
    """Build every op a training run may load; the names of those built or found."""
    built = [load_cpu_adam().__name__, load_row_adam().__name__]
    builder = _shm_comm_builder()
    if builder is not None:
        built.append(load(builder, "DeepSpeed shared-memory collectives").__name__)
    return built
