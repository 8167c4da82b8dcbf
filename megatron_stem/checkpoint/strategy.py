"""How megatron writes and reads a dist checkpoint here: its torch_dist format with the
writes and the reads spread over the data-parallel replicas (each byte written once and
read once; what a rank needs from another's reads comes over the network), a fixed number
of files per rank, and its write results kept in this process (megatron would start a
`spawn` process for them)."""

from __future__ import annotations

import queue

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from megatron_stem.runtime.mcore_versions import SAVE_THREADS


def parallel_save_strategy() -> FullyParallelSaveStrategyWrapper | TorchDistSaveShardedStrategy:
    """Megatron's torch_dist save with the writes spread over the data-parallel replicas:
    each tensor shard replicated over DP is written by one of them, chosen to balance the
    bytes per rank (only metadata is exchanged). Without it DP rank 0 writes them all. Each
    rank writes `mcore_versions.SAVE_THREADS` files, whichever megatron-core writes them."""
    _keep_write_results_in_process()
    files = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=SAVE_THREADS)
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return files
    return FullyParallelSaveStrategyWrapper(files, ps.get_data_parallel_group())


def parallel_load_strategy() -> FullyParallelLoadStrategyWrapper | TorchDistLoadShardedStrategy:
    """Megatron's torch_dist load with the reads spread over the data-parallel replicas:
    each tensor shard that several replicas need is read by one of them (balancing the bytes
    per rank) and broadcast to the others; a shard only one rank needs (its ZeRO partition
    of the optimizer states, its rows of the tables' states) is read by that rank alone.
    Without it every replica reads every replicated tensor."""
    files = TorchDistLoadShardedStrategy()
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return files
    return FullyParallelLoadStrategyWrapper(files, ps.get_data_parallel_group())


def _keep_write_results_in_process() -> None:
    """megatron's file writer returns its results through a queue made for asynchronous
    saves: a multiprocessing manager started with `spawn`, a new interpreter that imports
    the training script again (torch, megatron, DeepSpeed: ~5 s of CPU per rank, and 40%
    of a small test run) at a rank's first save. Our saves are synchronous: the results
    are put and read in this process, so a plain queue does."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
