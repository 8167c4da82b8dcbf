"""The output layer and cross-entropy in chunks of positions, never the whole logits.

megatron's path (`GPTModel._postprocess`) multiplies every position by the output layer at
once and keeps, for backward, the cross-entropy's fp32 softmax of all of them: at 32,768
positions x 128,256 vocabulary that is 16.8 GB per sequence, beside the logits themselves
in the training dtype while the loss is computed. `parallel.loss_chunk_tokens` computes the
same per-token loss a chunk of positions at a time instead, as Liger's fused linear
cross-entropy and torchtitan's chunked loss do: the forward keeps only its inputs (the
final hidden states, already kept by the layer norm's backward, and the labels); the
backward computes each chunk's logits again and its gradients from them. What it keeps at
any time is one chunk's logits and softmax, and the output weight's gradient in fp32 while
the chunks add into it.

Each chunk runs megatron's own vocab-parallel cross-entropy on its logits, so under tensor
parallelism the weight stays the rank's vocabulary slice and the loss's statistics meet in
the same all-reduces (every rank runs the same chunks). The hidden states enter as
megatron's output layer takes them: gathered along the sequence under sequence
parallelism (the backward reduce-scattered), else as a copy whose gradient is all-reduced
over the tensor-parallel group.

Cost: one more GEMM of the output layer per token (the backward's recompute of the
logits), 2 x hidden x vocabulary / TP FLOPs, which the planner charges
(`planning/compute.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int, sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) of the final hidden states [s, b, h] (this rank's
    sequence part under sequence parallelism) against `labels` [b, s], with the output
    layer's `weight` [vocab / TP, h]: what `GPTModel` returns given labels."""
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    s, b, h = hidden.shape
    per_token = _ChunkedOutputCrossEntropy.apply(hidden.reshape(s * b, h), weight,
                                                 labels.t().reshape(s * b), chunk_tokens)
    return per_token.view(s, b).t()


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    """megatron's output layer and vocab-parallel cross-entropy on one chunk of positions."""
    return vocab_parallel_cross_entropy(F.linear(hidden, weight), labels)


class _ChunkedOutputCrossEntropy(torch.autograd.Function):
    """hidden [n, h], weight [vocab / TP, h], labels [n] -> loss [n], chunk by chunk;
    the backward recomputes each chunk's forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        for part in _chunks(labels.numel(), chunk_tokens):
            loss[part] = _chunk_loss(hidden[part], weight, labels[part])
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # The chunks' weight gradients add up in fp32, as one GEMM over all positions would.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        leaf_weight = weight.detach().requires_grad_()
        for part in _chunks(labels.numel(), ctx.chunk_tokens):
            leaf_hidden = hidden[part].detach().requires_grad_()
            with torch.enable_grad():
                loss = _chunk_loss(leaf_hidden, leaf_weight, labels[part])
                grad_hidden[part], chunk_grad = torch.autograd.grad(
                    loss, (leaf_hidden, leaf_weight), grad_loss[part])
            grad_weight += chunk_grad
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]
