"""Every shell command the docs show works as written.

The README's two set-up commands are run for real elsewhere: the test-suite command is
`.ci/run`'s, verbatim, and `tools/quickstart.sh` is run by tests/test_quickstart.py. Every
other command in a ```bash block of README.md, docs/*.md and bench/README.md is checked
here without running it: the program it names exists, its own argument parser accepts the
arguments (the real `main` of each tool, stopped right after parsing), recipes load with
the overrides given, and the environment variables set are ones the script reads. The
README is also read as one script: every path a command reads must be in the checkout or
written by a command before it, so its walk-through uses the recipes' own paths. Figures
quoted in two places agree with their source: the step planner's predicted 1B step and
memory (its output), the CPU quality comparison (docs/quality.md). Relative links resolve,
anchors included.
"""

import argparse
import contextlib
import functools
import io
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

from support.processes import ROOT
from support.processes import tool_main as script_main
from megatron_stem.config import load_recipe
from megatron_stem.runtime.errors import ConfigError

DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "bench/README.md"]
PYTHONS = {"python", "python3", ".venv/bin/python"}
# SLURM's own clients: their flags are SLURM's business (the SLURM tests run them).
SLURM_CLIENTS = {"scancel"}

def command_lines(doc: str) -> list[str]:
    """The commands of `doc`'s ```bash blocks, one per line (continuations joined)."""
    text = (ROOT / doc).read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(" ".join(line.split()))
    return lines


def commands(line: str) -> list[tuple[dict, list[str]]]:
    """A command line as its `&&`-chained commands: (environment assignments, words)."""
    out = []
    for part in line.split(" && "):
        words = shlex.split(part)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        out.append((env, words))
    return out


@dataclass
class Step:
    """The repository-relative paths a command reads and writes."""
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)


# --- running a CLI's argument parsing, and nothing else ----------------------------------

class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parsed_args(main, argv: list[str], what: str) -> argparse.Namespace:
    """The namespace `main()` parses from `argv` (its sys.argv[1:]); it is stopped there."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise _Parsed(parse(parser, args, namespace))

    stderr = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            mock.patch.object(sys, "argv", [what, *argv]), contextlib.redirect_stderr(stderr):
        try:
            main()
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:
            pytest.fail(f"{what} refuses {argv} (exit {e.code}): {stderr.getvalue()}")
    pytest.fail(f"{what}: main() returned without parsing its arguments")


def recipe_step(recipe: str, overrides: list[str]) -> Step:
    """A training run's recipe, validated with `overrides`: its data in, checkpoints out."""
    try:
        r = load_recipe(ROOT / recipe, overrides)
    except ConfigError as e:
        pytest.fail(f"recipe {recipe} with {overrides}: {e}")
    return Step(reads=[*r.data.training_blend()[0], r.data.tokenizer_model,
                       *filter(None, [r.train.init_from])], writes=[r.train.save_dir])


# --- one check per program --------------------------------------------------------------

TOOL_PATHS = {  # what a tool reads and writes, from its parsed arguments
    "tools/preprocess_data.py": lambda a: Step(
        reads=[*a.input, a.tokenizer_model],
        writes=[f"{a.output_prefix}_{key}_document" for key in a.json_keys]),
    "tools/train_tokenizer.py": lambda a: Step(reads=a.input, writes=[f"{a.output_prefix}.model"]),
    "tools/mds_to_megatron.py": lambda a: Step(reads=[*a.input, a.tokenizer_model],
                                               writes=[f"{a.output_prefix}_text_document"]),
    "tools/to_hf.py": lambda a: Step(reads=[a.checkpoint, *filter(None, [a.tokenizer])],
                                     writes=[a.output]),
}


def check_script(path: str, args: list[str]) -> Step:
    ns = parsed_args(script_main(path), args, path)
    return TOOL_PATHS.get(path, lambda a: Step())(ns)


def check_train(args: list[str]) -> Step:
    from megatron_stem.train import main

    ns = parsed_args(main, args, "python -m megatron_stem.train")
    return recipe_step(ns.recipe, ns.overrides)


