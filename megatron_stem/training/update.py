"""The end of a training step, in one place: the order every optimizer of the run follows.

After the last micro-batch's backward (`Update.apply`):

1. the tables' row gradients are averaged over data parallel (`TableOptimizer.sync_grads`);
2. the gradient norms: DeepSpeed's ZeRO optimizer computes the backbone's inside its step
   and calls the norm hook installed here, which adds the tables' share (`grad_norm_sq`)
   and reads them on the host with the step's other values, once (runtime/host_read.py).
   `optimizer.clip_tables: joint` clips both by one coefficient from the global norm over
   both; `separate` (the official STEM code's) clips each by its own norm, each a global
   norm over all of its shards and ranks;
3. the backbone's step (DeepSpeed), then the tables' step (the same learning-rate
   schedule, times `optimizer.tables.lr_mult`).

A step whose loss (the data-parallel mean), backbone norm or table norm is not finite is
skipped whole, on every rank alike (the loss and the norms are the same on every rank:
they are reduced over all of them): the hook hands DeepSpeed an infinite norm, which makes
its ZeRO optimizer drop the gradients without stepping (`bf16.check_grad_overflow` on;
fp32 always; DeepSpeed's separate overflow check is the norm's, see `NormHook`), and the
tables drop theirs. No parameter, moment, table row or optimizer
step count changes. The step's outcome says which part was not finite.

DeepSpeed's own checks guard the seam: the hook must have been called in the step
(a DeepSpeed release that stopped calling `scaled_global_norm` would otherwise leave the
tables unclipped), and DeepSpeed must have skipped exactly the steps asked to be skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_stem.runtime.host_read import HostRead, HostValue
from megatron_stem.tables.comm import mark_host
from megatron_stem.training.profiling import UNTIMED


@dataclass
class GradNorms:
    """A step's gradient norms (unscaled): backbone, tables, and the global one (over
    both, whichever norm clips)."""

    backbone: float = 0.0
    tables: float = 0.0
    total: float = 0.0


@dataclass
class Outcome:
    """What the update did: `applied`, or skipped because `nonfinite` names parts (of
    "loss", "backbone", "tables") that were not finite."""

    norms: GradNorms
    nonfinite: tuple[str, ...] = ()
    ranks: str = ""  # a skipped step: which ranks' own values were not finite

    @property
    def applied(self) -> bool:
        return not self.nonfinite


def _valid_norm(value: float) -> bool:
    """A norm that can be trained on: DeepSpeed reports an invalid one as inf (its group
    norms as -1), a NaN gradient gives NaN."""
    return math.isfinite(value) and value >= 0


def clip_coefficient(norm: float, clip_grad: float) -> float:
    """The factor DeepSpeed applies to gradients whose norm is `norm`."""
    if clip_grad <= 0 or norm <= clip_grad:
        return 1.0
    return clip_grad / (norm + 1e-6)


def _whose(local_loss: float, local_tables_finite: bool) -> str:
    """Which ranks' own loss or table gradients were not finite (a skipped step, on every
    rank at once: one all-gather of two flags). The backbone's gradients are only seen
    after DeepSpeed's reduction over data parallel, which mixes the ranks'."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (math.isfinite(local_loss), local_tables_finite))
    parts = [f"rank {r}'s {what}" for r, (loss_ok, tables_ok) in enumerate(flags)
             for what, ok in (("loss", loss_ok), ("table gradients", tables_ok)) if not ok]
    return f" ({', '.join(parts)})" if parts else ""


def _host(value):
    """A value given as a float, or as a `HostValue` of the step's host read."""
    return value.get() if isinstance(value, HostValue) else value


