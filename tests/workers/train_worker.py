"""Run the trainer on a tiny model and dump its result as JSON.

    torchrun --nproc_per_node N train_worker.py --data PREFIX --out FILE.json
             [--preempt-at STEP|-1] [--slow-save STEP:SECONDS] [--full-disk-at STEP]
             [--kill-at STEP] [--cost-per-document SECONDS] [--say-model-built]
             [section.field=value ...]
"""

import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
import threading
import time

from common import TINY
from host_reads import HostReads
from megatron_stem.config import Recipe, apply_overrides, from_dict
from megatron_stem.runtime.errors import cli
from megatron_stem.training.loop import run


class VocabOnlyTokenizer:
    """What megatron's GPTDataset needs of a tokenizer, for pre-tokenized test data."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = vocab_size - 2
        self.unique_identifiers = {"class": "VocabOnlyTokenizer", "vocab_size": vocab_size}


class StopDuringStartup(VocabOnlyTokenizer):
    """Sends this rank SIGUSR1 when megatron's dataset builder first reads the tokenizer's
    identity: a stop signal in the middle of the trainer's start-up."""

    @property
    def unique_identifiers(self):
        if not getattr(self, "_signalled", False):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return self._identifiers

    @unique_identifiers.setter
    def unique_identifiers(self, value):
        self._identifiers = value


def delay_the_rest(seconds: float) -> None:
    """`tables.overlap: next_step` updates the rows the next step's first micro-batch
    reads first, then those of its later micro-batches, then the rest, in the background:
    hold back the arithmetic of all but the first, so the next forward surely runs before
    them (and the second micro-batch's lookups must wait for their rows)."""
    from megatron_stem.tables.overlap import STAGE_NAMES, Overlap

    launch = Overlap.launch

    def delayed(job):
        compute = job.compute

        def later():
            time.sleep(seconds)
            compute()
        return job if job.name.endswith(STAGE_NAMES[0]) else \
            dataclasses.replace(job, compute=later)

    def launch_delayed(self, stages, rest):
        launch(self, [[(param, delayed(job)) for param, job in stage] for stage in stages],
               [delayed(job) for job in rest])
    Overlap.launch = launch_delayed


def slow_save(step: int, seconds: int, full_disk_at: int) -> None:
    """The background writer of step `step`'s checkpoint sleeps before its files; that of
    step `full_disk_at`'s finds the disk full."""
    import errno

    from megatron_stem.checkpoint import background
    from megatron_stem.checkpoint import iter_name

    write = background._write_buckets

    def slow(transforms, buckets, results):
        if buckets and f"{iter_name(step)}.tmp" in buckets[0][0]:
            time.sleep(seconds)
        if buckets and f"{iter_name(full_disk_at)}.tmp" in buckets[0][0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(transforms, buckets, results)
    background._write_buckets = slow


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_to_all", "all_to_all_single", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
               "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "monitored_barrier",
               "all_reduce_coalesced", "new_group", "new_subgroups_by_enumeration")


def record_collectives() -> list:
    """Every collective this process issues through torch.distributed (whoever calls it:
    ours, DeepSpeed's, megatron's), as (thread, op, the group's ranks or "its own" for a
    group of this rank alone), in issue order; one made of others (`all_gather_object`,
    `new_subgroups_by_enumeration`) once."""
    import inspect

    import torch.distributed as dist

    issued, inside = [], threading.local()

    def recorded(op, collective):
        signature = inspect.signature(collective)

        def run(*args, **kwargs):
            if not getattr(inside, "depth", 0):  # the outermost call
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
                ranks = "world" if group is None or not hasattr(group, "size") else \
                    dist.get_process_group_ranks(group)
                if ranks == [dist.get_rank()]:
                    ranks = "its own"  # (the same group on every rank)
                issued.append((threading.current_thread().name, op, ranks))
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return collective(*args, **kwargs)
            finally:
                inside.depth -= 1
        return run
    for op in COLLECTIVES:
        setattr(dist, op, recorded(op, getattr(dist, op)))
        if hasattr(dist.distributed_c10d, op):
            setattr(dist.distributed_c10d, op, getattr(dist, op))
    return issued


def plant_nan(step: int) -> None:
    """Rank 1's own row gradients of its first table get a NaN at `step`."""
    import torch.distributed as dist

    from megatron_stem.tables.optimizer import TableOptimizer

    take, calls = TableOptimizer._local_row_grads, [0]

    def planted(self):
        ids, grads, looked_up = take(self)
        calls[0] += 1
        if calls[0] == step and dist.get_rank() == 1:
            grads[0][0, 0] = float("nan")
        return ids, grads, looked_up
    TableOptimizer._local_row_grads = planted