def registered_markers() -> set[str]:
    """The names in pyproject.toml's `markers = [...]` (pytest's ini options)."""
    block = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    return set(re.findall(r'"(\w+):', block[1])) if block else set()


def check_python(args: list[str]) -> Step:
    if args[:2] == ["-m", "venv"]:
        return Step(writes=[args[2]])
    if args[:2] == ["-m", "pytest"]:
        if "-m" in args[2:]:
            expression = args[args.index("-m", 2) + 1]
            names = set(re.findall(r"\w+", expression)) - {"not", "and", "or"}
            assert names <= registered_markers(), f"unregistered pytest markers {names}"
        return Step()
    if args[:2] == ["-m", "megatron_stem.train"]:
        return check_train(args[2:])
    assert args and args[0].endswith(".py"), f"python {args}: no check for this form"
    return check_script(args[0], args[1:])


def check_pip(args: list[str]) -> Step:
    assert args[0] == "install", f"pip {args[0]}: no check for it"
    for i, word in enumerate(args):
        if word == "-r":
            assert (ROOT / args[i + 1]).is_file(), f"pip -r {args[i + 1]}: no such file"
        if word == "-e":
            assert (ROOT / args[i + 1] / "pyproject.toml").is_file()
    return Step()


def check_bash(args: list[str]) -> Step:
    script, *rest = args
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script == "tools/quickstart.sh":  # its arguments are overrides of its recipe
        recipe_step("recipes/tiny_cpu.yaml", rest)
        return Step(writes=["runs/quickstart"])
    assert not rest, f"{script}: arguments are not checked"
    return Step()


def check_torchrun(args: list[str]) -> Step:
    from torch.distributed.run import get_args_parser

    ns = parsed_args(lambda: get_args_parser().parse_args(), args, "torchrun")
    assert ns.module and ns.training_script == "megatron_stem.train", args
    return check_train(ns.training_script_args)


