"""Memory per GPU of a recipe's training step, part by part: what the planner predicts.

Every figure is a count times bytes, none is measured: parameter counts from
`model/accounting.py` (the backbone's active parameters, sliced over TP x PP as `step.py` does),
table shapes and row counts from `traffic.py` and the Zipf row model (`rows.py`), the
recipe's sequence, micro-batch, dtype, ZeRO stage and recompute, and the table options
(placement, partition, where the tables' optimizer state lives). Activations follow
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
with flash-style attention, so without its 5as/h term: 34 bytes x hidden per token per
layer in a 16-bit dtype (`workload.ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN`), of which 24 are
split over tensor parallelism and the other 10 only with sequence parallelism.

One rank, one micro-batch in flight (the trainer does not pipeline), at the peak of its
backward:

* parameters: the backbone in the training dtype;
* gradients: the backbone's in the training dtype (ZeRO-1: all of them; ZeRO-2: the
  rank's partition), and the tables' row gradients of the step: each micro-batch's sparse
  gradient as backward gives it (one row per token position), then their fp32 sums over
  the step's distinct rows (`tables/row_grads.py`);
* optimizer: the backbone's fp32 master and two Adam moments, 12 bytes per parameter over
  data parallel (ZeRO-1/2), in host memory with `optimizer.offload`;
* tables: the device tables in the training dtype (`tables.placement: device`) or the
  staged rows and hot-row cache (`host`), and with `optimizer.tables.device: accelerator`
  the owned rows' fp32 master and moments (`traffic.device_state_bytes`);
* activations: the layers' (all of them stored, or with `parallel.recompute: full` each
  layer's input plus the one layer being recomputed, or with `selective` what the
  recomputed modules do not keep, `selective_freed_bytes`, less), and the logits: the cross-entropy's
  fp32 softmax kept for backward (Korthikanti's 4sbv/t) and the logits in the training
  dtype while the loss is computed; with `parallel.loss_chunk_tokens` those of one chunk
  of positions, and the output weight's gradient summed over the chunks in fp32.

Host memory per GPU: the tables' optimizer state in CPU memory (`traffic.cpu_state_bytes`:
with host placement this includes the rank's share of its node's copy), and the backbone's
with `optimizer.offload`.

Left out (each under a few percent at the shipped recipes' sizes): DeepSpeed's reduction
buckets and the fp32 gradient partition at the optimizer step (they live after backward,
when the activations are gone), the table update's 64 MB chunks and exchange buffers,
attention's per-head softmax statistics, CUDA's context and the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_stem.config import Recipe
from megatron_stem.model.accounting import account
from megatron_stem.planning import rows as row_model
from megatron_stem.planning import traffic
from megatron_stem.planning.backbone import BACKBONE_OPTIMIZER_BYTES_PER_PARAM
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.traffic import FP32, Layout, TableShape
from megatron_stem.planning.workload import (
    ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN,
    Cluster,
    expected_rows,
)

# Of Korthikanti's 34 bytes x hidden per token per layer, those tensor parallelism splits
# without sequence parallelism (the attention and MLP blocks' inner tensors); the other 10
# (the layer norms' and blocks' inputs, dropout masks) only sequence parallelism splits.
ACTIVATION_BYTES_SPLIT_BY_TP = 24
# A layer's input, kept for its recompute (`parallel.recompute: full`), in 16-bit.
LAYER_INPUT_BYTES_PER_TOKEN_HIDDEN = 2
KINDS = ("parameters", "gradients", "optimizer", "tables", "activations")
TABLE_WEIGHTS = "tables"  # the name of the part of the tables' weights on the device


@dataclass(frozen=True)
class Part:
    kind: str  # one of KINDS, or "host" (CPU memory)
    name: str
    bytes: float
    counted: str  # how, for the printout


@dataclass(frozen=True)
class MemoryPlan:
    """A rank's predicted memory: its parts on the GPU and in host memory."""

    title: str
    parts: tuple[Part, ...]
    capacity: float  # the accelerator's memory; 0: not checked (a CPU run)

    def total(self, kind: str | None = None) -> float:
        """Bytes on the accelerator (of one kind, or all)."""
        return sum(p.bytes for p in self.parts if p.kind != "host"
                   and (kind is None or p.kind == kind))

    @property
    def host(self) -> float:
        return sum(p.bytes for p in self.parts if p.kind == "host")

    @property
    def fits(self) -> bool:
        return not self.capacity or self.total() <= self.capacity


