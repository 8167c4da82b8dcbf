"""A Hugging Face Llama in and out: tiny random `LlamaForCausalLM`s made here with
transformers (tied and untied embeddings, with Llama 3's RoPE scaling and without) import,
load at TP=1, TP=2 (untied also at PP=2) with transformers' logits, train, and export
back as plain Llamas that transformers loads without remote code.

One torchrun job (`workers/hf_layouts.py`, 2 ranks) loads every import and every trained
checkpoint at each layout; the training runs are `conftest.train`'s.
"""

import json
import os

import pytest
import torch

from support.processes import ROOT, hf_tensors, tool, torchrun
from megatron_stem import checkpoint
from megatron_stem.hf.export import export
from megatron_stem.hf.import_model import import_hf
from workers.common import TINY, hf_shape, tiny_model
from workers.common import hf_tokens as tokens  # what workers/hf_layouts.py runs models on

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.integration  # torchrun and trainer runs

VOCAB = TINY["vocab_size"]
# original_max_position_embeddings 16 with head_dim 16 and theta 1e4: one frequency is
# kept, one interpolated, six stretched 8x; the tokens span 16 positions, so it shows.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
VARIANTS = {"tied_llama3": (True, LLAMA3), "untied": (False, None),
            "tied": (True, None), "untied_llama3": (False, LLAMA3)}
TRAINED = ("tied_llama3", "untied")


def llama(tied: bool, rope_scaling) -> LlamaForCausalLM:
    """A random Llama of the trainer tests' TINY shape, weights large enough that attention
    and RoPE matter to the logits, norms away from 1."""
    config = LlamaConfig(**hf_shape(VOCAB),
                         rope_scaling=dict(rope_scaling) if rope_scaling else None,
                         tie_word_embeddings=tied, initializer_range=0.1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each variant saved by transformers' `save_pretrained` (the tied one in shards of
    at most 100 kB, with an index), its logits, and its import (one through the CLI)."""
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for i, (name, (tied, scaling)) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = llama(tied, scaling)
        model.save_pretrained(root / name, max_shard_size="100KB" if name == "tied" else "5GB")
        if name == "untied":
            assert tool("from_hf")(["--hf", str(root / name), "--save-dir",
                                    str(root / f"{name}_ckpt")]) == 0
            ckpt = checkpoint.resolve(root / f"{name}_ckpt")
        else:
            ckpt = import_hf(root / name, root / f"{name}_ckpt")
        with torch.no_grad():
            logits = model(tokens()).logits
        out[name] = {"dir": root / name, "ckpt": ckpt, "model": model, "logits": logits}
    assert len(list((root / "tied").glob("*.safetensors"))) > 1
    return out


def recipe_overrides(source: dict) -> list[str]:
    """The trainer's model section for an import: its recipe, as a user writes it."""
    m = checkpoint.read_recipe(source["ckpt"]).model
    scaling = m.rope_scaling
    return [f"model.stem_layers={m.stem_layers}",
            f"model.untie_embeddings={str(m.untie_embeddings).lower()}",
            f"model.rotary_base={m.rotary_base}", f"model.norm_eps={m.norm_eps}",
            *([f"model.rope_scaling={{factor: {scaling.factor}, original_max_position_embeddings: "
               f"{scaling.original_max_position_embeddings}}}"] if scaling else []),
            f"train.init_from={source['ckpt']}"]


@pytest.fixture(scope="module")
def trained(sources, train):
    return {name: train(1, *recipe_overrides(sources[name]), name=f"from_{name}")
            for name in TRAINED}


@pytest.fixture(scope="module")
def megatron(sources, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "logits.pt"
    torchrun(2, "hf_layouts.py", "--out", out, "--load",
             *[f"{name}={s['ckpt']}" for name, s in sources.items()],
             *[f"trained_{name}={run['save_dir']}" for name, run in trained.items()])
    return torch.load(out)


# ---------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_imported_llama_gives_transformers_logits_at_tp1_tp2_and_pp2(name, sources,
                                                                         megatron):
    assert torch.equal(megatron["tokens"], tokens())
    tied = VARIANTS[name][0]  # tied embeddings: not at PP=2 on CPU (workers/hf_layouts.py)
    for layout in ("tp1", "tp2") if tied else ("tp1", "tp2", "pp2"):
        torch.testing.assert_close(megatron[f"{name}@{layout}"][..., :VOCAB],
                                   sources[name]["logits"], atol=1e-4, rtol=1e-4)


