import pytest

from megatron_stem.config import ModelConfig, Recipe, from_dict, load_recipe
from megatron_stem.runtime.errors import ConfigError

from support.processes import ROOT

BASE = {"hidden_size": 64, "num_layers": 16, "num_attention_heads": 4, "ffn_hidden_size": 128,
        "vocab_size": 300, "seq_length": 32}


def model(**kw) -> ModelConfig:
    return from_dict(ModelConfig, {**BASE, **kw})


@pytest.mark.parametrize("placement, expected", [
    ("none", []),
    ("1/3", [1, 4, 7, 10, 13]),
    ("1/2", [1, 3, 5, 7, 9, 11, 13, 15]),
    ("full", list(range(1, 16))),
    ([5, 2], [2, 5]),
])
def test_placements(placement, expected):
    assert model(stem_layers=placement).stem_layer_indices == expected


@pytest.mark.parametrize("data, message", [
    ({"hiden_size": 64}, r"model\.hiden_size: unknown field \(did you mean 'hidden_size'\?\)"),
    ({"num_layers": "sixteen"}, r"model\.num_layers: expected an integer, got 'sixteen'"),
    ({"num_layers": 16.5}, r"model\.num_layers: expected an integer, got 16\.5"),
    ({"num_layers": True}, r"model\.num_layers: expected an integer, got True"),
    ({"init_std": "small"}, r"model\.init_std: expected a number, got 'small'"),
    ({"untie_embeddings": 1}, r"model\.untie_embeddings: expected true/false"),
    ({"stem_layers": "1/4"}, r"model\.stem_layers: expected one of .* or expected a list"),
    ({"stem_layers": [0, 16]}, r"model\.stem_layers: index 16 is out of range for num_layers=16"),
    ({"stem_layers": [1, 1]}, r"model\.stem_layers: duplicate index"),
    ({"num_attention_heads": 5}, r"model\.hidden_size: 64 is not divisible by num_attention_"),
    ({"num_query_groups": 3}, r"model\.num_query_groups: 3 must divide num_attention_heads=4"),
    ({"vocab_size": 0}, r"model\.vocab_size: must be positive"),
])
def test_model_errors_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Recipe, {"model": {**BASE, **data}})


def test_layout_must_fit_the_model():
    with pytest.raises(ConfigError, match=r"model\.ffn_hidden_size: 128 is not divisible by "
                                          r"parallel\.tensor_parallel=3"):
        from_dict(Recipe, {"model": {**BASE, "num_attention_heads": 1},
                           "parallel": {"tensor_parallel": 3}})
    with pytest.raises(ConfigError, match=r"model\.num_layers: 16 is not divisible by "
                                          r"parallel\.pipeline_parallel=3"):
        from_dict(Recipe, {"model": BASE, "parallel": {"pipeline_parallel": 3}})
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: needs tensor_parallel"):
        from_dict(Recipe, {"model": BASE, "parallel": {"sequence_parallel": True}})
    with pytest.raises(ConfigError, match=r"model: required field is missing"):
        from_dict(Recipe, {"parallel": {}})


def test_recipes_inherit_and_accept_overrides(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "stem_1b.yaml",
                         ["model.stem_layers=[2, 3]", "parallel.tensor_parallel=2"])
    assert recipe.model.hidden_size == 2048 and recipe.model.stem_layer_indices == [2, 3]
    assert recipe.parallel.tensor_parallel == 2
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="inherit cycle"):
        load_recipe(tmp_path / "a.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["model.hidden_sise=3"], "command line: model.hidden_sise=3: unknown field "
                              "(did you mean 'hidden_size'?)"),
    (["train.steps=5", "train.steps=many"], "command line: train.steps=many: expected an "
                                            "integer, got 'many'"),
    (["trian.steps=5"], "command line: trian.steps=5: trian: unknown field "
                        "(did you mean 'train'?)"),
    (["model={hidden_size: 3}"], "command line: model={hidden_size: 3}: "
                                 "model.num_layers: required field is missing"),
    (["model.hidden_size=2048=1"], "command line: model.hidden_size=2048=1: expected an "
                                   "integer, got '2048=1'"),
    (["train"], "command line: train: expected the form section.field=value"),
])
def test_errors_in_command_line_overrides_say_so(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "recipes" / "stem_1b.yaml", overrides)
    assert str(e.value) == message


def test_errors_in_the_recipe_name_its_file(tmp_path):
    (tmp_path / "base.yaml").write_text((ROOT / "recipes" / "tiny_cpu.yaml").read_text())
    (tmp_path / "mine.yaml").write_text("inherit: base.yaml\ntrain:\n  stpes: 5\n")
    with pytest.raises(ConfigError) as e:  # an override of another field changes nothing
        load_recipe(tmp_path / "mine.yaml", ["train.steps=5"])
    assert str(e.value) == f"{tmp_path / 'mine.yaml'}: train.stpes: unknown field " \
                           "(did you mean 'steps'?)"


