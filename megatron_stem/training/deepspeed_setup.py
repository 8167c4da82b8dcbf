"""What the DeepSpeed engine is given: its config (ZeRO stage, buckets, bf16 with fp32
gradient accumulation), the `mpu` it asks parallel state of, the optimizer it wraps, and
the one choice it makes here otherwise than the tables and checkpoints need
(`zero_optimizer_for_fp32_grads`, a patch held only around `deepspeed.initialize`)."""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps

from megatron_stem.config import Recipe
from megatron_stem.model.accounting import account
from megatron_stem.runtime.errors import ConfigError


class MegatronMpu:
    """DeepSpeed's `mpu` protocol answered from megatron-core's parallel state (DeepSpeed
    still asks for the pre-0.5 names that megatron-core no longer has)."""

    get_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(
        ps.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)


def deepspeed_config(recipe: Recipe, dp_size: int) -> dict:
    train, opt = recipe.train, recipe.optimizer
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
            f"micro_batch_size x data-parallel size = {per_step}")
    # The backbone's gradient reduction overlapped with the backward: DeepSpeed reduces
    # each bucket from the gradient hooks as it fills (ZeRO-1: during the last
    # micro-batch's backward; ZeRO-2: every micro-batch's), instead of all of it after the
    # backward. Buckets as Megatron-LM sizes them (max(40M, 1M x DP) elements): small
    # enough to start early, large enough for the network's bandwidth; no larger than the
    # backbone (DeepSpeed allocates two whole buckets).
    bucket = min(max(40_000_000, 1_000_000 * dp_size),
                 account(recipe.model).active_params // recipe.parallel.tensor_parallel)
    zero = {"stage": opt.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if opt.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.global_batch_size // per_step,
        "zero_optimization": zero,
        "gradient_clipping": opt.clip_grad,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }
    if train.dtype == "bf16":
        # bf16 parameters and per-micro-batch gradients, but the micro-batches' gradients
        # summed and reduced over data parallel in fp32, as Megatron-LM does by default:
        # summing 32 ranks x 4 micro-batches in bf16 loses the small gradients. A step with
        # inf/NaN gradients is skipped (training/update.py relies on it).
        config |= {"bf16": {"enabled": True, "check_grad_overflow": True},
                   "data_types": {"grad_accum_dtype": "fp32"},
                   "communication_data_type": "fp32"}
    return config


def dense_optimizer(recipe: Recipe, decay, no_decay):
    opt = recipe.optimizer
    groups = [{"params": decay, "weight_decay": opt.weight_decay}]
    if no_decay:  # none under `optimizer.decay_norms` (ZeRO cannot flatten an empty group)
        groups.append({"params": no_decay, "weight_decay": 0.0})
    kwargs = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    if opt.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kwargs)


@contextlib.contextmanager
def zero_optimizer_for_fp32_grads():
    """ZeRO's optimizer for bf16 parameters with fp32 gradient accumulation at stage 1.

    For that combination DeepSpeed 0.19 builds its `BF16_Optimizer`, which keeps a full
    fp32 gradient on every rank, all-reduces it after the backward (never overlapped with
    it) and computes the norm in a module function the tables cannot join. Its ZeRO-1/2
    optimizer (`DeepSpeedZeroOptimizer`) does fp32 accumulation too (`grad_accum` per
    parameter, reduced in fp32 at the boundary, overlappable with the last backward) and
    is the one the tables' norm hook and checkpoints are written for (training/update.py,
    checkpoint/optimizer_io.py). DeepSpeed picks it for this combination only with offload, so the
    choice is made here, for the `initialize` call only."""
    from deepspeed.runtime import engine as ds_engine

    choose = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check

    def zero_rather_than_bf16(self, basic_optimizer):
        choice = choose(self, basic_optimizer)
        return ds_engine.ZERO_OPTIMIZATION \
            if choice == ds_engine.BFLOAT16 and self.zero_optimization() else choice

    ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = zero_rather_than_bf16
    try:
        yield
    finally:
        ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = choose
