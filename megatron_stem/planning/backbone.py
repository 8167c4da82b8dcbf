"""The backbone's ZeRO-1/2 step in DeepSpeed (its `stage_1_and_2.py`), and its settings.

What DeepSpeed runs, as training/engine.py configures it (bf16: fp32 gradient accumulation
and fp32 communication, `communication_data_type: fp32`; fp32 runs communicate fp32 too):

* the gradient reduction, with `overlap_comm` (`zero_reduction_config`: the engine's
  entries for it, buckets as Megatron-LM sizes them): every parameter's gradient is copied into a bucket of
  `reduce_bucket_size` elements by a hook as backward finishes it; a bucket is reduced
  when the next gradient does not fit (one larger than a bucket goes alone), on a side
  stream, while backward goes on: at ZeRO-1 in the last micro-batch's backward (the others
  accumulate), at ZeRO-2 in every micro-batch's. Each bucket is averaged in place,
  flattened into a new buffer and all-reduced whole (`use_multi_rank_bucket_allreduce`),
  then this rank's partition copied out. Backward finishes the output layer first and the
  input embedding last: at the end of backward the last bucket is still to go, and the
  step waits for the side stream (`independent_gradient_partition_epilogue`). What the
  step waits for is modelled (`reduction_seconds`): buckets in the order backward
  finishes their gradients over a backward at an even rate per layer. On a CPU the
  reduction runs inside the hooks, on the main thread: all of it on the step's path.
* the step: the overflow check of bf16 runs (`check_grad_overflow`: a max and a min over
  the partition's gradients, a one-byte all-reduce, a host sync), the norm (the tables'
  hook, training/update.py), Adam on the partition (two passes into new buffers and two in
  place around it: flatten, the norm's copy, the clip, the copy into the bf16 params),
  then the all-gather of the updated parameters (bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_stem.model.accounting import account
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.workload import Cluster, Component, Workload

COMM_BYTES = 4  # gradients are reduced in fp32 (training/engine.py `deepspeed_config`)
# Per element of a bucket, on the reduction stream: the in-place average (read + write)
# and the partition's share (1/DP) copied out and back (read + write, twice); and the
# flatten, into a new buffer. In the hook (the compute stream), the gradient is copied into
# the bucket, a buffer DeepSpeed allocates every micro-batch (fresh pages on a CPU).
AVERAGE_BYTES = 2 * COMM_BYTES
PARTITION_BYTES = 4 * COMM_BYTES
# Passes over the partition's fp32 gradients that DeepSpeed's ZeRO-1/2 step makes besides
# Adam: into new buffers (the flattened partition, the norm's copy) and in place (clip, the
# updated partition copied into the params); the overflow check's max and min read it.
ZERO_STEP_BUFFER_PASSES = 2
ZERO_STEP_PASSES = 2
OVERFLOW_CHECK_READS = 2
# Fused AdamW on the partition: fp32 master, grad, two moments read, three written.
ACCELERATOR_ADAM_BYTES = 28
# ZeRO-1/2 backbone: bf16 params and grads on the device, fp32 master and moments / DP.
BACKBONE_OPTIMIZER_BYTES_PER_PARAM = 12
# Bucket sizes the planner chooses from (elements), and the device memory its two buffers
# (DeepSpeed double-buffers with overlap_comm) may take at most.
BUCKET_CHOICES = tuple(1 << k for k in range(20, 30))
BUCKET_MEMORY_SHARE = 0.02


@dataclass(frozen=True)
class Grad:
    """One parameter's gradient as backward finishes it: elements, and when (fraction of a
    micro-batch's backward)."""

    elements: float
    ready: float


def gradient_order(w: Workload) -> list[Grad]:
    """The backbone's gradients in the order backward finishes them: the output layer and
    final norm after the head's share, each layer's MLP then attention from the last layer
    down at an even rate, the input embedding at the end."""
    m, tp = w.model, w.tp
    h, f, v = m.hidden_size, m.ffn_hidden_size / tp, m.vocab_size
    head_dim = h // m.num_attention_heads
    qkv = h * head_dim * (m.num_attention_heads + 2 * m.kv_heads) / tp
    head = w.head_share
    out = [Grad(h, head), Grad(v * h / tp, head)]
    stem = set(w.stem_layers)
    for n, layer in enumerate(reversed(range(m.num_layers))):
        done = head + (1 - head) * (n + 1) / m.num_layers
        fc1 = h * f * (1 if layer in stem else 2)
        out += [Grad(f * h, done), Grad(fc1, done), Grad(h, done),
                Grad(h * h / tp, done), Grad(qkv, done), Grad(h, done)]
    if m.untie_embeddings:
        out.append(Grad(v * h / tp, 1.0))
    return out


def buckets(grads: list[Grad], size: int) -> list[tuple[float, float]]:
    """(elements, launch time) of each reduction, as DeepSpeed's hook launches them: a
    bucket when the next gradient does not fit (at that gradient's time), the last at the
    end of backward."""
    out, elements = [], 0.0
    for g in grads:
        if elements and elements + g.elements > size:
            out.append((elements, g.ready))
            elements = 0.0
        elements += g.elements
    if elements:
        out.append((elements, 1.0))
    return out


def _bucket_seconds(elements: float, w: Workload, hw: Hardware, rpn: int) -> float:
    """One bucket on the reduction stream: its passes over memory and its all-reduce."""
    mem = hw.device_pass_seconds(elements * (AVERAGE_BYTES + PARTITION_BYTES / w.dp), rpn) + \
        hw.alloc_copy_seconds(elements * COMM_BYTES, rpn)
    if w.dp == 1:
        return mem
    return mem + hw.collective_latency + hw.ring_seconds(elements * COMM_BYTES, w.dp, rpn)


