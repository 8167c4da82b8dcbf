"""The optimizer states in a checkpoint (`iter_N/optim/`): the dense parameters' (DeepSpeed
ZeRO) and the tables', one megatron dist checkpoint.

Each state is saved as the global tensor of the parameter it belongs to (TP-sliced as the
parameter, whatever the DP size), so a checkpoint saved at one TP/DP layout or table
partition resumes at any other. Every rank writes and reads only what it holds: its ZeRO
partition of the dense states (`zero_state`: boxes of those tensors, views into the live
partition) and its rows of the tables' states (`tables.partition: sharded`; whole tables,
replicated over DP, are written by one rank and read by one, which sends them to the
others: `strategy.py`). Loading fills the live states in place: no gather, no copy of a
whole state on any rank.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from megatron_stem.checkpoint.model_io import load_sharded, save_sharded
from megatron_stem.checkpoint.shard_writes import ShardWrites
from megatron_stem.checkpoint.zero_state import link_states, partition_state
from megatron_stem.tables.adam import replay_deepspeed_steps
from megatron_stem.tables.optimizer import TableOptimizer

OPTIM = "optim"


def _param_shardings(model) -> dict[int, ShardedTensor | ShardedTensorFactory]:
    return {id(sh.data): sh for sh in nested_values(model.sharded_state_dict())
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}


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


def _sharded_state(model, tables: TableOptimizer, table_states: dict) -> dict:
    """{name: sharded tensor} of every optimizer state this rank holds: the tables'
    (`table_states`, shaped like `tables.state_tensors()`) and its ZeRO partition of the
    dense parameters'. The same global tensors whatever the layout (TP, DP, table
    partition), so any layout loads what any other saved."""
    shardings = _param_shardings(model)
    shard = tables.shard()
    out, dense = {}, []
    for name, param in model.named_parameters():
        sh = shardings[id(param)]
        if name not in table_states:
            dense.append((param, sh))
            continue
        for key, tensor in table_states[name].items():
            prefix = f"optimizer.{key}"
            out[f"{key}.{sh.key}"] = _row_shard(sh, tensor, prefix, shard) \
                if shard is not None else make_sharded_optimizer_tensor(sh, tensor, prefix)
    return out | partition_state(dense)


def save_optimizers(model, zero_optimizer, tables: TableOptimizer, folder: Path,
                    writes: ShardWrites) -> None:
    """The dense and table optimizer states into `folder`, planned into the save's
    `writes` (`model_io.save_sharded`)."""
    link_states(zero_optimizer)
    (folder / OPTIM).mkdir(exist_ok=True)
    save_sharded(_sharded_state(model, tables, tables.state_tensors()), folder / OPTIM, writes)


def _create_dense_states(zero_optimizer, step: int) -> None:
    """Materialize the inner optimizer's (lazily created) per-partition Adam states, with
    the resumed step count for bias correction, for the load to fill in place. DeepSpeed's
    CPU Adam (ZeRO-Offload) also gets its kernel's running beta powers back."""
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
    """Restore the dense and table optimizer states of `ckpt` into the live ones: each rank
    reads its ZeRO partition of the dense states and its part of the tables' into them.
    The dense parameters are then set from their fp32 masters, as DeepSpeed does after
    every step (a resume reads no dense weight: `model_io.load_model`'s `dense`)."""
    table_states = tables.state_tensors()
    _create_dense_states(zero_optimizer, step)
    link_states(zero_optimizer)
    state = _sharded_state(model, tables, table_states)
    targets = {name: sh.data for name, sh in state.items()}
    loaded = load_sharded(state, ckpt / OPTIM)
    for name, target in targets.items():  # what came from another rank's read: copied in
        if loaded[name].data_ptr() != target.data_ptr():
            target.copy_(loaded[name])
    zero_optimizer.update_lp_params()
    tables.load_state_tensors(table_states, step)
