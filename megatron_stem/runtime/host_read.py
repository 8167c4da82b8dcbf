"""A step's device values that the host needs, read in one transfer.

Reading a value of a device tensor on the host (`.item()`, `float()`, `.tolist()`, a copy
to the CPU) makes the host wait until the device has run everything queued before it: the
host stops queueing work, and the device then idles while the host catches up. A training
step needs a handful of such values: whether any rank was asked to stop, the loss, the
gradient norms that decide clipping and whether the step is skipped, the divergence
guard's inputs, whether every rank has written a background save. Each is computed on the
device (and agreed between ranks by a collective) where its part of the step runs, added
to the step's `HostRead`, and read by the host with all the others in one copy, once
the last of them exists (the gradient norm, inside DeepSpeed's step).

    read = HostRead()
    stop = read.add(agreed_flag)      # a HostValue: nothing is read yet
    ...
    norm = read.add(norm_tensor)
    norm.get()                        # the one read: every value added so far
    stop.get()                        # already on the host

A value added after the read is refused: it would be a second wait in the step.
"""

from __future__ import annotations

import torch


class HostRead:
    """The device values of one step to read on the host at once (module docstring)."""

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._size = 0
        self._values: list[float] | None = None

    def add(self, tensor: torch.Tensor) -> "HostValue":
        """`tensor`'s values (any shape, read as float64: exact for counts below 2^53), to
        be read with the others."""
        if self._values is not None:
            raise RuntimeError("HostRead.add after the step's read: a second host sync in "
                               "the step (add every value before the first `get`)")
        flat = tensor.detach().reshape(-1).to(torch.float64)
        value = HostValue(self, self._size, flat.numel())
        self._parts.append(flat)
        self._size += flat.numel()
        return value

    @property
    def done(self) -> bool:
        return self._values is not None

    def read(self) -> None:
        """Copy every value added to the host (the step's one sync); later calls do
        nothing."""
        if self._values is None:
            self._values = torch.cat(self._parts).tolist() if self._parts else []
            self._parts = []


class HostValue:
    """One tensor's values in a `HostRead`: `get()` reads them all (the first time)."""

    def __init__(self, read: HostRead, start: int, count: int):
        self._read, self._start, self._count = read, start, count

    def get(self) -> float | list[float]:
        """The value (a float), or the values (a list) of a tensor of several."""
        self._read.read()
        values = self._read._values[self._start:self._start + self._count]
        return values[0] if self._count == 1 else values
