"""Rows gathered from host-resident tables into the host buffers they are copied to the
accelerator from (tables/host_tables.py): split over threads (`index_select` releases
the GIL), into reusable buffers pinned on a GPU node."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

# Below this many rows per thread a gather is not worth splitting.
_MIN_ROWS_PER_THREAD = 256


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                pool: Optional[ThreadPoolExecutor] = None) -> None:
    """out[i] = table[ids[i]] (cast to out's dtype), split over the threads of `pool`."""
    threads = pool._max_workers if pool is not None else 1
    n = ids.numel()
    per = max(_MIN_ROWS_PER_THREAD, -(-n // threads))
    if n <= per:
        _gather_chunk(table, ids, out)
        return
    futures = [pool.submit(_gather_chunk, table, ids[a:a + per], out[a:a + per])
               for a in range(0, n, per)]
    for f in futures:
        f.result()


def _gather_chunk(table, ids, out) -> None:
    if out.dtype == table.dtype:
        torch.index_select(table, 0, ids, out=out)
    else:
        out.copy_(table.index_select(0, ids))


class StagingBuffer:
    """A reusable host buffer rows are gathered into before their copy to the device;
    pinned when the device is a GPU, so the copy is an asynchronous DMA."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.data = torch.empty(0)
        self.copied: Optional[torch.cuda.Event] = None  # the last copy out of it

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # its previous contents have left
        numel = math.prod(shape)
        if self.data.numel() < numel or self.data.dtype != dtype:
            # Headroom: micro-batches differ in unique ids, and pinning is slow.
            self.data = torch.empty(int(numel * 1.25) + 1024, dtype=dtype, pin_memory=self.pin)
        return self.data[:numel].view(shape)