def test_every_shipped_recipe_loads():
    names = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert {"stem_1b.yaml", "dense_1b.yaml", "tiny_cpu.yaml", "stem_350m_third.yaml",
            "stem_350m_half.yaml", "stem_350m_full.yaml", "dense_350m.yaml"} <= set(names)
    tokenizer_of = {}  # token files -> the tokenizer that made them
    for name in names:
        recipe = load_recipe(ROOT / "recipes" / name)
        for prefix in recipe.data.training_blend()[0]:
            made_by = tokenizer_of.setdefault(prefix, recipe.data.tokenizer_model)
            assert made_by == recipe.data.tokenizer_model, \
                f"{name}: reads {prefix}, ids of {made_by}, with {recipe.data.tokenizer_model}"


def test_table_settings_that_moved_say_where_they_went(tmp_path):
    """The table optimizer's settings left `tables` for `optimizer.tables`: an old recipe
    (file or command line) is refused with the new name, never silently ignored."""
    (tmp_path / "old.yaml").write_text("inherit: " + str(ROOT / "recipes" / "tiny_cpu.yaml")
                                       + "\ntables:\n  update: lazy\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(tmp_path / "old.yaml")
    assert str(e.value) == f"{tmp_path / 'old.yaml'}: tables.update: moved to " \
                           "optimizer.tables.update"
    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "recipes" / "stem_1b.yaml", ["tables.optimizer_device=cpu"])
    assert str(e.value) == "command line: tables.optimizer_device=cpu: moved to " \
                           "optimizer.tables.device"


def test_checkpoints_saved_before_the_split_read_in_the_new_shape(tmp_path):
    import yaml

    from megatron_stem import checkpoint
    from megatron_stem.config import to_dict

    recipe = load_recipe(ROOT / "recipes" / "stem_1b.yaml",
                         ["optimizer.tables.kernel=torch", "optimizer.tables.lr_mult=2.0"])
    saved = to_dict(recipe)  # as checkpoints wrote it then: one `tables` section
    moved = saved["optimizer"].pop("tables")
    moved["optimizer_device"] = moved.pop("device")
    saved["tables"].update(moved)
    (tmp_path / checkpoint.RECIPE).write_text(yaml.safe_dump(saved))
    assert checkpoint.read_recipe(tmp_path) == recipe


def test_the_table_sections_docs_show_are_the_defaults():
    """docs/training.md's YAML of the two table sections loads, and says the defaults."""
    import re

    import yaml

    from megatron_stem.config import TableOptimizerConfig, TableStorageConfig

    text = (ROOT / "docs" / "training.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
                if re.search(r"^tables:", b, re.M)]
    shown = yaml.safe_load(block)
    assert from_dict(TableOptimizerConfig, shown["optimizer"]["tables"]) == TableOptimizerConfig()
    assert from_dict(TableStorageConfig, shown["tables"]) == TableStorageConfig()


