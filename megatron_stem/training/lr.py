"""Learning rate: linear warmup, then cosine decay to `lr x min_lr_ratio`.

`step` counts the steps taken before this one (0 for the first). Megatron's warmup gives
the first step lr / warmup_steps; lingua's (`optimizer.warmup_from_zero`, the official
STEM code's `lingua/optim.py`) gives it 0 and reaches the peak one step later. The cosine
after the warmup is the same in both.
"""

import math

from megatron_stem.config import OptimizerConfig


def lr_at(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    if step < opt.warmup_steps:
        return opt.lr * (step + (0 if opt.warmup_from_zero else 1)) / opt.warmup_steps
    decay_steps = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / decay_steps)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
