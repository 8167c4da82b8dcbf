"""The megatron <-> HF name map on its own: layouts invert, qkv is split by kv group,
config.json round-trips the recipe. (Parity with the real model is in test_hf.py.)"""

import pytest
import torch

from support.processes import ROOT

from megatron_stem.config import ModelConfig, RopeScalingConfig
from megatron_stem.runtime.errors import UserError
from megatron_stem.hf import names

SHAPES = {
    "mha": dict(num_attention_heads=4, num_query_groups=None),
    "gqa": dict(num_attention_heads=4, num_query_groups=2),
    "mqa": dict(num_attention_heads=4, num_query_groups=1),
}


def model(attention="gqa", **fields) -> ModelConfig:
    base = dict(hidden_size=32, num_layers=4, ffn_hidden_size=48, vocab_size=200,
                seq_length=16, stem_layers="1/2", **SHAPES[attention])
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("attention", list(SHAPES))
@pytest.mark.parametrize("untie", [True, False])
def test_every_layout_inverts_exactly(attention, untie):
    m = model(attention, untie_embeddings=untie)
    maps = names.tensor_map(m)
    hf_names = [n for t in maps for n in t.hf]
    assert len(hf_names) == len(set(hf_names))
    assert ("lm_head.weight" in hf_names) == untie
    for t in maps:
        tensor = torch.randn(t.megatron_shape)
        if t.megatron.startswith(("embedding", "output_layer")):
            tensor[m.vocab_size:] = 0  # padding rows are not carried by HF
        parts = t.to_hf(tensor)
        assert [tuple(p.shape) for p in parts] == list(t.hf_shapes), t.megatron
        assert torch.equal(t.to_megatron([p.contiguous() for p in parts]), tensor), t.megatron


@pytest.mark.parametrize("attention", list(SHAPES))
def test_qkv_rows_follow_megatron_grouping(attention):
    """Megatron stacks, per kv group: the group's q heads, then its k head, then its v head.
    HF query head h must be served by kv head h // (heads / groups)."""
    m = model(attention)
    heads, groups, head_dim = m.num_attention_heads, m.kv_heads, 32 // 4
    per_group = heads // groups
    rows = []  # label each megatron row with (kind, head)
    for g in range(groups):
        rows += [("q", g * per_group + j) for j in range(per_group) for _ in range(head_dim)]
        rows += [("k", g)] * head_dim + [("v", g)] * head_dim
    code = {("q", h): h for h in range(heads)}
    code.update({("k", g): 100 + g for g in range(groups)})
    code.update({("v", g): 200 + g for g in range(groups)})
    qkv = torch.tensor([float(code[r]) for r in rows])[:, None].expand(-1, 32).contiguous()
    (t,) = [t for t in names.tensor_map(m) if t.megatron.endswith("layers.0.self_attention."
                                                                     "linear_qkv.weight")]
    q, k, v = t.to_hf(qkv)
    assert q[::head_dim, 0].tolist() == list(range(heads))
    assert k[::head_dim, 0].tolist() == [100 + g for g in range(groups)]
    assert v[::head_dim, 0].tolist() == [200 + g for g in range(groups)]


def test_stem_and_dense_layers_get_their_own_tensors():
    hf = {n for t in names.tensor_map(model(stem_layers=[2])) for n in t.hf}
    assert "model.layers.2.mlp.table.weight" in hf and "model.layers.2.mlp.up_proj.weight" not in hf
    assert "model.layers.1.mlp.up_proj.weight" in hf and "model.layers.1.mlp.table.weight" not in hf


@pytest.mark.parametrize("fields", [
    dict(stem_layers="1/2"), dict(stem_layers=[3, 1]), dict(stem_layers="none"),
    dict(untie_embeddings=False, rotary_base=10000.0), dict(num_query_groups=None),
    dict(make_vocab_size_divisible_by=64, init_std=0.01, norm_eps=1e-6),
])
def test_config_json_gives_back_the_exact_model_config(fields):
    m = model(**fields)
    assert names.model_config(names.hf_config(m, "float32")) == m