def test_the_llama3_scaling_changes_the_logits_it_is_checked_against(sources):
    """Without its RoPE scaling the same weights give other logits: the parity above
    holds only because megatron rotates by the scaled frequencies."""
    source = sources["tied_llama3"]
    plain = llama(True, None)
    plain.load_state_dict(source["model"].state_dict())
    with torch.no_grad():
        assert (plain(tokens()).logits - source["logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_import_records_the_llama_as_a_dense_recipe(name, sources):
    tied, scaling = VARIANTS[name]
    m = checkpoint.read_recipe(sources[name]["ckpt"]).model
    assert m.stem_layers == "none" and m.untie_embeddings == (not tied)
    assert (m.rope_scaling is None) == (scaling is None)
    if scaling:
        assert (m.rope_scaling.factor, m.rope_scaling.original_max_position_embeddings) == (8.0, 16)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_untrained_import_exports_back_bit_for_bit(name, sources, tmp_path):
    source = sources[name]
    out = export(source["ckpt"], tmp_path / "hf")
    again, original = hf_tensors(out), hf_tensors(source["dir"])
    assert again.keys() == original.keys()  # a tied Llama has no lm_head.weight
    for key, value in original.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == VARIANTS[name][1]


def test_a_llama_with_another_rope_scaling_is_refused_in_one_line(sources, tmp_path, capsys):
    folder = tmp_path / "yarn"
    sources["untied"]["model"].save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' own progress bar
    assert tool("from_hf")(["--hf", str(folder), "--save-dir", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == (f"error: {folder / 'config.json'}: RoPE scaling of type "
                                       "'yarn' is not supported (only 'llama3')\n")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------
# Train, then export as a plain Llama
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRAINED)
def test_an_import_trains_and_exports_as_a_plain_llama_with_its_logits(name, sources, trained,
                                                                       megatron, tmp_path):
    run = trained[name]
    assert f"initialized from {sources[name]['ckpt']} (weights)" in run["log"]
    assert run["losses"][-1] < run["losses"][0]
    out = tmp_path / "hf"
    assert tool("to_hf")(["--checkpoint", str(run["save_dir"]), "--output", str(out)]) == 0
    assert not list(out.glob("*.py"))  # no model code of ours: transformers' own Llama
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # without trust_remote_code
    original = sources[name]["model"]
    assert type(model) is LlamaForCausalLM
    # No tokenizer shipped, so no special ids (LlamaConfig's defaults would be 1 and 2).
    assert (model.config.bos_token_id, model.config.eos_token_id) == (None, None)
    assert model.config.rope_parameters == original.config.rope_parameters
    tied = VARIANTS[name][0]
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    expected = megatron[f"trained_{name}@tp1"][..., :VOCAB]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(megatron[f"trained_{name}@tp2"][..., :VOCAB], expected,
                               atol=1e-4, rtol=1e-4)
    # The same tensors as the source Llama, moved by training.
    exported, source = hf_tensors(out), hf_tensors(sources[name]["dir"])
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == \
        {k: (v.shape, v.dtype) for k, v in source.items()}
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"],
                           source["model.layers.0.mlp.up_proj.weight"])


# ---------------------------------------------------------------------------------------
# A STEM model keeps its own code, and the same RoPE scaling
# ---------------------------------------------------------------------------------------


def test_a_stem_export_rotates_by_the_same_llama3_frequencies(world1, tmp_path):
    """A STEM model with `rope_scaling` (e.g. one started from an imported Llama) exports
    with the shipped model code, which scales RoPE with the training model's own function."""
    from megatron_stem.config import ParallelConfig, Recipe, RopeScalingConfig
    from megatron_stem.model import build_model

    scaling = RopeScalingConfig(**{k: v for k, v in LLAMA3.items() if k != "rope_type"})
    cfg = tiny_model("1/2", rotary_base=10000.0, rope_scaling=scaling, init_std=0.2)
    net = build_model(cfg, ParallelConfig(), seed=3).eval()
    with checkpoint.Writer(tmp_path / "ckpt", 1, Recipe(model=cfg)) as folder:
        checkpoint.save_model(net, folder)
    out = export(tmp_path / "ckpt", tmp_path / "hf")
    assert (out / "rope_scaling.py").read_text() == \
        (ROOT / "megatron_stem/model/rope_scaling.py").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        expected = net(tokens(), None, None)[..., :VOCAB]
        torch.testing.assert_close(model(tokens()).logits, expected, atol=1e-5, rtol=1e-5)
        model.config.llama3_rope_scaling = None  # the same weights, plain RoPE
        assert (model(tokens()).logits - expected).abs().max() > 1e-2