def test_numbers_as_people_type_them_in_recipes_and_overrides(tmp_path):
    """YAML 1.1 (PyYAML) reads `3e-4` and `1e5` as strings, and so does an override's
    value: a numeric field takes what Python's float()/int() take, an int field an
    integral float; bools and strings stay strict."""
    (tmp_path / "mine.yaml").write_text(
        "inherit: " + str(ROOT / "recipes" / "tiny_cpu.yaml") + "\n"
        "optimizer: {lr: 3e-4, eps: 1E-8, zero_stage: '2'}\n"
        "train: {steps: 1e3, log_interval: '10', peak_flops: 1_000e12}\n")
    recipe = load_recipe(tmp_path / "mine.yaml")
    assert (recipe.optimizer.lr, recipe.optimizer.eps, recipe.optimizer.zero_stage) == \
        (3e-4, 1e-8, 2)
    assert (recipe.train.steps, recipe.train.log_interval, recipe.train.peak_flops) == \
        (1000, 10, 1e15)
    assert type(recipe.train.steps) is int and type(recipe.optimizer.lr) is float
    recipe = load_recipe(tmp_path / "mine.yaml",
                         ["optimizer.lr=6e-4", "train.steps=2.0e3", "train.seed=1e1",
                          "optimizer.tables.lr_mult=2", "data.weights=[1, 5e-1]",
                          "data.prefixes=[a, b]"])
    assert (recipe.optimizer.lr, recipe.train.steps, recipe.train.seed) == (6e-4, 2000, 10)
    assert recipe.optimizer.tables.lr_mult == 2.0 and recipe.data.weights == [1.0, 0.5]
    for override, message in [
            ("train.steps=25e-2", "expected an integer, got '25e-2'"),
            ("train.steps=2.5", "expected an integer, got 2.5"),
            ("train.steps=inf", "expected an integer, got 'inf'"),
            ("optimizer.lr=fast", "expected a number, got 'fast'"),
            ("optimizer.lr=true", "expected a number, got True"),
            ("optimizer.zero_stage=3e0", "expected one of [1, 2], got 3"),
            ("model.untie_embeddings=1", "expected true/false, got 1"),
            ("model.untie_embeddings='true'", "expected true/false, got 'true'"),
            ("train.save_dir=2.5", "expected a string, got 2.5"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_recipe(tmp_path / "mine.yaml", [override])
        assert str(e.value) == f"command line: {override}: {message}"


@pytest.mark.parametrize("overrides, message", [
    (["lm_eval.interval=100"], "command line: lm_eval.interval=100: lm_eval.tasks: none "
                               "given to run every 100 steps (lm_eval.interval=0 turns it off)"),
    (["lm_eval.tasks=[hellaswag]", "lm_eval.interval=-1"],
     "command line: lm_eval.interval=-1: must be positive, got -1"),
    (["data.validation={a/b: x}"], "command line: data.validation={a/b: x}: "
                                   "data.validation.a/b: a set's name is letters, digits, '_', "
                                   "'-' or '.' (it names the set's TensorBoard tags)"),
    (["data.split=100,0,0"], "command line: data.split=100,0,0: '100,0,0' has no validation "
                             "share and data.validation names no sets: nothing to validate on"),
])
def test_the_long_run_sections_refuse_what_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", overrides)
    assert str(e.value) == message
    recipe = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml",
                         ["data.split=100,0,0", "data.validation={a: x, b: [y, z]}",
                          "lm_eval.tasks=[hellaswag]"])  # interval 0: off, tasks kept
    assert recipe.data.validation_sets == {"a": ["x"], "b": ["y", "z"]}
    assert not recipe.data.split_validates and recipe.lm_eval.interval == 0


@pytest.mark.parametrize("override, message", [
    ("optimizer.lr=nan", "expected a finite number, got 'nan'"),
    ("optimizer.lr=.inf", "expected a finite number, got inf"),
    ("optimizer.lr=-1e-3", "must be above 0, got -0.001"),
    ("optimizer.lr=4e4", "must be <= 1000, got 40000.0 (Adam's step is about lr per "
                         "weight: a learning rate is far below 1)"),
    ("optimizer.clip_grad=-1", "must be >= 0, got -1.0"),
    ("optimizer.weight_decay=-0.1", "must be >= 0, got -0.1"),
    ("optimizer.min_lr_ratio=1.5", "must be <= 1, got 1.5 (a fraction "
                                   "of lr)"),
    ("optimizer.tables.lr_mult=0", "must be above 0, got 0.0"),
    ("train.global_batch_size=1000000000000", "must be <= 16777216, got 1000000000000 (sequences per step; the 1B recipe takes 512)"),
    ("model.rotary_base=-inf", "expected a finite number, got '-inf'"),
])
def test_nonsense_numbers_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", [override])
    assert str(e.value) == f"command line: {override}: {message}"


def test_a_nonsense_number_in_a_recipe_file_names_the_field(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"inherit: {ROOT / 'recipes' / 'tiny_cpu.yaml'}\n"
                      "optimizer: {lr: .nan}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe)
    assert str(e.value) == f"{recipe}: optimizer.lr: expected a finite number, got nan"


def test_an_override_that_breaks_a_rule_across_fields_is_named():
    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "recipes" / "dense_1b.yaml", ["train.micro_batch_size=3"])
    assert str(e.value) == "command line: train.micro_batch_size=3: train.global_batch_size: " \
                           "512 is not a multiple of micro_batch_size=3"


def test_every_problem_is_found_at_once_each_named_by_its_file_or_override(tmp_path):
    """What `train --check` lists: a field's problem does not hide another's, and none is
    reported that only follows from another (train's rules wait for its fields)."""
    from megatron_stem.config import RecipeSource

    (tmp_path / "base.yaml").write_text((ROOT / "recipes" / "tiny_cpu.yaml").read_text()
                                        + "guard:\n  spike_window: 0\n")
    (tmp_path / "mine.yaml").write_text("inherit: base.yaml\nmodel:\n  hiden_size: 3\n"
                                        "train:\n  steps: many\n")
    recipe, problems = RecipeSource.read(tmp_path / "mine.yaml", [
        "optimizer.lr=fast", "data.split=[1", "train.micro_batch_size=3"]).load()
    mine = tmp_path / "mine.yaml"
    assert problems == [
        "command line: data.split=[1: not a YAML value (expected ',' or ']', but got "
        "'<stream end>')",
        f"{mine}: model.hiden_size: unknown field (did you mean 'hidden_size'?)",
        "command line: optimizer.lr=fast: expected a number, got 'fast'",
        f"{mine}: train.steps: expected an integer, got 'many'",
        f"{mine}: guard.spike_window: must be >= 1, got 0 (set in {tmp_path / 'base.yaml'})"]
    assert recipe.optimizer.lr == 4e-4 and recipe.model.hidden_size == 128  # the valid rest
