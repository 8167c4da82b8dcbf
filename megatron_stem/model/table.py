"""STEM embedding table U_l: one row of FFN width per vocabulary entry, per STEM layer."""

from __future__ import annotations

import math
from typing import Optional

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
    TP size yields exactly the same table, and memory stays at one chunk.
    """
    rows, width = weight.shape
    std = math.sqrt(2.0 / (rows + full_width))
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    with torch.no_grad():
        for start in range(0, rows, _INIT_ROWS_PER_CHUNK):
            stop = min(rows, start + _INIT_ROWS_PER_CHUNK)
            chunk = torch.empty(stop - start, full_width, device=weight.device,
                                dtype=torch.float32)
            chunk.normal_(0.0, std, generator=generator)
            weight[start:stop].copy_(chunk[:, column_offset:column_offset + width])
    return weight


class StemTable(MegatronModule):
    """`U_l[t]` for token ids `t`: returns rows of this TP rank's column slice.

    The slice matches the rank's shard of the gate projection, so the lookup needs no
    collective. The table is replicated over data parallel like any dense weight.
    Parameters carry `stem_table = True` so optimizers can treat them apart.

    `sparse_grad`: produce a row-sparse gradient (only the looked-up rows) instead of a
    dense [V, width] one; set by optimizers that consume row-sparse updates.
    """

    sparse_grad = False

    def __init__(self, config: TransformerConfig, num_embeddings: int, ffn_hidden_size: int,
                 init_seed: int, tp_group: Optional[torch.distributed.ProcessGroup] = None):
        super().__init__(config=config)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        width = ffn_hidden_size // tp_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(num_embeddings, width, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            xavier_normal_table_(self.weight, ffn_hidden_size, tp_rank * width, init_seed)
        tensor_parallel.set_tensor_model_parallel_attributes(
            self.weight, is_parallel=True, dim=1, stride=1)
        self.weight.stem_table = True

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight, sparse=self.sparse_grad)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        key = f"{prefix}weight"
        return {key: make_tp_sharded_tensor_for_checkpoint(
            self.weight, key, tp_axis=1, prepend_offsets=sharded_offsets)}
