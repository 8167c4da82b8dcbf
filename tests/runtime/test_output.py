"""What a person reads: `--help` and one-line errors with nothing around them, other
libraries' noise filtered at its source, JIT op builds announced once and cached per
environment. (The quickstart's whole output is checked in test_quickstart.py.)"""

import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from torch.utils import cpp_extension

from support.processes import ROOT, subprocess_env
from megatron_stem.runtime import jit_ops
from megatron_stem.runtime import warning_filters
from megatron_stem.data.indexed import PartWriter
from megatron_stem.runtime.errors import UserError
from megatron_stem.data.tokenizer import WHERE_TO_GET

CLIS = [[str(p)] for p in sorted((ROOT / "tools").glob("*.py"))] + \
    [["-m", "megatron_stem.train"]]


def run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    # No PYTHONWARNINGS: the filters under test are the only ones.
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=ROOT,
                          stdin=subprocess.DEVNULL)


@pytest.mark.integration
@pytest.mark.parametrize("cli", CLIS, ids=lambda c: Path(c[-1]).stem.split(".")[-1])
def test_help_prints_the_help_only(cli):
    proc = run_cli(cli + ["--help"])
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: ")


@pytest.mark.integration
@pytest.mark.parametrize("argv, error", [
    (["-m", "megatron_stem.train", "--recipe", "recipes/tiny_cpu.yaml", "train.stpes=3"],
     "command line: train.stpes=3: unknown field (did you mean 'steps'?)"),
    (["-m", "megatron_stem.train", "--recipe", "recipes/stem_1b.yaml",
      "data.prefixes=[{tmp}/data]", "data.tokenizer_model=/nope/tokenizer.json"],
     f"data.tokenizer_model: /nope/tokenizer.json: Hugging Face tokenizer.json not found "
     f"({WHERE_TO_GET})"),
    (["tools/to_hf.py", "--checkpoint", "/nope", "--output", "/nope/out"],
     "/nope: no such checkpoint folder"),
    (["tools/preprocess_data.py", "--input", "data_corpus/gcide.jsonl.gz", "--output-prefix",
      "{tmp}/x", "--tokenizer-type", "sentencepiece", "--tokenizer-model", "/nope.model"],
     "/nope.model: SentencePiece model not found"),
], ids=["override", "tokenizer", "to_hf", "preprocess"])
def test_errors_are_one_line_with_nothing_else(argv, error, tmp_path):
    # data that is there and whole, so that the tokenizer is what is missing
    writer = PartWriter(str(tmp_path / "data"), np.int32)
    writer.add(np.arange(1, 9), np.array([8]))
    writer.close(sync=False)
    proc = run_cli([a.format(tmp=tmp_path) for a in argv])
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {error}\n")


def test_filters_drop_only_the_messages_they_name(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warning_filters.install()
        warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back",
                               UserWarning, "x.py", 1, module="megatron.core.optimizer")
        warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back",
                               UserWarning, "x.py", 1, module="my_code")  # not megatron's
        warnings.warn_explicit("Some other megatron warning", UserWarning, "x.py", 2,
                               module="megatron.core.optimizer")
    assert [str(w.message) for w in caught] == [
        "Transformer Engine and Apex are not installed. Falling back",
        "Some other megatron warning"]
    logger = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, "
                       "we were unable to detect it.")
        logger.warning("something DeepSpeed wants the user to know")
    assert [r.getMessage() for r in caplog.records] == [
        "something DeepSpeed wants the user to know"]
    warning_filters.install()  # again: one filter, not two
    assert sum(isinstance(f, warning_filters._DropMessages) for f in logger.filters) == 1


class FakeBuilder:
    """An op builder whose `load` records that it ran (a real build takes minutes)."""

    name = "fake_op"

    def __init__(self):
        self.loads = 0

    def load(self):
        self.loads += 1
        return self


