"""Llama 3's RoPE frequency scaling, shared by the training model and the exported HF code.

Imports only torch: `tools/to_hf.py` ships this file beside `modeling_stem.py`, so both
models rotate by the very same frequencies. The formula is transformers'
`_compute_llama3_parameters` (and Meta's reference `apply_scaling`), with all four
parameters free (megatron-core's own version fixes three of them to Llama 3.1's values).
"""

import math

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """`inv_freq` (RoPE's 1 / base^(2i/d)) with Llama 3's scaling: frequencies whose
    wavelength exceeds the original context / `low_freq_factor` are divided by `factor`,
    those below the original context / `high_freq_factor` are kept, the ones between are
    interpolated smoothly."""
    context = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high_freq_factor) * ~(wavelen > context / low_freq_factor)
    return torch.where(medium, smoothed, scaled)
