"""Whether a node's CPU memory holds the tables' optimizer state before any rank allocates
it: the kernel's OOM killer would otherwise take down a rank midway through start-up."""

from __future__ import annotations

from megatron_stem.runtime.errors import ConfigError
from megatron_stem.runtime.parallel import local_world_size
from megatron_stem.tables.partition import cpu_state_bytes


def available_host_bytes() -> int | None:
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
    available = available_host_bytes()
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
