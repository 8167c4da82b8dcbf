"""The forward/backward of one rank's step, priced by what it computes.

The dense shape's forward/backward runs at the profile's achievable MFU (`Hardware.mfu`, on
FLOPs as model/accounting.py counts them for MFU). A STEM layer's MLP differs from the dense one
in its fc1 only: the gate alone (ffn/TP wide), where the dense layer multiplies by the gate
and the up-projection fused in one GEMM (2 x ffn/TP wide). So the STEM model's compute is
the dense shape's less, per STEM layer and micro-batch, the difference of those two GEMMs
in the forward and both backward GEMMs (input and weight gradients), priced on the
profile's GEMM efficiency curve (`Hardware.gemm_seconds`): a removed up-projection saves
what it costs at its own shape, not the step's average rate. On top of that:

* the tables' rows in forward and backward: the lookup writes them, the backward writes
  their row-sparse gradients, which are read again when collected (4 passes over tokens x
  width per table, training dtype), at the profile's `table_rows_bw` (measured on the CPU
  profile; the accelerator's memory elsewhere);
* DeepSpeed's accumulation of the backbone's gradients: bf16 training keeps an fp32
  `grad_accum` per parameter (ZeRO-1, `data_types.grad_accum_dtype: fp32` of
  training/engine.py), filled by its hooks every micro-batch (the first a cast, 6 B per
  parameter; the others a cast and an add, 18 B); fp32 training accumulates in autograd
  (12 B per parameter from the second micro-batch);
* forward work the backward does again (`Workload.recompute_flops_per_token`: activation
  recompute, the chunked loss's logits), at the same MFU: not in MFU's count, in the time;
  the FFN activation's elementwise recompute (`mlp_act`) as passes through memory;
* the loop's host syncs: `loss.item()` after every micro-batch's backward (training/loop.py) and the
  loss's mean over data parallel.
"""

from __future__ import annotations

from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.workload import Cluster, Component, Workload

# The GEMMs of one linear layer's forward and backward: output, input gradient, weight
# gradient, each 2 x tokens x in x out FLOPs.
GEMMS_PER_LINEAR = 3
TABLE_ROW_PASSES = 4


def linear_seconds(tokens: float, fan_in: float, fan_out: float, hw: Hardware,
                   ranks_per_node: int) -> float:
    """Forward and backward of one linear layer over `tokens` rows, on the GEMM curve."""
    return GEMMS_PER_LINEAR * hw.gemm_seconds(2 * tokens * fan_in * fan_out, ranks_per_node)


def fc1_saving(w: Workload, hw: Hardware, ranks_per_node: int) -> tuple[float, float]:
    """(FLOPs, seconds) a STEM model does not spend in its fc1s, all STEM layers and
    micro-batches: the fused gate + up-projection GEMMs of the dense layer less the gate's."""
    h, f = w.model.hidden_size, w.model.ffn_hidden_size / w.tp
    t = w.tokens_per_microbatch
    per_layer = linear_seconds(t, h, 2 * f, hw, ranks_per_node) - \
        linear_seconds(t, h, f, hw, ranks_per_node)
    layers = len(w.stem_layers) * w.microbatches
    return layers * GEMMS_PER_LINEAR * 2 * t * h * f, layers * per_layer


def accumulation_bytes(w: Workload) -> float:
    """Bytes of the backbone's gradient accumulation over the step's micro-batches."""
    p, n = w.backbone_params, w.microbatches
    if w.dtype_bytes == 2 and w.zero_stage == 1:
        return p * (6 + 18 * (n - 1))
    if w.dtype_bytes == 4:
        return p * 12 * (n - 1)
    return 0.0  # ZeRO-2 in bf16 reduces every micro-batch's gradients (backbone.py)


def loop_syncs(w: Workload) -> int:
    """Host syncs of the training loop itself (training/loop.py `train_step`)."""
    return w.microbatches + 1


def compute_components(w: Workload, cluster: Cluster, hw: Hardware) -> list[Component]:
    rpn = min(cluster.gpus_per_node, w.dp * w.tp)
    dense_flops = w.flops
    out = []
    if w.shape.tables:
        saved_flops, saved_s = fc1_saving(w, hw, rpn)
        dense_flops += saved_flops
        share = saved_flops / (saved_s * hw.peak_flops * hw._share(rpn))
    out.append(Component("forward/backward (dense shape, at MFU)", "gpu", dense_flops, "FLOP",
                         dense_flops / hw.compute_rate(rpn), "compute"))
    if w.shape.tables:
        out.append(Component(f"up-projections not computed ({share:.0%} of peak)", "gpu",
                             -saved_flops, "FLOP", -saved_s, "compute"))
        b = TABLE_ROW_PASSES * w.tokens * w.shape.width * w.shape.tables * w.dtype_bytes
        out.append(Component("table rows in fwd/bwd (memory)", "mem", b, "B",
                             hw.device_pass_seconds(b, rpn, hw.table_rows_bw), "compute"))
    if w.recompute_flops_per_token:
        flops = w.recompute_flops_per_token * w.tokens
        out.append(Component("forward recomputed in backward (at MFU)", "gpu", flops, "FLOP",
                             flops / hw.compute_rate(rpn), "compute"))
    if w.recompute_bytes_per_token:
        b = w.recompute_bytes_per_token * w.tokens
        out.append(Component("FFN activations recomputed in backward (memory)", "mem", b, "B",
                             hw.device_pass_seconds(b, rpn), "compute"))
    b = accumulation_bytes(w)
    if b:
        out.append(Component("backbone grad accumulation (memory)", "mem", b, "B",
                             hw.device_pass_seconds(b, rpn), "compute"))
    if hw.syncs_seconds(1):
        out.append(Component("host syncs: loss.item() per micro-batch", "gpu", loop_syncs(w),
                             "sync", hw.syncs_seconds(loop_syncs(w)), "compute"))
    return out
