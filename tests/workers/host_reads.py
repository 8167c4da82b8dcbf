"""Every point where a rank's main thread reads the device, and where in the code it is.

A read of a device tensor's value, or a copy of it to host memory that the host waits for,
stops the host until the device has run everything queued before it. On a CPU run host and
accelerator memory are one, so what is counted is what the code does on a GPU node:

* value reads: `item`, `tolist`, `float`, `int`, `bool`, `index`, `numpy`, `cpu` of a
  tensor;
* copies to host memory, when the package's own code makes them: `to("cpu")` (a
  `torch.device` it moves to is the accelerator, the CPU on a CPU run; third-party code
  names its accelerator the same way: DeepSpeed's `current_device_name()`), and `copy_`
  into a host tensor (check mode's host memory, or pinned) from another;
* the tables' crossings to host memory (tables/comm.py): `Devices.to_host` of a tensor
  not in host memory already, and `HostStaging.wait` for the copies `HostStaging.copy`
  queued (asynchronous on a GPU node: their one wait is the sync).

Each is recorded as (kind, site): the site is the innermost frame of the package
(`megatron_stem/...:function`), else the innermost of a library (`deepspeed/...`), so a
test can tell reads of host memory (a CPU AdamW's step counts, the loader's host copy of
the token ids, ...) from reads of the device by where they are.

    reads = HostReads()        # in the main thread, before training
    ...
    reads.take()               # [(kind, site), ...] since the last take
"""

from __future__ import annotations

import threading
import traceback

import torch

from megatron_stem.tables.comm import Devices, HostStaging, is_host

# Reads of host memory on a GPU node (on a CPU run the memories are one), by where they are.
HOST_SIDE = {
    "deepspeed/runtime/utils.py:is_invalid_grad_norm":
        "DeepSpeed's checks of the norm the hook returned, in host memory (training/update.py)",
    "torch/optim/optimizer.py:_get_value":
        "a CPU AdamW's step counts (a GPU run's fused AdamW keeps them on the device)",
}

VALUE_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy",
               "cpu")
PACKAGE = "megatron_stem/"
LIBRARIES = ("deepspeed/", "megatron/core/", "torch/optim/")
# Frames that only pass a call on: torch's own, and the CPU stand-in for CUDA calls.
PASSING = ("torch/", "megatron_stem/runtime/cpu_compat.py")


def _site() -> str:
    """Where a read is made: the innermost frame of the package or of a library, past the
    frames that only pass it on."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/tests/" in path:
            continue
        for root in (PACKAGE, *LIBRARIES):
            if root in path:
                return f"{root}{path.rsplit(root, 1)[1]}:{frame.name}"
        if not any(p in path for p in PASSING):
            break
    return "?"


def _host(tensor) -> bool:
    """Host memory (check mode's mark), or a view of it."""
    return is_host(tensor) or is_host(getattr(tensor, "_base", None))


def _in_package() -> bool:
    return _site().startswith(PACKAGE)


def _to_cpu(args, kwargs) -> bool:
    """Whether a `to` names the CPU as the package's copies to host memory do: the string
    "cpu" (a `torch.device` there is the accelerator: `parallel.device()`,
    `Devices.accelerator`, the CPU on a CPU run)."""
    return kwargs.get("device", args[0] if args else None) == "cpu"


class HostReads:
    """Counts the main thread's reads of the device from now on (module docstring)."""

    def __init__(self):
        self.reads: list[tuple[str, str]] = []
        self._wrapped = []  # (owner, name, original)
        self._main = threading.main_thread()
        self._staged = False  # copies queued by HostStaging since its last wait
        self._quiet = threading.local()  # inside a counted crossing: its parts are not
        for name in VALUE_READS:
            self._wrap(torch.Tensor, name, self._value_read(name))
        self._wrap(torch.Tensor, "to", self._to)
        self._wrap(torch.Tensor, "copy_", self._copy)
        self._wrap(Devices, "to_host", self._to_host)
        self._wrap(HostStaging, "copy", self._staging_copy)
        self._wrap(HostStaging, "wait", self._staging_wait)

    def take(self) -> list[tuple[str, str]]:
        reads, self.reads = self.reads, []
        return reads

    def close(self) -> list[tuple[str, str]]:
        """Stop counting (the methods as they were); the reads not taken."""
        for owner, name, original in reversed(self._wrapped):
            setattr(owner, name, original)
        return self.take()

    def _wrap(self, owner, name, make):
        original = getattr(owner, name)
        self._wrapped.append((owner, name, original))
        setattr(owner, name, make(original))

    def _counting(self) -> bool:
        return threading.current_thread() is self._main and not getattr(self._quiet, "on", 0)

    def _record(self, kind: str) -> None:
        self.reads.append((kind, _site()))

    # Each counted call runs its original quietly: a torch function mode that passes the
    # call on (check mode's, tables/comm.py) reaches these wrappers again.

    def _value_read(self, name):
        def read(original):
            def counted(tensor, *args, **kwargs):
                if self._counting() and not _host(tensor):
                    self._record(name.strip("_"))
                return self._quietly(original, tensor, *args, **kwargs)
            return counted
        return read

    def _to(self, original):
        def to(tensor, *args, **kwargs):
            if self._counting() and not _host(tensor) and _to_cpu(args, kwargs) and \
                    _in_package():
                self._record("to(cpu)")
            return self._quietly(original, tensor, *args, **kwargs)
        return to

    def _copy(self, original):
        def copy_(tensor, source, *args, **kwargs):
            into_host = _host(tensor) or (tensor.device.type == "cpu" and tensor.is_pinned())
            if self._counting() and into_host and not _host(source) and _in_package():
                self._record("copy_ into host memory")
            return self._quietly(original, tensor, source, *args, **kwargs)
        return copy_

    def _quietly(self, original, *args, **kwargs):
        self._quiet.on = getattr(self._quiet, "on", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            self._quiet.on -= 1

    def _to_host(self, original):
        def to_host(devices, tensor, *args, **kwargs):
            if self._counting() and not _host(tensor):
                self._record("Devices.to_host")
            return self._quietly(original, devices, tensor, *args, **kwargs)
        return to_host

    def _staging_copy(self, original):
        def copy(staging, *args, **kwargs):
            if self._counting():
                self._staged = True
            return self._quietly(original, staging, *args, **kwargs)
        return copy

    def _staging_wait(self, original):
        def wait(staging):
            if self._counting() and self._staged:
                self._staged = False
                self._record("HostStaging.wait")
            return self._quietly(original, staging)
        return wait
