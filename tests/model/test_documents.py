"""Document masking (`data.reset_position_ids`, `data.reset_attention_mask`,
`data.eod_mask_loss`): a token's logits depend only on its own document, equal those of
its document run alone, on every layout and in the Hugging Face export; the data gives
the model what megatron's dataset rules say.

The model tests run in this process (world size 1); one 2-rank run checks TP=2 with
sequence parallelism and activation recompute against it.
"""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from support.processes import merge_rank_dumps, torchrun
from megatron_stem.runtime import cpu_compat
from megatron_stem.config import DataConfig, ParallelConfig, Recipe, TrainConfig
from megatron_stem.runtime.errors import UserError
from megatron_stem.model import build_model, documents
from megatron_stem.tables.row_grads import HOST_TOKENS
from megatron_stem.training.batches import Samples, StepBatches, open_datasets
from workers.common import (document_inputs, eod_token, full_named, microbatches,
                            tiny_model)
from workers.schedule import forward_backward

CFG = tiny_model("1/2")  # STEM layers 1 and 3, 4 query / 2 kv heads, 32 tokens
EOD = eod_token(CFG)


def random_document(g, length: int, closed: bool = True) -> torch.Tensor:
    tokens = torch.randint(0, EOD, (length,), generator=g)
    if closed:
        tokens[-1] = EOD
    return tokens


@pytest.fixture(scope="module")
def packed():
    """Two rows of three documents [A | B | C] (9 + 12 + 11 tokens, C cut by the row end)
    that differ only in A's tokens, and B and C alone."""
    g = torch.Generator().manual_seed(0)
    a, a_other, b, c = (random_document(g, 9), random_document(g, 9), random_document(g, 12),
                        random_document(g, 11, closed=False))
    tokens = torch.stack([torch.cat([a, b, c]), torch.cat([a_other, b, c])])
    return SimpleNamespace(tokens=tokens, b=b, c=c, **document_inputs(tokens, EOD))


@pytest.fixture(scope="module")
def model(world1):
    torch.manual_seed(0)
    net = build_model(CFG, ParallelConfig()).eval()
    with torch.no_grad():  # weights well away from init, so attention is far from uniform
        for p in net.parameters():
            p.mul_(3.0)
    return net


@torch.no_grad()
def logits(model, tokens, **inputs):
    return model(tokens, **inputs)


def test_boundaries_follow_eod_tokens_and_row_ends():
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, 1, 2, 3, 4, 5]])
    docs = documents.document_boundaries(tokens, EOD)
    assert docs.cu_seqlens_q.tolist() == [0, 2, 5, 6, 7, 12]
    assert docs.cu_seqlens_q.dtype == torch.int32
    assert docs.max_seqlen_q == docs.max_seqlen_kv == 5
    assert documents.document_ids(docs, 2, 6).tolist() == [[0, 0, 1, 1, 1, 2], [3, 4, 4, 4, 4, 4]]


def test_a_token_sees_only_its_own_document(model, packed):
    out = logits(model, packed.tokens, position_ids=packed.position_ids,
                 packed_seq_params=packed.documents)
    assert torch.equal(out[0, 9:], out[1, 9:])  # B and C: A's tokens changed nothing
    assert not torch.allclose(out[0, :9], out[1, :9])
    torch.testing.assert_close(out[0, 9:21], logits(model, packed.b[None])[0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 21:], logits(model, packed.c[None])[0],
                               atol=1e-5, rtol=1e-5)
    # Without the document mask the same rows do see A.
    plain = logits(model, packed.tokens)
    assert not torch.allclose(plain[0, 9:], plain[1, 9:])


def test_attention_mask_alone_keeps_positions_running(model, packed):
    """reset_attention_mask without reset_position_ids: RoPE is relative, so a document
    keeps its own logits up to rounding even at the positions where it sits."""
    out = logits(model, packed.tokens, packed_seq_params=packed.documents)
    assert torch.equal(out[0, 9:], out[1, 9:])
    torch.testing.assert_close(out[0, 9:21], logits(model, packed.b[None])[0],
                               atol=1e-5, rtol=1e-4)


