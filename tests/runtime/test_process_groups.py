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


def test_the_recipes_timeout_is_the_process_groups(monkeypatch, toy_data, hf_tokenizer,
                                                    in_process_trainer):
    """`parallel.timeout_minutes` (validated: 1 minute to a day) reaches
    `init_distributed`, which gives it to torch's process groups."""
    from megatron_stem.config import load_recipe
    from megatron_stem.runtime.errors import ConfigError
    from megatron_stem.training import loop
    from support.processes import ROOT

    tiny = ROOT / "recipes" / "tiny_cpu.yaml"
    given = {}

    def init_distributed(parallel, seed, timeout_minutes):
        given["minutes"] = timeout_minutes
        raise KeyboardInterrupt  # nothing further: no process group is made here

    monkeypatch.setattr(loop, "init_distributed", init_distributed)
    recipe = load_recipe(tiny, [f"data.prefixes=[{toy_data}]", "model.vocab_size=640",
                                "data.tokenizer_type=huggingface",
                                f"data.tokenizer_model={hf_tokenizer}",
                                "parallel.timeout_minutes=7"])
    with pytest.raises(KeyboardInterrupt):
        loop.run(recipe)
    assert given == {"minutes": 7}
    assert load_recipe(tiny).parallel.timeout_minutes == 30
    with pytest.raises(ConfigError, match=r"parallel\.timeout_minutes=0: .*must be >= 1"):
        load_recipe(tiny, ["parallel.timeout_minutes=0"])
