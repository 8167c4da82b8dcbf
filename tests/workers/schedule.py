"""One forward/backward over a list of micro-batches, on any TP/PP layout.

Wraps megatron-core's pipeline schedules (1F1B under PP, plain loop otherwise). A
micro-batch is a dict of [b, s] tensors: `tokens`, `labels`, `loss_mask` (and, with documents,
`position_ids` and `documents`, as training/batches.py makes them). Every pipeline
stage receives the tokens: STEM layers on any stage look them up (see model/gpt.py).
"""

from __future__ import annotations

# megatron_stem before megatron-core: its import hook keeps megatron-core from importing
# TorchDynamo and Inductor (megatron_stem/runtime/lazy_imports.py), seconds of every rank's start.
import megatron_stem  # noqa: F401

# isort: split
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_stem.training.batches import model_inputs


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.float()
    loss_sum = (per_token_loss.float() * mask).sum()
    tokens = mask.sum().to(torch.int)
    # Three outputs: megatron divides the loss by the token count (and micro-batch count)
    # before backward; the report keeps sum and count so callers can average exactly.
    return loss_sum, tokens, torch.stack([loss_sum.detach(), mask.sum()])


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"], **model_inputs(batch))
    return output, partial(_loss_func, batch["loss_mask"])


def forward_backward(model, microbatches: list[dict], forward_only: bool = False):
    """Run all micro-batches; return the token-mean loss (a float) on every rank.

    Gradients accumulate into `.grad` of this rank's parameters, scaled so that they are
    the gradient of the mean (over micro-batches) of each micro-batch's token-mean loss.
    """
    b, s = microbatches[0]["tokens"].shape
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(microbatches), model=model,
        num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
        forward_only=forward_only)
    totals = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        totals = torch.stack(reports).sum(0).double()
    # Every stage reports the loss: it lives on the last one.
    torch.distributed.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    return (totals[0] / totals[1].clamp(min=1)).item()