def test_op_builds_are_announced_once_and_cached_per_environment(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    folder = jit_ops.extensions_dir()
    assert folder.parent == tmp_path / ".cache" / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", "/another/venv")  # another environment, same CPU
    other = jit_ops.extensions_dir()
    assert other != folder and other.parent == folder.parent
    monkeypatch.undo()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # the user's choice
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # restored after `load`'s change
    builder = FakeBuilder()
    jit_ops.load(builder, "the fake op")
    assert capsys.readouterr().out == \
        f"building the fake op, once per environment, ~1-2 min (into {tmp_path / 'ext'})\n"
    (tmp_path / "ext" / "fake_op").mkdir(parents=True)
    (tmp_path / "ext" / "fake_op" / "fake_op.so").write_bytes(b"")
    jit_ops.load(builder, "the fake op")  # built: nothing to say
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / "ext" / "fake_op" / "fake_op.so").unlink()
    jit_ops.load(builder, "the fake op")  # another rank of the node: the first one says it
    assert capsys.readouterr().out == "" and builder.loads == 3


# A stand-in for torch 2.14+'s JIT build: takes the folder's lock as it does (the filelock
# package's FileLock, an OS lock: torch's own is a subclass; for torch 2.13 `jit_ops.load`
# installs the same lock, tested below), says it has it, and keeps it until it is told to go
# (or killed).
HOLD_THE_BUILD_LOCK = """
import sys
from filelock import FileLock
held = FileLock(sys.argv[1])
held.acquire()
print("held", flush=True)
sys.stdin.readline()
held.release()
"""