def reduction_seconds(w: Workload, hw: Hardware, rpn: int, backward_s: float,
                      size: int) -> tuple[float, float]:
    """(the reduction stream's seconds over the step, the seconds the step waits for it)
    with buckets of `size` elements over micro-batches whose backward takes `backward_s`."""
    reductions = 1 if w.zero_stage == 1 else w.microbatches
    busy = exposed = 0.0
    end = 0.0
    for elements, launch in buckets(gradient_order(w), size):
        s = _bucket_seconds(elements, w, hw, rpn)
        end = max(end, launch * backward_s) + s
        busy += s
    if hw.device_is_host:  # in the hooks, on the main thread
        return busy * reductions, busy * reductions
    exposed = max(0.0, end - backward_s)
    return busy * reductions, exposed * reductions


def backward_seconds(w: Workload, compute_s: float) -> float:
    """A micro-batch's backward: two thirds of its forward/backward."""
    return 2 * compute_s / w.microbatches / 3


def reduce_bucket_elements(model, tp: int, dp: int) -> int:
    """DeepSpeed's `reduce_bucket_size` (and `allgather_bucket_size`) for the backbone, as
    Megatron-LM sizes its buckets: max(40M, 1M x DP) elements, small enough to start
    reducing early in the backward and large enough for the network's bandwidth, no larger
    than the backbone (DeepSpeed allocates two whole buckets). Within 2% of the least
    waiting among sizes of 1M-512M for the 1B pair on 4 x 8 H200 (`best_bucket_elements`)."""
    return int(min(max(40_000_000, 1_000_000 * dp), account(model).active_params // tp))


def zero_reduction_config(recipe, dp: int) -> dict:
    """The `zero_optimization` entries of the backbone's gradient reduction, for
    training/engine.py's DeepSpeed config: reduced while backward runs, in buckets of
    `reduce_bucket_elements`."""
    tp = recipe.parallel.tensor_parallel * recipe.parallel.pipeline_parallel
    bucket = reduce_bucket_elements(recipe.model, tp, dp)
    return {"overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}


def best_bucket_elements(w: Workload, cluster: Cluster, hw: Hardware,
                         compute_s: float) -> tuple[int, float]:
    """(the bucket size of `BUCKET_CHOICES` the step waits least for, that wait), the
    sizes whose two buffers fit `BUCKET_MEMORY_SHARE` of the device memory: a check of
    `reduce_bucket_elements`."""
    rpn = min(cluster.gpus_per_node, w.dp * w.tp)
    backward = backward_seconds(w, compute_s)
    limit = hw.memory_bytes * BUCKET_MEMORY_SHARE if hw.memory_bytes else float("inf")
    fitting = [b for b in BUCKET_CHOICES if 2 * b * COMM_BYTES <= limit] or [BUCKET_CHOICES[0]]
    waits = {b: reduction_seconds(w, hw, rpn, backward, b)[1] for b in fitting}
    size = min(waits, key=waits.get)
    return size, waits[size]


def backbone_components(w: Workload, cluster: Cluster, hw: Hardware,
                        compute_s: float) -> tuple[list[Component], float]:
    """The backbone's reduction (phase `reduction`) and step (`backbone`), and the seconds
    of the reduction the step waits for: the hooks' copies into the buckets (on the compute
    stream) and the reduction stream's tail."""
    p, dp = w.backbone_params, w.dp
    rpn = min(cluster.gpus_per_node, dp * w.tp)
    size = reduce_bucket_elements(w.model, w.tp, dp)
    busy, exposed = reduction_seconds(w, hw, rpn, backward_seconds(w, compute_s), size)
    reductions = 1 if w.zero_stage == 1 else w.microbatches
    grads = p * COMM_BYTES * reductions
    out = [Component(f"backbone grad reduction (ZeRO-{w.zero_stage}, fp32, buckets of "
                     f"{size / 1e6:.0f}M)", "net", grads, "B", busy, "reduction")]
    b = p * COMM_BYTES * reductions
    out.append(Component("backbone grads into buckets (memory)", "mem", b, "B",
                         hw.alloc_copy_seconds(b, rpn), "reduction"))
    elems = p / dp
    if hw.device_is_host:
        rate = hw.backbone_adam_rate or hw.torch_adam_rate
        opt_s = elems / (rate * hw.threads_per_rank(rpn))
    else:
        opt_s = hw.device_pass_seconds(elems * (ACCELERATOR_ADAM_BYTES + w.dtype_bytes), rpn)
    if w.dtype_bytes == 2:  # bf16: check_grad_overflow
        b = OVERFLOW_CHECK_READS * elems * COMM_BYTES
        out.append(Component("backbone overflow check (max/min, 1-byte all-reduce, sync)",
                             "mem", b, "B", hw.device_pass_seconds(b, rpn) +
                             hw.collective_latency + hw.syncs_seconds(1), "backbone"))
    out.append(Component("backbone Adam (partition)", "mem", elems, "elem", opt_s, "backbone"))
    fresh, in_place = ZERO_STEP_BUFFER_PASSES * elems * 4, ZERO_STEP_PASSES * elems * 4
    out.append(Component("backbone ZeRO bookkeeping (memory)", "mem", fresh + in_place, "B",
                         hw.alloc_copy_seconds(fresh, rpn) +
                         hw.device_pass_seconds(2 * in_place, rpn), "backbone"))
    received = p * w.dtype_bytes * (dp - 1) / dp
    calls = -(-p // size)  # in buckets of the same size (`allgather_bucket_size`)
    out.append(Component("backbone param all-gather", "net", received, "B",
                         hw.allgather_seconds(received, dp, rpn, calls) +
                         calls * hw.collective_latency, "backbone"))
    return out, exposed + out[1].seconds
