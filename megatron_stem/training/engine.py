"""DeepSpeed for the dense parameters, our table optimizer for the STEM tables.

The DeepSpeed engine owns every parameter but the tables: ZeRO-1/2 partitions their
optimizer states (and, at stage 2, gradients) over data parallel, optionally offloaded to
CPU. The tables are trained by `TableOptimizer` (training/tables/). Gradients are clipped
by one global norm over both or by one norm each (`optimizer.clip_tables`), and the order
of a step's update is written once (training/update.py). Host-resident tables (`tables.placement: host`) stay out of the
engine's reach and get a `HostTableStore`.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps

from megatron_stem import ops
from megatron_stem.accounting import account
from megatron_stem.config import Recipe
from megatron_stem.errors import ConfigError
from megatron_stem.model.table import StemTable
from megatron_stem.parallel import device, local_world_size
from megatron_stem.training.host_tables import HostTableStore
from megatron_stem.training.tables.layout import TableLayout
from megatron_stem.training.tables.optimizer import TableOptimizer
from megatron_stem.training.tables.partition import cpu_state_bytes
from megatron_stem.training.update import Update


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


def split_parameters(model: torch.nn.Module, decay_norms: bool = False):
    """(decayed dense, undecayed dense, tables as (name, param)) for the optimizers. The
    norm gains are undecayed (Megatron and Llama practice) unless `decay_norms` (the
    official STEM code decays every parameter)."""
    decay, no_decay, tables = [], [], []
    for name, p in model.named_parameters():
        if getattr(p, "stem_table", False):
            tables.append((name, p))
        elif p.ndim < 2 and not decay_norms:
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


def _dense_optimizer(recipe: Recipe, decay, no_decay):
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
def _zero_optimizer_for_fp32_grads():
    """ZeRO's optimizer for bf16 parameters with fp32 gradient accumulation at stage 1.

    For that combination DeepSpeed 0.19 builds its `BF16_Optimizer`, which keeps a full
    fp32 gradient on every rank, all-reduces it after the backward (never overlapped with
    it) and computes the norm in a module function the tables cannot join. Its ZeRO-1/2
    optimizer (`DeepSpeedZeroOptimizer`) does fp32 accumulation too (`grad_accum` per
    parameter, reduced in fp32 at the boundary, overlappable with the last backward) and
    is the one the tables' norm hook and checkpoints are written for (training/update.py,
    training/state.py). DeepSpeed picks it for this combination only with offload, so the
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
    """Wrap `model` in a DeepSpeed engine; returns (engine, table optimizer, the step's
    update: training/update.py)."""
    ops.start_deepspeed(cpu_adam=recipe.optimizer.offload)  # the tables load theirs
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    decay, no_decay, tables = split_parameters(model, recipe.optimizer.decay_norms)
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
    with _out_of_module(host_tables), _zero_optimizer_for_fp32_grads():
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
        tables, TableLayout.of(recipe), lr_mult=tab_opt.lr_mult,
        weight_decay=tab_opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps,
        dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
        host=host)
    return engine, table_optimizer, Update(engine, table_optimizer, opt.clip_grad,
                                           opt.clip_tables)