def _hold_build_lock(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_BUILD_LOCK, str(lock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    assert holder.stdout.readline() == "held\n"
    return holder


def _load_or_hang(builder, seconds=20.0):
    loading = threading.Thread(target=jit_ops.load, args=(builder, "the fake op"), daemon=True)
    started = time.monotonic()
    loading.start()
    loading.join(seconds)
    assert not loading.is_alive(), "the load hangs on the lock"
    return time.monotonic() - started


def test_a_build_lock_is_judged_by_whether_a_running_process_holds_it(tmp_path, monkeypatch,
                                                                       capsys):
    """torch 2.14+ leaves its lock file after a build and torch 2.13's was left by a killed
    build: neither makes a load wait. A lock a running build holds does, and says so after a
    moment; a build killed while a load waits releases it, and the load goes on."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    lock = tmp_path / "ext" / "fake_op" / "lock"
    lock.parent.mkdir(parents=True)
    (lock.parent / "fake_op.so").write_bytes(b"")
    builder = FakeBuilder()
    holder = _hold_build_lock(lock)  # a build that finishes
    holder.communicate("done\n")
    assert lock.exists() and _load_or_hang(builder) < 1.0
    lock.write_text("node7 4242")  # torch 2.13's file of a killed build: present, not held
    assert _load_or_hang(builder) < 1.0 and builder.loads == 2
    assert capsys.readouterr().out == ""

    monkeypatch.setattr(jit_ops, "QUIET_WAIT_S", 0.5)
    holder = _hold_build_lock(lock)  # a build running now, released within the quiet wait
    threading.Timer(0.2, holder.communicate, args=("done\n",)).start()
    _load_or_hang(builder)
    assert capsys.readouterr().out == ""
    holder = _hold_build_lock(lock)  # a build running now, killed while the load waits
    threading.Timer(1.0, holder.kill).start()
    monkeypatch.setattr(jit_ops, "QUIET_WAIT_S", 30.0)
    waited = _load_or_hang(builder)
    holder.wait()
    assert 0.9 < waited < 5.0 and builder.loads == 4
    monkeypatch.setattr(jit_ops, "QUIET_WAIT_S", 0.3)
    holder = _hold_build_lock(lock)
    try:
        jit_ops.load(builder, "the fake op")
    finally:
        holder.communicate("done\n")
    assert capsys.readouterr().out == (
        f"waiting for another process's build of the fake op (it holds {lock}; the lock is "
        "released when that process ends, however it ends)\n")


def test_a_filesystem_without_file_locks_is_one_line(tmp_path, monkeypatch):
    """Some shared filesystems refuse flock (Lustre mounted `noflock`): the build lock cannot
    work there, and the line says where to build instead."""
    import errno
    import fcntl

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    lock = tmp_path / "ext" / "fake_op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setattr(fcntl, "flock", refuse)
    with pytest.raises(UserError, match=rf"^{lock}: the ops' build lock needs file locks, which "
                       r"its filesystem refuses \(No locks available\): set "
                       r"TORCH_EXTENSIONS_DIR to a local folder"):
        jit_ops.load(FakeBuilder(), "the fake op")


def test_a_c_library_is_compiled_once_and_without_a_compiler_is_one_line(tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "twice.c"
    source.write_text("int twice(int x) { return 2 * x; }\n")
    assert jit_ops.load_library(source, "the test's library").twice(21) == 42
    assert capsys.readouterr().out == (f"building the test's library, once per environment "
                                       f"(into {tmp_path / 'ext' / 'twice'})\n")
    assert jit_ops.load_library(source, "the test's library").twice(4) == 8
    assert capsys.readouterr().out == ""  # built: loaded
    source.write_text("int twice(int x) { return x + x; }\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(UserError, match=r"^building the test's library \(twice.c\) needs a C "
                       r"compiler: .*no-such-cc not found \(install gcc, or set CC\)$"):
        jit_ops.load_library(source, "the test's library")


@pytest.mark.skipif(not hasattr(cpp_extension, "FileBaton"),
                    reason="torch 2.14+ takes an OS lock itself")
def test_torch_2_13_builds_take_the_os_lock(tmp_path):
    """Under torch 2.13 a JIT build takes the folder's lock through `FileBaton`: the one
    `jit_ops.load` installs waits for the OS lock, so a second build waits for the first, not for
    a file."""
    lock = tmp_path / "lock"
    holder = _hold_build_lock(lock)
    jit_ops._use_os_lock_batons()
    baton = cpp_extension.FileBaton(str(lock))
    threading.Timer(0.5, holder.communicate, args=("done\n",)).start()
    started = time.monotonic()
    assert baton.try_acquire() and time.monotonic() - started > 0.4
    baton.release()
    assert lock.exists() and not jit_ops.held_by_another(lock)


def test_a_build_that_does_not_finish_in_time_is_killed_with_one_line(tmp_path, monkeypatch,
                                                                       capsys):
    slow = tmp_path / "slow_build"
    slow.write_text("#!/bin/sh\nsleep 60 &\nwait\n")  # a compiler under the build
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    started = time.monotonic()
    assert not jit_ops.build_all_within(1.0)
    assert time.monotonic() - started < 10
    assert capsys.readouterr().out == ("the ops' build did not finish in 1 s: this run uses the "
                                       "torch kernel (optimizer.tables.kernel: torch)\n")


def test_op_builds_run_this_environments_ninja(tmp_path, monkeypatch):
    """Whether the environment is activated or run by path, its ops are built and checked
    by its own ninja: two ninja versions in turn rebuilt them at every switch."""
    import shutil

    env_bin, system_bin = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    for folder in (env_bin, system_bin):
        folder.mkdir(parents=True)
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("PATH", str(system_bin))  # run by path: the system's ninja first
    jit_ops.use_extensions_dir()
    assert shutil.which("ninja") == str(env_bin / "ninja")
    jit_ops.use_extensions_dir()  # once on PATH, not again
    assert os.environ["PATH"] == f"{env_bin}{os.pathsep}{system_bin}"


def test_deepspeed_builders_ask_the_cpu_once_per_process(tmp_path, monkeypatch):
    """py-cpuinfo answers from a new Python process (about a second); DeepSpeed's CPU op
    builders ask it twice per op load, even of an op already built."""
    import cpuinfo
    from deepspeed.ops.op_builder import CPUAdamBuilder

    asked = []

    def get_cpu_info():
        asked.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", get_cpu_info)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    jit_ops.load(FakeBuilder(), "the fake op")
    first, second = CPUAdamBuilder(), CPUAdamBuilder()
    answers = [first.cpu_arch(), first.simd_width(), second.cpu_arch(), second.simd_width()]
    assert len(asked) == 1
    assert answers[:2] == answers[2:] and "AVX256" in answers[1]
