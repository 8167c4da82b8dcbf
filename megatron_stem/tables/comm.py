"""Every collective of the tables' path, on the device its group communicates on.

On a GPU node the groups the tables use (data parallel, a node's host-copy ranks, the
copies' peers, tensor parallel, the overlap's own) are NCCL groups, which take accelerator
tensors only; gloo, which the CPU runs and tests use, takes any tensor. A node's shared
host copy, optimizer state in CPU memory, and whatever is read from them are host memory.
So the tables' path never calls `torch.distributed` itself:

* `Devices` names the two memories. A tensor crosses between them through `to_host` /
  `to_accelerator`, which count the bytes a GPU node copies (none on a CPU run, where
  both are the CPU's memory); host memory is allocated through `host_zeros`/`host_empty`.
* `Comm` runs the collectives of one group and refuses a tensor that is not on the
  group's device, with a message that names the collective and the group.
* Check mode (`STEM_CHECK_HOST_TENSORS=1`; the test suite turns it on): on a CPU run a
  device cannot tell host memory from the accelerator's, so the tables' path runs under a
  torch function mode that follows host memory instead: what `to_host`, `host_*` and
  `mark_host` return is host memory, and so is every result of an operation on host
  memory (as on a GPU node, where such a result is on the CPU), except copies into a
  tensor (`copy_`, item assignment: they keep the destination's memory) and
  `to_accelerator`. `Comm` then refuses host memory as NCCL would on a GPU node.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from megatron_stem.tables.streams import side_streams

CHECK_ENV = "STEM_CHECK_HOST_TENSORS"
_HOST = "_stem_host_memory"  # the attribute check mode marks host memory with


def check_mode() -> bool:
    return os.environ.get(CHECK_ENV) == "1"


def is_host(tensor) -> bool:
    """Whether check mode has marked `tensor` as host memory."""
    return isinstance(tensor, torch.Tensor) and getattr(tensor, _HOST, False)


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Declare `tensor` host memory for check mode (a node's shared copy, CPU state)."""
    if check_mode():
        setattr(tensor, _HOST, True)
    return tensor


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a new, unmarked tensor object (check mode's stand-in for a copy between
    host and accelerator, which on a CPU run is the same memory)."""
    with _HostTracking.suspended():
        return tensor.view_as(tensor)


# Operations whose result is host memory whatever their inputs are.
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}
# Copies into an existing tensor: the result is the destination, in its own memory.
_INTO_DESTINATION = {torch.Tensor.copy_, torch.Tensor.__setitem__}


_thread = threading.local()


class _HostTracking(TorchFunctionMode):
    """Check mode's torch function mode: marks what is computed from host memory."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(_thread, "suspended", 0) or func in _INTO_DESTINATION:
            return out
        if func in _TO_HOST and out is args[0] and not is_host(out):
            out = _alias(out)  # `.cpu()` of a CPU run's "accelerator" tensor is itself
        if func in _TO_HOST or any(is_host(x) for x in tree_leaves((args, kwargs))):
            for x in tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    setattr(x, _HOST, True)
        return out

    @staticmethod
    @contextlib.contextmanager
    def suspended():
        _thread.suspended = getattr(_thread, "suspended", 0) + 1
        try:
            yield
        finally:
            _thread.suspended -= 1


def tracked(method):
    """Run a tables' path entry point under check mode's host tracking (when it is on).
    The mode is per thread: the overlap's worker enters it for its jobs too."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with host_tracking():
            return method(*args, **kwargs)
    return run


@contextlib.contextmanager
def host_tracking():
    """Check mode's host tracking in this thread (nested entries are one)."""
    if not check_mode() or getattr(_thread, "tracking", False):
        yield
        return
    _thread.tracking = True
    try:
        with _HostTracking():
            yield
    finally:
        _thread.tracking = False


