"""The optimizer states in a checkpoint (`iter_N/optim/`): the dense parameters' (DeepSpeed
ZeRO) and the tables'.

They are written as a megatron dist checkpoint sharded exactly like the model
parameters they belong to (TP-sliced, replicated over DP), so a checkpoint saved at one
TP/DP layout resumes at any other: DeepSpeed's ZeRO partitions are assembled per parameter
with its `safe_get_full_*` API on save and scattered back with `safe_set_full_*` on load.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from megatron_stem.checkpoint.model_io import save_sharded
from megatron_stem.runtime.mcore_versions import check_readable
from megatron_stem.tables.adam import replay_deepspeed_steps
from megatron_stem.tables.optimizer import TableOptimizer

OPTIM = "optim"
STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")
# A resume holds the full fp32 states of this many bytes of dense parameters at a time
# (18 GB for all of the 1B backbone at once, on every rank).
DENSE_LOAD_BATCH_BYTES = 512 << 20


def _param_shardings(model) -> dict[int, ShardedTensor | ShardedTensorFactory]:
    return {id(sh.data): sh for sh in nested_values(model.sharded_state_dict())
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}


def _dense_states(param) -> dict[str, torch.Tensor]:
    return {"fp32_param": safe_get_full_fp32_param(param),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}


def _row_shard(sh: ShardedTensor, tensor: torch.Tensor, prefix: str,
               shard: tuple[int, int, int, int]) -> ShardedTensor:
    """The optimizer state of a table's row shard (`tables.partition: sharded`): rows
    [first, first + rows) of the table's TP slice `sh`, held by this rank alone."""
    first, rows, count, _ = shard
    return replace(sh, key=f"{prefix}.{sh.key}", data=tensor, dtype=tensor.dtype,
                   local_shape=(rows, *sh.local_shape[1:]),
                   global_offset=(sh.global_offset[0] + first, *sh.global_offset[1:]),
                   axis_fragmentations=(count, *sh.axis_fragmentations[1:]),
                   replica_id=(0,) * len(sh.replica_id) if isinstance(sh.replica_id, tuple)
                   else 0)


def _optimizer_sharded_state(model, tables: TableOptimizer, states_of,
                             names: set[str] | None = None) -> dict:
    """{`<state>.<param key>`: sharded tensor} for every parameter (of `names`, default
    all); `states_of(name, p)` returns the parameter's three state tensors. The same global
    tensors whatever the layout (TP, DP, table partition), so any layout loads what any
    other saved."""
    shardings = _param_shardings(model)
    table_names, shard = set(tables.state_tensors()), tables.shard()
    out = {}
    for name, param in model.named_parameters():
        if names is not None and name not in names:
            continue
        sh = shardings[id(param)]
        for key, tensor in states_of(name, param).items():
            prefix = f"optimizer.{key}"
            out[f"{key}.{sh.key}"] = _row_shard(sh, tensor, prefix, shard) \
                if name in table_names and shard is not None \
                else make_sharded_optimizer_tensor(sh, tensor, prefix)
    return out


def _link_optimizer_states(zero_optimizer) -> None:
    """Point every parameter at its slice of the optimizer states.

    DeepSpeed 0.19 links them once, right after the first param group's first step, when
    later groups (our no-weight-decay norms) have no state yet: their `safe_get_full_*`
    would fail. Linking all groups again once every group has state fixes that.
    """
    for i, _ in enumerate(zero_optimizer.optimizer.param_groups):
        lazy_init_hp_params_optimizer_state(zero_optimizer.bit16_groups[i],
                                            zero_optimizer.single_partition_of_fp32_groups[i],
                                            zero_optimizer.optimizer.state)


def save_optimizers(model, zero_optimizer, tables: TableOptimizer, folder: Path,
                    background=None) -> None:
    """The dense and table optimizer states into `folder` (`background`: planned and
    copied now, written by it, `model_io.save_sharded`)."""
    table_states = tables.state_tensors()
    _link_optimizer_states(zero_optimizer)

    def states_of(name, param):
        if name in table_states:
            return table_states[name]
        if param.device.type != "cpu":  # gather to CPU once here, not inside the writer
            return {k: v.cpu() for k, v in _dense_states(param).items()}
        return _dense_states(param)

    (folder / OPTIM).mkdir(exist_ok=True)
    save_sharded(_optimizer_sharded_state(model, tables, states_of), folder / OPTIM,
                 background)


def _create_dense_states(zero_optimizer, step: int) -> None:
    """Materialize the inner optimizer's (lazily created) per-partition Adam states, with
    the resumed step count for bias correction, so `safe_set_full_*` has tensors to fill.
    DeepSpeed's CPU Adam (ZeRO-Offload) also gets its kernel's running beta powers back."""
    inner = zero_optimizer.optimizer
    if type(inner).__name__ == "DeepSpeedCPUAdam":
        group = inner.param_groups[0]
        replay_deepspeed_steps(inner.ds_opt_adam, inner.opt_id, 0, step, group["betas"],
                               group["eps"])
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if isinstance(state.get("step"), int) or type(inner).__name__ == "DeepSpeedCPUAdam":
                state["step"] = step
            else:  # torch AdamW keeps a float tensor (on the param's device when fused)
                state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                             device=p.device if group.get("fused") else "cpu")
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)


def load_optimizers(model, zero_optimizer, tables: TableOptimizer, ckpt: Path,
                    step: int) -> None:
    """Restore the dense and table optimizer states of `ckpt` with bounded memory: the
    tables' (most of it) straight into the live tensors, each rank its own part; the dense
    parameters' full states, which ZeRO then slices, a batch of parameters at a time."""
    check_readable(ckpt / OPTIM)
    table_states = tables.state_tensors()
    _create_dense_states(zero_optimizer, step)
    _link_optimizer_states(zero_optimizer)
    if table_states:
        dist_checkpointing.load(_optimizer_sharded_state(
            model, tables, lambda name, _: table_states[name], set(table_states)),
            str(ckpt / OPTIM))
    dense = [(n, p) for n, p in model.named_parameters() if n not in table_states]
    shardings = _param_shardings(model)
    for batch in _batches(dense, DENSE_LOAD_BATCH_BYTES):
        loaded = dist_checkpointing.load(_optimizer_sharded_state(
            model, tables, lambda _, p: {k: torch.empty(p.shape) for k in STATE_KEYS},
            {n for n, _ in batch}), str(ckpt / OPTIM))
        for _, param in batch:
            key = shardings[id(param)].key
            safe_set_full_fp32_param(param, loaded[f"fp32_param.{key}"].to(param.device))
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(param, loaded[f"{k}.{key}"].to(param.device), k)
    tables.load_state_tensors(table_states, step)


def _batches(named: list, budget: int):
    """`named` (name, param) pairs in runs whose full fp32 states (3 x 4 bytes per
    element) fit `budget` bytes (a larger parameter makes a run of its own)."""
    batch, size = [], 0
    for name, p in named:
        need = 12 * p.numel()
        if batch and size + need > budget:
            yield batch
            batch, size = [], 0
        batch.append((name, p))
        size += need
    if batch:
        yield batch
