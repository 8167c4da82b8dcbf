"""The official STEM code's initial dense weights (`model.init: truncated_fan_in`).

lingua (and the official STEM code built on it) draws every projection from a normal
truncated at +-3 std with std = fan_in^-0.5: hidden_size^-0.5 for q/k/v/o, the gate and
up projections and the output layer, ffn_hidden_size^-0.5 for the down projection, and
hidden_size^-0.5 for the embedding (its row width), with no depth scaling. For every 2-D
weight here that is std = (its full in-dimension, `shape[1]`)^-0.5. The norm gains stay
ones and the STEM tables keep their own xavier-normal init (model/table.py).

Each weight is drawn whole from a CPU generator seeded by the run's seed and the weight's
name, then this rank's tensor-parallel shard is cut from it as megatron cuts its CPU init
(stride-aware: a SwiGLU fc1 shard is [gate_r; up_r]). So every TP size, and a GPU as a
CPU, starts from the same numbers; memory stays at one full weight at a time. (A pipeline
stage names its layers from 0, so a PP layout draws other numbers, as megatron's own init
does; training runs at PP 1.)
"""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state

TRUNCATION = 3.0  # in standard deviations


def fan_in_std(full_shape: tuple[int, ...]) -> float:
    return full_shape[1] ** -0.5


def truncated_fan_in_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every dense 2-D weight of `model` (this rank's stage and TP shard)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2 or getattr(p, "stem_table", False):
                continue
            sharded = getattr(p, "tensor_model_parallel", False) and tp > 1
            dim = p.partition_dim if sharded else 0
            full = list(p.shape)
            full[dim] *= tp if sharded else 1
            std = fan_in_std(tuple(full))
            weight = torch.empty(full)
            generator = torch.Generator().manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode()))
            torch.nn.init.trunc_normal_(weight, 0.0, std, -TRUNCATION * std, TRUNCATION * std,
                                        generator=generator)
            if sharded:
                stride = getattr(p, "partition_stride", 1)
                pieces = weight.split(p.shape[dim] // stride, dim)
                weight = torch.cat(pieces[rank::tp], dim)
            p.copy_(weight)
