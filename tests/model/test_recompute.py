"""Selective activation recompute (`parallel.recompute: selective`,
`parallel.recompute_modules`): every gradient equals the run without recompute, bit for
bit, on a STEM model with document masking (the STEM layers' token ids and the document
boundaries must reach the recomputed parts), and the chosen parts do run twice."""

import pytest
import torch

from support.processes import merge_rank_dumps, torchrun
from megatron_stem.runtime import cpu_compat
from megatron_stem.config import ParallelConfig
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.model import build_model, spec, stem_mlp
from megatron_stem.model.attention import SDPAttention
from workers.common import full_named, loss_masked, microbatches, tiny_model
from workers.schedule import forward_backward

CFG = tiny_model("1/2")  # layers 1 and 3 STEM, 0 and 2 dense


def _run(modules: list[str]):
    cpu_compat.model_parallel_seed(1234)
    parallel = ParallelConfig(recompute="selective" if modules else "none",
                              recompute_modules=modules)
    net = build_model(CFG, parallel, seed=1234)
    loss = forward_backward(net, loss_masked(microbatches(CFG, documents=True)))
    return loss, full_named(net, net.config, "grad")


@pytest.fixture(scope="module")
def reference(world1):
    return _run([])


def _counting(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("modules", [["core_attn"], ["mlp_act"], ["mlp"],
                                     ["core_attn", "mlp_act"]], ids=",".join)
def test_selective_recompute_gives_the_same_bits(reference, monkeypatch, modules):
    runs = {"core_attn": _counting(monkeypatch, SDPAttention, "forward"),
            "stem": _counting(monkeypatch, stem_mlp.StemMLP, "forward"),
            "mlp_act": _counting(monkeypatch, stem_mlp, "_gated"),
            "dense_act": _counting(monkeypatch, spec, "swiglu")}
    loss, grads = _run(modules)
    assert loss == reference[0]
    assert grads.keys() == reference[1].keys()
    for name, grad in reference[1].items():
        assert torch.equal(grads[name], grad), name
    layers, stem_layers, micro = 4, 2, 2
    # Each recomputed part runs once more per layer and micro-batch.
    assert runs["core_attn"][0] == layers * micro * (2 if "core_attn" in modules else 1)
    assert runs["stem"][0] == stem_layers * micro * (2 if "mlp" in modules else 1)
    act = "mlp_act" in modules
    assert runs["mlp_act"][0] == stem_layers * micro * (2 if act or "mlp" in modules else 1)
    # (megatron's own activation runs in a dense MLP without mlp_act)
    assert runs["dense_act"][0] == ((layers - stem_layers) * micro * 2 if act else 0)


@pytest.mark.integration  # a torchrun job
def test_tensor_parallel_2_sequence_parallel_selective_equals_tp1(reference, tmp_path):
    torchrun(2, "parity.py", "--out", tmp_path, "--tp", 2, "--sp", "--documents",
             "--loss-mask", "--recompute-modules", "core_attn,mlp_act")
    tp2 = merge_rank_dumps(tmp_path)
    assert tp2["loss"] == pytest.approx(reference[0], rel=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(tp2["grads"][name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fields, error", [
    (dict(recompute="selective"), "recompute_modules: give them with recompute: selective"),
    (dict(recompute_modules=["mlp"]), "recompute_modules: give them with recompute"),
    (dict(recompute="selective", recompute_modules=["mlp", "mlp_act"]), "give one of them"),
])
def test_recompute_modules_without_selective_or_overlapping_are_refused(fields, error):
    with pytest.raises(ConfigError, match=error):
        ParallelConfig(**fields).validate()


def _kept_bytes(modules: list[str]) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward."""
    cpu_compat.model_parallel_seed(1234)
    parallel = ParallelConfig(recompute="selective" if modules else "none",
                              recompute_modules=modules)
    net = build_model(CFG, parallel, seed=1234)
    batch = microbatches(CFG)[0]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = net(batch["tokens"], labels=batch["labels"])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in kept}
    del loss
    return sum(s.nbytes() for s in storages.values())


def test_mlp_act_keeps_neither_the_activation_nor_its_product(world1):
    """In every FFN, silu(gate) and its product with up (or the table's rows) are not
    kept: 2 x ffn fp32 values per token in a STEM layer, 3 in a dense one (megatron's
    activation also keeps its copy of up, `up + glu_linear_offset`)."""
    ffn_values = 2 * CFG.seq_length * CFG.ffn_hidden_size  # per layer: 2 rows of 32
    stem = len(CFG.stem_layer_indices)
    freed = _kept_bytes([]) - _kept_bytes(["mlp_act"])
    assert freed == (stem * 2 + (CFG.num_layers - stem) * 3) * ffn_values * 4
