"""Training data: megatron-core's GPTDataset over weighted `.bin/.idx` prefixes, read in a
fixed order that depends only on the step, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_stem.config import DataConfig, Recipe
from megatron_stem.data.checks import check_token_files
from megatron_stem.errors import UserError
from megatron_stem.model.documents import document_boundaries


def check_prefixes(prefixes: list[str], field: Callable[[int], str],
                   vocab_size: int | None = None) -> None:
    """Every token file of `prefixes` exists and its pair is whole, with ids below
    `vocab_size` where sampled (`data/checks.py`); `field(i)` names the recipe field of the
    i-th."""
    for i, prefix in enumerate(prefixes):
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise UserError(f"{field(i)}: {prefix}{missing[0]} not found "
                            "(give the path without .bin/.idx, as written by preprocess_data.py)")
        try:
            check_token_files(prefix, vocab_size)
        except UserError as e:
            raise UserError(f"{field(i)}: {e}") from None


def check_training_data(data: DataConfig, vocab_size: int | None = None) -> None:
    """Every token file the training data names exists, whole (the error names the recipe
    field); with `vocab_size`, a sample of its ids too."""
    prefixes, _ = data.training_blend()
    if not prefixes:
        raise UserError("data.prefixes: no training data given (a list of .bin/.idx prefixes, "
                        "or data.blend: a data recipe)")
    check_prefixes(prefixes, data.field_of, vocab_size)


def check_validation_sets(data: DataConfig, vocab_size: int | None = None) -> None:
    """Every named validation set's files, before anything starts."""
    for name, prefixes in data.validation_sets.items():
        check_prefixes(prefixes, lambda i, name=name: f"data.validation.{name}", vocab_size)


def check_documents(data: DataConfig, tokenizer) -> None:
    """Document masking finds documents by their EOD token: the tokenizer must have one."""
    if tokenizer.eod is not None:
        return
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(data, name):
            raise UserError(f"data.{name}: the tokenizer {data.tokenizer_model} has no "
                            "end-of-document token to find documents by")


def _dataset_config(recipe: Recipe, tokenizer, cache_dir: str, **blend) -> GPTDatasetConfig:
    """megatron's dataset config of `recipe` over a blend (`blend` and `split`, or
    `blend_per_split`), the same samples for training and every validation set."""
    data = recipe.data
    return GPTDatasetConfig(
        random_seed=recipe.train.seed,
        sequence_length=recipe.model.seq_length,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # a dense [s, s] mask; documents go to attention instead
        **blend,
    )


def build_datasets(recipe: Recipe, tokenizer, train_samples: int, valid_samples: int,
                   cache_dir: str):
    """(train, valid) GPTDatasets of `seq_length`-token samples; valid is None when
    `data.split` gives validation no share."""
    data = recipe.data
    check_training_data(data)
    check_documents(data, tokenizer)
    config = _dataset_config(recipe, tokenizer, cache_dir, blend=data.training_blend(),
                             split=data.split)
    # A split not read (the test split; validation when `split` gives it no share) asks for
    # no samples: megatron takes a size of None as "all of it", which it allows only for an
    # unweighted blend, and 0 otherwise.
    unread = None if config.blend[1] is None else 0
    wanted = valid_samples if data.split_validates else unread
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, wanted, unread], lambda: True, config).build()
    if train is None or (wanted and valid is None):
        raise UserError(f"data.split: {data.split!r} leaves no documents for training or "
                        "validation; give both a share")
    return train, valid


def build_validation_sets(recipe: Recipe, tokenizer, samples: int, cache_dir: str) -> dict:
    """{name: GPTDataset} of `data.validation`: each set's prefixes read whole (their
    documents in megatron's validation order), `samples` samples each."""
    check_validation_sets(recipe.data)
    sets = {}
    for name, prefixes in recipe.data.validation_sets.items():
        config = _dataset_config(recipe, tokenizer, cache_dir,
                                 blend_per_split=[None, (prefixes, None), None])
        _, valid, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [None, samples, None], lambda: True, config).build()
        if valid is None:
            raise UserError(f"data.validation.{name}: no documents in {', '.join(prefixes)}")
        sets[name] = valid
    return sets


HOST_TOKENS = "host_tokens"  # a micro-batch's token ids in host memory (its `tokens`' copy)


def host_tokens(batch: dict) -> torch.Tensor:
    """A micro-batch's token ids in host memory: the loader's copy, else `tokens` read back
    (a sync on a GPU: micro-batches made elsewhere, by tests and benchmarks)."""
    return batch[HOST_TOKENS] if HOST_TOKENS in batch else batch["tokens"].cpu()


class StepBatches:
    """Micro-batches of one step for this data-parallel rank.

    Step `s` uses global samples [s x G, (s+1) x G) (G = global batch), split into
    contiguous per-rank slices and then micro-batches. The data position is just the step.

    A micro-batch holds `tokens`, `labels`, `loss_mask` ([b, s]) and, as the dataset was
    configured (`build_datasets`, document masking): `position_ids` [b, s] restarting in each
    document, and `documents`, the document boundaries for attention (`PackedSeqParams`,
    computed here on the host so the step never waits for the device to find them).
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device):
        self.dataset, self.mbs, self.gbs = dataset, micro_batch_size, global_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank, self.device = dp_rank, device
        config = dataset.config  # what the dataset's samples hold
        self.keys = ("tokens", "labels", "loss_mask") + (
            ("position_ids",) if config.reset_position_ids else ())
        self.eod = config.tokenizer.eod if config.reset_attention_mask else None

    def microbatches(self, step: int) -> list[dict]:
        first = step * self.gbs + self.dp_rank * self.per_rank
        return [self._collate(range(start, start + self.mbs))
                for start in range(first, first + self.per_rank, self.mbs)]

    def _collate(self, indices) -> dict:
        samples = [self.dataset[i % len(self.dataset)] for i in indices]
        host = {key: torch.stack([torch.as_tensor(np.asarray(s[key])) for s in samples])
                for key in self.keys}
        batch = {key: t.to(self.device, non_blocking=True) for key, t in host.items()}
        batch[HOST_TOKENS] = host["tokens"]  # the table path's rows, read with no sync
        if self.eod is not None:
            batch["documents"] = document_boundaries(host["tokens"], self.eod, self.device)
        return batch


def model_inputs(batch: dict) -> dict:
    """The model's arguments for a micro-batch besides its tokens: positions and document
    boundaries when the data has them (StemGPTModel.forward)."""
    return {"position_ids": batch.get("position_ids"),
            "packed_seq_params": batch.get("documents")}