def say_model_built() -> None:
    """Each rank prints `model built` once the trainer has built its model."""
    from megatron_stem.training import loop

    build = loop.build_model

    def said(*args, **kwargs):
        model = build(*args, **kwargs)
        print("model built", flush=True)
        return model
    loop.build_model = said


@cli
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preempt-at", type=int, default=0,
                    help="rank 0 sends itself SIGUSR1 before this step (after the one before "
                         "it), whose end the run then stops at; -1: during start-up")
    ap.add_argument("--rss", action="store_true",
                    help="each rank writes its peak RSS after every step to OUT.rss<rank>")
    ap.add_argument("--plant-nan", type=int, default=0,
                    help="a NaN in rank 1's first table's row gradients at this step")
    ap.add_argument("--delay-rest", type=float, default=0.0,
                    help="seconds the overlapped table update waits before the rows the "
                         "next step does not read: a wrong split of the rows then shows")
    ap.add_argument("--slow-save", default="",
                    help="STEP:SECONDS: the background writer of step STEP's checkpoint "
                         "waits this long before writing its files")
    ap.add_argument("--full-disk-at", type=int, default=0,
                    help="the background writer of this step's checkpoint fails: no space")
    ap.add_argument("--kill-at", type=int, default=0,
                    help="every rank kills itself (SIGKILL) after this step")
    ap.add_argument("--record-collectives", action="store_true",
                    help="each rank writes its collectives to OUT.collectives<rank>")
    ap.add_argument("--count-host-reads", action="store_true",
                    help="each rank writes its main thread's reads of the device, step by "
                         "step, to OUT.reads<rank> (host_reads.py)")
    ap.add_argument("--cost-per-document", type=float, default=0.0,
                    help="seconds the data cache's build is predicted to spend on a document: "
                         "a stand-in for a corpus whose whole cache is refused at start")
    ap.add_argument("--say-model-built", action="store_true",
                    help="each rank prints 'model built' once the model is")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    data = {"model": {**TINY, "stem_layers": "1/2"},
            "data": {"prefixes": [args.data], "split": "90,10,0"},
            "optimizer": {"lr": 3e-3, "warmup_steps": 2, "clip_grad": 1.0,
                          "tables": {"kernel": "torch", "update": "lazy"}},  # tests: dense too
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "steps": 6,
                      "dtype": "fp32", "log_interval": 1, "eval_interval": 3,
                      "eval_iters": 2, "save_interval": 100}}
    recipe = from_dict(Recipe, apply_overrides(data, args.overrides))

    peaks = []  # this process's peak RSS (bytes) after each step
    reads = HostReads() if args.count_host_reads else None
    reads_by_step = []  # [(kind, site), ...] of each step, from the end of the one before

    def on_step(step):
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if reads is not None:
            reads_by_step.append(reads.take())
        if step + 1 == args.preempt_at and int(os.environ["RANK"]) == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    if args.slow_save or args.full_disk_at:
        step, seconds = map(int, args.slow_save.split(":")) if args.slow_save else (0, 0)
        slow_save(step, seconds, args.full_disk_at)
    if args.delay_rest:
        delay_the_rest(args.delay_rest)
    if args.plant_nan:
        plant_nan(args.plant_nan)
    issued = record_collectives() if args.record_collectives else None
    if args.cost_per_document:
        from megatron_stem.data import sample_cache

        sample_cache.SECONDS_PER_DOCUMENT = args.cost_per_document
    if args.say_model_built:
        say_model_built()
    # A real tokenizer when the recipe names one (in-loop lm-eval reads text).
    tokenizer = None if recipe.data.tokenizer_model else \
        (StopDuringStartup if args.preempt_at < 0 else VocabOnlyTokenizer)(recipe.model.vocab_size)
    result = run(recipe, tokenizer, on_step)
    if args.rss:  # the last entry: after the run's final save
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        with open(f"{args.out}.rss{os.environ['RANK']}", "w") as f:
            json.dump(peaks, f)
    if reads is not None:
        with open(f"{args.out}.reads{os.environ['RANK']}", "w") as f:
            json.dump(reads_by_step, f)
    if issued is not None:
        with open(f"{args.out}.collectives{os.environ['RANK']}", "w") as f:
            json.dump(issued, f)
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
