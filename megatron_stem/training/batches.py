"""Training data: megatron-core's GPTDataset over weighted `.bin/.idx` prefixes, read in a
fixed order that depends only on the step, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from megatron.core.datasets.utils import Split

from megatron_stem.config import DataConfig, Recipe
from megatron_stem.data.prefix_sets import resolve_blend
from megatron_stem.data.sample_cache import Plan, build, dataset_config
from megatron_stem.model.documents import document_boundaries
from megatron_stem.runtime.errors import UserError
from megatron_stem.tables.comm import mark_host
from megatron_stem.tables.row_grads import HOST_TOKENS


def training_entries(data: DataConfig) -> list[str]:
    """The training data's entries (prefixes or prefix sets), from either form."""
    entries, _ = data.training_blend()
    if not entries:
        raise UserError("data.prefixes: no training data given (a list of .bin/.idx prefixes "
                        "or prefix-set folders, or data.blend: a data recipe)")
    return entries


def check_training_data(data: DataConfig, vocab_size: int | None = None) -> None:
    """Every token file the training data names exists, is whole and fits megatron's
    document ids (the error names the recipe field); with `vocab_size`, a sample of its ids
    too (data/checks.py)."""
    _, weights = data.training_blend()
    resolve_blend(training_entries(data), weights, data.field_of, vocab_size)


def check_validation_sets(data: DataConfig, vocab_size: int | None = None) -> None:
    """Every named validation set's files, before anything starts."""
    for name, entries in data.validation_sets.items():
        resolve_blend(entries, None, lambda i, name=name: f"data.validation.{name}", vocab_size)


def check_documents(data: DataConfig, tokenizer) -> None:
    """Document masking finds documents by their EOD token: the tokenizer must have one."""
    if tokenizer.eod is not None:
        return
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(data, name):
            raise UserError(f"data.{name}: the tokenizer {data.tokenizer_model} has no "
                            "end-of-document token to find documents by")


def default_cache_dir(data: DataConfig) -> str:
    """`data.cache_dir`, else `cache/` beside the first training entry: shared by every run
    of the same data (the dense and STEM runs of a stage, a requeued run)."""
    if data.cache_dir:
        return data.cache_dir
    first = training_entries(data)[0].rstrip(os.sep)
    return os.path.join(os.path.dirname(first) or ".", "cache")


@dataclass(frozen=True)
class Samples:
    """How many samples a run reads: training (steps x global batch) and each validation
    (eval_iters micro-batches on every data-parallel rank)."""

    train: int
    valid: int

    @classmethod
    def of(cls, recipe: Recipe, data_parallel: int) -> "Samples":
        t = recipe.train
        return cls(t.steps * t.global_batch_size, t.eval_iters * t.micro_batch_size * data_parallel)


def plans(recipe: Recipe, tokenizer, samples: Samples) -> dict[Optional[str], Plan]:
    """{None: the training data's plan (its split's train and valid), name: each named
    validation set's}: every dataset a run reads."""
    data = recipe.data
    check_documents(data, tokenizer)
    cache = default_cache_dir(data)
    config = functools.partial(dataset_config, recipe.train.seed, recipe.model.seq_length,
                               tokenizer, cache, data)
    _, weights = data.training_blend()
    prefixes, weights = resolve_blend(training_entries(data), weights, data.field_of)
    split = config(blend=([p.path for p in prefixes], weights), split=data.split)
    # A split not read (the test split; validation when `split` gives it no share) asks
    # for no samples: megatron takes a size of None as "all of it", which it allows only
    # for an unweighted blend, and 0 otherwise.
    unread = None if weights is None else 0
    valid = samples.valid if data.split_validates else unread
    out = {None: Plan("training", split, prefixes, weights, split.split_matrix,
                      [samples.train, valid, unread])}
    for name, entries in data.validation_sets.items():
        prefixes, _ = resolve_blend(entries, None, lambda i, name=name: f"data.validation.{name}")
        blend = ([p.path for p in prefixes], None)
        out[name] = Plan(f"validation set {name}", config(blend_per_split=[None, blend, None]),
                         prefixes, None, [None, (0.0, 1.0), None], [0, samples.valid, 0])
    return out


def load_datasets(plans: dict[Optional[str], Plan], split_validates: bool
                  ) -> tuple[object, dict[Optional[str], object]]:
    """(train dataset, {None: the split's validation if any, name: each set's}) from a
    ready cache."""
    train, valid, _ = plans[None].datasets()
    if train is None or (split_validates and valid is None):
        raise UserError(f"data.split: {plans[None].config.split!r} leaves no documents for "
                        "training or validation; give both a share")
    sets = {None: valid} if split_validates else {}
    for name, plan in plans.items():
        if name is not None:
            sets[name] = plan.datasets()[Split.valid.value]
    return train, sets


