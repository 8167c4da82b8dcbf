"""Pretrain a STEM model (or its dense baseline).

    torchrun --nproc_per_node N -m megatron_stem.train --recipe recipes/stem_1b.yaml \
        [section.field=value ...]

Resumes from `<train.save_dir>/latest` when there is one; on SIGUSR1/SIGTERM (SLURM
preemption, `--signal`) saves a checkpoint and exits with `EXIT_REQUEUE`.

This module is the loop (`run`); what surrounds it has rooms of its own: save and resume
`training/checkpointing.py`, the stop signal `training/stop.py`, logging and MFU
`training/metrics.py`, phase timing and the profiler window `training/profiling.py`,
downstream evaluation `evaluation/in_loop.py`.
"""

# ruff: noqa: E402  (the imports come after the stop handler's installation)
from __future__ import annotations

from megatron_stem import lifetime
from megatron_stem.training.stop import catch_stop_signals, end_with_launcher

if __name__ == "__main__":  # a rank: a stop signal during the slow imports below is caught
    catch_stop_signals()
    end_with_launcher()

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem import quiet
from megatron_stem.config import Recipe, RecipeSource, load_recipe
from megatron_stem.errors import ConfigError, UserError, cli
from megatron_stem.evaluation.in_loop import DownstreamEval
from megatron_stem.model import build_model
from megatron_stem.parallel import destroy_distributed, device, init_distributed
from megatron_stem.training.checkpointing import Checkpointer, finished_step
from megatron_stem.training.data import (Prefetcher, Samples, StepBatches,
                                         check_training_data, check_validation_sets,
                                         load_datasets, model_inputs)
from megatron_stem.training.data import plans as data_plans
from megatron_stem.training.datasets import prepare
from megatron_stem.training.engine import build_engine
from megatron_stem.training.guard import Diverged, Guard
from megatron_stem.training.lr import lr_at
from megatron_stem.training.metrics import Metrics
from megatron_stem.training.profiling import UNTIMED, ProfilerWindow, check_ranks
from megatron_stem.training.stop import EXIT_REQUEUE, StopSignal
from megatron_stem.training.update import Outcome, Update
from megatron_stem.training.wandb_run import check_installed as check_wandb_installed


def _gpus_given(environ) -> str | None:
    """`NAME=value` of the variable by which SLURM (or the user) gave this job GPUs."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(name, "").strip()
        none = ("", "-1", "NoDevFiles") + (("0",) if name == "SLURM_GPUS_ON_NODE" else ())
        if value not in none:
            return f"{name}={value}"
    return None


def check_gpus_visible(environ=os.environ) -> None:
    """Refuse to start when the job was given GPUs but torch sees none: a CPU-only torch
    wheel on a GPU node would otherwise train on CPU with gloo, slowly and silently.
    `STEM_ALLOW_CPU=1` says a CPU run on such a node is meant (a test cluster whose GPUs
    are only scheduling tokens)."""
    given = _gpus_given(environ)
    if given is None or torch.cuda.is_available() or environ.get("STEM_ALLOW_CPU") == "1":
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise UserError(
            f"{given}: this job has GPUs but torch {torch.__version__} is a CPU-only build "
            "and sees none; install torch's CUDA build in this environment (pip install torch "
            "--index-url https://download.pytorch.org/whl/cu126, the CUDA version your driver "
            "supports), or set STEM_ALLOW_CPU=1 to train on CPU on purpose")
    raise UserError(
        f"{given}: this job has GPUs but torch {torch.__version__} (CUDA "
        f"{torch.version.cuda or torch.version.hip}) sees none: the GPU driver is missing or "
        "too old for this build (check nvidia-smi on the node)")


def use_deterministic_kernels() -> None:
    """`train.deterministic`: what makes two GPU runs give the same bits. cuBLAS's
    workspace must be fixed before its first call; SDPA's flash and memory-efficient
    backwards add with atomics, so attention takes the math kernel."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        for backend in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)


