"""RMSNorm usable under sequence parallelism (megatron's torch-norm wrapper refuses SP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

try:  # apex's fused kernel, where a GPU cluster has apex installed
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
except ImportError:
    fused_rms_norm_affine = None


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        # Each TP rank normalizes a different sequence slice under SP: the grad of this
        # replicated weight must then be summed over TP (see parallel.py).
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rms_norm_affine is not None and x.is_cuda:
            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