def test_position_ids_are_what_rope_rotates_by(model, packed):
    plain = logits(model, packed.tokens)
    counted = torch.arange(32).expand(2, 32)
    assert torch.equal(logits(model, packed.tokens, position_ids=counted), plain)
    shifted = logits(model, packed.tokens, position_ids=packed.position_ids)
    assert torch.equal(shifted[:, :9], plain[:, :9])  # the first document starts at 0 anyway
    assert not torch.allclose(shifted[:, 9:], plain[:, 9:])


def test_recompute_gives_the_same_gradients(world1):
    batches = microbatches(CFG, documents=True)
    grads = {}
    for recompute in ("none", "full"):
        cpu_compat.model_parallel_seed(1234)
        net = build_model(CFG, ParallelConfig(recompute=recompute), seed=1234)
        forward_backward(net, batches)
        grads[recompute] = full_named(net, net.config, "grad")
    assert grads["none"].keys() == grads["full"].keys()
    for name, grad in grads["none"].items():
        assert torch.equal(grads["full"][name], grad), name


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False):
    """torch's `varlen_attn` as documented ([total, heads, d] packed, causal for window
    (-1, 0)), one document at a time: the CPU stand-in for the CUDA kernel."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
    cu = cu_q.tolist()
    assert max_q == max(np.diff(cu))
    parts = [F.scaled_dot_product_attention(
        *(t[a:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=enable_gqa).transpose(0, 1) for a, e in zip(cu[:-1], cu[1:])]
    return torch.cat(parts)


def _reference_varlen_before_2_13(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False,
                                  return_aux=None):
    """The signature of earlier torch releases (2.9's): `is_causal`, no `scale` (1/sqrt(d)),
    no grouped key/value heads."""
    assert is_causal and q.shape[1] == k.shape[1]
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))


@pytest.mark.parametrize("kernel", [_reference_varlen, _reference_varlen_before_2_13],
                         ids=["torch_2_13", "torch_before_2_13"])
@pytest.mark.parametrize("batch", [1, 3])
def test_varlen_path_packs_megatron_layout_like_the_dense_path(monkeypatch, batch, kernel):
    """The GPU path's layout and boundaries, with the kernel replaced by its documented
    semantics (the kernel itself runs only on CUDA), in the signature of this torch
    release and of earlier ones (a GPU machine's torch may not be the project's)."""
    g = torch.Generator().manual_seed(1)
    s, heads, groups, dim = 40, 4, 2, 8
    tokens = torch.randint(0, EOD, (batch, s), generator=g)
    tokens[torch.rand(batch, s, generator=g) < 0.1] = EOD
    docs = documents.document_boundaries(tokens, EOD)
    # Strided views like megatron's split of the fused QKV projection.
    qkv = torch.randn(s, batch, groups, heads // groups + 2, dim, generator=g)
    q = qkv[:, :, :, :2].reshape(s, batch, heads, dim)
    k, v = qkv[:, :, :, 2], qkv[:, :, :, 3]
    from torch.nn.attention import varlen  # (documents imports it where it runs)

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    got = documents._varlen(q, k, v, docs, 0.3, True)
    expected = documents._dense_mask(q, k, v, docs, 0.3, True)
    assert got.shape == (s, batch, heads, dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.integration  # a torchrun job
def test_tensor_parallel_2_with_sequence_parallel_and_recompute(world1, tmp_path):
    """TP=2 + SP + full recompute on documents against this process's TP=1 run of the same
    seeded model: logits, loss and every gradient."""
    torchrun(2, "parity.py", "--out", tmp_path, "--tp", 2, "--sp", "--recompute",
             "--documents")
    tp2 = merge_rank_dumps(tmp_path)
    cpu_compat.model_parallel_seed(1234)
    net = build_model(CFG, ParallelConfig(), seed=1234)
    batches = microbatches(CFG, documents=True)
    for name, param in full_named(net, net.config, "param").items():
        assert torch.equal(tp2["params"][name], param), name
    torch.testing.assert_close(tp2["logits"], logits(net.eval(), batches[0]["tokens"],
                                                     position_ids=batches[0]["position_ids"],
                                                     packed_seq_params=batches[0]["documents"]),
                               atol=1e-5, rtol=1e-4)
    assert tp2["loss"] == pytest.approx(forward_backward(net.train(), batches), rel=1e-6)
    for name, grad in full_named(net, net.config, "grad").items():
        torch.testing.assert_close(tp2["grads"][name], grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Data: what megatron's dataset rules give the model
# ---------------------------------------------------------------------------------------


def _token_file(prefix, docs) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def _tokenizer(eod):
    return SimpleNamespace(eod=eod, pad=-1, vocab_size=CFG.vocab_size,
                           unique_identifiers={"class": "documents-test", "eod": eod})


@pytest.mark.parametrize("reset", [True, False])
def test_batches_carry_positions_boundaries_and_loss_mask(tmp_path, reset):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, EOD, rng.integers(2, 20))) + [EOD] for _ in range(40)]
    _token_file(tmp_path / "docs", docs)
    recipe = Recipe(model=CFG, data=DataConfig(
        prefixes=[str(tmp_path / "docs")], split="1,0,0", reset_position_ids=reset,
        reset_attention_mask=reset, eod_mask_loss=reset, cache_dir=str(tmp_path / "cache")),
        train=TrainConfig(seed=3))
    train, _ = open_datasets(recipe, _tokenizer(EOD), Samples(8, 0))
    (batch,) = StepBatches(train, 4, 4, 0, 1, torch.device("cpu")).microbatches(0)
    tokens = batch["tokens"]
    assert (tokens == EOD).any(dim=1).all()  # every row crosses a document boundary
    # the ids in host memory too, for the table path (read with no sync on a GPU)
    assert batch[HOST_TOKENS].device.type == "cpu" and torch.equal(batch[HOST_TOKENS], tokens)
    if not reset:
        assert set(batch) == {"tokens", "labels", "loss_mask", HOST_TOKENS}
        assert batch["loss_mask"].all()
        return
    expected = document_inputs(tokens, EOD)
    assert torch.equal(batch["position_ids"], expected["position_ids"])
    assert torch.equal(batch["documents"].cu_seqlens_q, expected["documents"].cu_seqlens_q)
    for row, positions in zip(tokens.tolist(), batch["position_ids"].tolist()):
        for i in range(1, len(row)):  # 0 right after an EOD, else one more
            assert positions[i] == (0 if row[i - 1] == EOD else positions[i - 1] + 1)
    assert torch.equal(batch["loss_mask"] == 0, tokens == EOD)


def test_masking_without_an_eod_token_is_refused(tmp_path):
    recipe = Recipe(model=CFG, data=DataConfig(prefixes=[str(tmp_path / "x")],
                                               tokenizer_model="tok.model",
                                               reset_attention_mask=True))
    _token_file(tmp_path / "x", [[1, 2, 3]])
    with pytest.raises(UserError, match="data.reset_attention_mask: the tokenizer tok.model "
                                        "has no end-of-document token"):
        open_datasets(recipe, _tokenizer(None), Samples(8, 0))


# ---------------------------------------------------------------------------------------
# Hugging Face export
# ---------------------------------------------------------------------------------------


@pytest.mark.integration  # exports a checkpoint and loads it through transformers
def test_export_keeps_documents_apart_given_restarting_positions(model, packed, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from megatron_stem import checkpoint
    from megatron_stem.hf.export import export

    with checkpoint.Writer(tmp_path / "ckpt", 1, Recipe(model=CFG)) as folder:
        checkpoint.save_model(model, folder)
    hf = AutoModelForCausalLM.from_pretrained(export(tmp_path / "ckpt", tmp_path / "hf"),
                                              trust_remote_code=True).eval()
    vocab = CFG.vocab_size
    expected = logits(model, packed.tokens, position_ids=packed.position_ids,
                      packed_seq_params=packed.documents)[..., :vocab]
    with torch.no_grad():
        got = hf(packed.tokens, position_ids=packed.position_ids).logits
        alone = hf(packed.b[None]).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0, 9:], got[1, 9:])
    torch.testing.assert_close(got[0, 9:21], alone[0], atol=1e-5, rtol=1e-5)