def check_trainable(recipe: Recipe) -> None:
    """Refuse what a recipe may describe but this trainer does not run."""
    if recipe.parallel.pipeline_parallel > 1:
        raise ConfigError("parallel.pipeline_parallel: training runs under the DeepSpeed "
                          "engine, which cannot pipeline a megatron model; use tensor "
                          "parallelism (checkpoints saved this way load at any PP)")


def _local_and_dp_mean(local: torch.Tensor) -> tuple[float, float]:
    """This rank's `local` (a one-element tensor on its device) and its data-parallel
    mean, read by the host together: one sync."""
    mine = local.detach().double().reshape(1)
    total = mine.clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    mine, total = torch.cat([mine, total]).tolist()
    return mine, total / ps.get_data_parallel_world_size()


def _mean_over_dp(value) -> float:
    return _local_and_dp_mean(torch.as_tensor(value, dtype=torch.float64, device=device()))[1]


def _token_mean_loss(model_or_engine, batch: dict) -> torch.Tensor:
    per_token = model_or_engine(batch["tokens"], labels=batch["labels"], **model_inputs(batch))
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def train_step(update: Update, microbatches: list[dict], lr: float,
               next_ids: list[torch.Tensor] | None = None,
               timer=UNTIMED) -> tuple[float, Outcome]:
    """Forward/backward every micro-batch, then the step's update of backbone and tables
    (training/update.py; `next_ids`: the next step's token ids, whose rows an overlapped
    table update puts in place first). Host-resident tables are handed the step's
    micro-batches first (their rows are staged one micro-batch ahead). `timer` times the
    phases (training/profiling.py). Returns the data-parallel mean loss and the update's
    outcome.

    The losses stay on the device until every backward is launched, then the host reads
    them once (a read per micro-batch would make it wait for each backward before
    launching the next forward)."""
    engine = update.engine
    with timer.phase("tables_stage"):
        update.tables.stage(microbatches)
    losses = []
    for i, batch in enumerate(microbatches):
        with timer.phase("forward_backward"):
            loss = _token_mean_loss(engine, batch)
            engine.backward(loss)
            losses.append(loss.detach())
        if i + 1 < len(microbatches):
            engine.step()  # DeepSpeed's micro-step; the last one is the update's
    local, loss = _local_and_dp_mean(torch.stack(losses).double().mean())
    return loss, update.apply(lr, loss, next_ids, local_loss=local, timer=timer)


@torch.no_grad()
def evaluate(model, microbatches: list[dict], tables=None) -> float:
    if tables is not None:
        tables.finish()  # an overlapped update: every row in place
        tables.stage(microbatches, requires_grad=False)
    model.eval()
    loss = torch.stack([_token_mean_loss(model, b) for b in microbatches]).double().mean()
    model.train()
    return _mean_over_dp(loss)


def load_tokenizer(recipe: Recipe):
    """The recipe's tokenizer, checked to fit the model's vocabulary."""
    from megatron_stem.tokenizer import check_fits, load_setting

    tokenizer = load_setting("data.tokenizer_model", recipe.data.tokenizer_type,
                             recipe.data.tokenizer_model)
    check_fits(tokenizer, recipe.model.vocab_size,
               f"data.tokenizer_model: {recipe.data.tokenizer_model}")
    return tokenizer


def _data(recipe: Recipe, tokenizer) -> tuple[Prefetcher, dict[str | None, list[dict]]]:
    """This data-parallel rank's training batches (by step, read ahead) and validation
    micro-batches of each set: None the split's, then the named sets of `data.validation`.
    The datasets' sample indices come from the shared cache (training/datasets.py), built
    here by rank 0 only when that is quick."""
    train = recipe.train
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    samples = Samples.of(recipe, dp)
    plans = data_plans(recipe, tokenizer, samples)
    prepare(list(plans.values()), dist.get_rank(), dist.barrier,
            f"python tools/build_data_cache.py --recipe <this recipe> [its overrides] "
            f"--ranks {dist.get_world_size()}")
    train_ds, sets = load_datasets(plans, recipe.data.split_validates)
    batches = StepBatches(train_ds, train.micro_batch_size, train.global_batch_size,
                          dp_rank, dp, device())
    valid = {name: StepBatches(ds, train.micro_batch_size, samples.valid, dp_rank, dp,
                               device()).microbatches(0) for name, ds in sets.items()}
    return Prefetcher(batches, train.steps), valid


