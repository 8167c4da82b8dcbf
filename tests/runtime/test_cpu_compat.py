"""The CPU runtime layer: what it patches behaves like the CUDA original would."""

import pytest
import torch
from megatron.core.tensor_parallel import random as mpu_random

from megatron_stem.runtime import cpu_compat
from megatron_stem.config import ModelConfig, ParallelConfig
from megatron_stem.model import build_model
from megatron_stem.model.attention import SDPAttention
from workers.common import tiny_model


def test_apply_patches_cuda_queries(world1):
    assert cpu_compat.needed()
    cpu_compat.apply()  # idempotent
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()


def test_cuda_literals_are_redirected_inside_the_mode_only():
    with cpu_compat.CudaToCpuMode():
        assert torch.zeros(3, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"


def test_rng_tracker_forks_an_independent_reproducible_stream():
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("a", 5)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork("a"):
        second = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))  # stream continued
    # Activation recompute saves and restores tracker states: replay gives the same draw.
    saved = tracker.get_states()
    with tracker.fork("a"):
        x = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), x)


def test_model_parallel_seed_installs_the_tracker(world1):
    assert isinstance(mpu_random.get_cuda_rng_tracker(), cpu_compat.CpuRNGStatesTracker)


def test_sdpa_attention_matches_megatron_reference(world1):
    cfg = ModelConfig(hidden_size=64, num_layers=1, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, vocab_size=300, seq_length=16)
    attention = build_model(cfg, ParallelConfig()).decoder.layers[0].self_attention
    core = attention.core_attention
    assert isinstance(core, SDPAttention)
    q = torch.randn(16, 2, 4, 16)
    k, v = torch.randn(16, 2, 2, 16), torch.randn(16, 2, 2, 16)
    causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    reference = super(SDPAttention, core).forward(q, k, v, causal)
    torch.testing.assert_close(core(q, k, v, None), reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tracker_path", [False, True], ids=["cpu_init", "tracker_init"])
def test_every_build_starts_from_the_seeds_weights(world1, monkeypatch, tracker_path):
    """Two builds in one process start from the same weights. `tracker_init` is the GPU's
    path (megatron draws each weight inside the RNG tracker's fork, which the default
    generator's seed does not reset) taken on CPU, so this fails here where a GPU would."""
    if tracker_path:
        overrides = cpu_compat.transformer_config_overrides
        monkeypatch.setattr(cpu_compat, "transformer_config_overrides",
                            lambda: {**overrides(), "use_cpu_initialization": False})
    cfg = tiny_model("1/2")
    first = build_model(cfg, ParallelConfig(), seed=7).state_dict()
    torch.rand(5)  # whatever runs between two builds
    second = build_model(cfg, ParallelConfig(), seed=7).state_dict()
    other = build_model(cfg, ParallelConfig(), seed=8).state_dict()
    weights = [name for name, value in first.items()
               if torch.is_tensor(value) and value.is_floating_point() and value.dim() == 2]
    assert any(".mlp.table." in name for name in weights)
    for name in weights:
        assert torch.equal(first[name], second[name]), name
        assert not torch.equal(first[name], other[name]), name
