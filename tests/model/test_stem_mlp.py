"""The STEM FFN against a plain PyTorch rendering of the paper's formula."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_stem.config import ParallelConfig
from megatron_stem.model import build_model
from megatron_stem.model.stem_mlp import StemMLP
from megatron_stem.model.table import xavier_normal_table_
from workers.common import tiny_model


def reference_stem_ffn(x, token_ids, w_gate, table, w_down):
    """y = W_down( silu(W_gate x) * U[t] ), x: [s, b, d], token_ids: [b, s]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * table[token_ids.t()], w_down)


def test_stem_ffn_matches_reference_formula(world1):
    torch.manual_seed(0)
    model = build_model(tiny_model("1/2"), ParallelConfig())
    mlp = model.decoder.layers[1].mlp
    assert isinstance(mlp, StemMLP)
    with torch.no_grad():  # random weights, not only the init distribution
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(32, 2, 64, requires_grad=True)
    ids = torch.randint(0, 300, (2, 32))
    out, bias = mlp(x, padding_mask=ids)
    assert bias is None

    x_ref = x.detach().clone().requires_grad_()
    weights = [mlp.linear_gate.weight, mlp.table.weight, mlp.linear_down.weight]
    ref_weights = [w.detach().clone().requires_grad_() for w in weights]
    ref = reference_stem_ffn(x_ref, ids, *ref_weights)
    torch.testing.assert_close(out, ref)

    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for w, w_ref in zip(weights, ref_weights):
        torch.testing.assert_close(w.grad, w_ref.grad)
    # Only the rows of tokens present in the batch receive gradient.
    touched = torch.zeros(300, dtype=torch.bool)
    touched[ids.unique()] = True
    assert mlp.table.weight.grad[~touched].abs().sum() == 0
    assert (mlp.table.weight.grad[touched].abs().sum(1) > 0).all()


def test_stem_layer_without_token_ids_is_an_error(world1):
    model = build_model(tiny_model("1/2"), ParallelConfig())
    with pytest.raises(RuntimeError, match="without token ids"):
        model.decoder.layers[1].mlp(torch.randn(4, 1, 64))


def test_placement_builds_stem_layers_exactly_where_asked(world1):
    model = build_model(tiny_model([1, 2]), ParallelConfig())
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["SwiGLUMLP", "StemMLP", "StemMLP", "SwiGLUMLP"]
    dense = build_model(tiny_model("none"), ParallelConfig())
    assert all(type(layer.mlp).__name__ == "SwiGLUMLP" for layer in dense.decoder.layers)


def test_table_init_is_xavier_normal_and_independent_of_tp_size():
    vocab, width = 1000, 64
    full = xavier_normal_table_(torch.empty(vocab, width), width, 0, seed=7)
    halves = [xavier_normal_table_(torch.empty(vocab, width // 2), width, r * width // 2, 7)
              for r in range(2)]
    assert torch.equal(torch.cat(halves, dim=1), full)
    assert full.std().item() == pytest.approx(math.sqrt(2 / (vocab + width)), rel=0.02)
    other_seed = xavier_normal_table_(torch.empty(vocab, width), width, 0, seed=8)
    assert not torch.equal(other_seed, full)


def test_stem_ids_remap_lookups_like_swapping_table_rows(world1):
    """Reading token Z's rows at X's positions == copying U[Z] into U[X] (text unchanged),
    and a per-layer id tensor reaches only the chosen layer."""
    torch.manual_seed(0)
    model = build_model(tiny_model([1, 3]), ParallelConfig()).eval()
    ids = torch.randint(0, 300, (2, 32))
    x, z = int(ids[0, 5]), 7
    remapped = torch.where(ids == x, z, ids)
    per_layer = torch.stack([ids, ids, ids, remapped])  # edit layer 3 only
    with torch.no_grad():
        plain = model(ids)
        assert torch.equal(model(ids, stem_ids=ids), plain)
        edited = model(ids, stem_ids=per_layer)
        assert not torch.allclose(edited, plain)
        table = model.decoder.layers[3].mlp.table.weight
        table[x] = table[z]
        torch.testing.assert_close(model(ids), edited)
