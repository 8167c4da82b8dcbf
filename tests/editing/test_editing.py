"""Knowledge editing through STEM rows, on a tiny model that learned templated facts.

`facts_models` (conftest) trains a STEM model and its dense control once per run on
"the capital of X is Y ." facts (`workers/facts.py`). Remapping X's lookups onto Z's rows
must make the STEM model answer Z's capital while every other prompt keeps its
distribution; the dense control, which has no rows, must not move at all.
"""

import json
import os

import pytest
import torch

from megatron_stem.editing import forward
from megatron_stem.editing.backend import HFBackend, MegatronBackend, open_tokenizer
from megatron_stem.editing.evaluate import EvalSpec, Fact, evaluate, format_report
from megatron_stem.editing.inject import inject_writes, written
from megatron_stem.editing.remap import (TokenRemap, bake_writes, build_stem_ids,
                                         find_occurrences, span_plan)
from megatron_stem.editing.resolve import resolve
from megatron_stem.editing.spec import Inject, Remap, load_edits, parse_edits
from support.processes import hf_tensors, tool
from megatron_stem.runtime.errors import UserError
from workers import facts

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SINGLE = [(x, y) for x, y in facts.CAPITALS if " " not in x]
MULTI = [(x, y) for x, y in facts.CAPITALS if " " in x]


# ---------------------------------------------------------------------------------------
# Strategies and lookup ids (no model)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, n, target, expected", [
    ("one_to_one", 2, [7, 8], [7, 8]),
    ("pad_left", 3, [7], [0, 0, 7]),
    ("pad_right", 3, [7], [7, 0, 0]),
    ("subset", 3, [7, 8], [None, 7, 8]),
    ("copy", 4, [7, 8], [7, 7, 8, 8]),
    ("average", 2, [7, 8], [(7, 8), (7, 8)]),
    ("average", 2, [7], [7, 7]),
    # target longer than the source
    ("pad_left", 1, [7, 8, 9], [9]),
    ("pad_right", 1, [7, 8, 9], [7]),
    ("subset", 2, [7, 8, 9], [8, 9]),
    ("copy", 2, [7, 8, 9, 10], [7, 9]),
    ("average", 1, [7, 8, 9], [(7, 8, 9)]),
])
def test_length_strategies(strategy, n, target, expected):
    assert span_plan(n, target, strategy, pad=0) == expected


def test_strategies_that_cannot_apply_say_why():
    with pytest.raises(ValueError, match=r"one_to_one needs as many target tokens .*\(2 vs 1\)"):
        span_plan(2, [7], "one_to_one", pad=0)
    with pytest.raises(ValueError, match="no pad token"):
        span_plan(2, [7], "pad_left", pad=None)


def test_stem_ids_move_only_the_chosen_occurrences_and_layers():
    batch = torch.tensor([[5, 1, 2, 5, 1, 2, 0], [3, 5, 1, 9, 9, 9, 9]])
    remap = TokenRemap("a", (5, 1), (7, 8), "one_to_one", (1, 3))
    stem = build_stem_ids(batch, [6, 7], [[remap], [remap]], num_layers=4, vocab_size=10)
    assert stem.hits == [[2], [1]]
    for layer in (0, 2):  # untouched layers read the input ids
        assert torch.equal(stem.ids[layer], batch)
    assert stem.ids[1, 0].tolist() == [7, 8, 2, 7, 8, 2, 0]
    assert stem.ids[3, 1].tolist() == [3, 7, 8, 9, 9, 9, 9]
    second = TokenRemap("b", (5, 1), (7, 8), "one_to_one", (1,), occurrences=(1,))
    stem = build_stem_ids(batch[:1], [6], [[second]], num_layers=4, vocab_size=10)
    assert stem.ids[1, 0].tolist() == [5, 1, 2, 7, 8, 2, 0]
    # Averaged rows travel as placeholders past the vocabulary.
    avg = TokenRemap("c", (2,), (7, 8), "average", (2,))
    stem = build_stem_ids(batch[:1], [6], [[avg]], num_layers=4, vocab_size=10)
    assert stem.averages == {10: (7, 8)} and stem.ids[2, 0].tolist() == [5, 1, 10, 5, 1, 10, 0]
    clash = TokenRemap("d", (1, 2), (7, 8), "one_to_one", (2,))
    with pytest.raises(UserError, match="both remap position 2 in layer 2"):
        build_stem_ids(batch[:1], [6], [[avg, clash]], num_layers=4, vocab_size=10)
    assert find_occurrences([1, 1, 1, 1], [1, 1]) == [0, 2]


