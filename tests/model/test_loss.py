"""The loss in chunks of positions (`parallel.loss_chunk_tokens`, model/loss.py) against
megatron's whole-logits path: the same per-token loss and every gradient, fp32 on CPU,
with a loss mask and document masking, at TP=1 in this process and TP=2 (with and
without sequence parallelism) in torchrun ranks."""

import pytest
import torch

from support.processes import merge_rank_dumps, torchrun
from megatron_stem.runtime import cpu_compat
from megatron_stem.config import ParallelConfig
from megatron_stem.model import build_model
from megatron_stem.model.loss import chunked_lm_loss
from workers.common import ChunkLossCalls, full_named, loss_masked, microbatches, tiny_model
from workers.schedule import forward_backward

CFG = tiny_model("1/2")  # 2 x 32 positions per micro-batch, vocabulary 300 (padded 384)
# 64 positions in chunks of 24: two whole chunks and a short one.
CHUNK = 24
MICRO_BATCHES = 2


def chunk_calls(chunk: int) -> int:
    """The chunk function's calls over the micro-batches: each chunk once in the forward
    and once more in the backward, which recomputes its logits."""
    positions = CFG.seq_length * 2
    return MICRO_BATCHES * 2 * -(-positions // chunk) if chunk else 0


def _run(chunk: int, **parallel):
    """Loss and gradients of one seeded model on masked document micro-batches; asserts
    that the loss took the path `chunk` asks for (a chunked loss bypassed by the model
    would compute whole logits on both sides and agree bit for bit)."""
    cpu_compat.model_parallel_seed(1234)
    net = build_model(CFG, ParallelConfig(loss_chunk_tokens=chunk, **parallel), seed=1234)
    calls = ChunkLossCalls()
    try:
        loss = forward_backward(net, loss_masked(microbatches(CFG, MICRO_BATCHES,
                                                              documents=True)))
    finally:
        assert calls.close() == chunk_calls(chunk)
    return loss, full_named(net, net.config, "grad")


@pytest.fixture(scope="module")
def reference(world1):
    return _run(0)


def assert_equal_within_fp32(result, reference):
    loss, grads = result
    assert loss == pytest.approx(reference[0], rel=1e-6)
    assert grads.keys() == reference[1].keys()
    assert "output_layer.weight" in grads
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")  # noqa: B023


def test_chunked_loss_equals_whole_logits(reference):
    assert_equal_within_fp32(_run(CHUNK), reference)


def test_chunk_larger_than_the_micro_batch_is_one_chunk(reference):
    assert_equal_within_fp32(_run(1000), reference)


def test_bf16_chunked_loss_is_the_whole_logits_loss_within_bf16(world1):
    """In the training dtype: the same loss, the output weight's gradient (summed over the
    chunks in fp32) and the hidden states' within bf16 rounding."""
    def run(chunk):
        cpu_compat.model_parallel_seed(1234)
        net = build_model(CFG, ParallelConfig(loss_chunk_tokens=chunk), seed=1234,
                          params_dtype=torch.bfloat16)
        calls = ChunkLossCalls()
        loss = forward_backward(net, loss_masked(microbatches(CFG, MICRO_BATCHES,
                                                              documents=True)))
        assert calls.close() == chunk_calls(chunk)
        return loss, full_named(net, net.config, "grad")

    (loss, grads), (ref_loss, ref_grads) = run(CHUNK), run(0)
    assert grads["output_layer.weight"].dtype == torch.bfloat16
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name].float(), grad.float(), rtol=2e-2, atol=1e-3,
                                   msg=lambda m: f"{name}: {m}")  # noqa: B023


def test_per_token_loss_and_grads_of_the_function_alone(world1):
    """Random hidden states and weight, non-uniform upstream gradient per token."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 3, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    upstream = torch.rand(3, 7, generator=g)
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.t()).transpose(0, 1).reshape(-1, 50), labels.reshape(-1),
        reduction="none").view(3, 7)
    calls = ChunkLossCalls()
    got = chunked_lm_loss(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    want = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    have = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert calls.close() == 2 * 6  # 21 positions in chunks of 4, forward and backward


@pytest.mark.integration  # torchrun jobs
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_2_chunked_equals_tp1_whole_logits(reference, tmp_path, sp):
    torchrun(2, "parity.py", "--out", tmp_path, "--tp", 2, *(["--sp"] if sp else []),
             "--documents", "--loss-mask", "--loss-chunk", CHUNK)
    tp2 = merge_rank_dumps(tmp_path)
    assert tp2["chunk_loss_calls"] == chunk_calls(CHUNK)  # (rank 1's: every rank runs all)
    assert_equal_within_fp32((tp2["loss"], tp2["grads"]), reference)
