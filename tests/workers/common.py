"""Helpers shared by the multi-process test workers (run under torchrun)."""

from __future__ import annotations

# megatron_stem before megatron-core: its import hook keeps megatron-core from importing
# TorchDynamo and Inductor (megatron_stem/runtime/lazy_imports.py), seconds of every rank's start.
import megatron_stem  # noqa: F401

# isort: split
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_stem.config import ModelConfig

TINY = dict(hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, vocab_size=300, seq_length=32)


def hf_shape(vocab_size: int) -> dict:
    """TINY as a Hugging Face Llama-style config's fields."""
    return dict(vocab_size=vocab_size, hidden_size=TINY["hidden_size"],
                intermediate_size=TINY["ffn_hidden_size"], num_hidden_layers=TINY["num_layers"],
                num_attention_heads=TINY["num_attention_heads"],
                num_key_value_heads=TINY["num_query_groups"],
                max_position_embeddings=TINY["seq_length"], rope_theta=10000.0)


def hf_tokens() -> torch.Tensor:
    """The fixed [2, 16] ids the Hugging Face parity tests run every model on."""
    return torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))


class HostTable(torch.nn.Module):
    """What a HostTableStore needs of a StemTable: a host `weight`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def tiny_model(stem_layers="1/2", **overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides}, stem_layers=stem_layers)


def microbatches(model: ModelConfig, count=2, batch=2, seed=0,
                 documents: bool = False) -> list[dict]:
    """Random micro-batches; with `documents`, cut into documents by `eod_token(model)` at
    random places, with megatron's reset position ids and the boundaries for attention."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        high = model.vocab_size - 1 if documents else model.vocab_size  # EOD: the last id
        seq = torch.randint(0, high, (batch, model.seq_length + 1), generator=g)
        mb = {"tokens": seq[:, :-1], "labels": seq[:, 1:],
              "loss_mask": torch.ones(batch, model.seq_length)}
        if documents:
            ends = torch.rand(batch, model.seq_length, generator=g) < 0.15
            mb["tokens"][ends] = eod_token(model)
            mb.update(document_inputs(mb["tokens"], eod_token(model)))
        out.append(mb)
    return out


def loss_masked(batches: list[dict], seed: int = 1) -> list[dict]:
    """The micro-batches with about a third of their positions out of the loss."""
    g = torch.Generator().manual_seed(seed)
    return [{**mb, "loss_mask": (torch.rand(mb["loss_mask"].shape, generator=g) > 0.3).float()}
            for mb in batches]


def eod_token(model: ModelConfig) -> int:
    return model.vocab_size - 1


def document_inputs(tokens: torch.Tensor, eod: int) -> dict:
    """`position_ids` and `documents` of a [b, s] micro-batch, as the trainer's data gives
    them with reset_position_ids and reset_attention_mask (megatron's own position rule)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_stem.model.documents import document_boundaries

    positions = [_get_ltor_masks_and_position_ids(row, eod, True, True, False, False)[2]
                 for row in tokens]
    return {"position_ids": torch.stack(positions),
            "documents": document_boundaries(tokens, eod)}


def _gather_tp(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or \
            parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    # A stride-2 shard ([gate_r; up_r] of a SwiGLU fc1) interleaves: gate parts first.
    parts = [chunk for j in range(stride) for shard in shards
             for chunk in [shard.chunk(stride, dim)[j]]]
    return torch.cat(parts, dim)


def full_named(model, config, what: str) -> dict[str, torch.Tensor]:
    """This stage's params or grads, gathered over TP, named by global layer index."""
    offset = get_transformer_layer_offset(config)
    out = {}
    for name, p in model.named_parameters():
        tensor = p if what == "param" else p.grad
        if tensor is None:
            continue
        name = re.sub(r"decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
        out[name] = _gather_tp(p, tensor)
    return out


class ChunkLossCalls:
    """Counts the calls of the chunked loss's per-chunk function (model/loss.py) while
    installed: a run that took megatron's whole-logits path instead calls it never."""

    def __init__(self):
        from megatron_stem.model import loss

        self._module, self._original, self.calls = loss, loss._chunk_loss, 0

        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)
        loss._chunk_loss = counted

    def close(self) -> int:
        self._module._chunk_loss = self._original
        return self.calls
