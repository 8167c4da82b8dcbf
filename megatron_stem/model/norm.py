"""RMSNorm that is correct under sequence parallelism (megatron's torch-norm wrapper
refuses SP, and its fused norms need apex or Transformer Engine)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
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
        self.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.sequence_parallel:
            # Each TP rank normalizes its own sequence slice, so this replicated weight's
            # grad is a partial sum: route it through identity-forward / all-reduce-backward
            # and every rank holds the full grad after backward, whatever optimizer runs.
            weight = copy_to_tensor_model_parallel_region(weight)
        if fused_rms_norm_affine is not None and x.is_cuda:
            return fused_rms_norm_affine(x, weight, weight.shape, self.eps)
        return F.rms_norm(x, weight.shape, weight, self.eps)
