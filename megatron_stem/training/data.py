"""Training data: megatron-core's GPTDataset over weighted `.bin/.idx` prefixes, read in a
fixed order that depends only on the step, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_stem.config import DataConfig, Recipe
from megatron_stem.errors import UserError


def check_prefixes(data: DataConfig) -> None:
    """Every token file the training data names exists (the error names the recipe field)."""
    prefixes, _ = data.training_blend()
    if not prefixes:
        raise UserError("data.prefixes: no training data given (a list of .bin/.idx prefixes, "
                        "or data.blend: a data recipe)")
    for i, prefix in enumerate(prefixes):
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise UserError(f"{data.field_of(i)}: {prefix}{missing[0]} not found "
                            "(give the path without .bin/.idx, as written by preprocess_data.py)")


def build_datasets(recipe: Recipe, tokenizer, train_samples: int, valid_samples: int,
                   cache_dir: str):
    """(train, valid) GPTDatasets of `seq_length`-token samples."""
    data = recipe.data
    check_prefixes(data)
    config = GPTDatasetConfig(
        random_seed=recipe.train.seed,
        sequence_length=recipe.model.seq_length,
        blend=data.training_blend(),
        split=data.split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    # No test split is read; megatron takes a size of None as "all of it", which it allows
    # only for an unweighted blend.
    test_samples = None if config.blend[1] is None else 0
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, test_samples], lambda: True, config).build()
    if train is None or (valid_samples and valid is None):
        raise UserError(f"data.split: {data.split!r} leaves no documents for training or "
                        "validation; give both a share")
    return train, valid


class StepBatches:
    """Micro-batches of one step for this data-parallel rank.

    Step `s` uses global samples [s x G, (s+1) x G) (G = global batch), split into
    contiguous per-rank slices and then micro-batches. The data position is just the step.
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device):
        self.dataset, self.mbs, self.gbs = dataset, micro_batch_size, global_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank, self.device = dp_rank, device

    def microbatches(self, step: int) -> list[dict]:
        first = step * self.gbs + self.dp_rank * self.per_rank
        return [self._collate(range(start, start + self.mbs))
                for start in range(first, first + self.per_rank, self.mbs)]

    def _collate(self, indices) -> dict:
        samples = [self.dataset[i % len(self.dataset)] for i in indices]
        return {key: torch.stack([torch.as_tensor(np.asarray(s[key])) for s in samples])
                .to(self.device, non_blocking=True)
                for key in ("tokens", "labels", "loss_mask")}