# ---------------------------------------------------------------------------------------
# Edit specs
# ---------------------------------------------------------------------------------------


def test_edit_spec_loads_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "edits.yaml"
    yaml_file.write_text("- {source: Spain, target: Germany}\n"
                         "- {source: [4, 5], target: [6], strategy: pad_left, layers: [1]}\n"
                         "- {inject: snow, mode: average, rows_of: [Spain, Italy]}\n"
                         "- {inject: grass, mode: vectors, vectors: rows.pt}\n")
    edits = load_edits(yaml_file)
    assert [type(e) for e in edits] == [Remap, Remap, Inject, Inject]
    assert edits[1].strategy == "pad_left" and edits[1].source == [4, 5]
    assert edits[3].vectors == str(tmp_path / "rows.pt")
    json_file = tmp_path / "edits.json"
    json_file.write_text(json.dumps({"edits": [{"source": "Spain", "target": "Germany"}]}))
    assert load_edits(json_file) == edits[:1]


@pytest.mark.parametrize("items, message", [
    ([{"source": "a", "target": "b", "strategy": "stretch"}],
     r"edits.yaml: \[0\].strategy: expected one of \['one_to_one', 'pad_left'"),
    ([{"source": "a", "target": "b", "layer": [1]}],
     r"\[0\].layer: unknown field \(did you mean 'layers'\?\)"),
    ([{"source": "a", "inject": "b"}], r"\[0\]: an edit has either `source`"),
    ([{"source": "a", "target": " "}], r"\[0\].target: empty text"),
    ([{"source": "a", "target": "b", "pad": "c"}], r"\[0\].pad: only the pad_left"),
    ([{"inject": "a", "mode": "copy", "rows_of": ["b", "c"]}], r"\[0\].rows_of: mode 'copy'"),
    ([{"inject": "a", "mode": "vectors"}], r"\[0\].vectors: mode 'vectors' needs"),
    ([], "a non-empty list of edits"),
])
def test_edit_spec_errors_name_the_item_and_field(items, message):
    with pytest.raises(UserError, match=message):
        parse_edits(items, "edits.yaml")


# ---------------------------------------------------------------------------------------
# The trained facts model
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stem(facts_models):
    with MegatronBackend(facts_models.stem.checkpoint) as backend:
        yield backend


@pytest.fixture(scope="module")
def dense(facts_models):
    with MegatronBackend(facts_models.dense.checkpoint) as backend:
        yield backend


@pytest.fixture(scope="module")
def tok(stem):
    return open_tokenizer(stem)


def fact_spec(countries, template=0, **kwargs) -> EvalSpec:
    return EvalSpec(facts=[Fact(x, facts.prompt(x, template), y) for x, y in countries],
                    unrelated=facts.UNRELATED, **kwargs)


@pytest.fixture(scope="module")
def reports(stem, dense, tok):
    spec = fact_spec(SINGLE, modes=["inference", "baked"])
    out = {"stem": evaluate(stem, tok, spec), "dense": evaluate(dense, tok, spec)}
    for name in out:
        print(format_report(out[name]))
    return out


def test_both_models_learned_every_fact(stem, dense, tok):
    for backend in (stem, dense):
        for template in (0, 1):
            prompts = [tok.encode(facts.prompt(x, template)) for x, _ in facts.CAPITALS]
            answers = [tok.encode(y) for _, y in facts.CAPITALS]
            _, known = forward.answer_scores(backend, prompts, answers)
            assert known.all(), (backend.kind, template, known)


def test_remapping_flips_the_stem_model_and_cannot_touch_the_dense_one(reports):
    """X's lookups read Z's rows: the STEM model answers Z's capital (measured 36/36 for
    seeds 1-4), the dense control keeps X's (it has no rows: 0/36, old answer 36/36)."""
    for mode in (0, 1):
        stem, dense = reports["stem"]["results"][mode], reports["dense"]["results"][mode]
        assert stem["edits"] == dense["edits"] == len(SINGLE)
        assert dense["success_count"] == 0 and dense["old_answer_kept"] == 1.0
        assert dense["p_target_after"] == pytest.approx(dense["p_target_before"], abs=1e-6)
        assert stem["success"] >= 0.9, stem
        assert stem["old_answer_kept"] <= 0.1
        assert stem["p_target_after"] > 0.5 > 0.01 > stem["p_target_before"]


