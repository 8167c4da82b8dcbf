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
- the cluster (with `--gpus-per-node`): every rule between the recipe and the job's size
  that the trainer checks at start (`config/world.py`: the layout divides the world, the
  batch the data-parallel ranks, the tables' rows the ranks that share them), the
  profiled ranks in the world, the step planner's memory per GPU within the accelerator's
  (planning/memory.py: predicted, not measured) on the GPU `--hardware` names or
  `nvidia-smi` finds, and the stage's budget: GPU-hours and storage (planning/budget.py).
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_stem import checkpoint
from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.checkpoint.finding import StagePending, finished_step
from megatron_stem.config import Recipe, RecipeSource
from megatron_stem.config.printing import render
from megatron_stem.config.world import world_problems
from megatron_stem.data import sample_cache
from megatron_stem.data.indexed import (
    IndexHeader,
    bin_path,
    idx_path,
    index_size,
    read_header,
    token_dtype,
)
from megatron_stem.data.prefix_sets import Prefix, resolve
from megatron_stem.planning import budget, hardware, memory
from megatron_stem.planning.workload import Cluster
from megatron_stem.runtime.errors import UserError
from megatron_stem.training.batches import (
    check_documents,
    check_training_data,
    default_cache_dir,
)
from megatron_stem.training.checks import check_trainable, load_tokenizer
from megatron_stem.training.profiling import check_ranks
from megatron_stem.training.wandb_run import check_installed as check_wandb_installed


# What the memory line leaves out (planning/memory.py), said beside it.
NOT_COUNTED = "not counted: CUDA context, NCCL buffers and allocator fragmentation, a few GB"


@dataclass(frozen=True)
class Target:
    """The cluster to check the recipe against; `gpus_per_node` None: none given;
    `hardware` None: none known (`hardware_from` says why), else where it came from."""

    nodes: int = 1
    gpus_per_node: Optional[int] = None
    hardware: Optional[str] = "h200"
    hardware_from: str = "--hardware"

    @classmethod
    def given(cls, nodes: int, gpus_per_node: Optional[int], name: Optional[str]) -> "Target":
        """The flags as given; without `--hardware`, the GPU `nvidia-smi` finds here."""
        if name is not None or gpus_per_node is None:
            return cls(nodes, gpus_per_node, name, f"--hardware {name}")
        found, said = hardware.detect()
        return cls(nodes, gpus_per_node, found, said)


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


def print_and_check(source: RecipeSource, target: Target) -> int:
    """`--print-config --check`: the resolved recipe, then every check (the problems once)."""
    recipe, problems = source.load()
    if not problems:
        print(render(recipe, source), end="")
        print()
    return check(source, target)


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
    headers, training = _data(recipe, found)
    _tokenizer(recipe, headers, found)
    _checkpoints(recipe, found)
    _cluster(recipe, target, found, training)
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


def _data(recipe: Recipe, found: Findings
          ) -> tuple[dict[tuple[str, str], IndexHeader], Optional[list[Prefix]]]:
    """{(field, entry): header} of every data entry whose token files are whole, and the
    training entries' prefixes (None unless all of them are)."""
    data = recipe.data
    prefixes, _ = data.training_blend()
    if not prefixes:
        with found.catch():
            check_training_data(data)  # the one saying that none is given
    named = [(data.field_of(i), prefix) for i, prefix in enumerate(prefixes)]
    named += [(f"data.validation.{name}", prefix)
              for name, entries in data.validation_sets.items() for prefix in entries]
    headers, training = {}, []
    for i, (where, entry) in enumerate(named):
        with found.catch(where):
            resolved = resolve(entry, where)  # every prefix there, whole, within the ids
            headers[where, entry] = read_header(idx_path(resolved[0].path))
            if i < len(prefixes):
                training += resolved
    if named:
        found.notes.append(f"data: the token files of {len(headers)} of {len(named)} "
                           "entries are there and whole")
    whole = prefixes and all((data.field_of(i), p) in headers for i, p in enumerate(prefixes))
    return headers, training if whole else None


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
    """Where the run would start, as the trainer finds it (`Checkpointer`), checked; a
    previous stage still to finish is where it will start, not a problem (a chain is
    checked, and submitted, before its first stage has run)."""
    with found.catch():
        try:
            start = Checkpointer(recipe)
        except StagePending as e:
            found.notes.append(f"start: will start from the last checkpoint in {e.save_dir} "
                               f"when {recipe.train.init_from} finishes ({e.status})")
            return
        for source in filter(None, (start.resume_from, start.init_from)):
            checkpoint.check_same_shape(checkpoint.read_recipe(source), recipe, source)
        found.notes.append(f"start: {start.origin()}")
        finished_step(recipe)  # says so when there is nothing left to train


def _cluster(recipe: Recipe, target: Target, found: Findings,
             training: Optional[list[Prefix]]) -> None:
    if target.gpus_per_node is None:
        found.notes.append("cluster: not checked (give --nodes and --gpus-per-node: the "
                           "layout, memory per GPU and the budget on that many GPUs)")
        return
    cluster = Cluster(target.nodes, target.gpus_per_node)
    flags = f"--nodes {target.nodes} --gpus-per-node {target.gpus_per_node}"
    rules = world_problems(recipe, cluster.world, target.gpus_per_node)
    found.problems += [f"{flags}: {line}" for line in rules]
    with found.catch():
        check_ranks(recipe.profile, cluster.world)
    if target.hardware is None:
        found.problems.append(f"--hardware: not given, and {target.hardware_from}: name the "
                              f"GPUs of the job ({', '.join(hardware.PUBLISHED)})")
        return
    found.notes.append(f"hardware: {target.hardware} ({target.hardware_from})")
    if rules:
        return  # no step to plan on this world
    with found.catch():
        hw = hardware.load(target.hardware)
        plan = memory.memory_per_gpu(recipe, cluster, hw)
        line = (f"memory per GPU: {plan.total() / 1e9:.1f} GB predicted on {target.nodes} x "
                f"{target.gpus_per_node} {hw.name}")
        if plan.fits:
            found.notes.append(f"{line}, of {plan.capacity / 1e9:.0f} GB ({NOT_COUNTED})")
        else:
            found.problems.append(f"{flags} --hardware {target.hardware}: {line}, more than "
                                  f"its {plan.capacity / 1e9:.0f} GB ({NOT_COUNTED}; "
                                  "tools/plan_step.py shows the parts)")
        found.notes += _budget(recipe, cluster, hw, training).lines()


def _budget(recipe: Recipe, cluster: Cluster, hw, training: Optional[list[Prefix]]
            ) -> budget.Budget:
    train, data = recipe.train, recipe.data
    samples = train.steps * train.global_batch_size
    if training is not None:
        files = float(sum(os.path.getsize(bin_path(p.path)) + os.path.getsize(idx_path(p.path))
                          for p in training))
        files_from = f"{len(training)} prefixes, as on disk"
    sources = [s for s in data.sources if s.tokens and s.documents]
    sized = bool(sources) and len(sources) == len(data.sources)
    if training is None and sized:
        width = np.dtype(token_dtype(recipe.model.vocab_size)).itemsize
        files = sum(s.tokens * width + index_size(int(s.documents)) for s in sources)
        files_from = "predicted from data.blend's sizes"
    elif training is None:
        files, files_from = None, "not all there yet, and data.blend names no sizes"
    cache_dir = default_cache_dir(data) if training is not None or data.cache_dir else None
    built = sample_cache.cache_bytes(cache_dir) if cache_dir and os.path.isdir(cache_dir) else 0
    if built:
        cache, cache_from = float(built), f"built, in {cache_dir}"
    elif sized:
        shares = sample_cache.source_shares(sources, recipe.model.seq_length, samples)
        cache, cache_from = sample_cache.predicted_bytes(shares, samples), \
            "predicted from data.blend's sizes"
    else:
        cache, cache_from = None, "not built, and data.blend names no sizes"
    kept = train.keep_last or math.ceil(train.steps / train.save_interval)
    return budget.Budget(
        steps=train.steps, tokens=samples * recipe.model.seq_length,
        step_s=budget.step_seconds(recipe, cluster, hw), gpus=cluster.world,
        token_files=files, token_files_from=files_from, cache=cache, cache_from=cache_from,
        checkpoint=budget.checkpoint_bytes(recipe), kept=kept,
        kept_from="train.keep_last" if train.keep_last else "train.keep_last 0: every save")