def open_datasets(recipe: Recipe, tokenizer, samples: Samples):
    """(train, validation sets) of a recipe in one process, its cache built where missing:
    for tools and tests outside a run."""
    run_plans = plans(recipe, tokenizer, samples)
    build(list(run_plans.values()))
    return load_datasets(run_plans, recipe.data.split_validates)


class StepBatches:
    """Micro-batches of one step for this data-parallel rank.

    Step `s` uses global samples [s x G, (s+1) x G) (G = global batch), split into
    contiguous per-rank slices and then micro-batches. The data position is just the step.

    A micro-batch holds `tokens`, `labels`, `loss_mask` ([b, s]) and, as the dataset was
    configured (`plans`, document masking): `position_ids` [b, s] restarting in each
    document, and `documents`, the document boundaries for attention (`PackedSeqParams`,
    computed here on the host so the step never waits for the device to find them).

    `host(step)` reads and collates (pinned on a GPU), `to_device` only copies: a loader
    thread can do the first while the step computes (`Prefetcher`).
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device):
        self.dataset, self.mbs, self.gbs = dataset, micro_batch_size, global_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank, self.device = dp_rank, device
        self.samples = len(dataset)
        config = dataset.config  # what the dataset's samples hold
        self.keys = ("tokens", "labels", "loss_mask") + (
            ("position_ids",) if config.reset_position_ids else ())
        self.eod = config.tokenizer.eod if config.reset_attention_mask else None
        self.pin = device.type == "cuda"

    def microbatches(self, step: int) -> list[dict]:
        return self.to_device(self.host(step))

    def host(self, step: int) -> list[dict]:
        first = step * self.gbs + self.dp_rank * self.per_rank
        return [self._collate(range(start, start + self.mbs))
                for start in range(first, first + self.per_rank, self.mbs)]

    def to_device(self, host: list[dict]) -> list[dict]:
        return [self._to_device(mb) for mb in host]

    def _collate(self, indices) -> dict:
        samples = [self.dataset[i % self.samples] for i in indices]
        host = {key: torch.stack([torch.as_tensor(np.asarray(s[key])) for s in samples])
                for key in self.keys}
        if self.pin:
            host = {key: t.pin_memory() for key, t in host.items()}
        if self.eod is not None:
            host["documents"] = document_boundaries(host["tokens"], self.eod)
        return host

    def _to_device(self, host: dict) -> dict:
        batch = {key: host[key].to(self.device, non_blocking=True) for key in self.keys}
        batch[HOST_TOKENS] = mark_host(host["tokens"])  # the table path's rows: no sync
        if "documents" in host:
            batch["documents"] = documents_to(host["documents"], self.device)
        return batch


class Prefetcher:
    """The next step's micro-batches read and collated by a loader thread while this step
    computes; handed over in step order, so what a step reads depends only on the step
    (a resumed run reads the same batches). The copies to the device are issued by the
    caller's thread, on its stream."""

    def __init__(self, batches: StepBatches, last_step: int):
        self.batches, self.last_step = batches, last_step
        # Pinning touches CUDA: the thread works on this rank's device, not device 0.
        device = batches.device
        self.pool = ThreadPoolExecutor(
            1, thread_name_prefix="stem-loader",
            initializer=(lambda: torch.cuda.set_device(device)) if batches.pin else None)
        self.pending: dict[int, Future] = {}

    def microbatches(self, step: int) -> list[dict]:
        """Step `step`'s micro-batches on the device; starts reading step + 1's."""
        future = self.pending.pop(step, None)
        host = future.result() if future is not None else self.batches.host(step)
        if step + 1 < self.last_step and step + 1 not in self.pending:
            self.pending[step + 1] = self.pool.submit(self.batches.host, step + 1)
        return self.batches.to_device(host)

    def settle(self) -> None:
        """Wait until the loader thread is idle: before a checkpoint's writer forks
        processes (megatron's file writer), no thread may be in the middle of a read."""
        for future in self.pending.values():
            future.exception()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def documents_to(documents, device: torch.device):
    """Document boundaries (`PackedSeqParams`) with their offsets on `device`."""
    cu = documents.cu_seqlens_q.to(device, non_blocking=True)
    return dataclasses.replace(documents, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def model_inputs(batch: dict) -> dict:
    """The model's arguments for a micro-batch besides its tokens: positions and document
    boundaries when the data has them (StemGPTModel.forward)."""
    return {"position_ids": batch.get("position_ids"),
            "packed_seq_params": batch.get("documents")}