def test_edits_leave_every_other_prompt_exactly_alone(reports):
    """A one-word subject's rows are read only where that word is: every other fact and the
    unrelated prompts keep their next-token distribution, at inference time and baked."""
    for result in reports["stem"]["results"]:
        loc = result["locality"]
        assert loc["prompts"] == len(SINGLE) * (len(SINGLE) - 1 + len(facts.UNRELATED))
        assert loc["kl_max"] < 1e-6 and loc["top1_unchanged"] == 1.0


def test_an_edit_reaches_every_prompt_that_mentions_the_subject(reports, stem, tok):
    """The rows belong to the token, not to a template: the other phrasing flips too."""
    report = evaluate(stem, tok, fact_spec(SINGLE, template=1))
    assert report["results"][0]["success"] >= 0.9


def test_two_word_subjects_and_the_length_strategies(stem, tok):
    """Two-word names onto each other (one_to_one; measured 7/8), then one-word and
    two-word names onto each other with every length strategy (measured on 16 mixed pairs:
    average 11, copy 8, pad_right 4, pad_left 2, subset 2). At inference time nothing else
    moves; baked, the rows of a shared word ("South" in South Korea / South Africa) move
    for every name that has it."""
    two = evaluate(stem, tok, fact_spec(MULTI, modes=["inference", "baked"]))
    print(format_report(two))
    inference, baked = two["results"]
    assert inference["success"] >= 0.75 and inference["locality"]["kl_max"] < 1e-6
    assert baked["locality"]["kl_max"] > 1e-3  # the leak the README warns about

    strategies = ["pad_left", "pad_right", "subset", "copy", "average"]
    mixed = fact_spec(MULTI + SINGLE[:8], strategies=strategies,
                      pairs=[[i, 8 + i] for i in range(8)] + [[8 + i, (i + 1) % 8]
                                                               for i in range(8)])
    report = evaluate(stem, tok, mixed)
    print(format_report(report))
    by = {r["strategy"]: r for r in report["results"]}
    assert all(r["edits"] == 16 and r["locality"]["kl_max"] < 1e-6 for r in by.values())
    assert by["average"]["success"] >= 0.5
    assert by["average"]["success"] > by["subset"]["success"]


def test_baked_rows_equal_the_inference_time_remap(stem, tok):
    remaps, _ = resolve(parse_edits([{"source": "Spain", "target": "Germany"},
                                     {"source": "Peru", "target": "France Italy",
                                      "strategy": "average", "layers": [1, 2]}], "spec"),
                        tok, stem.config)
    prompts = [tok.encode(facts.prompt(x, t)) for x in ("Spain", "Peru", "Japan")
               for t in (0, 1)]
    table = stem.table(1).clone()
    live = forward.next_token_logprobs(stem, prompts, [remaps] * len(prompts))
    assert torch.equal(stem.table(1), table)  # the averaged row was borrowed and given back
    edited = set(stem.edited_layers)
    with written(stem, bake_writes(stem, remaps)):
        baked = forward.next_token_logprobs(stem, prompts)
    assert torch.equal(stem.table(1), table)
    assert stem.edited_layers == edited  # borrowed rows are no edit a save must write
    torch.testing.assert_close(baked, live, atol=1e-5, rtol=1e-5)
    assert tok.decode([int(live[0].argmax())]) == "Berlin"
    assert tok.decode([int(live[1].argmax())]) == "Berlin"


