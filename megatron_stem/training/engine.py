"""DeepSpeed for the dense parameters, our table optimizer for the STEM tables.

The DeepSpeed engine owns every parameter but the tables: ZeRO-1/2 partitions their
optimizer states (and, at stage 2, gradients) over data parallel, optionally offloaded to
CPU. The tables are trained by `TableOptimizer` (row-sparse, CPU-resident states).
Gradient clipping uses one global norm over both: the engine's ZeRO optimizer is handed
the tables' share of the norm (see `_include_tables_in_grad_norm`). Host-resident tables
(`tables.placement: host`) stay out of the engine's reach and get a `HostTableStore`.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps

from megatron_stem import ops
from megatron_stem.config import Recipe
from megatron_stem.errors import ConfigError
from megatron_stem.model.table import StemTable
from megatron_stem.parallel import device, local_world_size
from megatron_stem.training.host_tables import HostTableStore
from megatron_stem.training.table_optim import TableOptimizer, cpu_state_bytes


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


def split_parameters(model: torch.nn.Module):
    """(decayed dense, undecayed dense, tables as (name, param)) for the optimizers."""
    decay, no_decay, tables = [], [], []
    for name, p in model.named_parameters():
        if getattr(p, "stem_table", False):
            tables.append((name, p))
        elif p.ndim < 2:  # norms: no weight decay (Megatron and Llama practice)
            no_decay.append(p)
        else:
            decay.append(p)
    return decay, no_decay, tables


def deepspeed_config(recipe: Recipe, dp_size: int) -> dict:
    train, opt = recipe.train, recipe.optimizer
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
            f"micro_batch_size x data-parallel size = {per_step}")
    zero = {"stage": opt.zero_stage}
    if opt.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.global_batch_size // per_step,
        "zero_optimization": zero,
        "gradient_clipping": opt.clip_grad,
        "bf16": {"enabled": train.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }


def _dense_optimizer(recipe: Recipe, decay, no_decay):
    opt = recipe.optimizer
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    if opt.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kwargs)


class GradNorms:
    """The last step's gradient norms: backbone, tables, and the global one clipped by."""

    backbone = tables = total = 0.0


def _include_tables_in_grad_norm(zero_optimizer, tables: TableOptimizer,
                                 norms: GradNorms) -> None:
    """Make the ZeRO optimizer clip by the norm over backbone *and* tables.

    DeepSpeed's ZeRO-1/2 computes its (loss-scaled) global norm in `scaled_global_norm`
    and clips its own partitions by it; it never sees the tables. We wrap that one method
    on this optimizer instance to add the tables' share, so both clip by the same norm.
    """
    backbone_norm = zero_optimizer.scaled_global_norm

    def global_norm(norm_type=2):
        scale = float(getattr(zero_optimizer, "loss_scale", 1.0))
        backbone = float(backbone_norm(norm_type)) / scale
        table_sq = tables.grad_norm_sq()
        norms.backbone, norms.tables = backbone, table_sq ** 0.5
        norms.total = (backbone ** 2 + table_sq) ** 0.5
        return torch.tensor(norms.total * scale, device=zero_optimizer.device)

    zero_optimizer.scaled_global_norm = global_norm


@contextlib.contextmanager
def _out_of_module(tables: list[StemTable]):
    """DeepSpeed casts (bf16), moves and broadcasts every parameter of the module it wraps.
    A host table must do none of that: it stays fp32 in host memory shared by a node's
    ranks, and it is its optimizer's master copy. So it leaves the module meanwhile."""
    saved = [(m, m._parameters.pop("weight")) for m in tables]
    try:
        yield
    finally:
        for m, weight in saved:
            m._parameters["weight"] = weight


def _available_host_bytes() -> int | None:
    """MemAvailable of this node (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_table_memory(tables, placement: str, shards: int = 1) -> None:
    """With `placement: device` every rank keeps its part of the tables' fp32 master and
    Adam moments in CPU memory (1/`shards` of 63 GB per rank at 1B). Say so before
    allocating, rather than let the kernel's OOM killer take down a rank midway through
    start-up. Called before the engine's collectives: no rank has allocated its share
    when any rank checks."""
    if placement != "device" or not tables:
        return
    available = _available_host_bytes()
    ranks = local_world_size()
    need = cpu_state_bytes(tables, shards) * ranks
    if available is not None and need > available:
        raise ConfigError(
            f"tables.placement: device keeps the tables' fp32 master and Adam moments in "
            f"every rank's CPU memory: {need / 2**30:.1f} GiB for {ranks} rank(s) on this "
            f"node, which has {available / 2**30:.1f} GiB available. Use "
            "tables.placement=host (one shared copy per node), tables.partition=sharded "
            "(1/n of it per data-parallel rank), more tensor parallelism, or fewer ranks "
            "per node")


def build_engine(model: torch.nn.Module, recipe: Recipe):
    """Wrap `model` in a DeepSpeed engine; returns (engine, table optimizer, norms)."""
    ops.start_deepspeed(cpu_adam=recipe.optimizer.offload)  # the tables load theirs
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    decay, no_decay, tables = split_parameters(model)
    tab, tab_opt = recipe.tables, recipe.optimizer.tables
    if tab_opt.device == "cpu":
        check_table_memory(tables, tab.placement,
                           ps.get_data_parallel_world_size() if tab.partition == "sharded" else 1)
    host_tables = []
    for module in model.modules():
        if isinstance(module, StemTable):
            module.sparse_grad = True
            if module.placement == "host":
                host_tables.append(module)
    with _out_of_module(host_tables):
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=_dense_optimizer(recipe, decay, no_decay),
            config=deepspeed_config(recipe, ps.get_data_parallel_world_size()),
            mpu=MegatronMpu())
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        raise RuntimeError(f"expected DeepSpeed's ZeRO-1/2 optimizer, got {type(optimizer)}")
    opt = recipe.optimizer
    host = None
    if host_tables:
        host = HostTableStore(
            host_tables, device(), torch.bfloat16 if recipe.train.dtype == "bf16" else
            torch.float32, cache_rows=tab.cache_rows, gather_threads=tab.gather_threads)
    table_optimizer = TableOptimizer(
        tables, update=tab_opt.update, lr_mult=tab_opt.lr_mult,
        weight_decay=tab_opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps,
        kernel=tab_opt.kernel,
        dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
        host=host, partition=tab.partition, overlap=tab.overlap,
        state_device=str(device()) if tab_opt.device == "accelerator" else "cpu")
    norms = GradNorms()
    _include_tables_in_grad_norm(optimizer, table_optimizer, norms)
    return engine, table_optimizer, norms


def clip_coefficient(norms: GradNorms, clip_grad: float) -> float:
    """The factor DeepSpeed applied to the backbone grads; the tables get the same."""
    if clip_grad <= 0 or norms.total <= clip_grad:
        return 1.0
    return clip_grad / (norms.total + 1e-6)
