"""The process groups `init_distributed` builds.

megatron-core's `initialize_model_parallel` also makes gloo copies of the data-parallel
groups unless told not to. They serve only megatron's distributed optimizer (and Muon);
here DeepSpeed optimizes the dense parameters. On a GPU run every other group is NCCL, so
those would be the run's only gloo groups, across nodes, each needing a routable network
interface. Whether megatron makes them does not depend on the device (it asks for
`backend="gloo"` explicitly), so a CPU world shows it.
"""

import pytest
from megatron.core import parallel_state as ps


@pytest.mark.parametrize("getter", [
    lambda: ps.get_data_parallel_group_gloo(),
    lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True),
    lambda: ps.get_expert_data_parallel_group_gloo(),
], ids=["dp", "dp with cp", "expert dp"])
def test_megatron_makes_no_gloo_groups(world1, getter):
    assert ps.get_data_parallel_group() is not None
    with pytest.raises(AssertionError, match="group-gloo .*is not initialized"):
        getter()