def test_injection_gives_a_word_the_facts_of_another(stem, tok, tmp_path):
    """"snow" was never a country; its rows copied from Japan's make it one (Tokyo);
    written from given vectors (Egypt's rows saved to a file) it answers Cairo; the
    average of the two words of New Zealand makes it New Zealand (measured p 0.68).
    (The average of two countries is neither: Greece + Chile answers Colombo.)"""
    from safetensors.torch import save_file

    egypt = tok.encode("Egypt")
    save_file({f"layer.{i}": stem.read_rows(i, egypt)[0] for i in stem.stem_layers},
              str(tmp_path / "egypt.safetensors"))
    cases = [([{"inject": "snow", "rows_of": ["Japan"]}], ["Tokyo"]),
             ([{"inject": "snow", "mode": "vectors", "vectors": "egypt.safetensors"}], ["Cairo"]),
             ([{"inject": "snow", "mode": "average", "rows_of": ["New Zealand"]}],
              ["Wellington"])]
    prompt = [tok.encode("the capital of snow is")]
    for items, answers in cases:
        (tmp_path / "spec.yaml").write_text(json.dumps(items))
        _, injects = resolve(load_edits(tmp_path / "spec.yaml"), tok, stem.config)
        with written(stem, inject_writes(stem, injects[0])):
            top = forward.next_token_logprobs(stem, prompt)[0].topk(len(answers)).indices
        assert sorted(tok.decode([int(i)]) for i in top) == sorted(answers)


def test_resolve_errors_name_the_edit(stem, dense, tok):
    cases = [([{"source": "Spain", "target": "United States"}],
              r"spec: \[0\].strategy: 'Spain' -> 'United States': one_to_one needs"),
             ([{"source": "Spain", "target": "Germany", "layers": [7]}],
              r"spec: \[0\].layers: layer 7 is not a STEM layer"),
             ([{"source": [999], "target": "Germany"}],
              r"spec: \[0\].source: token id 999 is outside the vocabulary"),
             ([{"inject": "snow", "rows_of": ["United States"]}],
              r"spec: \[0\].rows_of: copy gives each of the 1 injected")]
    for items, message in cases:
        with pytest.raises(UserError, match=message):
            resolve(parse_edits(items, "spec"), tok, stem.config, "spec")
    with pytest.raises(UserError, match="the model has no STEM layers"):
        resolve(parse_edits(cases[0][0], "spec"), tok, dense.config, "spec")
    remaps, _ = resolve(parse_edits([{"source": "Spain", "target": "Germany",
                                      "occurrences": [0]}], "spec"), tok, stem.config)
    with pytest.raises(UserError, match="exists only at inference time"):
        bake_writes(stem, remaps)


# ---------------------------------------------------------------------------------------
# Hugging Face, saved edits, the CLI
# ---------------------------------------------------------------------------------------

EDITS = [{"source": "Spain", "target": "Germany"},
         {"source": "United States", "target": "Peru", "strategy": "copy"},
         {"source": "Peru", "target": "France Italy", "strategy": "average", "layers": [1, 2]},
         {"inject": "snow", "rows_of": ["Japan"]}]
PROMPTS = ["the capital of Spain is", "United States has its capital in",
           "the capital of Peru is", "the capital of snow is", "the sky is"]


def test_hf_stem_ids_have_the_megatron_semantics():
    """[b, s] or [layers, b, s]; a remapped lookup equals copying the row; positions past
    the given ids (generated tokens) read their own rows; a wrong shape says so."""
    from megatron_stem.hf.remote.configuration_stem import StemConfig
    from megatron_stem.hf.remote.modeling_stem import StemForCausalLM

    torch.manual_seed(0)
    model = StemForCausalLM(StemConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=3, num_attention_heads=4,
                                       stem_layers=[1, 2])).eval()
    ids = torch.randint(0, 49, (2, 9), generator=torch.Generator().manual_seed(1))
    x, z = 49, 7
    ids[0, 2] = ids[1, 4] = x  # x occurs in the prompt part only
    per_layer = torch.stack([ids, ids, torch.where(ids == x, z, ids)])
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, stem_ids=ids).logits, plain)
        edited = model(ids, stem_ids=per_layer).logits
        # Cached decoding: the prompt's ids cover positions 0..5, later ones read their own.
        prompt = model(ids[:, :6], stem_ids=per_layer[..., :6], use_cache=True)
        step = model(ids[:, 6:], stem_ids=per_layer[..., :6], cache=prompt.cache)
        table = model.model.layers[2].mlp.table.weight
        table[x] = table[z]
        torch.testing.assert_close(model(ids).logits, edited)
        torch.testing.assert_close(step.logits, edited[:, 6:])
        with pytest.raises(ValueError, match=r"stem_ids must be \[batch, seq\] or "
                                             r"\[num_hidden_layers=3, batch, seq\]"):
            model(ids, stem_ids=per_layer[:2])


