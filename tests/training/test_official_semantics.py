"""The official STEM code's training semantics, as recipe fields (docs/design.md, "Fidelity
to the paper's code"): lingua's warmup, decay on the norm gains, backbone and tables
clipped each by its own norm. The update is checked against AdamW computed by hand."""

import math

import pytest
import torch
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                             safe_get_full_optimizer_state)

from megatron_stem.config import OptimizerConfig, Recipe, from_dict, load_recipe
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.model import build_model
from megatron_stem.model.init import TRUNCATION
from megatron_stem.training.loop import train_step
from megatron_stem.training.engine import build_engine, split_parameters
from megatron_stem.training.lr import lr_at
from megatron_stem.checkpoint.zero_state import link_states
from megatron_stem.tables.shards import interleaved_order
from support.processes import ROOT
from test_update import _backward
from workers.common import TINY, microbatches, tiny_model

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def test_lingua_warmup_starts_at_zero_and_meets_megatrons_after_it():
    lingua = OptimizerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=1e-6, warmup_from_zero=True)
    megatron = OptimizerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=1e-6)
    assert [lr_at(s, lingua, 12) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [lr_at(s, megatron, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # After the warmup, lingua's cosine: min + (1 - min) (1 + cos(pi (s - w) / (n - w))) / 2.
    for s in range(4, 13):
        expected = 1e-6 + (1 - 1e-6) * 0.5 * (1 + math.cos(math.pi * (s - 4) / 8))
        assert lr_at(s, lingua, 12) == pytest.approx(expected, rel=1e-12)
        assert lr_at(s, megatron, 12) == lr_at(s, lingua, 12)
    assert lr_at(12, lingua, 12) == pytest.approx(1e-6)


@pytest.mark.parametrize("recipe", ["dense_1b", "stem_1b_pretrain", "stem_1b_midtrain",
                                    "dense_350m", "stem_350m_half"])
def test_the_papers_recipes_train_as_the_official_code(recipe):
    r = load_recipe(f"recipes/{recipe}.yaml")
    opt = r.optimizer
    assert (r.model.init, opt.clip_tables, opt.decay_norms, opt.warmup_from_zero) == \
        ("truncated_fan_in", "separate", True, True)
    assert r.train.init_tables == "keep"
    if "midtrain" not in recipe:
        assert opt.min_lr_ratio == 1e-6  # the official configs' lr_min_ratio


def test_reinit_tables_refuses_the_checkpoints_table_optimizer_states():
    with pytest.raises(ConfigError, match="init_tables: reinit starts fresh tables"):
        from_dict(Recipe, {"model": TINY, "train": {
            "init_from": "x", "init_optimizer": True, "init_tables": "reinit"}})


def _recipe(**optimizer):
    return from_dict(Recipe, {
        "model": {**TINY, "stem_layers": "1/2"},
        "optimizer": {"lr": LR, "warmup_steps": 0, "weight_decay": WD,
                      "tables": {"kernel": "torch", "update": "dense", "weight_decay": WD},
                      **optimizer},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "dtype": "fp32"}})


def _built(recipe):
    torch.manual_seed(0)
    model = build_model(recipe.model, recipe.parallel, tables=recipe.tables)
    engine, tables, update = build_engine(model, recipe)
    return engine, tables, update, microbatches(tiny_model(), count=2)


def _adam_states(engine, tables) -> dict[str, tuple[torch.Tensor, ...]]:
    """{name: (fp32 param, exp_avg, exp_avg_sq)} of every parameter."""
    link_states(engine.optimizer)
    out = {}
    for name, states in tables.state_tensors().items():  # rows in the checkpoint's order
        order = interleaved_order(len(states["exp_avg"]))
        out[name] = tuple(torch.empty_like(states[k], dtype=torch.float64)
                          .index_copy_(0, order, states[k].double())
                          for k in ("fp32_param", "exp_avg", "exp_avg_sq"))
    for n, p in engine.module.named_parameters():
        if n not in out:
            out[n] = (safe_get_full_fp32_param(p).double().clone(),
                      *(safe_get_full_optimizer_state(p, k).double().clone()
                        for k in ("exp_avg", "exp_avg_sq")))
    return out


def _grads(engine, tables) -> dict[str, torch.Tensor]:
    """The step's reduced gradients, before the update clips them."""
    out = {t.name: sum(g.to_dense() for g in t.param.row_grads._parts).double()
           for t in tables.tables}
    for n, p in engine.module.named_parameters():
        if n not in out:
            out[n] = safe_get_full_grad(p).double()
    return out


def _hand_adamw(param, m, v, grad, step, decay):
    m = BETAS[0] * m + (1 - BETAS[0]) * grad
    v = BETAS[1] * v + (1 - BETAS[1]) * grad * grad
    m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
    return param * (1 - LR * decay) - LR * m_hat / (v_hat.sqrt() + EPS)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("threshold", ["between", "below_both"])
def test_separate_clipping_is_adamw_on_each_part_clipped_by_its_own_norm(threshold):
    """Step 2 (moments not fresh): the backbone clipped by its norm, the tables by theirs
    (unclipped when under the threshold), norm gains decayed; every parameter equals
    AdamW computed by hand in float64."""
    engine, tables, update, batches = _built(_recipe(clip_tables="separate",
                                                     decay_norms=True))
    train_step(update, batches, LR)
    before = _adam_states(engine, tables)
    loss = _backward(engine, batches)
    grads = _grads(engine, tables)
    table_names = {t.name for t in tables.tables}
    norms = {part: math.sqrt(sum(float(g.square().sum()) for n, g in grads.items()
                                 if (n in table_names) == (part == "tables")))
             for part in ("backbone", "tables")}
    assert norms["tables"] < norms["backbone"]
    clip = math.sqrt(norms["tables"] * norms["backbone"]) if threshold == "between" \
        else norms["tables"] / 2
    update.clip_grad = engine.optimizer.clip_grad = clip
    outcome = update.apply(LR, loss)
    assert outcome.applied
    assert outcome.norms.backbone == pytest.approx(norms["backbone"], rel=1e-6)
    assert outcome.norms.tables == pytest.approx(norms["tables"], rel=1e-6)
    after = _adam_states(engine, tables)
    for name, (param, m, v) in before.items():
        part = "tables" if name in table_names else "backbone"
        coef = min(1.0, clip / (norms[part] + 1e-6))
        if part == "tables" and threshold == "between":
            assert coef == 1.0
        expected = _hand_adamw(param, m, v, grads[name] * coef, step=2, decay=WD)
        torch.testing.assert_close(after[name][0], expected, rtol=0, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("decay_norms", [False, True])
def test_norm_gains_are_decayed_only_under_decay_norms(decay_norms):
    """Megatron's convention leaves the RMSNorm gains (every 1-D parameter here) out of
    weight decay; the official code decays them (the hand-computed update above)."""
    engine, *_ = _built(_recipe(decay_norms=decay_norms))
    model = engine.module
    decay, no_decay, tables = split_parameters(model, decay_norms)
    gains = {id(p) for n, p in model.named_parameters() if "layernorm" in n}
    assert gains and {id(p) for p in model.parameters() if p.ndim == 1} == gains
    assert {id(p) for p in no_decay} == (set() if decay_norms else gains)
    assert len(decay) + len(no_decay) + len(tables) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in engine.optimizer.optimizer.param_groups] == \
        ([WD] if decay_norms else [WD, 0.0])


def _truncated_std(std: float, bound: float = TRUNCATION) -> float:
    """The standard deviation of N(0, std) truncated at +-bound std."""
    density = math.exp(-bound * bound / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(bound / math.sqrt(2))
    return std * math.sqrt(1 - 2 * bound * density / mass)


# Each kind of dense weight and its fan-in under `model.init: truncated_fan_in` (the
# official code: dim^-0.5 everywhere but the down projection's ffn_dim^-0.5).
_FAN_IN = {"embedding.word_embeddings": "hidden_size", "output_layer": "hidden_size",
           "linear_qkv": "hidden_size", "linear_proj": "hidden_size",
           "linear_fc1": "hidden_size", "linear_gate": "hidden_size",
           "linear_fc2": "ffn_hidden_size", "linear_down": "ffn_hidden_size"}


@pytest.mark.integration
def test_truncated_fan_in_init_matches_the_formulas_and_tp2_draws_tp1s_numbers(
        tmp_path_factory):
    from support.processes import merge_rank_dumps, torchrun

    params = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"init_tp{tp}")
        torchrun(tp, "parity.py", "--out", out, "--tp", tp, "--init", "truncated_fan_in")
        params[tp] = merge_rank_dumps(out)["params"]
    assert params[2].keys() == params[1].keys()
    for name, value in params[1].items():
        assert torch.equal(params[2][name], value), name
    for kind, dim in _FAN_IN.items():
        weights = [v for n, v in params[1].items() if f"{kind}.weight" in n]
        assert weights, kind
        std = TINY[dim] ** -0.5
        values = torch.cat([w.flatten() for w in weights]).double()
        assert float(values.std()) == pytest.approx(_truncated_std(std), rel=0.02), kind
        assert float(values.abs().max()) <= TRUNCATION * std, kind
    gains = [v for n, v in params[1].items() if "layernorm" in n]
    assert gains and all(torch.equal(g, torch.ones_like(g)) for g in gains)
    tables = [v for n, v in params[1].items() if ".table." in n]  # xavier over [V, F]
    assert tables and float(torch.cat([t.flatten() for t in tables]).std()) == \
        pytest.approx(math.sqrt(2 / (TINY["vocab_size"] + TINY["ffn_hidden_size"])), rel=0.02)


def test_the_quality_bench_runs_the_official_semantics_as_the_papers_recipes_train(
        monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import quality
    paper = load_recipe("recipes/stem_350m_half.yaml")
    for semantics, expected in (("megatron", load_recipe(quality.RECIPE)), ("official", paper)):
        r = load_recipe(quality.RECIPE, quality.SEMANTICS[semantics])
        for section, names in (("model", ["init"]),
                               ("optimizer", ["clip_tables", "decay_norms", "warmup_from_zero",
                                              "min_lr_ratio"])):
            for name in names:
                got, want = (getattr(getattr(x, section), name) for x in (r, expected))
                assert got == want, f"{semantics}: {section}.{name}"
