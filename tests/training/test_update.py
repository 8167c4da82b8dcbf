"""The end of a step (training/update.py) on a real DeepSpeed engine, in this process:
one global norm over backbone and tables, a non-finite step skipped whole, bf16 gradients
accumulated and reduced in fp32."""

import math
import os

import pytest
import torch
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                             safe_get_full_optimizer_state)

from megatron_stem.config import Recipe, from_dict
from megatron_stem.model import build_model
from megatron_stem.training.loop import _mean_over_dp, _token_mean_loss, train_step
from megatron_stem.tables.comm import mark_host
from megatron_stem.tables.row_grads import HOST_TOKENS
from megatron_stem.training.deepspeed_setup import deepspeed_config
from megatron_stem.training.engine import build_engine
from megatron_stem.checkpoint.zero_state import link_states
from workers.common import TINY, microbatches, tiny_model

# The engine runs in this process: DeepSpeed at world size 1 (gloo), a tiny STEM model.
pytestmark = pytest.mark.usefixtures("world1")


def _recipe(dtype="fp32", **optimizer):
    return from_dict(Recipe, {
        "model": {**TINY, "stem_layers": "1/2"},
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "clip_grad": 0.05,
                      "tables": {"kernel": "torch", "update": "dense"}, **optimizer},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "dtype": dtype}})


def _built(recipe):
    torch.manual_seed(0)
    model = build_model(recipe.model, recipe.parallel, tables=recipe.tables)
    engine, tables, update = build_engine(model, recipe)
    return engine, tables, update, microbatches(tiny_model(), count=2)


def _backward(engine, batches, scale_last=1.0) -> float:
    """Forward/backward of every micro-batch as `train_step` does; returns the mean loss."""
    total = 0.0
    for i, batch in enumerate(batches):
        loss = _token_mean_loss(engine, batch) * (scale_last if i == len(batches) - 1 else 1)
        engine.backward(loss)
        total += loss.item()
        if i + 1 < len(batches):
            engine.step()
    return _mean_over_dp(total / len(batches))


def _state(engine, tables) -> dict[str, torch.Tensor]:
    """Every trained number: parameters, the backbone's fp32 master and moments, the
    tables' state, and the step counts."""
    link_states(engine.optimizer)
    out = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for n, p in engine.module.named_parameters():
        if not getattr(p, "stem_table", False):
            out[f"master/{n}"] = safe_get_full_fp32_param(p).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                state = safe_get_full_optimizer_state(p, k)
                if state is not None:
                    out[f"{k}/{n}"] = state.clone()
    for name, states in tables.state_tensors().items():
        out |= {f"table/{name}/{k}": v.clone() for k, v in states.items()}
    steps = [float(s["step"]) for s in engine.optimizer.optimizer.state.values()]
    out["steps"] = torch.tensor(steps + [tables.step_count])
    return out


def test_the_global_norm_is_over_backbone_and_tables_and_clips_both():
    engine, tables, update, batches = _built(_recipe())
    train_step(update, batches, 1e-2)  # a first step: the moments exist
    loss = _backward(engine, batches)
    backbone = math.sqrt(sum(float(safe_get_full_grad(p).double().square().sum())
                             for _, p in engine.module.named_parameters()
                             if not getattr(p, "stem_table", False)))
    table = math.sqrt(sum(float(sum(g.to_dense() for g in t.param.row_grads._parts)
                                .double().square().sum()) for t in tables.tables))
    outcome = update.apply(1e-2, loss)
    assert outcome.applied
    assert outcome.norms.backbone == pytest.approx(backbone, rel=1e-6)
    assert outcome.norms.tables == pytest.approx(table, rel=1e-6)
    norms = outcome.norms
    assert norms.total == pytest.approx(math.hypot(norms.backbone, norms.tables), rel=1e-12)
    assert outcome.norms.total > 0.05  # so both were clipped, by clip_grad / total


@pytest.mark.parametrize("plant", ["table", "loss"])
def test_a_non_finite_step_changes_nothing_and_says_what(plant):
    """A NaN in one table gradient (or an infinite loss, whose backward spoils every
    gradient) skips the update of backbone and tables alike; the next step trains."""
    engine, tables, update, batches = _built(_recipe())
    train_step(update, batches, 1e-2)
    before = _state(engine, tables)
    loss = _backward(engine, batches, scale_last=math.inf if plant == "loss" else 1.0)
    if plant == "table":
        part = tables.tables[0].param.row_grads._parts[0]
        part._values()[0, 0] = math.nan
    outcome = update.apply(1e-2, loss)
    assert not outcome.applied
    assert outcome.nonfinite == (("tables",) if plant == "table" else
                                 ("loss", "backbone", "tables"))
    assert not math.isfinite(outcome.norms.total)  # never a finite number
    after = _state(engine, tables)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    loss, outcome = train_step(update, batches, 1e-2)
    assert outcome.applied and math.isfinite(loss)
    assert not torch.equal(_state(engine, tables)["steps"], before["steps"])