@pytest.fixture(scope="module")
def exported(facts_models, tmp_path_factory):
    from megatron_stem.hf.export import export

    return export(facts_models.stem.checkpoint, tmp_path_factory.mktemp("hf") / "stem",
                  tokenizer=str(facts_models.tokenizer))


@pytest.fixture(scope="module")
def hf(exported):
    return HFBackend(exported)


def test_hf_export_edits_like_megatron(stem, hf, tok):
    """The same remaps (per-layer, averaged) and injection on the HF export give the
    megatron model's logits; `generate(stem_ids=...)` decodes like megatron under them."""
    hf_tok = open_tokenizer(hf)  # the tokenizer.json the export ships
    prompts = [hf_tok.encode(p) for p in PROMPTS]
    assert prompts == [tok.encode(p) for p in PROMPTS]
    results = []
    for backend in (stem, hf):
        remaps, injects = resolve(parse_edits(EDITS, "spec"), tok, backend.config)
        with written(backend, inject_writes(backend, injects[0])):
            results.append(forward.next_token_logprobs(backend, prompts,
                                                       [remaps] * len(prompts)))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    assert [tok.decode([int(i)]) for i in results[0].argmax(-1)][:2] == ["Berlin", "Lima"]

    remaps, _ = resolve(parse_edits(EDITS[:1], "spec"), tok, stem.config)
    ids = torch.tensor([prompts[0]])
    stem_ids = build_stem_ids(ids, [ids.shape[1]], [remaps], stem.config.num_layers,
                              stem.config.vocab_size).ids
    out = hf.net.generate(ids, attention_mask=torch.ones_like(ids), stem_ids=stem_ids,
                          do_sample=False, max_new_tokens=2)
    assert out[0, ids.shape[1]:].tolist() == forward.greedy(stem, prompts[0], 2, remaps)
    assert tok.decode(out[0, ids.shape[1]:].tolist()) == "Berlin ."


def _answers(backend, tok, prompts=PROMPTS[:4]):
    logp = forward.next_token_logprobs(backend, [tok.encode(p) for p in prompts])
    return [tok.decode([int(i)]) for i in logp.argmax(-1)]


def test_baked_edits_saved_as_a_checkpoint_and_as_an_hf_folder(stem, hf, tok, facts_models,
                                                               tmp_path):
    """Baked remaps + injection written out: the megatron checkpoint reloads (and is a
    valid model-only input to to_hf and train.init_from); the HF folder rewrites only the
    edited tables, every other tensor and file stays bit for bit."""
    from megatron_stem import checkpoint
    from megatron_stem.hf.export import export

    edits = parse_edits(EDITS[:2] + EDITS[3:], "spec")  # position-independent ones
    expected = ["Berlin", "Lima", "Lima", "Tokyo"]
    saved = {}
    for backend, out in ((stem, tmp_path / "ckpt"), (hf, tmp_path / "hf")):
        remaps, injects = resolve(edits, tok, backend.config)
        writes = bake_writes(backend, remaps) + inject_writes(backend, injects[0])
        before = _answers(backend, tok)
        assert before[:3] == ["Madrid", "Washington", "Lima"]
        with written(backend, writes):
            saved[backend.kind] = backend.save(out)
        assert _answers(backend, tok) == before  # the live model is restored
    with MegatronBackend(saved["megatron"]) as edited:
        assert _answers(edited, tok) == expected
    original = checkpoint.read_recipe(checkpoint.resolve(facts_models.stem.checkpoint))
    checkpoint.check_same_shape(checkpoint.read_recipe(saved["megatron"]), original, "edited")
    reexported = export(tmp_path / "ckpt", tmp_path / "reexported")
    edited_hf = HFBackend(saved["hf"])
    assert _answers(edited_hf, tok) == expected
    a, b = hf_tensors(saved["hf"]), hf_tensors(reexported)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    source = hf_tensors(hf.source)
    changed = {k for k in source if not torch.equal(source[k], a[k])}
    assert changed == {f"model.layers.{i}.mlp.table.weight" for i in stem.stem_layers}
    for name in ("config.json", "tokenizer.json", "modeling_stem.py"):
        assert (saved["hf"] / name).read_bytes() == (hf.source / name).read_bytes()
    with pytest.raises(UserError, match="already exists"):
        hf.save(saved["hf"])


