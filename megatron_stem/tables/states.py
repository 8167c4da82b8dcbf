"""The tables' optimizer states in a checkpoint: in one row order for every layout.

Every layout saves its states in the positions of the shards' walk (shards.py,
`ROW_ORDER`), so a checkpoint resumes at any data-parallel size, placement or partition:
a row shard's states are a contiguous range of that order already (saved as they are),
whole tables (kept by table row) are reordered into it. `checkpoint/optimizer_io.py` writes and
reads them as megatron dist-checkpoint shards.
"""

from __future__ import annotations

import torch


def checkpoint_states(partition, tables) -> dict[str, dict[str, torch.Tensor]]:
    """{table name: {"fp32_param", "exp_avg", "exp_avg_sq"}}: this rank's rows of the
    states (a shard's, `partition.shard`) in the checkpoint's row order: the live tensors
    where they are in that order already, copies where not (a shard's rows of a table that
    is its own master, and whole tables)."""
    return {t.name: {key: live if rows is None else live[rows]
                     for key, (live, rows) in partition.checkpoint_rows(t).items()}
            for t in tables}


def load_states(partition, tables, states: dict[str, dict[str, torch.Tensor]],
                counters) -> None:
    """Take `states` (shaped like `checkpoint_states`; loading into those tensors
    themselves copies nothing) into the live ones, then publish every master to the
    holders of its table (a shared copy's ranks: one writes)."""
    for t in tables:
        if partition.writes_on_load:
            for key, (live, rows) in partition.checkpoint_rows(t).items():
                loaded = states[t.name][key]
                if rows is not None:
                    live.index_copy_(0, rows, loaded.to(live.device))
                elif loaded.data_ptr() != live.data_ptr():
                    live.copy_(loaded)
        partition.publish(t, None, t.master if t.separate else None, counters)
    if tables:
        partition.barrier()