class NormHook:
    """The tables in DeepSpeed's global norm, and the step's one host read: DeepSpeed's
    ZeRO-1/2 optimizer computes the (loss-scaled) backbone norm in `scaled_global_norm`
    and clips its partitions by what that returns. The hook replaces the method on that
    optimizer instance: it adds the backbone's norm and the tables' squared norm to the
    step's host read (runtime/host_read.py), reads it (with the loss, the stop flag and
    whatever else the step added), and returns the norm the backbone is clipped by
    (`joint`: over backbone and tables; else the backbone's own), infinite for a step to
    skip, in host memory (DeepSpeed's checks of it then read nothing from the device); it
    records the parts.

    It also replaces DeepSpeed's own overflow check (bf16's `check_grad_overflow`: an
    all-reduce and a host read of its own, before the norm): the norm covers every
    gradient, so it is infinite, NaN or DeepSpeed's -1 whenever a gradient is not finite,
    and DeepSpeed skips a step whose norm is (`is_invalid_grad_norm`)."""

    def __init__(self, zero_optimizer, tables, joint: bool = True):
        self.zero_optimizer, self.tables, self.joint = zero_optimizer, tables, joint
        self._backbone_norm = zero_optimizer.scaled_global_norm
        zero_optimizer.scaled_global_norm = self
        zero_optimizer.has_overflow = lambda partition_gradients=True: False  # the norm's
        self.calls = 0
        self.read = HostRead()  # the step's, set by `Update.apply`
        self.loss = 0.0  # the step's loss: a float or a value of `read`
        self.norms = GradNorms()
        self.nonfinite: tuple[str, ...] = ()

    def __call__(self, norm_type=2):
        self.calls += 1
        scale = float(getattr(self.zero_optimizer, "loss_scale", 1.0))
        backbone = self.read.add(self._backbone_norm(norm_type))
        table_sq = self.read.add(self.tables.grad_norm_sq())
        backbone, table_sq = backbone.get() / scale, table_sq.get()  # the step's host read
        self.nonfinite = tuple(name for name, ok in (
            ("loss", math.isfinite(_host(self.loss))), ("backbone", _valid_norm(backbone)),
            ("tables", _valid_norm(table_sq))) if not ok)
        total = (backbone ** 2 + table_sq) ** 0.5 if not self.nonfinite else math.inf
        self.norms = GradNorms(backbone, table_sq ** 0.5, total)
        clipped_by = total if self.joint or self.nonfinite else backbone
        return mark_host(torch.tensor(clipped_by * scale))

    def tables_norm(self) -> float:
        """The norm the tables are clipped by."""
        return self.norms.total if self.joint else self.norms.tables


class Update:
    """The end of every step (module docstring): `apply` after the last backward."""

    def __init__(self, engine, tables, clip_grad: float, clip_tables: str = "joint"):
        self.engine, self.tables, self.clip_grad = engine, tables, clip_grad
        self.hook = NormHook(engine.optimizer, tables, joint=clip_tables == "joint")

    @property
    def norms(self) -> GradNorms:
        return self.hook.norms

    def apply(self, lr: float, loss, next_ids: Optional[list[torch.Tensor]] = None,
              local_loss=None, timer=UNTIMED, read: Optional[HostRead] = None) -> Outcome:
        """The update of a step whose data-parallel mean loss is `loss` (`local_loss`: this
        rank's), floats or values of the step's host read `read` (None: one of its own),
        which DeepSpeed's step reads; `next_ids`: the next step's token ids (an overlapped
        table update puts their rows first); `timer` times its phases
        (training/profiling.py)."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError("Update.apply: not at DeepSpeed's gradient accumulation "
                               "boundary (train.global_batch_size / micro-batches mismatch)")
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        read = read or HostRead()
        with timer.phase("tables_sync"):
            self.tables.sync_grads(read)
        self.hook.read, self.hook.loss = read, loss
        calls = self.hook.calls
        with timer.phase("backbone_step"):
            engine.step()
        outcome = self._outcome(self.hook.calls - calls, not engine.was_step_applied())
        with timer.phase("tables_step"):
            if outcome.applied:
                self.tables.step(lr, clip_coefficient(self.hook.tables_norm(), self.clip_grad),
                                 next_ids)
            else:
                self.tables.skip()
        if not outcome.applied:
            outcome.ranks = _whose(_host(loss if local_loss is None else local_loss),
                                   self.tables.local_grads_finite())
        return outcome

    def _outcome(self, hook_calls: int, skipped: bool) -> Outcome:
        """The step's outcome from what DeepSpeed did, checked against what it was asked."""
        if hook_calls != 1:
            raise RuntimeError(
                f"DeepSpeed's step called the gradient-norm hook {hook_calls} times, not "
                "once: this DeepSpeed release computes the norm elsewhere, so the tables "
                "would not be clipped by the backbone's norm (training/update.py)")
        outcome = Outcome(self.hook.norms, self.hook.nonfinite)
        if skipped != (not outcome.applied):
            raise RuntimeError(
                f"DeepSpeed {'skipped' if skipped else 'applied'} a step whose gradients "
                f"were {'finite' if outcome.applied else 'not finite'}: the backbone and "
                "the tables would part ways (training/update.py)")
        return outcome
