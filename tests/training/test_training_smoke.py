"""A few optimizer steps on a fixed batch must lower the loss, STEM and dense alike."""

import pytest
import torch

from megatron_stem.config import ParallelConfig
from megatron_stem.model import build_model
from workers.schedule import forward_backward
from workers.common import microbatches, tiny_model


@pytest.mark.parametrize("placement", ["1/2", "none"])
def test_few_steps_lower_the_loss(world1, placement):
    cfg = tiny_model(placement)
    model = build_model(cfg, ParallelConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = microbatches(cfg, count=2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        losses.append(forward_backward(model, batches))
        optimizer.step()
    assert losses[-1] < 0.7 * losses[0], losses
