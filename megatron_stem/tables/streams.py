"""The side streams of the tables' path: CUDA's on a GPU node, none on a CPU run.

Three pieces of the path run beside the compute stream: the row gradients' sum at the end
of a step's last backward (`tables/row_grads.py`, beside the backbone reduction's tail),
the gradients' copies into pinned host memory for CPU Adam (`comm.HostStaging`, under
DeepSpeed's step) and the overlapped update (`overlap.py`: its arithmetic queued by a
worker thread, its publications by the main thread, each on a stream of its own). All follow
one protocol, so a CPU test can stand in for CUDA and see what is asked of it, from which
thread:

* `hand_over(tensors)`: before the side stream works on tensors made on the compute
  stream, it waits for that stream's work, and each tensor is recorded on the side stream
  (the caching allocator does not give its memory back to the compute stream while the
  side stream still reads it);
* `running()`: a context in which the work queued goes to the side stream;
* `mark()`: an event after what the side stream has queued so far; `wait(event)`: the
  compute stream waits for it (no host sync); `follow(event)`: the side stream waits for
  an event of another side stream; `synchronize(event)`: the host waits for it (None: for
  nothing); `join()`: the compute stream waits for the whole side stream;
* `enter_worker()`: a thread other than the main one takes the main thread's device (the
  current CUDA device is per thread: 0 in a new one).
"""

from __future__ import annotations

import contextlib

import torch


class CudaStreams:
    """A CUDA side stream on `device` (the one the main thread had when it was made)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enter_worker(self) -> None:
        torch.cuda.set_device(self.device)

    def hand_over(self, tensors) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.stream)

    def running(self):
        return torch.cuda.stream(self.stream)

    def mark(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def follow(self, event) -> None:
        self.stream.wait_event(event)

    def synchronize(self, event) -> None:
        if event is not None:
            event.synchronize()

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class NoStreams:
    """A CPU run: work queued is done when its call returns."""

    def enter_worker(self) -> None:
        pass

    def hand_over(self, tensors) -> None:
        pass

    def running(self):
        return contextlib.nullcontext()

    def mark(self):
        return None

    def wait(self, event) -> None:
        pass

    def follow(self, event) -> None:
        pass

    def synchronize(self, event) -> None:
        pass

    def join(self) -> None:
        pass


def side_streams(device: torch.device):
    """A new side stream's protocol for `device`: CUDA's, or none."""
    return CudaStreams(device) if device.type == "cuda" else NoStreams()
