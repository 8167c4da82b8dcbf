"""The training loop: `run(recipe)` builds the run's parts, then steps until `train.steps`
or a stop signal, saving, evaluating and logging on the way.

    batches, valid = _data(recipe, ...)      # the data cache first: refused before the model
    checkpointer = Checkpointer(recipe)      # where the run starts (checkpoint/checkpointer.py)
    model = build_model(...)
    checkpointer.load_weights(model)         # before the engine copies them
    engine, tables, update = build_engine(model, recipe)
    step = checkpointer.resume(model, engine, tables)
    while step < train.steps: train_step(...); metrics; guard; evaluations; save

What surrounds the loop has rooms of its own: save and resume `checkpoint/checkpointer.py`,
the stop signal `training/stop.py`, logging and MFU `training/metrics.py`, phase timing and
the profiler window `training/profiling.py`, downstream evaluation `evaluation/in_loop.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.checkpoint.finding import finished_step
from megatron_stem.config import Recipe
from megatron_stem.config.world import check_world
from megatron_stem.data.sample_cache import prepare
from megatron_stem.evaluation.in_loop import DownstreamEval
from megatron_stem.model import build_model
from megatron_stem.runtime.host_read import HostRead
from megatron_stem.runtime.parallel import (
    destroy_distributed,
    device,
    init_distributed,
    local_world_size,
)
from megatron_stem.training.batches import (
    Prefetcher,
    Samples,
    StepBatches,
    check_training_data,
    check_validation_sets,
    load_datasets,
    model_inputs,
)
from megatron_stem.training.batches import plans as data_plans
from megatron_stem.training.checks import (
    check_gpus_visible,
    check_trainable,
    load_tokenizer,
    use_deterministic_kernels,
)
from megatron_stem.training.engine import build_engine
from megatron_stem.training.guard import Diverged, Guard
from megatron_stem.training.lr import lr_at
from megatron_stem.training.metrics import Metrics, memory_gb
from megatron_stem.training.profiling import UNTIMED, ProfilerWindow, check_ranks
from megatron_stem.training.stop import StopSignal
from megatron_stem.training.update import Outcome, Update
from megatron_stem.training.wandb_run import check_installed as check_wandb_installed


def _dp_mean(local: torch.Tensor) -> torch.Tensor:
    """The data-parallel mean of `local` (a one-element tensor on this rank's device), on
    the device: a collective, no host read."""
    total = local.detach().double().reshape(1).clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total / ps.get_data_parallel_world_size()


def _mean_over_dp(value) -> float:
    return _dp_mean(torch.as_tensor(value, dtype=torch.float64, device=device())).item()


def _token_mean_loss(model_or_engine, batch: dict) -> torch.Tensor:
    per_token = model_or_engine(batch["tokens"], labels=batch["labels"], **model_inputs(batch))
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def train_step(update: Update, microbatches: list[dict], lr: float,
               next_ids: list[torch.Tensor] | None = None,
               timer=UNTIMED, read: HostRead | None = None) -> tuple[float, Outcome]:
    """Forward/backward every micro-batch, then the step's update of backbone and tables
    (training/update.py; `next_ids`: the next step's token ids, whose rows an overlapped
    table update puts in place first). Host-resident tables are handed the step's
    micro-batches first (their rows are staged one micro-batch ahead). `timer` times the
    phases (training/profiling.py). Returns the data-parallel mean loss and the update's
    outcome.

    The losses stay on the device; the host reads their mean with the step's other values
    in one transfer (`read`: the step's host read, runtime/host_read.py; None: one of its
    own), inside DeepSpeed's step (a read per micro-batch would make the host wait for each
    backward before launching the next forward)."""
    engine = update.engine
    read = read or HostRead()
    with timer.phase("tables_stage"):
        update.tables.stage(microbatches)
    losses = []
    for i, batch in enumerate(microbatches):
        with timer.phase("forward_backward"):
            loss = _token_mean_loss(engine, batch)
            if i + 1 == len(microbatches):  # the last step's update beside this backward
                update.tables.publish_rest()
            engine.backward(loss)
            losses.append(loss.detach())
        if i + 1 < len(microbatches):
            engine.step()  # DeepSpeed's micro-step; the last one is the update's
    local = torch.stack(losses).double().mean()
    mean, local = read.add(_dp_mean(local)), read.add(local)
    outcome = update.apply(lr, mean, next_ids, local_loss=local, timer=timer, read=read)
    return mean.get(), outcome


@torch.no_grad()
def evaluate(model, microbatches: list[dict], tables=None) -> float:
    if tables is not None:
        tables.finish()  # an overlapped update: every row in place
        tables.stage(microbatches, requires_grad=False)
    model.eval()
    loss = torch.stack([_token_mean_loss(model, b) for b in microbatches]).double().mean()
    model.train()
    return _mean_over_dp(loss)


def _data(recipe: Recipe, tokenizer) -> tuple[Prefetcher, dict[str | None, list[dict]]]:
    """This data-parallel rank's training batches (by step, read ahead) and validation
    micro-batches of each set: None the split's, then the named sets of `data.validation`.
    The datasets' sample indices come from the shared cache (data/sample_cache.py), built
    here by rank 0 only when that is quick: the first thing a run reads, so a cache that
    must be built first is refused before the model is."""
    train = recipe.train
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    samples = Samples.of(recipe, dp)
    plans = data_plans(recipe, tokenizer, samples)
    prepare(list(plans.values()), dist.get_rank(),
            f"python tools/build_data_cache.py --recipe <this recipe> [its overrides] "
            f"--ranks {dist.get_world_size()}")
    train_ds, sets = load_datasets(plans, recipe.data.split_validates)
    batches = StepBatches(train_ds, train.micro_batch_size, train.global_batch_size,
                          dp_rank, dp, device())
    valid = {name: StepBatches(ds, train.micro_batch_size, samples.valid, dp_rank, dp,
                               device()).microbatches(0) for name, ds in sets.items()}
    return Prefetcher(batches, train.steps), valid


def run(recipe: Recipe, tokenizer=None, on_step=None, stop_after: int | None = None) -> dict:
    """Train per `recipe`; returns {"losses": [per step run here], "valid": [the split's
    validation losses, else the first named set's], "valid_sets": {name: [...]},
    "downstream": [{"step": s, "scores": {task: {metric: value}}}] (rank 0), "step": last
    step, "preempted": bool}. `on_step(step)` is called after every step (for tools and
    tests: fault injection). `stop_after`: end after that step, before `train.steps`,
    without the last step's save and evaluation (a trial of the recipe's first steps: its
    schedule, data and saves as the recipe says; a save in flight is committed)."""
    train, opt = recipe.train, recipe.optimizer
    stop_signal = StopSignal()  # first (a rank started as the trainer caught it at its start)
    check_gpus_visible()
    if train.deterministic:
        use_deterministic_kernels()
    check_trainable(recipe)
    finished = finished_step(recipe)
    if finished is not None:
        return {"losses": [], "valid": [], "valid_sets": {}, "downstream": [],
                "step": finished, "preempted": False}
    check_training_data(recipe.data, recipe.model.vocab_size)
    check_validation_sets(recipe.data, recipe.model.vocab_size)
    check_wandb_installed(recipe)
    tokenizer = tokenizer or load_tokenizer(recipe)
    init_distributed(recipe.parallel, seed=train.seed,
                     timeout_minutes=recipe.parallel.timeout_minutes)
    tables = batches = None
    try:
        check_world(recipe, dist.get_world_size(), local_world_size())
        check_ranks(recipe.profile, dist.get_world_size())
        batches, valid = _data(recipe, tokenizer)
        downstream = DownstreamEval.start(recipe, tokenizer)  # None: lm_eval.interval 0
        checkpointer = Checkpointer(recipe)  # where the run starts; says any fallback
        model = build_model(recipe.model, recipe.parallel, seed=train.seed,
                            tables=recipe.tables)
        model_memory = memory_gb()  # its weights (and tables on the device): the first line's
        checkpointer.load_weights(model)  # before the engine copies them
        engine, tables, update = build_engine(model, recipe)
        step = checkpointer.resume(model, engine, tables)  # and saves these from now on

        metrics = Metrics(recipe, first_step=step + 1)
        metrics.start(checkpointer.origin(), model_memory)
        guard = Guard(recipe.guard, checkpointer.keep_before, checkpointer.rewind,
                      lambda at, line: metrics.log(at, {}, line))
        profiler = ProfilerWindow(recipe.profile, dist.get_rank(), train.save_dir)

        result = {"losses": [], "valid": [], "valid_sets": {name: [] for name in valid
                                                            if name is not None},
                  "downstream": [], "step": step, "preempted": False}
        last = min(train.steps, stop_after or train.steps)
        upcoming = batches.microbatches(step) if step < last else None
        while step < last:
            profiler.before(step + 1)
            lr = lr_at(step, opt, train.steps)
            current = upcoming
            # The next step's batch, now: an overlapped table update puts its rows first.
            upcoming = batches.microbatches(step + 1) if step + 1 < last else None
            # The step's values for the host, read at once inside its update
            # (runtime/host_read.py): every rank's stop flag and, while a save is written
            # in the background, whether every rank has written it, then the loss and the
            # gradient norms.
            read = HostRead()
            stop_signal.share(read)
            checkpointer.share(read)
            loss, outcome = train_step(update, current, lr,
                                       upcoming and [mb["tokens"] for mb in upcoming],
                                       metrics.timer, read)
            step += 1
            profiler.after(step)
            result["losses"].append(loss)
            if on_step is not None:
                on_step(step)
            metrics.step(step, loss, lr, outcome.norms, tables)
            try:
                guard.after(step, loss, outcome, outcome.ranks)
            except Diverged as e:  # said now: the launcher stops the others' teardown
                metrics.error(str(e))
                e.reported = True
                raise
            with metrics.paused():
                _evaluations(step, recipe, model, tables, valid, downstream, metrics, result)
            stop = stop_signal.requested()
            batches.settle()
            checkpointer.save(step, force=stop)
            if stop:
                result["preempted"] = True
                metrics.log(step, {}, f"step {step} | stop signal: checkpoint saved, exiting "
                                      f"for requeue")
                stop_signal.report()
                break
        checkpointer.wait_for_save()  # a trial's end (`stop_after`): its save in flight
        result["step"] = step
        profiler.close()  # a stop inside the window: what it traced
        metrics.close()
        return result
    finally:
        if batches is not None:
            batches.close()  # the loader thread
        if tables is not None:
            tables.close()  # the host tables' staging threads
        destroy_distributed()


def _evaluations(step, recipe, model, tables, valid, downstream, metrics, result) -> None:
    """The validation sets every `train.eval_interval` steps, lm-eval every
    `lm_eval.interval` steps, each also at the last step."""
    last = recipe.train.steps
    if step % recipe.train.eval_interval == 0 or step == last:
        first = next(iter(valid))  # the split's set when it has one
        for name, microbatches in valid.items():
            loss = evaluate(model, microbatches, tables)
            metrics.valid(step, loss, name)
            if name is not None:
                result["valid_sets"][name].append(loss)
            if name == first:
                result["valid"].append(loss)
    if downstream is not None and downstream.due(step, last):
        scores = downstream.run(model, tables)
        metrics.downstream(step, scores)
        result["downstream"].append({"step": step, "scores": scores})
