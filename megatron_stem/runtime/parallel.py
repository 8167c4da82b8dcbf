"""Process groups: torch.distributed from torchrun/SLURM env, then megatron parallel state."""

from __future__ import annotations

import datetime
import os
import re
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_stem.runtime import cpu_compat
from megatron_stem.runtime.errors import ConfigError, UserError

if TYPE_CHECKING:  # a type only: the runtime sits below the recipes (docs/development.md)
    from megatron_stem.config import ParallelConfig


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def local_world_size() -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else srun's tasks per node."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    tasks = os.environ.get("SLURM_TASKS_PER_NODE", "")  # e.g. "8(x4)": 8 on each of 4
    if "SLURM_PROCID" in os.environ and tasks[:1].isdigit():
        return int(re.match(r"\d+", tasks).group())
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def init_distributed(parallel: ParallelConfig, seed: int = 1234,
                     timeout_minutes: int = 30) -> None:
    """Join (or create) the process group and build TP/PP/DP groups.

    Rank and world size come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from srun
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); a plain `python` run is a world of one.
    NCCL on GPUs, gloo on CPU.
    """
    cpu_compat.apply()
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    # DeepSpeed reads these itself (and tries MPI discovery without them).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    if not dist.is_initialized():
        if world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend="nccl" if torch.cuda.is_available() else "gloo",
            rank=rank, world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes))
    world = dist.get_world_size()
    model_parallel = parallel.tensor_parallel * parallel.pipeline_parallel
    if world % model_parallel:
        raise ConfigError(
            f"parallel: world size {world} is not divisible by tensor_parallel x "
            f"pipeline_parallel = {model_parallel}")
    # No gloo copies of the data-parallel groups (megatron makes them by default): only
    # megatron's own distributed optimizer and Muon use them, and the dense parameters'
    # optimizer here is DeepSpeed's. On GPU nodes they would be gloo groups across nodes,
    # each needing a routable interface (GLOO_SOCKET_IFNAME), for nothing; on CPU every
    # group is gloo already.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        create_gloo_process_groups=False)
    seed_random_streams(seed)


def seed_random_streams(seed: int) -> None:
    """Every stream megatron draws from, set to `seed`'s start: the default generator and
    the RNG tracker's data-, tensor- and expert-parallel states (megatron's seed offsets).

    On a GPU megatron initialises weights inside `get_cuda_rng_tracker().fork()`, which
    `torch.manual_seed` does not touch: a second model built in the same process would
    continue the tracker's stream and start from other weights. `build_model` calls this
    first, so every build starts from its seed's weights on a GPU as on a CPU."""
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.model_parallel_seed(seed)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def on_rank0(fn):
    """`fn()` on global rank 0 only, its failure raised on every rank: a mistake rank 0
    finds (a W&B login, a task that will not load) stops the whole job at once instead of
    leaving the other ranks waiting in their next collective. One broadcast. Returns
    `fn()` on rank 0, None on the others."""
    result, failure = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 (sent to the other ranks, then raised)
            failure = e
    message = [None if failure is None else
               (isinstance(failure, UserError), str(failure))]
    dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    if message[0] is not None:
        user, text = message[0]
        raise (UserError if user else RuntimeError)(text if user else f"rank 0: {text}")
    return result