@dataclass(frozen=True)
class Devices:
    """The accelerator (the compute device, on which the groups communicate: the CPU on a
    CPU run) and the host's memory."""

    accelerator: torch.device
    host: torch.device = torch.device("cpu")

    @property
    def separate(self) -> bool:
        """Whether host and accelerator memory differ (a GPU node): crossing copies."""
        return self.accelerator.type != self.host.type

    def to_host(self, tensor: torch.Tensor, counters=None, counter: str = "") -> torch.Tensor:
        """`tensor` in host memory, its bytes counted in `counters.<counter>` when that is a
        copy."""
        if self.separate and tensor.device.type != "cpu":
            _count(counters, counter, tensor)
            return mark_host(tensor.to(self.host))
        if check_mode() and not is_host(tensor):  # the same memory: a marked alias
            return mark_host(_alias(tensor))
        return tensor

    def to_accelerator(self, tensor: torch.Tensor, counters=None, counter: str = "",
                       non_blocking: bool = False) -> torch.Tensor:
        if self.separate:
            if tensor.device.type == "cpu":
                _count(counters, counter, tensor)
            return tensor.to(self.accelerator, non_blocking=non_blocking)
        return _alias(tensor) if is_host(tensor) else tensor

    def host_zeros(self, shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
        pin = pin and self.separate  # pinned memory needs an accelerator to pin for
        return mark_host(torch.zeros(shape, dtype=dtype, pin_memory=pin))

    def host_empty(self, shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
        pin = pin and self.separate
        return mark_host(torch.empty(shape, dtype=dtype, pin_memory=pin))


class HostBuffers:
    """Buffers reused from step to step where they are host memory, by key, grown as
    needed (`headroom`: by that factor, for sizes that vary from step to step); new ones
    on an accelerator, whose caching allocator reuses its blocks itself. glibc instead
    returns freed buffers of tens of MB to the system (as soon as the heap's free top
    passes its trim threshold, twice the mmap threshold's 32 MiB) and faults new ones in at
    a sixth of the copy rate. `allocate(count, dtype)`: a flat host buffer (default: plain
    memory). Not shared by threads at once (the overlapped update and the main thread's
    take turns)."""

    def __init__(self, allocate=None, headroom: float = 1.0):
        self._allocate = allocate or (lambda count, dtype: torch.empty(count, dtype=dtype))
        self.headroom = headroom
        self._by_key: dict = {}

    def empty(self, key, shape, dtype, device="cpu") -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        buffer = self._by_key.get(key)
        if buffer is None or buffer.numel() < count or buffer.dtype != dtype:
            size = count if self.headroom == 1 else int(count * self.headroom) + 1024
            buffer = self._by_key[key] = self._allocate(size, dtype)
        return buffer[:count].view(shape)


class HostStaging:
    """Reused pinned host buffers that accelerator tensors are copied into on a side stream
    (`copy`), and the host's wait for those copies (`wait`) just before it reads them: the
    gradients' way to CPU Adam. Queued before DeepSpeed's step, the copies run under it on
    the copy engine, not in the compute stream's queue ahead of it. On a CPU run the
    tensors are handed over as they are. `streams`: the side stream's protocol
    (streams.py; CUDA's on a GPU node)."""

    HEADROOM = 1.25  # steps differ in their rows; pinning is slow, so buffers only grow

    def __init__(self, devices: Devices, streams=None):
        self.devices = devices
        self._buffers = HostBuffers(
            lambda count, dtype: devices.host_empty((count,), dtype, pin=True), self.HEADROOM)
        self._copied = None  # an event after the last copies
        self._streams = streams or side_streams(devices.accelerator)

    def copy(self, key, tensor: torch.Tensor, counters=None, counter: str = "") -> torch.Tensor:
        """`tensor` (on the accelerator) in host memory: buffer `key`'s, once `wait` has
        returned. The buffer is reused by the next `copy` of `key`: the caller reads it
        before then (the tables' optimizer does, before it takes the next gradients)."""
        if not self.devices.separate:
            return self.devices.to_host(tensor)
        out = self._buffers.empty(key, tensor.shape, tensor.dtype)
        self._streams.hand_over([tensor])  # after the kernels that made it; kept while read
        with self._streams.running():
            out.copy_(tensor, non_blocking=True)
        self._copied = self._streams.mark()
        _count(counters, counter, tensor)
        return out

    def wait(self) -> None:
        """Until every `copy` so far has landed (from any thread)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            self._streams.synchronize(copied)


def _count(counters, counter: str, tensor: torch.Tensor) -> None:
    if counters is not None and counter:
        setattr(counters, counter, getattr(counters, counter) + tensor.numel() *
                tensor.element_size())


class Comm:
    """The collectives of the tables' path over one group (`group`; None: the world), on
    `devices.accelerator`. `name` says which group in errors."""

    def __init__(self, group, devices: Devices, name: str):
        self.group, self.devices, self.name = group, devices, name
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self._alone = False
        self._buffers = HostBuffers()  # `all_gather_varying`'s

    @classmethod
    def alone(cls, devices: Devices, name: str) -> "Comm":
        """A group of this rank only (no collectives run over it)."""
        comm = cls(None, devices, name)
        comm.size, comm.rank, comm._alone = 1, 0, True
        return comm

    def ranks(self) -> list[int]:
        """The group's global ranks, in group rank order."""
        if not dist.is_initialized():
            return [0]
        if self._alone:
            return [dist.get_rank()]
        return dist.get_process_group_ranks(self.group or dist.group.WORLD)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device.type != self.devices.accelerator.type or is_host(t):
                where = "host memory" if is_host(t) else f"a tensor on {t.device}"
                raise RuntimeError(
                    f"tables: {op} over {self.name} was handed {where}; the group "
                    f"communicates on {self.devices.accelerator} (NCCL on a GPU node takes "
                    "accelerator tensors only): move it with Devices.to_accelerator")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._check("all_reduce", tensor)
        dist.all_reduce(tensor, group=self.group)

    def reduce(self, tensor: torch.Tensor, dst: int) -> None:
        """Sum `tensor` onto the group's rank `dst`."""
        self._check("reduce", tensor)
        dist.reduce(tensor, dst=self.ranks()[dst], group=self.group)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._check("all_gather", tensor, *outputs)
        dist.all_gather(outputs, tensor, group=self.group)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits=None,
                   input_splits=None) -> None:
        self._check("all_to_all", output, tensor)
        dist.all_to_all_single(output, tensor, output_splits, input_splits, group=self.group)

    def all_gather_varying(self, tensors: list[torch.Tensor], counts: list[int] | None = None):
        """Every rank's `tensors` (of one first-dimension length per rank, which may differ
        between ranks), gathered padded to the longest: per tensor, the ranks' tensors in
        rank order, trimmed; and the longest length. `counts`: the ranks' lengths when the
        caller knows them (else exchanged here, and read by the host: one sync). The results
        are valid until the next call (host memory reuses its buffers): read them before."""
        length = tensors[0].shape[0]
        if counts is None:
            count = torch.full((1,), length, device=self.devices.accelerator)
            gathered = [torch.empty_like(count) for _ in range(self.size)]
            self.all_gather(gathered, count)
            counts = torch.cat(gathered).tolist()
        longest = max(counts)
        out = []
        for k, t in enumerate(tensors):  # (a CPU run: into buffers reused per call site)
            shape = (longest, *t.shape[1:])
            padded = self._buffers.empty(("sent", k), shape, t.dtype, t.device)
            padded[:length] = t
            padded[length:] = 0
            gathered = [self._buffers.empty(("received", k, r), shape, t.dtype, t.device)
                        for r in range(self.size)]
            self.all_gather(gathered, padded)
            out.append([g[:c] for g, c in zip(gathered, counts)])
        return out, longest
