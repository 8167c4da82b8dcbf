"""`train --print-config` and `train --check` on every shipped recipe and on a recipe whose
files exist: the resolved recipe with each value's origin, and every problem at once."""

import os
import shutil

import pytest
import yaml

from support.processes import ROOT
from megatron_stem.config import Recipe, from_dict, load_recipe, to_dict
from megatron_stem.train import main

RECIPES = sorted(p.relative_to(ROOT) for p in (ROOT / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their files from the repository's root


def run(capsys, *argv) -> tuple[int, list[str], list[str]]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def origins(lines: list[str]) -> dict[str, tuple[str, str]]:
    """{dotted key: (value, origin comment)} of a --print-config listing."""
    found, sections = {}, []
    for line in lines:
        if line.startswith("#") or line.lstrip().startswith("- "):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key, _, rest = line.strip().partition(":")
        value, _, origin = rest.partition("  # ")
        sections[depth:] = [key]
        if origin or value.strip():
            found[".".join(sections)] = (value.strip(), origin)
    return found


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_print_config_is_the_resolved_recipe_with_each_values_origin(recipe, capsys):
    code, out, err = run(capsys, "--recipe", recipe, "--print-config")
    assert (code, err) == (0, [])
    loaded = load_recipe(recipe)
    assert yaml.safe_load("\n".join(out)) == to_dict(loaded)  # the recipe, inherit resolved
    assert from_dict(Recipe, yaml.safe_load("\n".join(out))) == loaded
    assert out[0] == f"# {recipe}, resolved"
    values = origins(out)
    assert values["train.save_dir"][1] == str(recipe)  # every stage names its own
    assert values["train.deterministic"] == ("false", "default")


def test_each_value_names_the_file_of_the_chain_or_the_override_that_set_it(capsys):
    code, out, _ = run(capsys, "--recipe", "recipes/stem_1b_long.yaml", "--print-config",
                       "train.micro_batch_size=2", "data.validation={held_out: d/x}")
    assert code == 0
    assert out[1] == "# inherits: recipes/dense_1b_long.yaml <- recipes/dense_1b_midtrain.yaml" \
                     " <- recipes/dense_1b_pretrain.yaml <- recipes/dense_1b.yaml"
    assert out[2] == "# overrides: train.micro_batch_size=2 'data.validation={held_out: d/x}'"
    values = origins(out)
    assert values["model.hidden_size"] == ("2048", "recipes/dense_1b.yaml")
    assert values["model.seq_length"] == ("32768", "recipes/dense_1b_long.yaml")
    assert values["model.stem_layers"] == ("1/3", "recipes/stem_1b_long.yaml")
    assert values["data.prefixes"] == ("[]", "recipes/dense_1b_pretrain.yaml")
    assert values["data.sources"][1] == "recipes/data/long_context_llama3.yaml"
    assert values["train.micro_batch_size"] == ("2", "override")
    assert values["data.validation.held_out"] == ("d/x", "override")
    assert values["optimizer.eps"] == ("1.0e-08", "default")


def test_print_config_of_a_broken_recipe_lists_its_problems(capsys):
    code, out, err = run(capsys, "--recipe", "recipes/tiny_cpu.yaml", "--print-config",
                         "train.micro_batch_size=3", "model.hiden_size=2")
    assert (code, out) == (2, [])
    assert err == [
        "error: command line: model.hiden_size=2: unknown field (did you mean 'hidden_size'?)",
        "error: command line: train.micro_batch_size=3: train.global_batch_size: 16 is not a "
        "multiple of micro_batch_size=3",
        "2 problem(s): nothing started"]


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_check_of_a_recipe_whose_files_are_not_here_names_each_missing_one(recipe, capsys):
    """No token file, tokenizer or previous stage of the shipped recipes is in the checkout:
    each is one line naming its field, and nothing is started."""
    loaded = load_recipe(recipe)
    code, out, err = run(capsys, "--recipe", recipe, "--check", "--nodes", "4",
                         "--gpus-per-node", "8", "--hardware", "h200")
    assert code == 2 and err[-1] == f"{len(err) - 1} problem(s): nothing started"
    problems = err[:-1]
    prefixes, _ = loaded.data.training_blend()
    for i, prefix in enumerate(prefixes):
        assert f"error: {loaded.data.field_of(i)}: {prefix}.bin not found (give the path " \
               "without .bin/.idx, or a prefix-set folder, as written by preprocess_data.py)" \
            in problems
    assert sum(line.startswith("error: data.tokenizer_model: ") for line in problems) == 1
    init_from = loaded.train.init_from
    stage = bool(init_from) and init_from.endswith(".yaml")
    if stage:  # the stage before has not run here: where this one will start
        previous = load_recipe(init_from).train.save_dir
        assert f"start: will start from the last checkpoint in {previous} when {init_from} " \
               "finishes (not started yet)" in out
    missing = bool(init_from) and not stage  # an import's folder (tools/from_hf.py)
    assert sum(line.startswith("error: train.init_from: ") for line in problems) == missing
    assert len(problems) == len(prefixes) + 1 + missing + (recipe.stem == "tiny_cpu")
    assert out[0] == "fields: no problems"
    assert f"data: the token files of 0 of {len(prefixes)} entries are there and whole" in out
    assert "hardware: h200 (--hardware h200)" in out


@pytest.fixture
def ready(toy_data, hf_tokenizer, tmp_path):
    """A recipe whose token files and tokenizer exist (tiny_cpu's model on the toy data)."""
    recipe = tmp_path / "ready.yaml"
    recipe.write_text(f"inherit: {ROOT / 'recipes' / 'tiny_cpu.yaml'}\n"
                      f"model: {{vocab_size: 640}}\n"
                      f"data: {{prefixes: [{toy_data}], tokenizer_type: huggingface, "
                      f"tokenizer_model: {hf_tokenizer}}}\n"
                      f"train: {{save_dir: {tmp_path / 'run'}}}\n")
    return recipe


def test_check_passes_a_recipe_whose_files_are_all_here(ready, hf_tokenizer, capsys):
    code, out, err = run(capsys, "--recipe", ready, "--check", "--gpus-per-node", "2",
                         "--hardware", "h100")
    assert (code, err) == (0, [])
    assert out[:5] == ["fields: no problems",
                       "data: the token files of 1 of 1 entries are there and whole",
                       f"tokenizer: {hf_tokenizer}, 600 ids", "start: from scratch",
                       "hardware: h100 (--hardware h100)"]
    assert out[5].startswith("memory per GPU: ") and out[5].endswith(
        " on 1 x 2 h100, of 80 GB (not counted: CUDA context, NCCL buffers and allocator "
        "fragmentation, a few GB)")
    assert out[6].startswith("budget: ") and out[-1] == "all checks passed"


def test_check_lists_every_problem_at_once(ready, toy_data, hf_tokenizer, tmp_path, capsys):
    """A field, a damaged token file, a tokenizer too large for the model, a batch and
    tables the world does not divide: all in one run, one line each."""
    damaged = tmp_path / "damaged"
    shutil.copy(toy_data + ".idx", f"{damaged}.idx")
    with open(toy_data + ".bin", "rb") as f, open(f"{damaged}.bin", "wb") as out:
        out.write(f.read()[:-6])  # the last three tokens lost
    code, out, err = run(capsys, "--recipe", ready, "--check", "--gpus-per-node", "3",
                         "--hardware", "h100",
                         f"data.validation={{held_out: {damaged}}}", "model.vocab_size=512",
                         "guard.spike_factor=0.5", "train.save_interval=0")
    assert code == 2
    size = (tmp_path / "damaged.bin").stat().st_size
    assert err == [
        "error: command line: train.save_interval=0: must be positive, got 0",
        "error: command line: guard.spike_factor=0.5: must be above 1 (or 0: off), got 0.5",
        f"error: data.validation.held_out: {damaged}.bin is {size:,} bytes but its .idx "
        f"needs {size + 6:,} bytes (truncated, or the .idx of another prefix)",
        f"error: data.tokenizer_model: {hf_tokenizer}: the tokenizer "
        f"has 600 tokens but the model's vocab_size is 512: not this model's tokenizer (its ids "
        "would index past the embedding and the STEM tables)",
        "error: --nodes 1 --gpus-per-node 3: train.global_batch_size: 16 is not a multiple of "
        "micro_batch_size x data-parallel size = 24",
        "error: --nodes 1 --gpus-per-node 3: tables.partition: sharded splits the 512 table "
        "rows (model.vocab_size) evenly over the 3 data-parallel ranks, and 3 does not divide "
        "512; use a data-parallel size that does (2 or 4), or tables.partition=replicated",
        "6 problem(s): nothing started"]


def test_memory_that_does_not_fit_is_a_problem_naming_the_flags(capsys):
    code, _, err = run(capsys, "--recipe", "recipes/stem_1b_long.yaml", "--check",
                       "--gpus-per-node", "1", "--hardware", "h100")
    assert code == 2
    (line,) = [e for e in err if "memory per GPU" in e]
    assert line.startswith("error: --nodes 1 --gpus-per-node 1 --hardware h100: memory per "
                           "GPU: ") and line.endswith(
        " GB predicted on 1 x 1 h100, more than its 80 GB (not counted: CUDA context, NCCL "
        "buffers and allocator fragmentation, a few GB; tools/plan_step.py shows the parts)")


def test_a_data_parallel_size_that_does_not_divide_the_vocabulary_is_found_by_check(capsys):
    """The issue's 5 x 8 job: 40 data-parallel ranks cannot split 128,256 table rows, which
    the trainer refuses at start (config/world.py) and --check reports in the same words."""
    code, _, err = run(capsys, "--recipe", "recipes/stem_1b_pretrain.yaml", "--check",
                       "--nodes", "5", "--gpus-per-node", "8", "--hardware", "h100",
                       "train.global_batch_size=640", "train.micro_batch_size=2")
    assert code == 2
    assert "error: --nodes 5 --gpus-per-node 8: tables.partition: sharded splits the 128,256 " \
           "table rows (model.vocab_size) evenly over the 40 data-parallel ranks, and 40 does " \
           "not divide 128,256; use a data-parallel size that does (32 or 48), or " \
           "tables.partition=replicated" in err
    assert not any("memory per GPU" in line for line in err)  # no step on that world


def fake_nvidia_smi(tmp_path, monkeypatch, names: list[str]) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{n}'\n" for n in names))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


@pytest.mark.parametrize("gpus, said", [
    (["NVIDIA H100 80GB HBM3"] * 8, "hardware: h100 (nvidia-smi: NVIDIA H100 80GB HBM3)"),
    (["NVIDIA H200"], "hardware: h200 (nvidia-smi: NVIDIA H200)")])
def test_without_hardware_check_plans_for_the_gpu_nvidia_smi_finds(
        ready, tmp_path, monkeypatch, capsys, gpus, said):
    fake_nvidia_smi(tmp_path, monkeypatch, gpus)
    code, out, err = run(capsys, "--recipe", ready, "--check", "--gpus-per-node", "2")
    assert (code, err) == (0, [])
    assert said in out
    capacity = "80" if "h100" in said else "141"
    assert any(line.endswith(f"h{said[11:14]}, of {capacity} GB (not counted: CUDA context, "
                             "NCCL buffers and allocator fragmentation, a few GB)")
               for line in out), out


@pytest.mark.parametrize("gpus, why", [
    (None, "no GPU here (nvidia-smi did not run)"),
    (["NVIDIA A100-SXM4-80GB"], "nvidia-smi: NVIDIA A100-SXM4-80GB, which has no profile of "
                                "its own")])
def test_without_hardware_and_no_known_gpu_check_asks_for_it(
        ready, tmp_path, monkeypatch, capsys, gpus, why):
    if gpus is None:
        monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    else:
        fake_nvidia_smi(tmp_path, monkeypatch, gpus)
    code, _, err = run(capsys, "--recipe", ready, "--check", "--gpus-per-node", "2")
    assert code == 2
    assert err == [f"error: --hardware: not given, and {why}: name the GPUs of the job "
                   "(h100, h200)", "1 problem(s): nothing started"]


def test_print_config_with_check_prints_the_recipe_then_checks_it(ready, capsys):
    code, out, err = run(capsys, "--recipe", ready, "--print-config", "--check",
                         "--gpus-per-node", "2", "--hardware", "h100")
    assert (code, err) == (0, [])
    listing = out[:out.index("")]
    assert listing[0] == f"# {ready}, resolved"
    assert yaml.safe_load("\n".join(listing)) == to_dict(load_recipe(ready))
    assert out[out.index("") + 1] == "fields: no problems" and out[-1] == "all checks passed"
    code, out, err = run(capsys, "--recipe", ready, "--print-config", "--check",
                         "train.save_interval=0")  # a problem: no listing, the check's lines
    assert code == 2 and out[0] == "fields: 1 problem(s)"
    assert err == ["error: command line: train.save_interval=0: must be positive, got 0",
                   "1 problem(s): nothing started"]


@pytest.mark.parametrize("flags", [["--nodes", "4"], ["--gpus-per-node", "8", "--hardware", "h100"]])
def test_the_jobs_size_without_check_says_it_needs_check(ready, capsys, flags):
    code, out, err = run(capsys, "--recipe", ready, "--print-config", *flags)
    assert (code, out) == (2, [])
    assert err == [f"error: {', '.join(f for f in flags if f.startswith('--'))}: describe the "
                   "job for --check; add --check (training itself takes its size from torchrun)"]


def test_token_files_too_narrow_for_the_tokenizers_ids_are_another_tokenizers(
        ready, tmp_path, capsys):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    narrow = str(tmp_path / "narrow")
    builder = IndexedDatasetBuilder(narrow + ".bin", dtype=np.int8)
    builder.add_document(torch.tensor([5, 6, 7]), [3])
    builder.finalize(narrow + ".idx")
    code, _, err = run(capsys, "--recipe", ready, "--check", f"data.validation={{x: {narrow}}}")
    assert code == 2
    assert err[:-1] == [f"error: data.validation.x: {narrow}.idx holds int8 tokens, too narrow "
                        "for this tokenizer's 600 ids: written with another tokenizer"]