def test_config_json_without_the_megatron_block_still_imports():
    """A config written by transformers itself (no `megatron_stem` extras)."""
    hf = names.hf_config(model(stem_layers="1/2"), "float32")
    del hf[names.MEGATRON_KEY]
    assert names.model_config(hf).stem_layer_indices == [1, 3]


def test_foreign_or_contradictory_config_json_is_refused():
    hf = names.hf_config(model(), "float32")
    with pytest.raises(UserError, match="model_type is 'gpt2'; only 'megatron_stem'"):
        names.model_config({**hf, "model_type": "gpt2"})
    with pytest.raises(UserError, match="disagrees with stem_layers"):  # a Llama is dense
        names.model_config({**hf, "model_type": "llama"})
    with pytest.raises(UserError, match="missing intermediate_size"):
        names.model_config({k: v for k, v in hf.items() if k != "intermediate_size"})
    with pytest.raises(UserError, match="disagrees with stem_layers"):
        names.model_config({**hf, "stem_layers": [1, 2]})


LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


@pytest.mark.parametrize("scaling", [None, LLAMA3])
@pytest.mark.parametrize("untie", [True, False])
def test_a_dense_model_is_a_plain_llama_and_comes_back_exactly(scaling, untie):
    m = model(stem_layers="none", untie_embeddings=untie,
              rope_scaling=RopeScalingConfig(**scaling) if scaling else None)
    hf = names.hf_config(m, "bfloat16")
    assert (hf["model_type"], hf["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert "auto_map" not in hf and not any(k.startswith("stem_") for k in hf)
    assert hf["rope_scaling"] == ({"rope_type": "llama3", **scaling} if scaling else None)
    assert names.model_config(hf) == m
    del hf[names.MEGATRON_KEY]  # as a Llama from elsewhere says it
    assert names.model_config(hf) == m


HUB_LLAMA = {  # Llama-3.2-1B's config.json, as the hub has it
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}


def test_llama_3_2_1b_config_gives_the_paper_backbone_tied_with_llama3_rope():
    m = names.model_config(HUB_LLAMA)
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.kv_heads, m.ffn_hidden_size,
            m.vocab_size, m.rotary_base) == (2048, 16, 32, 8, 8192, 128256, 500000.0)
    assert not m.untie_embeddings and not m.is_stem
    assert m.rope_scaling == RopeScalingConfig(**LLAMA3)
    # transformers 5 writes the same RoPE as `rope_parameters`, theta inside.
    v5 = {k: v for k, v in HUB_LLAMA.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**HUB_LLAMA["rope_scaling"], "rope_theta": 500000.0}
    assert names.model_config(v5) == m


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "RoPE scaling of type 'yarn' is not supported \\(only 'llama3'\\)"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "type 'linear' is not supported"),
    ({"rope_scaling": {**HUB_LLAMA["rope_scaling"], "factor": 0.5}},
     "rope_scaling.factor: must be >= 1"),
    ({"attention_bias": True}, "attention_bias is True; only False imports"),
    ({"mlp_bias": True}, "mlp_bias is True; only False imports"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; only 'silu' imports"),
    ({"rope_theta": 10000.5}, "rope_theta 10000.5 is not an integer"),
    ({"head_dim": 128}, "head_dim x num_attention_heads must equal hidden_size"),
])
def test_a_llama_this_model_cannot_be_is_refused_in_one_line(change, message):
    with pytest.raises(UserError, match=message) as caught:
        names.model_config({**HUB_LLAMA, **change}, "llama/config.json")
    assert str(caught.value).startswith("llama/config.json: ") and "\n" not in str(caught.value)


def test_the_llama_recipe_is_llama_3_2_1b_as_imported():
    """recipes/dense_1b_from_llama.yaml trains the import of Llama-3.2-1B: the same
    parameter shapes (which init_from checks) and the same RoPE (which it cannot)."""
    from megatron_stem.checkpoint import parameter_shape
    from megatron_stem.config import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "dense_1b_from_llama.yaml").model
    imported = names.model_config(HUB_LLAMA)
    assert parameter_shape(recipe) == parameter_shape(imported)
    assert (recipe.rotary_base, recipe.rope_scaling) == (imported.rotary_base,
                                                         imported.rope_scaling)
