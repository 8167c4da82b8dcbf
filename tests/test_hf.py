"""Hugging Face export and import, proven against the megatron model itself.

One torchrun job (`workers/hf_reference.py`, 2 ranks) saves STEM and dense checkpoints at
TP=2 and at PP=2 with their full-vocab logits and greedy decodes, and loads the imports of
two random HF models at both layouts. Everything else runs in this process: export, HF
loading (`trust_remote_code`), generate, round trips, errors, memory, lm-eval.
"""

import glob
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun
from megatron_stem import checkpoint
from megatron_stem.errors import UserError
from megatron_stem.hf.export import export
from megatron_stem.hf.import_ import import_hf
from workers.common import TINY

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_stem.hf.remote.configuration_stem import StemConfig  # noqa: E402
from megatron_stem.hf.remote.modeling_stem import StemForCausalLM  # noqa: E402

VOCAB = TINY["vocab_size"]  # 300 real ids; megatron pads embeddings/logits to 384
CASES = ["stem_tp2", "stem_pp2", "dense_tp2", "dense_pp2"]
HF_SOURCES = {"hf_stem": dict(stem_layers=[1, 3], tie_word_embeddings=False),
              "hf_dense": dict(stem_layers=[], tie_word_embeddings=True)}


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(f))
    return out


def load_hf(folder: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory):
    """Random HF models (STEM untied, dense tied), saved by transformers' own
    `save_pretrained`, with their logits, and their imports as megatron checkpoints."""
    root = tmp_path_factory.mktemp("hf_sources")
    sources = {}
    for i, (name, fields) in enumerate(HF_SOURCES.items()):
        torch.manual_seed(i)
        config = StemConfig(vocab_size=VOCAB, hidden_size=TINY["hidden_size"],
                            intermediate_size=TINY["ffn_hidden_size"],
                            num_hidden_layers=TINY["num_layers"],
                            num_attention_heads=TINY["num_attention_heads"],
                            num_key_value_heads=TINY["num_query_groups"],
                            max_position_embeddings=TINY["seq_length"], rope_theta=10000.0,
                            **fields)
        model = StemForCausalLM(config).eval()
        with torch.no_grad():  # norms away from 1, so a norm mix-up cannot go unnoticed
            for p in model.parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        ckpt = import_hf(root / name, root / f"{name}_ckpt")
        sources[name] = {"dir": root / name, "ckpt": ckpt, "model": model}
    return sources


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, hf_sources):
    out = tmp_path_factory.mktemp("megatron")
    torchrun(2, "hf_reference.py", "--out", out,
             "--load", *[f"{name}={s['ckpt']}" for name, s in hf_sources.items()])
    reference = torch.load(out / "reference.pt")
    reference["root"] = out
    return reference


@pytest.fixture(scope="module")
def exported(megatron, tmp_path_factory):
    root = tmp_path_factory.mktemp("exported")
    # A tiny shard limit, so the multi-shard index path is what gets tested.
    return {case: export(megatron["root"] / case, root / case, max_shard_bytes=100_000)
            for case in CASES}


# ---------------------------------------------------------------------------------------
# Parity with megatron
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_exported_logits_equal_megatron(case, megatron, exported):
    model = load_hf(exported[case])
    assert model.config.stem_layers == ([1, 3] if case.startswith("stem") else [])
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    assert logits.shape[-1] == VOCAB
    torch.testing.assert_close(logits, megatron[case]["logits"][..., :VOCAB],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_generate_equals_megatron_greedy_decode(case, megatron, exported):
    model = load_hf(exported[case])
    reference = megatron[case]["greedy"]
    prompt = megatron["prompt"]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=reference.shape[1] - prompt.shape[1])
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", list(HF_SOURCES))
def test_imported_checkpoint_matches_hf_at_tp2_and_pp2(name, hf_sources, megatron):
    with torch.no_grad():
        expected = hf_sources[name]["model"](megatron["tokens"]).logits
    # Tied embeddings cannot be built at PP>1 on CPU (see workers/hf_reference.py).
    tied = HF_SOURCES[name]["tie_word_embeddings"]
    for layout in ("tp2",) if tied else ("tp2", "pp2"):
        logits = megatron[f"{name}@{layout}"]
        torch.testing.assert_close(logits[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HF_SOURCES))
def test_hf_megatron_hf_round_trip_is_bit_exact(name, hf_sources, tmp_path):
    """HF (as transformers saves it) -> megatron -> HF: identical tensors."""
    source = hf_sources[name]
    again = hf_tensors(export(source["ckpt"], tmp_path / "again"))
    original = hf_tensors(source["dir"])
    assert again.keys() == original.keys()
    for key, value in original.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key


def test_export_import_export_is_bit_exact_and_keeps_the_recipe(megatron, exported, tmp_path):
    first = exported["stem_pp2"]
    again = export(import_hf(first, tmp_path / "ckpt", step=7), tmp_path / "again")
    a, b = hf_tensors(first), hf_tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "config.json").read_text() == (again / "config.json").read_text()
    # The import re-creates the exact model recipe ("1/2", not [1, 3]), so a run resumed
    # with the original recipe passes its shape check.
    original = checkpoint.read_recipe(checkpoint.resolve(megatron["root"] / "stem_pp2"))
    imported = checkpoint.read_recipe(checkpoint.resolve(tmp_path / "ckpt"))
    checkpoint.check_same_shape(imported, original, tmp_path / "ckpt")
    assert imported.model.stem_layers == "1/2"


def test_import_writes_the_same_dist_checkpoint_keys_as_megatron(megatron, hf_sources):
    """Guards the hand-built dist checkpoint against megatron format drift."""
    from megatron_stem.hf.dist_io import CheckpointReader
    from torch.distributed.checkpoint import FileSystemReader

    def keys(ckpt):
        return set(FileSystemReader(str(ckpt / checkpoint.MODEL)).read_metadata()
                   .state_dict_metadata)

    native = checkpoint.resolve(megatron["root"] / "stem_tp2")
    imported = hf_sources["hf_stem"]["ckpt"]
    assert keys(imported) == keys(native)
    a, b = CheckpointReader(imported / checkpoint.MODEL), CheckpointReader(native / "model")
    assert all(a.shape(k) == b.shape(k) for k in a.keys())
    assert json.loads((imported / "model/metadata.json").read_text()) == \
        json.loads((native / "model/metadata.json").read_text())
