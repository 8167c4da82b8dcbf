"""One host copy of the STEM tables per node, shared by the node's ranks.

With `tables.placement: host` a table lives in CPU memory, and the data-parallel ranks of a
node that hold the same tensor-parallel slice share one copy of it (and of its optimizer
states) instead of one each: the copy is a file in /dev/shm that every sharer maps
(`torch.from_file(shared=True)`), created and initialized by the copy's first rank and
unlinked as soon as all have mapped it (nothing is left behind, even after a crash later).
The table is not pinned: rows are gathered from it into a pinned staging buffer, which is
what the DMA to the GPU reads (tables/host_tables.py).

`HostCopy` also carries the groups the table optimizer needs to split the work on a copy
among its sharers (row ownership) and to keep copies on different nodes identical.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import uuid
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem.runtime.errors import ConfigError, UserError

SHM_DIR = "/dev/shm"


class HostCopy:
    """The ranks that share this rank's host copy, and its peers in the other copies.

    `size` ranks share the copy (`group`, None when alone); this rank is `index` among
    them. `copies` copies of this TP slice exist (one per node by default); `cross_group`
    holds the ranks at this rank's `index` in every copy (None when there is one copy).
    `ranks_per_copy` (0 = all of a node's data-parallel ranks of this TP slice) may split a
    node into several copies, e.g. one per CPU socket.
    """

    def __init__(self, ranks_per_copy: int = 0):
        self._alone()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if ranks_per_copy > 1:
                raise ConfigError(f"tables.ranks_per_copy: {ranks_per_copy} ranks per copy "
                                  "but this run has one rank")
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        info = [None] * world
        dist.all_gather_object(info, (socket.gethostname(),
                                      ps.get_tensor_model_parallel_rank()))
        keys = [self.key]
        dist.broadcast_object_list(keys, src=0)
        self.key = keys[0]
        copies = _split_into_copies(info, ranks_per_copy)
        # Every rank creates every group, in the same order (a torch.distributed rule).
        mine, _ = dist.new_subgroups_by_enumeration(copies)
        cross = _cross_groups(copies, info)
        mine_cross, _ = dist.new_subgroups_by_enumeration(cross) if cross else (None, None)
        copy = next(c for c in copies if rank in c)
        self.copy_id = copies.index(copy)
        self.size, self.index = len(copy), copy.index(rank)
        self.group = mine if self.size > 1 else None
        self.copies = sum(1 for c in copies if info[c[0]][1] == info[rank][1])
        self.cross_group = mine_cross if self.copies > 1 else None

    def _alone(self) -> None:
        self.group = self.cross_group = None
        self.size, self.index, self.copies, self.copy_id = 1, 0, 1, 0
        self.key = uuid.uuid4().hex[:12]

    @classmethod
    def alone(cls) -> "HostCopy":
        """A copy that only this rank uses (no collectives at all)."""
        copy = cls.__new__(cls)
        copy._alone()
        return copy

    def tensor(self, name: str, shape: tuple[int, ...],
               init: Optional[Callable[[torch.Tensor], object]] = None) -> torch.Tensor:
        """An fp32 CPU tensor shared by this copy's ranks, filled by `init` (else zeros)
        on the copy's first rank before any other rank sees it."""
        numel = math.prod(shape)
        if self.size == 1:
            tensor = torch.zeros(shape) if init is None else torch.empty(shape)
        else:
            path = os.path.join(SHM_DIR, f"megatron_stem_{self.key}_c{self.copy_id}_{name}")
            if self.index == 0:  # a new file is zero-filled
                _check_space(numel * 4, name)
                if os.path.exists(path):
                    os.unlink(path)
                tensor = torch.from_file(path, shared=True, size=numel,
                                         dtype=torch.float32).view(shape)
            self.barrier()
            if self.index != 0:
                tensor = torch.from_file(path, shared=True, size=numel,
                                         dtype=torch.float32).view(shape)
            self.barrier()
            if self.index == 0:
                os.unlink(path)  # the mappings stay valid; nothing is left in /dev/shm
        if init is not None and self.index == 0:
            init(tensor)
        self.barrier()
        return tensor

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _split_into_copies(info: list[tuple[str, int]], ranks_per_copy: int) -> list[list[int]]:
    by_slice: dict[tuple[str, int], list[int]] = {}
    for rank, key in enumerate(info):
        by_slice.setdefault(tuple(key), []).append(rank)
    copies = []
    for (host, _), ranks in by_slice.items():
        per = ranks_per_copy or len(ranks)
        if len(ranks) % per:
            raise ConfigError(f"tables.ranks_per_copy: {per} does not divide the "
                              f"{len(ranks)} data-parallel ranks of one slice on {host}")
        copies += [ranks[i:i + per] for i in range(0, len(ranks), per)]
    if len({len(c) for c in copies}) > 1:
        raise ConfigError("tables.ranks_per_copy: nodes run different numbers of ranks "
                          f"({sorted({len(c) for c in copies})} per table slice); set it to a "
                          "common divisor")
    return sorted(copies)


def _cross_groups(copies: list[list[int]], info) -> list[list[int]]:
    """Ranks at the same index of every copy of the same TP slice."""
    groups = []
    for tp in sorted({tp for _, tp in info}):
        same_slice = [c for c in copies if info[c[0]][1] == tp]
        if len(same_slice) > 1:
            groups += [[c[i] for c in same_slice] for i in range(len(same_slice[0]))]
    return groups


def _check_space(nbytes: int, name: str) -> None:
    free = shutil.disk_usage(SHM_DIR).free
    if free < nbytes:
        raise UserError(f"tables.placement: host needs {nbytes / 2**30:.2f} GB more in "
                        f"{SHM_DIR} for {name}, {free / 2**30:.2f} GB free (raise the shared "
                        "memory limit, e.g. docker --shm-size)")
