"""The FFN's activation recomputed in backward (`parallel.recompute_modules: [mlp_act]`).

A SwiGLU FFN keeps, besides its input, the gate and up-projection (or the table's rows),
silu(gate), and their product, which the down-projection saves as its input. Recomputing
the activation keeps only what goes into it: the product's storage is freed once the
down-projection has run and refilled in backward, just before the down-projection's own
backward reads it, by megatron's `CheckpointWithoutOutput` (its MoE experts' `moe_act`).
The recompute is elementwise: no GEMM runs twice.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """megatron's gated activation of a fused [gate | up] fc1 output (no clamp, no offset)."""
    gate, up = torch.chunk(fc1_output, 2, dim=-1)
    return F.silu(gate) * up


def down_of_recomputed(activation: Callable[..., torch.Tensor], inputs: tuple,
                       down: torch.nn.Module):
    """`down(activation(*inputs))`, the activation's output kept only until `down` has run
    and computed again in backward. `down` returns (output, bias), as megatron's linears."""
    checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
    out = down(checkpoint.checkpoint(activation, *inputs))
    checkpoint.discard_output_and_register_recompute(out[0])
    return out
