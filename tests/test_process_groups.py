"""The process groups `init_distributed` builds.

megatron-core's `initialize_model_parallel` also makes gloo copies of the data-parallel
groups unless told not to. They serve only megatron's distributed optimizer (and Muon);
here DeepSpeed optimizes the dense parameters. On a GPU run every other group is NCCL, so
those would be the run's only gloo groups, across nodes, each needing a routable network
interface. Whether megatron asks for one does not depend on the device (it passes
`backend="gloo"` explicitly), so the requests are counted here, on CPU.
"""

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem.config import ParallelConfig
from megatron_stem.parallel import destroy_distributed, init_distributed


def test_no_gloo_groups_are_asked_for(monkeypatch):
    backends = []
    new_group = dist.new_group

    def recording(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    init_distributed(ParallelConfig())
    try:
        assert backends and "gloo" not in backends  # groups made, all on the default backend
        with pytest.raises(AssertionError, match="data parallel group-gloo is not initialized"):
            ps.get_data_parallel_group_gloo()
    finally:
        destroy_distributed()