def memory_per_gpu(recipe: Recipe, cluster: Cluster, hw: Hardware,
                   exponent: float = row_model.ZIPF_EXPONENT,
                   rank_rows: int | None = None, title: str = "") -> MemoryPlan:
    """The memory of one rank of `recipe` trained on `cluster` of `hw` (see the module
    docstring); `rank_rows` replaces the Zipf model's distinct rows per rank per step."""
    m, t, par, opt = recipe.model, recipe.train, recipe.parallel, recipe.optimizer
    model_parallel = par.tensor_parallel * par.pipeline_parallel
    dp = max(1, cluster.world // model_parallel)
    microbatches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    tokens = t.micro_batch_size * m.seq_length  # one micro-batch
    dtype = 2 if t.dtype == "bf16" else 4
    backbone = account(m).active_params / model_parallel
    parts = [Part("parameters", "backbone weights", backbone * dtype,
                  f"{_n(backbone)} params x {dtype} B")]
    grads = backbone / (dp if opt.zero_stage == 2 else 1)
    parts.append(Part("gradients", f"backbone grads (ZeRO-{opt.zero_stage})", grads * dtype,
                      f"{_n(grads)} x {dtype} B"))
    states = backbone * BACKBONE_OPTIMIZER_BYTES_PER_PARAM / dp
    parts.append(Part("host" if opt.offload else "optimizer",
                      "backbone fp32 master + Adam moments", states,
                      f"{_n(backbone)} x {BACKBONE_OPTIMIZER_BYTES_PER_PARAM} B / DP{dp}"))
    layout = Layout(recipe.tables.placement, recipe.optimizer.tables.update,
                    recipe.tables.partition, recipe.optimizer.tables.device, dp=dp,
                    ranks_per_copy=recipe.tables.ranks_per_copy or min(dp, cluster.gpus_per_node),
                    grad_bytes=dtype, param_bytes=dtype, device_is_host=hw.device_is_host)
    parts += _table_parts(recipe, layout, microbatches, tokens, exponent, rank_rows)
    parts += _activation_parts(recipe, tokens, dtype)
    return MemoryPlan(title, tuple(parts), 0.0 if hw.device_is_host else hw.memory_bytes)


def _table_parts(recipe: Recipe, layout: Layout, microbatches: int, tokens: int,
                 exponent: float, rank_rows: int | None) -> list[Part]:
    m, par, storage = recipe.model, recipe.parallel, recipe.tables
    count = len(m.stem_layer_indices)
    if not count:
        return []
    shape = TableShape(count, m.vocab_size, m.ffn_hidden_size // par.tensor_parallel)
    dtype = layout.param_bytes
    rows = expected_rows(shape.rows, layout.dp, microbatches, tokens, exponent,
                         {"rank_rows": rank_rows})
    what = f"{count} x {shape.rows:,} x {shape.width:,}"
    out = []
    if storage.placement == "device":
        out.append(Part("tables", TABLE_WEIGHTS, traffic.rows_bytes(shape.rows, shape, dtype),
                        f"{what} x {dtype} B"))
    else:
        staged = rows.microbatch_rows / microbatches
        out.append(Part("tables", "staged rows: this micro-batch's and the next's",
                        traffic.rows_bytes(2 * staged, shape, dtype),
                        f"2 x {staged:,.0f} rows x {shape.width:,} x {count} x {dtype} B"))
        if storage.cache_rows:
            out.append(Part("tables", "hot-row cache", traffic.rows_bytes(
                storage.cache_rows, shape, dtype), f"{storage.cache_rows:,} rows x {count}"))
    state = traffic.device_state_bytes(shape, layout) - (
        traffic.rows_bytes(shape.rows, shape, dtype) if storage.placement == "device" else 0)
    if state:
        owned = traffic.owned_range_rows(shape, layout)
        out.append(Part("tables", "tables' fp32 master + Adam moments (owned rows)", state,
                        f"{count} x {owned:,} rows x {shape.width:,} x 12 B"))
    if storage.placement == "device":  # a row per token position, summed at the sync
        out.append(Part("gradients", "tables' row grads, as backward gives them",
                        traffic.rows_bytes(microbatches * tokens, shape, dtype),
                        f"{microbatches * tokens:,} positions x {shape.width:,} x {count} x "
                        f"{dtype} B"))
    else:  # staged rows: summed per micro-batch as its backward ends
        out.append(Part("gradients", "tables' row grads, per micro-batch (fp32)",
                        traffic.rows_bytes(rows.microbatch_rows, shape, FP32),
                        f"{rows.microbatch_rows:,} rows x {shape.width:,} x {count} x 4 B"))
    out.append(Part("gradients", "tables' row grads, summed (fp32)",
                    traffic.rows_bytes(rows.rank_rows, shape, FP32),
                    f"{rows.rank_rows:,} distinct rows x {shape.width:,} x {count} x 4 B"))
    host = traffic.cpu_state_bytes(shape, layout)
    if host:
        out.append(Part("host", "tables' fp32 master + Adam moments", host,
                        "the owned rows' (and, host placement: this rank's share of its "
                        "node's copy)"))
    return out


def _activation_parts(recipe: Recipe, tokens: int, dtype: int) -> list[Part]:
    m, par = recipe.model, recipe.parallel
    tp = par.tensor_parallel
    h, layers = m.hidden_size, m.num_layers // par.pipeline_parallel
    scale = dtype / 2  # Korthikanti counts 16-bit tensors
    full = ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN
    per_layer_hidden = full / tp if par.sequence_parallel or tp == 1 else \
        (full - ACTIVATION_BYTES_SPLIT_BY_TP) + ACTIVATION_BYTES_SPLIT_BY_TP / tp
    one_layer = per_layer_hidden * scale * tokens * h
    if par.recompute == "full":
        split = tp if par.sequence_parallel else 1
        inputs = LAYER_INPUT_BYTES_PER_TOKEN_HIDDEN * scale * tokens * h / split
        out = [Part("activations", "layer inputs kept for recompute", layers * inputs,
                    f"{layers} layers x {tokens:,} tokens x {h:,} x "
                    f"{LAYER_INPUT_BYTES_PER_TOKEN_HIDDEN * scale:g} B"
                    + (f" / SP{split}" if split > 1 else "")),
               Part("activations", "one layer recomputed in backward", one_layer,
                    f"{tokens:,} tokens x {h:,} x {per_layer_hidden * scale:g} B")]
    elif par.recompute == "selective":
        freed = selective_freed_bytes(recipe) * scale
        kept = per_layer_hidden * scale - freed
        modules = ", ".join(par.recompute_modules)
        out = [Part("activations", f"layers (recomputing {modules})",
                    layers * kept * tokens * h,
                    f"{layers} layers x {tokens:,} tokens x {h:,} x {kept:g} B")]
        if freed:
            out.append(Part("activations", "one layer's recomputed parts in backward",
                            freed * tokens * h, f"{tokens:,} tokens x {h:,} x {freed:g} B"))
    else:
        out = [Part("activations", "layers (no recompute)", layers * one_layer,
                    f"{layers} layers x {tokens:,} tokens x {h:,} x "
                    f"{per_layer_hidden * scale:g} B")]
    return out + _logit_parts(recipe, tokens, dtype)


def selective_freed_bytes(recipe: Recipe) -> float:
    """16-bit bytes x hidden per token and layer that `parallel.recompute_modules` do not
    keep, of Korthikanti's 34, on this rank. `core_attn`: none (the count already has
    flash-style attention, which keeps no s^2 scores; it frees memory only where attention
    materializes them, e.g. the dense document mask on a CPU). `mlp_act`: the activation's
    output, 2 x ffn bytes (Korthikanti's 8 at ffn 4 x hidden), split by TP. `mlp`:
    everything the MLP block keeps but its input, the activation's input and output (2 x
    2 x ffn, split by TP) and its dropout mask (1, split by sequence parallelism)."""
    m, par = recipe.model, recipe.parallel
    tp, sp = par.tensor_parallel, par.tensor_parallel if par.sequence_parallel else 1
    ffn = m.ffn_hidden_size / m.hidden_size
    freed = {"core_attn": 0.0, "mlp_act": 2 * ffn / tp, "mlp": 4 * ffn / tp + 1 / sp}
    return sum(freed[name] for name in par.recompute_modules)


def _logit_parts(recipe: Recipe, tokens: int, dtype: int) -> list[Part]:
    """The loss's: the fp32 softmax and the logits of every position (megatron's path), or
    of one chunk of positions and the output weight's fp32 gradient sum (model/loss.py)."""
    m, par = recipe.model, recipe.parallel
    vocab = m.padded_vocab_size / par.tensor_parallel
    chunk = min(par.loss_chunk_tokens, tokens)
    if not chunk:
        return [Part("activations", "logits (fp32 softmax; the logits)",
                     tokens * vocab * (FP32 + dtype),
                     f"{tokens:,} tokens x {vocab:,.0f} x ({FP32} + {dtype}) B")]
    return [Part("activations", "loss chunk's logits (fp32 softmax; logits)",
                 chunk * vocab * (FP32 + dtype),
                 f"{chunk:,} positions x {vocab:,.0f} x ({FP32} + {dtype}) B"),
            Part("activations", "output weight's grad over the chunks (fp32)",
                 vocab * m.hidden_size * FP32,
                 f"{vocab:,.0f} x {m.hidden_size:,} x {FP32} B")]


def report(plan: MemoryPlan) -> list[str]:
    """The printout: every part, the totals by kind, and whether it fits."""
    lines = [plan.title, f"  {'part':<58}{'GB':>9}  counted as"]
    for kind in (*KINDS, "host"):
        for p in (p for p in plan.parts if p.kind == kind):
            where = "host: " if kind == "host" else f"{kind}: "
            lines.append(f"  {where + p.name:<58}{p.bytes / 1e9:>9.2f}  {p.counted}")
    by_kind = ", ".join(f"{k} {plan.total(k) / 1e9:.1f}" for k in KINDS)
    verdict = "" if not plan.capacity else \
        f" of {plan.capacity / 1e9:.0f} GB: " + (
            f"fits, {1 - plan.total() / plan.capacity:.0%} free" if plan.fits else "DOES NOT FIT")
    lines.append(f"  {'on the GPU':<58}{plan.total() / 1e9:>9.2f}{verdict} ({by_kind})")
    if plan.host:
        lines.append(f"  {'in host memory, per GPU':<58}{plan.host / 1e9:>9.2f}")
    return lines


def _n(count: float) -> str:
    return f"{count / 1e9:.3f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