def run(recipe: Recipe, tokenizer=None, on_step=None) -> dict:
    """Train per `recipe`; returns {"losses": [per step run here], "valid": [the split's
    validation losses, else the first named set's], "valid_sets": {name: [...]},
    "downstream": [{"step": s, "scores": {task: {metric: value}}}] (rank 0), "step": last
    step, "preempted": bool}. `on_step(step)` is called after every step (for tools and
    tests: fault injection)."""
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
    init_distributed(recipe.parallel, seed=train.seed)
    tables = batches = None
    try:
        check_ranks(recipe.profile, dist.get_world_size())
        downstream = DownstreamEval.start(recipe, tokenizer)  # None: lm_eval.interval 0
        checkpointer = Checkpointer(recipe)  # where the run starts; says any fallback
        model = build_model(recipe.model, recipe.parallel, seed=train.seed,
                            tables=recipe.tables)
        checkpointer.load_weights(model)  # before the engine copies them
        engine, tables, update = build_engine(model, recipe)
        step = checkpointer.resume(model, engine, tables)  # and saves these from now on

        batches, valid = _data(recipe, tokenizer)
        metrics = Metrics(recipe, first_step=step + 1)
        metrics.start(checkpointer.origin())
        guard = Guard(recipe.guard, checkpointer.keep_before, checkpointer.rewind,
                      lambda at, line: metrics.log(at, {}, line))
        profiler = ProfilerWindow(recipe.profile, dist.get_rank(), train.save_dir)

        result = {"losses": [], "valid": [], "valid_sets": {name: [] for name in valid
                                                            if name is not None},
                  "downstream": [], "step": step, "preempted": False}
        upcoming = batches.microbatches(step) if step < train.steps else None
        while step < train.steps:
            profiler.before(step + 1)
            lr = lr_at(step, opt, train.steps)
            current = upcoming
            # The next step's batch, now: an overlapped table update puts its rows first.
            upcoming = batches.microbatches(step + 1) if step + 1 < train.steps else None
            loss, outcome = train_step(update, current, lr,
                                       upcoming and [mb["tokens"] for mb in upcoming],
                                       metrics.timer)
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


@cli
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_stem.train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a YAML file in recipes/")
    parser.add_argument("overrides", nargs="*", help="section.field=value (YAML values)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved recipe, each value with the file or override "
                             "it came from, and exit")
    parser.add_argument("--check", action="store_true",
                        help="run every check that can run before training (fields, data "
                             "files, tokenizer, checkpoints, memory per GPU) and exit: 2 and "
                             "every problem, one per line, if any")
    parser.add_argument("--nodes", type=int, default=1, help="--check: nodes of the job")
    parser.add_argument("--gpus-per-node", type=int,
                        help="--check: GPUs per node (checks the layout and memory per GPU)")
    parser.add_argument("--hardware", default="h200",
                        help="--check: the GPU whose memory to plan for (h100, h200)")
    args = parser.parse_args(argv)
    if args.print_config or args.check:
        from megatron_stem import preflight  # noqa: PLC0415 (it imports this module)

        source = RecipeSource.read(args.recipe, args.overrides)
        if args.print_config:
            return preflight.print_config(source)
        return preflight.check(source, preflight.Target(args.nodes, args.gpus_per_node,
                                                        args.hardware))
    quiet.other_ranks_quiet()
    result = run(load_recipe(args.recipe, args.overrides))
    return EXIT_REQUEUE if result["preempted"] else 0


if __name__ == "__main__":
    lifetime.exit_soon(main())  # a thread a library left running keeps no finished rank