def variables_read(*scripts: str) -> set[str]:
    return {name for s in scripts
            for name in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", (ROOT / s).read_text())}


def check_sbatch(args: list[str], env: dict) -> Step:
    """An sbatch script and the STEM_* settings slurm/launch.sh turns into its command."""
    script = args[-1]
    text = (ROOT / script).read_text()
    assert not set(env) - variables_read(script, "slurm/launch.sh", "slurm/job.sh",
                                         "slurm/environment.sh"), f"{script} reads no {set(env)}"
    recipe = env.get("STEM_RECIPE") or re.search(r"STEM_RECIPE:-([^}]+)\}", text)[1]
    overrides = shlex.split(env.get("STEM_OVERRIDES", ""))
    if "STEM_DATA" in env:
        overrides.append(f"data.prefixes=[{','.join(env['STEM_DATA'].split())}]")
    if "STEM_TOKENIZER" in env:
        overrides.append(f"data.tokenizer_model={env['STEM_TOKENIZER']}")
    step = recipe_step(recipe, overrides)
    job = next((a.split("=", 1)[1] for a in args if a.startswith("--job-name=")),
               re.search(r"#SBATCH --job-name=(\S+)", text)[1])
    run = f"{env.get('STEM_OUTPUT', 'runs')}/{env.get('STEM_RUN_NAME', job)}"
    if "slurm/acceptance.sh" in text:  # the acceptance run: its report
        return Step(reads=step.reads, writes=[f"{run}/summary.json"])
    return Step(reads=step.reads, writes=[env.get("STEM_SAVE_DIR", f"{run}/checkpoints")])


def check_preprocess_array(args: list[str], env: dict) -> Step:
    """slurm/preprocess.sh: its settings, as the tools/preprocess_data.py command they make."""
    assert not set(env) - variables_read("slurm/preprocess.sbatch", "slurm/environment.sh"), \
        f"unknown setting in {env}"
    assert args[0].isdigit(), "slurm/preprocess.sh TASKS [sbatch options]"
    return check_script("tools/preprocess_data.py", [
        "--input", *env["INPUT"].split(), "--output-prefix", env["OUTPUT_PREFIX"],
        "--tokenizer-type", env.get("TOKENIZER_TYPE", "sentencepiece"),
        "--tokenizer-model", env["TOKENIZER_MODEL"], *shlex.split(env.get("EXTRA_ARGS", ""))])


def check_lm_eval(args: list[str]) -> Step:
    from lm_eval.__main__ import cli_evaluate

    ns = parsed_args(cli_evaluate, args, "lm_eval")
    return Step(reads=[ns.model_args["pretrained"]])


@functools.cache
def hf_help(subcommand: str) -> str:
    from huggingface_hub.cli.hf import app

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        app.main([subcommand, "--help"], prog_name="hf", standalone_mode=False)
    return out.getvalue()


def check_hf(args: list[str]) -> Step:
    """`hf download REPO [FILES] --option value ...` (every option used takes a value)."""
    assert args[0] == "download", f"hf {args[0]}: no check for it"
    files, options, words = [], {}, iter(args[2:])
    for word in words:
        if word.startswith("--"):
            flag = rf"(?<![\w-]){word}(?![\w-])"
            assert re.search(flag, hf_help("download")), f"hf download has no {word}"
            options[word] = next(words)
        else:
            files.append(word)
    target = options["--local-dir"]
    return Step(writes=[f"{target}/{f}" for f in files] or [target])


def check_container_build(args: list[str]) -> Step:
    """`docker build -f containers/Dockerfile ...`, `apptainer build X containers/stem.def`,
    `enroot import ...`: the definitions they name are the repository's."""
    named = [a for a in args if a.startswith("containers/")]
    assert args[0] in ("build", "import") and all((ROOT / a).is_file() for a in named), args
    return Step()


def check(env: dict, words: list[str]) -> Step:
    prog, *args = words
    if prog in PYTHONS or re.fullmatch(r"(\S+/bin/)?python(3(\.\d+)?)?", prog):
        return check_python(args)
    if Path(prog).name == "pip":
        return check_pip(args)
    handlers = {"bash": check_bash, "torchrun": check_torchrun, "lm_eval": check_lm_eval,
                "hf": check_hf, "docker": check_container_build,
                "apptainer": check_container_build, "enroot": check_container_build}
    if prog in handlers:
        assert not env, f"{prog}: environment {env} is not checked"
        return handlers[prog](args)
    if prog == "sbatch":
        return check_sbatch(args, env)
    if prog == "slurm/preprocess.sh":
        return check_preprocess_array(args, env)
    if prog in SLURM_CLIENTS:
        return Step()
    pytest.fail(f"no check for `{prog}`: teach tests/test_docs.py how to check it")


# --- the tests --------------------------------------------------------------------------

ALL_LINES = [(doc, line) for doc in DOCS for line in command_lines(doc)]


@pytest.mark.parametrize("doc,line", ALL_LINES, ids=[f"{d}:{ln[:60]}" for d, ln in ALL_LINES])
def test_command_is_accepted_as_written(doc, line):
    for env, words in commands(line):
        check(env, words)


def test_readme_commands_read_only_what_the_checkout_has_or_an_earlier_command_wrote():
    written = []
    for line in command_lines("README.md"):
        for env, words in commands(line):
            step = check(env, words)
            for path in step.reads:
                assert (ROOT / path).exists() or any(
                    path == w or path.startswith(w.rstrip("/") + "/") for w in written), \
                    f"README: `{line}` reads {path}, which no command before it writes"
            written += step.writes


def test_readme_setup_commands_are_the_ones_ci_and_the_quickstart_test_run():
    lines = command_lines("README.md")
    install = "python3 -m venv .venv && .venv/bin/pip install -q -r requirements-dev.txt"
    tests = f"{install} && .venv/bin/python tools/build_ops.py && .venv/bin/python -m pytest -q -n 2"
    assert tests in lines
    ci = (ROOT / ".ci" / "run").read_text().replace("&&\n", "&& ")
    ci_chain = next(" ".join(line.split()) for line in ci.splitlines() if "pytest" in line)
    ci_steps = iter(ci_chain.split(" && "))  # the README's steps in order, the lint among them
    assert all(step in ci_steps for step in tests.split(" && ")), f".ci/run: {ci_chain}"
    assert f"{install} && bash tools/quickstart.sh" in lines
    assert '"quickstart.sh"' in (ROOT / "tests" / "test_quickstart.py").read_text()


def test_sbatch_comments_name_the_recipes_paths():
    scripts = {}
    for script in sorted((ROOT / "slurm").glob("*.sbatch")):
        default = re.search(r"STEM_RECIPE=\$\{STEM_RECIPE:-(\S+)\}", script.read_text())
        if default:
            scripts[script.name] = default[1]
    assert {"stem_1b.sbatch", "dense_1b.sbatch", "stem_350m.sbatch"} <= scripts.keys()
    for name, recipe_file in scripts.items():
        recipe = load_recipe(ROOT / recipe_file)
        comments = (ROOT / "slurm" / name).read_text()
        data = [recipe.data.blend] if recipe.data.blend else recipe.data.prefixes
        for path in (*data, recipe.data.tokenizer_model, *filter(None, [recipe.train.init_from])):
            assert path in comments, f"slurm/{name}: say where {path} comes from"


def test_readme_links_resolve_and_list_every_doc():
    links = set(re.findall(r"\]\(([^)#:]+)\)", (ROOT / "README.md").read_text()))
    missing = {link for link in links if not (ROOT / link).exists()}
    assert not missing, f"README links to missing files: {missing}"
    assert set(DOCS[1:]) <= links, f"not in the README's table: {set(DOCS[1:]) - links}"


# --- the step planner's figures, where the docs quote them -------------------------------

PLAN_1B = ("--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
           "--nodes", "4", "--gpus-per-node", "8", "--hardware", "h200", "--details")
PLAN_1B_LONG = ("--recipe", "recipes/stem_1b_long.yaml", "--baseline",
                "recipes/dense_1b_long.yaml", *PLAN_1B[4:])
OPTION = r"\w+/\w+/\w+/\w+/\w+"


@functools.cache
def planner_output(argv: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script_main("tools/plan_step.py")(list(argv)) == 0
    return out.getvalue()


@dataclass
class Plan:
    """What the docs quote of one planner run, formatted as they quote it."""
    dense: tuple[str, str]                      # step s, MFU
    options: dict[str, tuple[str, str, str]]    # option -> step s, x dense, MFU
    recipe_option: str
    gpu_memory_gb: list[int]                    # dense, then STEM as configured


def plan(argv: tuple[str, ...]) -> Plan:
    text = planner_output(argv)
    dense = re.search(r"^  step +([\d.]+) +MFU ([\d.]+%)$", text, re.M)
    options = {"/".join(m.groups()[:5]): (f"{float(m[6]):.3f}", m[7], m[8]) for m in re.finditer(
        r"^  [* ][> ](\w+) +(\w+) +(\w+) +(\w+) +(\w+) +([\d.]+) +([\d.]+) +([\d.]+%)",
        text, re.M)}
    memory = [round(float(gb)) for gb in re.findall(r"^  on the GPU +([\d.]+) of", text, re.M)]
    return Plan((f"{float(dense[1]):.3f}", dense[2]), options,
                re.search(rf"^choice: recipe = ({OPTION})$", text, re.M)[1], memory)


def prose(doc: str) -> str:
    return " ".join((ROOT / doc).read_text().split())


def test_the_predicted_1b_step_quoted_in_the_readme_and_tables_md_is_the_planners():
    p = plan(PLAN_1B)
    cpu = p.options[p.recipe_option]
    gpu = p.options[p.recipe_option.rsplit("/", 1)[0] + "/accelerator"]
    quote = (f"dense {p.dense[0]} s, STEM {cpu[0]} s ({cpu[1]} x dense) with the tables' "
             f"optimizer state in CPU memory, {gpu[0]} s ({gpu[1]} x) on the GPUs")
    for doc in ("README.md", "docs/tables.md"):
        assert quote in prose(doc), f"{doc}: the planner now says `{quote}`"


def test_tables_md_option_table_is_the_planners_ranking():
    p = plan(PLAN_1B)
    rows = re.findall(rf"^\|[^|\n]*`({OPTION})`[^|\n]*\| ([\d.]+) \| \**([\d.]+)\** \| ([\d.]+%) \|$",
                      (ROOT / "docs/tables.md").read_text(), re.M)
    assert len(rows) >= 4, "docs/tables.md: no table of options against the planner's ranking"
    for option, *figures in rows:
        assert tuple(figures) == p.options[option], f"docs/tables.md: {option} is {p.options[option]}"
    dense = re.search(r"^\| dense baseline \| ([\d.]+) \| 1 \| ([\d.]+%) \|$",
                      (ROOT / "docs/tables.md").read_text(), re.M)
    assert dense and dense.groups() == p.dense, f"docs/tables.md: dense is {p.dense}"


def test_the_readme_memory_per_gpu_at_32k_is_the_planners():
    dense_gb, stem_gb = plan(PLAN_1B_LONG).gpu_memory_gb
    quote = f"`stem_1b_long`: {stem_gb} GB of an H200's 141, dense {dense_gb} GB"
    assert quote in prose("README.md"), f"README: the planner now says `{quote}`"


def heading_anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_with_their_anchors(doc):
    source = ROOT / doc
    for link in re.findall(r"\]\(([^)\s:]+)\)", source.read_text()):
        path, _, anchor = link.partition("#")
        target = (source.parent / path) if path else source
        assert target.exists(), f"{doc}: {link} links to a missing file"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target), f"{doc}: {link}: no such heading"


def test_the_readme_quality_table_is_docs_quality_md():
    """The README's final validation losses are bench/quality.py's, as docs/quality.md has them."""
    measured = {(size, model): loss for size, model, loss in re.findall(
        r"^\| (\d+x\d+) \| (dense|STEM [\w/]+) \|.*?\| ([\d.]+) \| [+-][\d.]+ \| \d+ \|$",
        (ROOT / "docs/quality.md").read_text(), re.M)}  # (size, model) -> final valid loss
    table = re.search(r"^\| size \| (dense.*?) \|\n\|[-:| ]+\|\n((?:\|.*\|\n)+)",
                      (ROOT / "README.md").read_text(), re.M)
    models = table[1].split(" | ")
    quoted = {(row[0], model): loss for line in table[2].splitlines()
              for row in [line.strip("| ").split(" | ")] for model, loss in zip(models, row[1:])}
    assert quoted and quoted == measured, f"README: docs/quality.md has {measured}"


def test_the_readme_budget_is_what_check_prints():
    """The stage table's GPU time: the step planner's step of each STEM stage on 4 x 8 H100
    (published numbers), as `--check` prints it (planning/budget.py)."""
    from megatron_stem.config import load_recipe
    from megatron_stem.planning import budget, hardware
    from megatron_stem.planning.workload import Cluster

    readme = (ROOT / "README.md").read_text()
    for stage in ("pretrain", "midtrain", "long"):
        recipe = load_recipe(ROOT / "recipes" / f"stem_1b_{stage}.yaml")
        step_s = budget.step_seconds(recipe, Cluster(4, 8), hardware.PUBLISHED["h100"])
        days, hours = step_s * recipe.train.steps / 86400, step_s * recipe.train.steps * 32 / 3600
        row = re.search(rf"^\| \d [^|]+\|[^\n]*`stem_1b_{stage}` \|[^\n]*$", readme, re.M)
        assert row and f"| {days:.1f} days, {hours:,.0f} GPU-hours" in row[0], \
            f"README: stem_1b_{stage} now {days:.1f} days, {hours:,.0f} GPU-hours"


TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))


@pytest.mark.parametrize("name", TOOLS)
def test_a_tools_help_says_whole_sentences(name, capsys):
    """`--help`'s description is the tool's docstring cut at a paragraph, never mid-sentence
    (`__doc__.splitlines()[0]` cut tools/from_hf.py's after "such as")."""
    from support.processes import tool

    with pytest.raises(SystemExit) as end:
        tool(name)(["--help"])
    assert end.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1].strip()
    assert description[-1] in ".:)", f"tools/{name}.py --help: {description!r}"
