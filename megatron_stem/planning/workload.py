"""What one rank does in one step of a recipe on a cluster, and the parts its time is made of.

`Workload` is read from a recipe (`workload`): the model's shape, the rank's micro-batches,
the tables' shape and the distinct rows they touch (the Zipf model of `rows.py`, or
measured counts). `Component` is one priced part of the step: what it moves or computes,
on which resource, in which phase (the step model of `step.py` decides what overlaps).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_stem.config import ModelConfig, Recipe
from megatron_stem.model.accounting import account, training_flops_per_token
from megatron_stem.planning import rows as row_model
from megatron_stem.planning.traffic import RowCounts, TableShape
from megatron_stem.runtime.errors import UserError

# Activation memory per token per layer in bf16 without recompute, with flash attention
# (Korthikanti et al. 2022: 34 x hidden bytes per token per layer, the s^2 term gone).
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 34
# Elementwise passes over ffn elements of the FFN activation's recompute (`recompute_bytes`).
MLP_ACT_RECOMPUTE_PASSES = 5


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """One rank's step of a recipe on a cluster."""

    name: str
    model: ModelConfig
    dp: int
    tp: int
    microbatches: int
    tokens_per_microbatch: int
    flops_per_token: float  # forward + backward, as the trainer's MFU counts them, per TP rank
    # Forward work done again in backward (activation recompute, the chunked loss's
    # logits), per token and TP rank: not in MFU's count, but in the step's time.
    recompute_flops_per_token: float
    # ... and the bytes of elementwise work it does again (`mlp_act`), per token, TP rank.
    recompute_bytes_per_token: float
    head_share: float  # of those FLOPs, the output layer's (first in backward)
    backbone_params: int  # per TP rank: the parameters DeepSpeed trains
    activation_bytes: float
    dtype_bytes: int
    zero_stage: int
    kernel: str  # the tables' CPU Adam: "deepspeed" | "torch"
    shape: TableShape
    rows: RowCounts
    # The busiest owner's received rows over the mean in the grads-to-owners all-to-all:
    # 1 with the shards' interleaved rows (tables/shards.py); contiguous ranges of
    # a frequency-ordered BPE vocabulary would give the first owner ~3x (docs/tables.md).
    owner_skew: float = 1.0

    @property
    def tokens(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def stem_layers(self) -> tuple[int, ...]:
        return tuple(self.model.stem_layer_indices)


@dataclass
class Component:
    name: str
    resource: str  # gpu | net | d2h | h2d | cpu | mem (the accelerator's memory)
    amount: float
    unit: str  # FLOP | B | elem
    seconds: float
    phase: str  # compute | reduction | backbone | sync | tables | staging


def workload(recipe: Recipe, cluster: Cluster, exponent: float = row_model.ZIPF_EXPONENT,
             rows_override: dict | None = None, name: str = "") -> Workload:
    m, t, par = recipe.model, recipe.train, recipe.parallel
    tp = par.tensor_parallel * par.pipeline_parallel
    if cluster.world % tp:
        raise UserError(f"--nodes x --gpus-per-node = {cluster.world} is not a multiple of "
                        f"TP x PP = {tp}")
    dp = cluster.world // tp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise UserError(f"{name}: train.global_batch_size {t.global_batch_size} is not a "
                        f"multiple of micro_batch_size x DP = {t.micro_batch_size * dp}")
    mbs = t.global_batch_size // (t.micro_batch_size * dp)
    per_mb = t.micro_batch_size * m.seq_length
    flops = training_flops_per_token(m)
    head = 6 * m.vocab_size * m.hidden_size
    stem = m.stem_layer_indices
    shape = TableShape(len(stem), m.vocab_size, m.ffn_hidden_size // par.tensor_parallel)
    counts = expected_rows(shape.rows, dp, mbs, per_mb, exponent, rows_override or {})
    activations = ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN * per_mb * m.hidden_size * \
        m.num_layers / tp
    return Workload(
        name=name, model=m, dp=dp, tp=tp, microbatches=mbs, tokens_per_microbatch=per_mb,
        flops_per_token=flops / tp, recompute_flops_per_token=recompute_flops(recipe) / tp,
        recompute_bytes_per_token=recompute_bytes(recipe) / tp,
        head_share=min(head / flops, 0.9),
        backbone_params=account(m).active_params // tp, activation_bytes=activations,
        dtype_bytes=2 if t.dtype == "bf16" else 4, zero_stage=recipe.optimizer.zero_stage,
        kernel=recipe.optimizer.tables.kernel, shape=shape, rows=counts)


def recompute_flops(recipe: Recipe) -> float:
    """FLOPs per token that the backward spends computing forward work again (counted as
    `model/accounting.py` counts the forward: 2 x the weights' GEMM parameters, 4 x layers x
    hidden x sequence for attention): `parallel.recompute: full` every layer's forward,
    `selective` its modules' (`core_attn` attention's scores and values, `mlp` the FFN's
    GEMMs, `mlp_act` elementwise only: none), `parallel.loss_chunk_tokens` the output
    layer's."""
    m, par = recipe.model, recipe.parallel
    h, vocab, layers = m.hidden_size, m.vocab_size, m.num_layers
    flops = 2 * h * vocab if par.loss_chunk_tokens else 0.0
    attention = 4 * layers * h * m.seq_length
    if par.recompute == "full":
        acc = account(m)
        weights = acc.active_params - acc.embedding_params * (2 if m.untie_embeddings else 1)
        flops += 2 * weights + attention
    elif par.recompute == "selective":
        stem = len(m.stem_layer_indices)  # a STEM FFN has two GEMMs, a dense one three
        mlp = 2 * h * m.ffn_hidden_size * (3 * (layers - stem) + 2 * stem)
        flops += attention * ("core_attn" in par.recompute_modules) + \
            mlp * ("mlp" in par.recompute_modules)
    return flops


def recompute_bytes(recipe: Recipe) -> float:
    """Bytes per token that `parallel.recompute_modules: [mlp_act]` moves through memory
    again: per layer, silu(gate) (read the gate, write its silu) and the product (read both
    factors, write it), 5 passes over ffn elements in the training dtype."""
    m, par = recipe.model, recipe.parallel
    if par.recompute != "selective" or "mlp_act" not in par.recompute_modules:
        return 0.0
    dtype = 2 if recipe.train.dtype == "bf16" else 4
    return MLP_ACT_RECOMPUTE_PASSES * m.num_layers * m.ffn_hidden_size * dtype


def expected_rows(vocab: int, dp: int, microbatches: int, per_microbatch: int,
                  exponent: float, override: dict) -> RowCounts:
    """Distinct rows per rank, per micro-batch, over DP, and over DP in the first
    micro-batch from the Zipf model; `override`
    replaces any of `rank_rows`, `union_rows`, `microbatch_rows`, `longest_rank_rows`
    (measured counts)."""
    rank_tokens = microbatches * per_microbatch
    rank = override.get("rank_rows") or row_model.expected_distinct(rank_tokens, vocab, exponent)
    union = override.get("union_rows") or row_model.expected_distinct(rank_tokens * dp, vocab,
                                                                      exponent)
    mb = override.get("microbatch_rows") or microbatches * row_model.expected_distinct(
        per_microbatch, vocab, exponent)
    first = row_model.expected_distinct(per_microbatch * dp, vocab, exponent)
    if override.get("union_rows"):  # measured: the model's share of it
        first *= union / row_model.expected_distinct(rank_tokens * dp, vocab, exponent)
    return RowCounts(rank_rows=round(rank), union_rows=round(union),
                     owned_rows=round(union / dp), microbatch_rows=round(mb),
                     longest_rank_rows=round(override.get("longest_rank_rows") or rank),
                     first_microbatch_union_rows=round(min(first, union)))
