"""JIT-compiled ops: built once per environment, in one folder, announced.

DeepSpeed compiles its C++ ops (CPU Adam; on CPU also its shared-memory collectives) the
first time they load, a minute or two each, under `$TORCH_EXTENSIONS_DIR`; our own are the
tables' row Adam (a torch extension, the same way) and plain C libraries loaded with
ctypes (`load_library`: the data cache's blend, a second to compile). The folder is
keyed by the CPU model (ops are built with -march=native: a home directory shared by nodes
of different CPUs would otherwise load illegal code) and by the environment (two virtual
environments, or two torch/DeepSpeed versions, would otherwise rebuild each other's ops).
Every load goes through `load`, which says what it builds before a cold build starts and
nothing when the op is already there. `tools/build_ops.py` builds them ahead of time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import hashlib
import io
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from megatron_stem.runtime import file_locks
from megatron_stem.runtime.errors import UserError


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


# A JIT build holds its folder's `lock` while it builds, and every other load of the op
# waits for it. torch 2.14+ holds it as an OS advisory lock (`flock`, through the filelock
# package) and leaves the file in place after the build: the file's existence means nothing,
# and the kernel releases the lock of a process that dies. torch 2.13 used the file's
# existence (`FileBaton`: created exclusively, removed at the end), which a killed build left
# behind for every later load to wait on forever. Our loads give it torch 2.14's
# lock (`_os_lock_baton`), so with any supported torch a lock is judged by whether a running
# process holds it: never by the file's existence or age.
#
# Another rank's load holds the lock while ninja checks a built op is up to date: well under
# a second, seconds on a loaded node. A lock still held after this is a build: said.
QUIET_WAIT_S = 10.0


_NO_LOCKS_REMEDY = ("set TORCH_EXTENSIONS_DIR to a local folder (each node then builds the "
                    "ops once)")


def _os_lock(fd: int, lock: Path, exclusive: bool = True, blocking: bool = True) -> bool:
    """flock on `fd`; False when another process holds it and `blocking` is off."""
    return file_locks.lock(fd, lock, "the ops' build lock", _NO_LOCKS_REMEDY, exclusive,
                           blocking)


def held_by_another(lock: Path) -> bool:
    """Whether a running process holds `lock` (a build or an up-to-date check in progress)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        # Shared: it conflicts with a holder's exclusive lock and, on NFS (where flock is a
        # byte-range lock), needs only read access.
        free = _os_lock(fd, lock, exclusive=False, blocking=False)
    finally:
        os.close(fd)  # closing releases the probe's lock
    return not free


def _os_lock_baton():
    """torch 2.13's `FileBaton` as torch 2.14+'s build lock: the acquire waits for the
    OS lock and always gets it (then the build, or ninja's up-to-date check, runs under it);
    the release leaves the file."""
    from torch.utils.file_baton import FileBaton

    class OsLockBaton(FileBaton):
        def try_acquire(self) -> bool:
            self.fd = os.open(self.lock_file_path, os.O_RDWR | os.O_CREAT, 0o644)
            _os_lock(self.fd, Path(self.lock_file_path))
            return True

        def wait(self) -> None:  # not reached: `try_acquire` always acquires
            self.try_acquire()
            self.release()

        def release(self) -> None:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    return OsLockBaton


def _use_os_lock_batons() -> None:
    """Where torch's JIT build still takes a `FileBaton` (torch 2.13)."""
    from torch.utils import cpp_extension

    baton = getattr(cpp_extension, "FileBaton", None)
    if baton is not None and not getattr(baton, "os_lock", False):
        cpp_extension.FileBaton = _os_lock_baton()
        cpp_extension.FileBaton.os_lock = True


def _say_when_waiting(lock: Path, what: str) -> None:
    """Say why a load waits when another process holds the lock for longer than a check."""
    waited = 0.0
    while held_by_another(lock) and waited < QUIET_WAIT_S:
        time.sleep(0.1)
        waited += 0.1
    if waited >= QUIET_WAIT_S and _speaks():
        print(f"waiting for another process's build of {what} (it holds {lock}; the lock "
              "is released when that process ends, however it ends)", flush=True)


def load(builder, what: str):
    """`builder.load()` from the one folder, announced when it has to compile first. A
    build it waits for that dies releases its lock, and this load builds."""
    _ask_cpuinfo_once()
    _use_os_lock_batons()
    folder = use_extensions_dir()
    _say_when_waiting(folder / builder.name / "lock", what)
    if not (folder / builder.name / f"{builder.name}.so").is_file() and _speaks():
        print(f"building {what}, once per environment, ~1-2 min (into {folder})", flush=True)
    return builder.load()


def build_all_within(seconds: float) -> bool:
    """`build_all` in a child process given `seconds`. False, with one line, when it did
    not finish: the child and its compilers are killed (the kernel releases the locks they
    held) and the caller runs the torch kernel."""
    child = subprocess.Popen([sys.executable, "-c",
                              "from megatron_stem.runtime import jit_ops; jit_ops.build_all()"],
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


# A plain C library: megatron's arithmetic exactly (no fused multiply-add), vectorized for
# this CPU (the folder is keyed by its model).
C_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp-simd", "-shared", "-fPIC"]


def load_library(source: Path, what: str) -> ctypes.CDLL:
    """`source` (C, no Python headers) compiled with the C compiler (`$CC`, else `cc`)
    into the extensions folder, once per source and environment, under the build lock; a
    library appears under its name only when whole."""
    digest = hashlib.sha1(source.read_bytes() + " ".join(C_FLAGS).encode()).hexdigest()[:10]
    folder = extensions_dir() / source.stem
    library = folder / f"{source.stem}-{digest}.so"
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with file_locks.held(folder / "lock", "the ops' build lock", _NO_LOCKS_REMEDY):
            if not library.is_file():
                _compile(source, library, what)
    return ctypes.CDLL(str(library))


def _compile(source: Path, library: Path, what: str) -> None:
    compiler = os.environ.get("CC", "cc")
    if _speaks():
        print(f"building {what}, once per environment (into {library.parent})", flush=True)
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([compiler, *C_FLAGS, "-o", str(partial), str(source), "-lm"],
                              capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError(f"building {what} ({source.name}) needs a C compiler: {compiler} "
                        "not found (install gcc, or set CC)") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        raise UserError(f"building {what} ({source.name}) with {compiler} failed: {first}")
    os.replace(partial, library)


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
            return f"megatron_stem.runtime.jit_ops.{self.NAME}"

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
