"""Run the trainer on a tiny model and dump its result as JSON.

    torchrun --nproc_per_node N train_worker.py --data PREFIX --out FILE.json
             [--preempt-at STEP|-1] [--slow-save STEP:SECONDS] [--full-disk-at STEP]
             [--kill-at STEP]
             [section.field=value ...]
"""

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time

from common import TINY
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
    """`tables.overlap: next_step` runs the rows the next step's first micro-batch reads
    first, then those of its later micro-batches, then the rest, in the background: hold
    back all but the first, so the next forward surely runs before them (and the second
    micro-batch's lookups must wait for their rows)."""
    from megatron_stem.tables.overlap import STAGE_NAMES, Overlap

    run = Overlap._run

    def delayed(self, job):
        if not job.name.endswith(STAGE_NAMES[0]):
            time.sleep(seconds)
        run(self, job)
    Overlap._run = delayed


def slow_save(step: int, seconds: int, full_disk_at: int) -> None:
    """The background writer of step `step`'s checkpoint sleeps before its files; that of
    step `full_disk_at`'s finds the disk full."""
    import errno

    from megatron_stem.checkpoint import iter_name, shard_writes

    write = shard_writes._write_buckets

    def slow(transforms, buckets, results):
        if buckets and f"{iter_name(step)}.tmp" in buckets[0][0]:
            time.sleep(seconds)
        if buckets and f"{iter_name(full_disk_at)}.tmp" in buckets[0][0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(transforms, buckets, results)
    shard_writes._write_buckets = slow


def record_collectives() -> list:
    """Every collective the tables issue, as (communicator, thread, op), in issue order."""
    from megatron_stem.tables.comm import Comm

    issued, check = [], Comm._check

    def recorded(self, op, *tensors):
        issued.append((self.name, threading.current_thread().name, op))
        check(self, op, *tensors)
    Comm._check = recorded
    return issued


def plant_nan(step: int) -> None:
    """Rank 1's own row gradients of its first table get a NaN at `step`."""
    import torch.distributed as dist

    from megatron_stem.tables.optimizer import TableOptimizer

    take, calls = TableOptimizer._local_row_grads, [0]

    def planted(self):
        ids, grads = take(self)
        calls[0] += 1
        if calls[0] == step and dist.get_rank() == 1:
            grads[0][0, 0] = float("nan")
        return ids, grads
    TableOptimizer._local_row_grads = planted


@cli
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preempt-at", type=int, default=0,
                    help="rank 0 sends itself SIGUSR1 after this step; -1: during start-up")
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
                    help="each rank writes the tables' collectives to OUT.collectives<rank>")
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

    def on_step(step):
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if step == args.preempt_at and int(os.environ["RANK"]) == 0:
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
    # A real tokenizer when the recipe names one (in-loop lm-eval reads text).
    tokenizer = None if recipe.data.tokenizer_model else \
        (StopDuringStartup if args.preempt_at < 0 else VocabOnlyTokenizer)(recipe.model.vocab_size)
    result = run(recipe, tokenizer, on_step)
    if args.rss:  # the last entry: after the run's final save
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        with open(f"{args.out}.rss{os.environ['RANK']}", "w") as f:
            json.dump(peaks, f)
    if issued is not None:
        with open(f"{args.out}.collectives{os.environ['RANK']}", "w") as f:
            json.dump(issued, f)
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
