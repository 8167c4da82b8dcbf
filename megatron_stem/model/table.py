"""STEM embedding table U_l: one row of FFN width per vocabulary entry, per STEM layer."""

from __future__ import annotations

import math
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import (
    get_tensor_model_parallel_group_if_none,
    make_tp_sharded_tensor_for_checkpoint,
)

# Rows generated per init step: bounds init memory to ~chunk x ffn_hidden_size floats,
# whatever the vocabulary (a 1B table is 128k x 8k).
_INIT_ROWS_PER_CHUNK = 4096


def xavier_normal_table_(weight: torch.Tensor, full_width: int, column_offset: int,
                         seed: int) -> torch.Tensor:
    """Fill `weight` with columns [offset, offset+width) of a xavier-normal [V, full_width]
    table drawn from `seed`.

    The full-width rows are drawn chunk by chunk from one generator and sliced, so every
    TP size yields exactly the same table, and memory stays at one chunk. The generator is
    the CPU's whatever the table's device, so a GPU's device tables and host tables start
    from the same numbers too (at 1B, 5.25B draws: 30-60 s of one core per rank, once per
    fresh run).
    """
    rows, width = weight.shape
    std = math.sqrt(2.0 / (rows + full_width))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for start in range(0, rows, _INIT_ROWS_PER_CHUNK):
            stop = min(rows, start + _INIT_ROWS_PER_CHUNK)
            chunk = torch.empty(stop - start, full_width, dtype=torch.float32)
            chunk.normal_(0.0, std, generator=generator)
            weight[start:stop].copy_(chunk[:, column_offset:column_offset + width])
    return weight


class RowSource(Protocol):
    """Serves the lookups of host-placed tables (`StemTable.host`): what the model needs of
    whoever stages their rows on the accelerator (the trainer's `HostTableStore`,
    tables/host_tables.py, which implements it; the model never imports training)."""

    def lookup(self, token_ids: torch.Tensor,
               table: "StemTable") -> tuple[torch.Tensor, torch.Tensor]:
        """For one forward's token ids (the micro-batch's ids tensor as staged, or a view of
        it: recompute replays a forward with the same ids): each id's position among the
        staged rows, shaped like `token_ids`, and `table`'s staged rows. The rows are a
        leaf whose row-sparse gradient reaches the table optimizer."""


class StemTable(MegatronModule):
    """`U_l[t]` for token ids `t`: returns rows of this TP rank's column slice.

    The slice matches the rank's shard of the gate projection, so the lookup needs no
    collective. The table is replicated over data parallel like any dense weight.
    Parameters carry `stem_table = True` so optimizers can treat them apart.

    `sparse_grad`: produce a row-sparse gradient (only the looked-up rows) instead of a
    dense [V, width] one; set by optimizers that consume row-sparse updates.

    `placement="host"` (`tables.placement`): the table is an fp32 tensor in host memory,
    shared by a node's ranks (`model/host_copy.py`, which allocates it after the model is
    built; until then it is on the meta device), never moved or cast with the module, and
    it is the table optimizer's master copy. A forward reads the rows of its micro-batch,
    staged on the accelerator by the `RowSource` set in `self.host`; their gradients go to
    the staged rows, not here.

    `weight.pending_rows`: while the table optimizer is still writing rows this forward
    may read (`tables.overlap: next_step`, tables/overlap.py), a callable that
    returns once the rows a lookup of these ids may read are in place; a lookup calls it
    first.
    """

    sparse_grad = False
    host: Optional[RowSource] = None  # placement "host": what serves the lookups

    def __init__(self, config: TransformerConfig, num_embeddings: int, ffn_hidden_size: int,
                 init_seed: int, tp_group: Optional[torch.distributed.ProcessGroup] = None,
                 placement: str = "device"):
        super().__init__(config=config)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        width = ffn_hidden_size // tp_size
        self.placement = placement
        self._init_args = (ffn_hidden_size, tp_rank * width, init_seed)
        self.perform_initialization = config.perform_initialization
        if placement == "host":
            self.set_host_weight(torch.empty(num_embeddings, width, device="meta"))
            return
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(num_embeddings, width, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            self.init_table_(self.weight)
        self._mark(self.weight)

    def init_table_(self, weight: torch.Tensor) -> None:
        """Fill `weight` (this rank's slice) with the table's initial values."""
        xavier_normal_table_(weight, *self._init_args)

    def set_host_weight(self, tensor: torch.Tensor) -> None:
        """Make `tensor` (fp32, host memory) this table. No autograd gradient reaches it."""
        self.weight = torch.nn.Parameter(tensor, requires_grad=False)
        self._mark(self.weight)

    @staticmethod
    def _mark(weight: torch.nn.Parameter) -> None:
        tensor_parallel.set_tensor_model_parallel_attributes(
            weight, is_parallel=True, dim=1, stride=1)
        weight.stem_table = True

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        pending = getattr(self.weight, "pending_rows", None)
        if pending is not None:
            pending(token_ids)
        if self.placement == "host":
            if self.host is None:
                raise RuntimeError("a host-placed STEM table has no RowSource to stage its "
                                   "rows: build the trainer's engine (training/engine.py)")
            inverse, rows = self.host.lookup(token_ids, self)
            return F.embedding(inverse, rows, sparse=True)
        return F.embedding(token_ids, self.weight, sparse=self.sparse_grad)

    def _apply(self, fn, recurse=True):
        # A host table stays where it is (fp32, shared host memory): `.cuda()`, `.to()`
        # and casts of the model apply to everything else.
        return self if self.placement == "host" else super()._apply(fn, recurse)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        key = f"{prefix}weight"
        return {key: make_tp_sharded_tensor_for_checkpoint(
            self.weight, key, tp_axis=1, prepend_offsets=sharded_offsets)}
