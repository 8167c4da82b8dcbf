"""Parallel layouts against the single-rank reference, in real torchrun/gloo processes.

The reference (TP=1, PP=1) dumps loss, logits, params and grads and saves a megatron dist
checkpoint; every other layout must reproduce it. PP stages build their layers from a
different random stream, so PP layouts start from the reference checkpoint (which tests
TP1 -> PP2 resharding on the way).
"""

import pytest
import torch

from support.processes import merge_rank_dumps, torchrun

pytestmark = pytest.mark.integration  # every test compares torchrun runs


def _run(tmp_path_factory, name, nproc, *args):
    out = tmp_path_factory.mktemp(name)
    torchrun(nproc, "parity.py", "--out", out, *args)
    return merge_rank_dumps(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt_tp1")
    result = _run(tmp_path_factory, "tp1", 1, "--save", ckpt)
    result["ckpt"] = ckpt
    return result


def assert_same(result, reference, atol=1e-5, logits=True):
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert result["grads"].keys() == reference["grads"].keys()
    assert any(".mlp.table.weight" in k for k in reference["grads"]), "no STEM table in model"
    for kind in ("params", "grads"):
        for name, value in reference[kind].items():
            torch.testing.assert_close(result[kind][name], value, atol=atol, rtol=1e-4,
                                       msg=lambda m: f"{kind} {name}: {m}")  # noqa: B023
    if logits:
        torch.testing.assert_close(result["logits"], reference["logits"], atol=atol, rtol=1e-4)


def test_tensor_parallel_2_matches_1(reference, tmp_path_factory):
    assert_same(_run(tmp_path_factory, "tp2", 2, "--tp", 2), reference)


def test_tensor_parallel_2_with_sequence_parallel_matches_1(reference, tmp_path_factory):
    assert_same(_run(tmp_path_factory, "tp2sp", 2, "--tp", 2, "--sp"), reference)


def test_pipeline_parallel_2_matches_1(reference, tmp_path_factory):
    result = _run(tmp_path_factory, "pp2", 2, "--pp", 2, "--load", reference["ckpt"])
    assert_same(result, reference, logits=False)


def test_tp2_pp2_sequence_parallel_matches_1(reference, tmp_path_factory):
    result = _run(tmp_path_factory, "tp2pp2", 4, "--tp", 2, "--pp", 2, "--sp",
                  "--load", reference["ckpt"])
    assert_same(result, reference, logits=False)


def test_activation_recompute_gives_same_grads(reference, tmp_path_factory):
    assert_same(_run(tmp_path_factory, "recompute", 1, "--recompute"), reference, atol=0)


def test_checkpoint_resharding_tp2_to_tp1_and_back(reference, tmp_path_factory):
    # A differently seeded TP=2 model, so loading (not init) is what makes them agree.
    ckpt2 = tmp_path_factory.mktemp("ckpt_tp2")
    tp2 = _run(tmp_path_factory, "tp2_seed99", 2, "--tp", 2, "--seed", 99, "--save", ckpt2)
    assert not torch.allclose(tp2["logits"], reference["logits"])
    tp1_from_tp2 = _run(tmp_path_factory, "tp1_from_tp2", 1, "--load", ckpt2)
    assert_same(tp1_from_tp2, tp2)
    tp2_from_tp1 = _run(tmp_path_factory, "tp2_from_tp1", 2, "--tp", 2, "--seed", 99,
                        "--load", reference["ckpt"])
    assert_same(tp2_from_tp1, reference)


def test_tied_embeddings_under_pipeline_parallel(tmp_path_factory):
    """The last stage's copy of a tied embedding is synced from the first at build time."""
    ckpt = tmp_path_factory.mktemp("ckpt_tied")
    reference = _run(tmp_path_factory, "tied_tp1", 1, "--tied", "--save", ckpt)
    assert not any(k.startswith("output_layer") for k in reference["params"])
    pp2 = _run(tmp_path_factory, "tied_pp2", 2, "--tied", "--pp", 2, "--load", ckpt)
    # Stage grads of a tied weight are partial until summed across stages (a trainer's
    # job), so the forward is what must agree.
    assert pp2["loss"] == pytest.approx(reference["loss"], rel=1e-6)