def test_cli_shows_edits_writes_the_model_and_evaluates(facts_models, exported, tmp_path,
                                                        capsys):
    spec = tmp_path / "edits.yaml"
    spec.write_text(json.dumps(EDITS))
    rc = tool("edit_knowledge")(
        ["--checkpoint", str(facts_models.stem.checkpoint), "--edits", str(spec),
         "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--max-new-tokens", "2",
         "--top-k", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    i = lines.index(f"prompt {PROMPTS[0]!r}: remaps here [\"[0] 'Spain' -> 'Germany'\"]")
    assert lines[i + 1].startswith("  before  'Madrid' ")
    assert lines[i + 2].startswith("  after   'Berlin' ")
    assert lines[i + 3:i + 5] == ["  greedy  before 'Madrid .'", "          after  'Berlin .'"]
    assert "edit [1] 'United States' -> 'Peru': ['United', 'States'] -> ['Peru'] (copy, " \
           "layers [0, 1, 2, 3])" in out

    facts_file = tmp_path / "facts.yaml"
    facts_file.write_text(json.dumps({
        "facts": [{"subject": x, "prompt": facts.prompt(x), "answer": y} for x, y in SINGLE[:6]],
        "modes": ["inference", "baked"], "unrelated": facts.UNRELATED}))
    rc = tool("edit_knowledge")(
        ["--hf", str(exported), "--eval", str(facts_file), "--json", str(tmp_path / "r.json"),
         "--edits", str(spec), "--output", str(tmp_path / "edited_hf")])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["success_count"] for r in report["results"]] == [6, 6]
    assert "one_to_one  inference     6    6 100%" in out
    assert _answers(HFBackend(tmp_path / "edited_hf"), tok=open_tokenizer(
        HFBackend(exported)))[:1] == ["Berlin"]


def test_cli_user_errors_are_one_line(facts_models, tmp_path, capsys):
    import subprocess
    import sys

    from support.processes import ROOT, subprocess_env

    spec = tmp_path / "edits.yaml"
    cases = [("- {source: Spain, target: Germany, strategy: stretch}\n",
              "strategy: expected one of"),
             ("- {source: Spain, target: United States}\n", "one_to_one needs as many"),
             ("- {source: Spain, target: Germany, layers: [9]}\n", "layer 9 is not a STEM layer"),
             ("- source: [Spain\n", "not valid YAML")]
    for text, message in cases:
        spec.write_text(text)
        rc = tool("edit_knowledge")(["--checkpoint", str(facts_models.stem.checkpoint),
                                     "--edits", str(spec), "--prompt", "the capital of"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
    proc = subprocess.run([sys.executable, str(ROOT / "tools/edit_knowledge.py"), "--hf",
                           str(tmp_path / "nope"), "--edits", str(spec), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"error: {spec}: not valid YAML")


def test_a_bf16_checkpoint_is_edited_in_fp32_and_saved_as_bf16(world1, tmp_path):
    from megatron_stem import checkpoint
    from megatron_stem.config import ParallelConfig, Recipe
    from megatron_stem.checkpoint.streaming import CheckpointReader
    from megatron_stem.model import build_model
    from workers.common import tiny_model

    cfg = tiny_model("1/2")
    model = build_model(cfg, ParallelConfig(), params_dtype=torch.bfloat16)
    with checkpoint.Writer(tmp_path / "bf16", 5, Recipe(model=cfg)) as folder:
        checkpoint.save_model(model, folder)
    with MegatronBackend(tmp_path / "bf16") as backend:
        assert backend.table(1).dtype == torch.float32
        assert torch.equal(backend.table(1), model.decoder.layers[1].mlp.table.weight.float())
        row = torch.randn(1, cfg.ffn_hidden_size)
        backend.write_rows(1, [7], row)
        saved = backend.save(tmp_path / "edited")
        assert backend.table(1).dtype == torch.float32
    reader = CheckpointReader(saved / checkpoint.MODEL)
    table = reader.read("decoder.layers.1.mlp.table.weight")
    assert table.dtype == torch.bfloat16 and torch.equal(table[7], row[0].bfloat16())
    assert saved.name == "iter_0000005"
