"""Parameter and FLOP accounting, counted the way the STEM paper counts.

total  = the dense baseline's parameters + all STEM tables (the removed up-projections are
         not subtracted: 1B paper config = 1.4985B + 5 x 128,256 x 8,192 = 6.752B)
active = the dense baseline - (STEM layers) x d x d_ff: one table row per token replaces
         an up-projection, so per-token compute drops by that matmul
FLOPs/token (forward) = 2 x active;  ROI = (accuracy / FLOPs) relative to the dense model.

Counts use the true vocabulary (no TP padding), like the paper.

MFU counts otherwise, as Megatron-LM, llm-foundry and torchtitan do: training FLOPs per
token = 6 x the non-embedding parameters (the output layer counted, the input embedding,
a lookup, not) + 12 x layers x hidden x sequence (attention's scores and values, forward
and backward, without halving for the causal mask). A STEM table is a lookup too: its rows
are not counted, and the up-projections it replaces are not there to count. `dense_1b`:
6 x 1.2358B + 12 x 16 x 2048 x 2048 = 8.22 GFLOP/token (2 x active = 3.00 forward, the
paper's figure, counts the embedding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_stem.config import ModelConfig


@dataclass(frozen=True)
class Accounting:
    dense_params: int  # the dense baseline of the same shape
    table_params: int  # sum of all STEM tables
    stored_params: int  # what the STEM model really holds: active + tables
    total_params: int  # paper's "total"
    active_params: int  # paper's "active"
    flops_per_token: int  # forward, 2 x active (the paper's count)
    embedding_params: int  # the input embedding (a lookup, not in MFU's count)
    training_flops_per_token: int  # forward + backward as MFU counts them (module docstring)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"total {_count(self.total_params)}, active {_count(self.active_params)}, "
                f"tables {_count(self.table_params)}, "
                f"{_count(self.flops_per_token)} FLOPs/token (paper), "
                f"{_count(self.training_flops_per_token)} training FLOPs/token (MFU)")


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def account(model: ModelConfig) -> Accounting:
    d, ff, vocab = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    head_dim = d // model.num_attention_heads
    attention = d * head_dim * (2 * model.num_attention_heads + 2 * model.kv_heads)
    swiglu = 3 * d * ff
    layer = attention + swiglu + 2 * d  # + two RMSNorm weights
    embeddings = vocab * d * (2 if model.untie_embeddings else 1)
    dense = embeddings + model.num_layers * layer + d  # + final norm
    stem_layers = len(model.stem_layer_indices)
    tables = stem_layers * vocab * ff
    active = dense - stem_layers * d * ff
    # MFU's count: 6 x the non-embedding parameters (the output layer in, the input
    # embedding and the STEM tables out) + 12 x layers x hidden x sequence; with tied
    # embeddings the one matrix is the output layer's: it is counted
    matmul = active - (vocab * d if model.untie_embeddings else 0)
    training = 6 * matmul + 12 * model.num_layers * d * model.seq_length
    return Accounting(dense_params=dense, table_params=tables, stored_params=active + tables,
                      total_params=dense + tables, active_params=active,
                      flops_per_token=2 * active, embedding_params=vocab * d,
                      training_flops_per_token=training)


def training_flops_per_token(model: ModelConfig) -> float:
    """Forward + backward FLOPs per token, as MFU counts them (the trainer's log and the
    step planner, module docstring)."""
    return account(model).training_flops_per_token


def mfu(tokens_per_s: float, model: ModelConfig, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilization: training FLOPs done per second over what `devices`
    accelerators of `peak_flops` each could do."""
    return tokens_per_s * training_flops_per_token(model) / (peak_flops * devices)


def roi(accuracy: float, flops: float, dense_accuracy: float, dense_flops: float) -> float:
    """Accuracy per FLOP relative to the dense baseline (1.0 = as efficient as dense)."""
    return (accuracy / flops) / (dense_accuracy / dense_flops)