def test_a_step_in_which_deepspeed_skips_the_norm_hook_fails_loudly():
    engine, tables, update, batches = _built(_recipe())
    engine.optimizer.scaled_global_norm = update.hook._backbone_norm  # a release without it
    loss = _backward(engine, batches)
    with pytest.raises(RuntimeError, match="called the gradient-norm hook 0 times, not once"):
        update.apply(1e-2, loss)


def test_bf16_accumulates_and_reduces_gradients_in_fp32():
    """The DeepSpeed config and the optimizer it builds: bf16 parameters, micro-batch
    gradients summed in fp32 (`grad_accum`), reduced in fp32; a step with inf/NaN
    gradients is skipped; and it trains."""
    recipe = _recipe("bf16")
    config = deepspeed_config(recipe, dp_size=1)
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["communication_data_type"] == "fp32"
    assert "data_types" not in deepspeed_config(_recipe("fp32"), dp_size=1)
    # The backbone's reduction overlaps the (last) backward, in buckets of Megatron-LM's
    # size, capped at the backbone's (DeepSpeed allocates two whole buckets).
    from megatron_stem.model.accounting import account

    zero = config["zero_optimization"]
    assert zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == account(recipe.model).active_params
    big = from_dict(Recipe, {"model": {**TINY, "vocab_size": 250_000, "hidden_size": 256,
                                       "num_attention_heads": 4}})
    assert deepspeed_config(big, 64)["zero_optimization"]["reduce_bucket_size"] == 64_000_000
    engine, tables, update, batches = _built(recipe)
    zero = engine.optimizer
    assert type(zero).__name__ == "DeepSpeedZeroOptimizer"  # not BF16_Optimizer
    assert zero.gradient_accumulation_dtype == zero.communication_data_type == torch.float32
    engine.backward(_token_mean_loss(engine, batches[0]))
    accumulated = [p.grad_accum for p in zero.bit16_groups[0] if p.grad_accum is not None]
    assert accumulated and {g.dtype for g in accumulated} == {torch.float32}
    engine.step()
    loss = _backward(engine, batches[1:])
    first = update.apply(1e-2, loss)
    losses = [train_step(update, batches, 1e-2)[0] for _ in range(6)]
    assert first.applied and losses[-1] < losses[0]
    # An infinite loss: the backbone's norm is not finite, and DeepSpeed skips the step.
    before = _state(engine, tables)
    outcome = update.apply(1e-2, _backward(engine, batches, scale_last=math.inf))
    assert not outcome.applied and "backbone" in outcome.nonfinite
    after = _state(engine, tables)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_the_deterministic_switch_sets_what_gpu_runs_need(monkeypatch):
    from megatron_stem.training.checks import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert from_dict(Recipe, {"model": TINY, "train": {"deterministic": True}}).train.deterministic
    try:
        use_deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_step_reads_the_device_once_whatever_its_micro_batches():
    """The loss of every micro-batch, the gradient norms (the backbone's inside
    DeepSpeed's step, the tables'), the tables' flags: one read by the host, in
    DeepSpeed's step, whatever the micro-batches; and the tables' gradients copied to
    their CPU state, one wait (`HostStaging`). Counted over the whole step, the update
    included (workers/host_reads.py: every value read, copy to host memory and crossing
    of the tables' path, by where it is made)."""
    from workers.host_reads import HOST_SIDE, HostReads

    recipe = _recipe()
    recipe.train.global_batch_size = 8
    engine, tables, update, _ = _built(recipe)
    batches = [{**mb, HOST_TOKENS: mark_host(mb["tokens"].clone())}  # as the loader gives them
               for mb in microbatches(tiny_model(), count=4)]
    with torch.no_grad():
        expected = sum(float(_token_mean_loss(engine, b)) for b in batches) / len(batches)
    reads = HostReads()
    try:
        loss, outcome = train_step(update, batches, 1e-2)
    finally:
        taken = reads.close()
    on_the_device = [read for read in taken if read[1] not in HOST_SIDE]
    assert outcome.applied and on_the_device == [
        ("tolist", "megatron_stem/runtime/host_read.py:read"),
        ("HostStaging.wait", "megatron_stem/tables/optimizer.py:step")]
    assert loss == pytest.approx(expected, rel=1e-6)
    assert outcome.norms.total > 0 and tables.touched_rows > 0

