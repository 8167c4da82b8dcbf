from megatron_stem.model.accounting import account, roi, training_flops_per_token
from megatron_stem.config import ModelConfig, ParallelConfig, load_recipe
from megatron_stem.model import build_model
from workers.common import tiny_model

from support.processes import ROOT


def test_paper_1b_numbers():
    model = load_recipe(ROOT / "recipes" / "stem_1b.yaml").model
    assert model.stem_layer_indices == [1, 4, 7, 10, 13]
    acc = account(model)
    assert acc.dense_params == 1_498_482_688  # 1.4985B, the dense baseline
    assert round(acc.total_params / 1e9, 2) == 6.75
    assert acc.total_params == 1_498_482_688 + 5 * 128_256 * 8_192
    assert round(acc.active_params / 1e9, 2) == 1.41
    assert acc.active_params == 1_498_482_688 - 5 * 2048 * 8192
    assert acc.flops_per_token == 2 * acc.active_params
    dense = account(load_recipe(ROOT / "recipes" / "dense_1b.yaml").model)
    assert dense.total_params == dense.active_params == acc.dense_params


def test_mfu_flops_by_the_fields_count_by_hand():
    """6 x the non-embedding parameters (the output layer in, the input embedding out) + 12
    x layers x hidden x sequence, counted from the Llama-3.2-1B shape by hand."""
    d, kv, ff, vocab, layers, seq = 2048, 512, 8192, 128256, 16, 2048
    layer = d * (d + 2 * kv + d) + 3 * d * ff + 2 * d  # q, k, v, o; gate, up, down; norms
    dense = layers * layer + d + vocab * d  # + final norm + output layer
    attention = 12 * layers * d * seq
    dense_1b = load_recipe(ROOT / "recipes" / "dense_1b.yaml").model
    assert training_flops_per_token(dense_1b) == 6 * dense + attention == 8_220_192_768
    assert abs(training_flops_per_token(dense_1b) / 8.22e9 - 1) < 0.01
    # STEM: five layers' up-projections are lookups; the tables are not counted
    stem_1b = load_recipe(ROOT / "recipes" / "stem_1b.yaml").model
    assert training_flops_per_token(stem_1b) == 6 * (dense - 5 * d * ff) + attention
    # the paper's count (2 x active, forward) keeps the input embedding
    assert account(dense_1b).flops_per_token == 2 * (dense + vocab * d)


def test_stored_params_equal_a_built_model(world1):
    for placement in ("none", "1/2", "full"):
        cfg = ModelConfig(**{**tiny_model().__dict__, "stem_layers": placement,
                             "vocab_size": 384})  # no padding, so counts compare exactly
        built = sum(p.numel() for p in build_model(cfg, ParallelConfig()).parameters())
        assert account(cfg).stored_params == built, placement


def test_roi_is_relative_accuracy_per_flop():
    assert roi(54.20, 2.0, 49.72, 3.0) == (54.20 / 2.0) / (49.72 / 3.0)
    assert roi(50.0, 1.0, 50.0, 1.0) == 1.0
