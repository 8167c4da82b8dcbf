"""Angular spread and distinct-parameter curves on inputs whose answer is known, then the
whole analysis (and its CLI) on the tiny facts models of `test_editing.py`."""

import json
import math

import pytest
import torch

from megatron_stem.model.accounting import account
from megatron_stem.analysis.capacity import default_lengths, distinct_parameter_curve
from megatron_stem.analysis.report import analyze
from megatron_stem.analysis.spread import Z95, spread
from megatron_stem.analysis.text import read_token_ids
from megatron_stem.editing.backend import MegatronBackend, open_tokenizer
from workers import facts

# ---------------------------------------------------------------------------------------
# Known inputs
# ---------------------------------------------------------------------------------------


def test_orthogonal_rows_have_no_overlap():
    q, _ = torch.linalg.qr(torch.randn(256, 256, generator=torch.Generator().manual_seed(0)))
    s = spread(q[:200])
    assert s.vectors == 200 and s.pairs == 200 * 199 // 2
    assert s.p95 < 1e-5 and s.mean_abs_cos < 1e-5


@pytest.mark.parametrize("width", [64, 1024])
def test_random_gaussian_rows_give_the_yardstick(width):
    g = torch.Generator().manual_seed(width)
    s = spread(torch.randn(600, width, generator=g))
    assert s.gaussian_p95 == pytest.approx(Z95 / math.sqrt(width))
    assert s.p95 == pytest.approx(s.gaussian_p95, rel=0.06)
    assert s.p50 == pytest.approx(0.6745 / math.sqrt(width), rel=0.06)  # median of |N(0,1)|


def test_collapsed_rows_have_cosine_one():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 128, generator=g) + 1e-3 * torch.randn(100, 128, generator=g)
    assert spread(rows).p50 > 0.999


def test_repeated_text_stops_adding_distinct_parameters():
    ids = list(range(50)) * 8
    curve = distinct_parameter_curve(ids, stem_layers=3, width=16, hidden=8)
    assert curve.lengths == default_lengths(400) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 400]
    assert curve.distinct_ids == [min(n, 50) for n in curve.lengths]
    assert curve.stem_params == [u * 3 * 16 for u in curve.distinct_ids]
    assert curve.dense_up_params == 3 * 8 * 16


def test_real_text_keeps_adding_parameters_until_it_repeats(sp_model):
    """GCIDE with a 1,000-piece tokenizer: every doubling of the context brings new ids;
    the same 1,024 tokens read four times bring none after the first pass."""
    from support.processes import CORPUS
    from megatron_stem.data.tokenizer import load_tokenizer

    ids = read_token_ids([str(CORPUS)], load_tokenizer("sentencepiece", sp_model), 4096)
    assert len(ids) == 4096
    curve = distinct_parameter_curve(ids, stem_layers=2, width=4, hidden=2)
    growth = [b - a for a, b in zip(curve.distinct_ids, curve.distinct_ids[1:])]
    assert all(g > 0 for g in growth), curve.distinct_ids
    repeated = distinct_parameter_curve(ids[:1024] * 4, 2, 4, 2, lengths=[512, 1024, 2048, 4096])
    first = distinct_parameter_curve(ids[:1024], 2, 4, 2, lengths=[1024])
    assert repeated.distinct_ids[1:] == [first.distinct_ids[0]] * 3
    assert repeated.distinct_ids[0] < repeated.distinct_ids[1]


# ---------------------------------------------------------------------------------------
# The facts models
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "facts.txt"
    path.write_text("\n".join(facts.sentences()) + "\n")
    return path


def test_analysis_of_a_stem_model_and_its_dense_control(facts_models, text_file):
    with MegatronBackend(facts_models.stem.checkpoint) as stem, \
            MegatronBackend(facts_models.dense.checkpoint) as dense:
        tok = open_tokenizer(stem)
        ids = read_token_ids([str(text_file)], tok, 10_000)
        report = analyze(stem, ids, rows=64, dense=dense)
    distinct = len(set(ids))
    assert report["text_tokens"] == len(ids) and report["distinct_tokens"] == distinct
    for name, layers, kind in (("spread", report["spread"], "stem_rows"),
                               ("dense", report["dense"]["spread"], "up_projection")):
        assert list(layers) == ["0", "1", "2", "3"], name
        for s in layers.values():
            assert s["kind"] == kind and s["vectors"] == min(64, distinct)
            assert s["width"] == facts.SHAPE["ffn_hidden_size"]
            assert sum(s["histogram"]) == pytest.approx(1.0)
            assert 0 <= s["p50"] <= s["p95"] <= s["p99"] <= 1
    # The STEM rows spread far wider than the dense model's up-projection outputs of the
    # same tokens (measured P95 |cos| 0.16-0.29 against 0.94-0.995, Gaussian 0.06).
    for layer, s in report["spread"].items():
        assert s["p95"] < 0.5 < report["dense"]["spread"][layer]["p95"]
    curve = report["capacity"]
    assert curve["distinct_ids"][-1] == distinct
    assert curve["params_per_id"] == 4 * facts.SHAPE["ffn_hidden_size"]
    assert report["model"]["accounting"] == account(stem.config).as_dict()


def test_cli_writes_the_report_and_plots(facts_models, text_file, tmp_path, capsys):
    from support.processes import tool

    out = tmp_path / "analysis"
    rc = tool("analyze")(["--checkpoint", str(facts_models.stem.checkpoint),
                          "--dense-checkpoint", str(facts_models.dense.checkpoint),
                          "--input", str(text_file), "--output", str(out), "--rows", "32",
                          "--accuracy", "0.55", "--dense-accuracy", "0.50"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "analysis.json").read_text())
    acc = account(facts_models_config(facts_models))
    assert report["roi"]["roi"] == pytest.approx(
        (0.55 / acc.flops_per_token) / (0.50 / acc.dense_params / 2))
    for png in ("angular_spread.png", "distinct_params.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "ROI vs dense: " in printed and "layer  3 rows" in printed
    assert "dense layer  0 W_up x" in printed

    assert tool("analyze")(["--checkpoint", str(tmp_path / "nope"), "--input", str(text_file),
                            "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / 'nope'}: no such checkpoint folder"


def facts_models_config(facts_models):
    from megatron_stem import checkpoint

    return checkpoint.read_recipe(checkpoint.resolve(facts_models.stem.checkpoint)).model
