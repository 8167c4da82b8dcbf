"""DeepSpeed for the dense parameters, our table optimizer for the STEM tables.

The DeepSpeed engine owns every parameter but the tables: ZeRO-1/2 partitions their
optimizer states (and, at stage 2, gradients) over data parallel, optionally offloaded to
CPU. The tables are trained by `TableOptimizer` (tables/). Gradients are clipped
by one global norm over both or by one norm each (`optimizer.clip_tables`), and the order
of a step's update is written once (training/update.py). Host-resident tables (`tables.placement: host`) stay out of the
engine's reach and get a `HostTableStore`.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps

from megatron_stem.config import Recipe, TableLayout
from megatron_stem.model.table import StemTable
from megatron_stem.runtime import jit_ops
from megatron_stem.runtime.parallel import device
from megatron_stem.tables.host_memory import check_table_memory
from megatron_stem.tables.host_tables import HostTableStore
from megatron_stem.tables.optimizer import TableOptimizer
from megatron_stem.training.deepspeed_setup import (
    MegatronMpu,
    deepspeed_config,
    dense_optimizer,
    zero_optimizer_for_fp32_grads,
)
from megatron_stem.training.update import Update


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


def build_engine(model: torch.nn.Module, recipe: Recipe):
    """Wrap `model` in a DeepSpeed engine; returns (engine, table optimizer, the step's
    update: training/update.py)."""
    jit_ops.start_deepspeed(cpu_adam=recipe.optimizer.offload)  # the tables load theirs
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
    with _out_of_module(host_tables), zero_optimizer_for_fp32_grads():
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=dense_optimizer(recipe, decay, no_decay),
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
