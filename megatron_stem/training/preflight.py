"""See and check a recipe before a job runs it: `python -m megatron_stem.train --recipe R
[overrides] --print-config | --check [--nodes N --gpus-per-node G --hardware h100|h200]`.

`--check` runs, on the machine it is given, every check that needs no training and no
process group, and reports every problem at once (one line each, naming the recipe field,
file, override or flag), exit 2 if there is any:

- fields: names, types and the rules across them (config/), each problem named by the
  file of the `inherit:` chain or the override that set it;
- what the trainer does not run (`training/checks.py`), and W&B installed if it logs there;
- data: every training prefix and validation set: both files there, the `.idx` header
  readable, the two files' sizes agreeing, the documents within megatron's int32 ids
  (`data.prefix_sets.resolve`);
- tokenizer: it loads, fits `model.vocab_size`, has an end-of-document token if document
  masking needs one, and its ids fit the token files' dtype (else they were written by
  another tokenizer);
- checkpoints: the resume point in `train.save_dir` if there is one, else `train.init_from`
  (a stage's predecessor: finished, and its last checkpoint whole), of this model's shape,
  with optimizer states when `train.init_optimizer` asks for them;
- the cluster (with `--gpus-per-node`): world size and batch divisible by the layout,
  the profiled ranks in the world, and the step planner's memory per GPU within the
  accelerator's (planning/memory.py: predicted, not measured).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_stem import checkpoint
from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.checkpoint.finding import finished_step
from megatron_stem.config import Recipe, RecipeSource
from megatron_stem.config.printing import render
from megatron_stem.data.indexed import IndexHeader, idx_path, read_header
from megatron_stem.data.prefix_sets import resolve
from megatron_stem.planning import hardware, memory
from megatron_stem.planning.workload import Cluster, workload
from megatron_stem.runtime.errors import UserError
from megatron_stem.training.batches import check_documents, check_training_data
from megatron_stem.training.checks import check_trainable, load_tokenizer
from megatron_stem.training.profiling import check_ranks
from megatron_stem.training.wandb_run import check_installed as check_wandb_installed


@dataclass(frozen=True)
class Target:
    """The cluster to check the recipe against; `gpus_per_node` None: none given."""

    nodes: int = 1
    gpus_per_node: Optional[int] = None
    hardware: str = "h200"


@dataclass
class Findings:
    notes: list[str] = field(default_factory=list)  # what was checked and found
    problems: list[str] = field(default_factory=list)

    @contextmanager
    def catch(self, where: str = ""):
        """A UserError inside is one problem, prefixed by `where` unless it names it."""
        try:
            yield
        except UserError as e:
            line = str(e)
            self.problems.append(line if not where or line.startswith(where)
                                 else f"{where}: {line}")


def print_config(source: RecipeSource) -> int:
    """`--print-config`: the resolved recipe, or its problems."""
    recipe, problems = source.load()
    if problems:
        return _report(Findings(problems=problems))
    print(render(recipe, source), end="")
    return 0


def check(source: RecipeSource, target: Target) -> int:
    """`--check`: every check, then the notes (stdout) and problems (stderr)."""
    return _report(findings(source, target))


def findings(source: RecipeSource, target: Target) -> Findings:
    """Every check of the module docstring, in its order, on the recipe as loaded (a field
    with a problem at its default)."""
    recipe, problems = source.load()
    found = Findings(problems=list(problems))
    if recipe is None:  # a required part is missing: nothing else can be checked
        return found
    found.notes.append(f"fields: {len(problems)} problem(s)" if problems else
                       "fields: no problems")
    with found.catch():
        check_trainable(recipe)
    with found.catch():
        check_wandb_installed(recipe)
    headers = _data(recipe, found)
    _tokenizer(recipe, headers, found)
    _checkpoints(recipe, found)
    _cluster(recipe, target, found)
    return found


def _report(found: Findings) -> int:
    for line in found.notes:
        print(line)
    for line in found.problems:
        print(f"error: {line}", file=sys.stderr)
    if found.problems:
        print(f"{len(found.problems)} problem(s): nothing started", file=sys.stderr)
        return 2
    print("all checks passed")
    return 0


def _data(recipe: Recipe, found: Findings) -> dict[tuple[str, str], IndexHeader]:
    """{(field, prefix): header} of every token file pair that is whole."""
    data = recipe.data
    prefixes, _ = data.training_blend()
    if not prefixes:
        with found.catch():
            check_training_data(data)  # the one saying that none is given
    named = [(data.field_of(i), prefix) for i, prefix in enumerate(prefixes)]
    named += [(f"data.validation.{name}", prefix)
              for name, entries in data.validation_sets.items() for prefix in entries]
    headers = {}
    for where, prefix in named:
        with found.catch(where):
            headers[where, prefix] = _token_files(prefix, where)
    if named:
        found.notes.append(f"data: {len(headers)} of {len(named)} token files whole")
    return headers


def _token_files(entry: str, where: str) -> IndexHeader:
    """The header of one data entry (a prefix, or a prefix set's first prefix) named by
    recipe field `where`: every prefix there, whole, within megatron's document ids."""
    first = resolve(entry, where)[0]
    return read_header(idx_path(first.path))


def _tokenizer(recipe: Recipe, headers: dict, found: Findings) -> None:
    with found.catch():
        tokenizer = load_tokenizer(recipe)
        check_documents(recipe.data, tokenizer)
        found.notes.append(f"tokenizer: {recipe.data.tokenizer_model}, "
                           f"{tokenizer.vocab_size:,} ids")
        for (where, prefix), header in headers.items():
            if not np.issubdtype(header.dtype, np.integer) or \
                    np.iinfo(header.dtype).max < tokenizer.vocab_size - 1:
                found.problems.append(
                    f"{where}: {prefix}.idx holds {np.dtype(header.dtype).name} tokens, too "
                    f"narrow for this tokenizer's {tokenizer.vocab_size:,} ids: written with "
                    "another tokenizer")


def _checkpoints(recipe: Recipe, found: Findings) -> None:
    """Where the run would start, as the trainer finds it (`Checkpointer`), checked."""
    with found.catch():
        start = Checkpointer(recipe)
        for source in filter(None, (start.resume_from, start.init_from)):
            checkpoint.check_same_shape(checkpoint.read_recipe(source), recipe, source)
        found.notes.append(f"start: {start.origin()}")
        finished_step(recipe)  # says so when there is nothing left to train


def _cluster(recipe: Recipe, target: Target, found: Findings) -> None:
    if target.gpus_per_node is None:
        found.notes.append("memory per GPU: not checked (give --gpus-per-node, and --nodes, "
                           "--hardware)")
        return
    cluster = Cluster(target.nodes, target.gpus_per_node)
    flags = f"--nodes {target.nodes} --gpus-per-node {target.gpus_per_node}"
    with found.catch():
        check_ranks(recipe.profile, cluster.world)
    with found.catch():
        hw = hardware.load(target.hardware)
        workload(recipe, cluster, name=flags)  # the layout fits the world and the batch
        plan = memory.memory_per_gpu(recipe, cluster, hw)
        line = (f"memory per GPU: {plan.total() / 1e9:.1f} GB predicted on {target.nodes} x "
                f"{target.gpus_per_node} {hw.name}")
        if plan.fits:
            found.notes.append(f"{line}, of {plan.capacity / 1e9:.0f} GB")
        else:
            found.problems.append(f"{flags} --hardware {target.hardware}: {line}, more than "
                                  f"its {plan.capacity / 1e9:.0f} GB (tools/plan_step.py "
                                  "shows the parts)")
