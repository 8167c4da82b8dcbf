"""The step-time model: one training step of one rank, component by component.

A step is the forward/backward of the rank's micro-batches (FLOPs from `accounting.py`
over the achievable FLOP/s), the backbone's ZeRO gradient reduction, parameter all-gather
and optimizer step, and the tables' path (`traffic.py` counts, over the links of
`hardware.py`). What overlaps what:

* `none`: the table path runs after the last backward, its stages one after another.
* `backward` (exact): each table's gradient exchange (ids, grads to owners, D2H) starts
  when its gradient is final (the last micro-batch's backward has passed its layer),
  tables in the order backward finishes them, in chunks that pipeline through the stages
  (a flow shop over the links: the network, host->device and device->host copies, the
  CPU, the accelerator's memory). The update itself cannot start before the global
  gradient norm is known (clipping scales every gradient, and Adam is not linear in it):
  after the backbone's step; the next step waits for it before its first STEM lookup
  (host placement: before its first staging).
* `delayed` (one-step-delayed update, not exact): step k's table path runs during step
  k+1, all tables ready at its start; only what outlasts step k+1 is exposed.

Host placement stages each micro-batch's rows one micro-batch ahead: the staging of the
first micro-batch is exposed, the others only by what exceeds a micro-batch's compute.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from megatron_stem.accounting import account, training_flops_per_token
from megatron_stem.config import Recipe
from megatron_stem.errors import UserError
from megatron_stem.planning import rows as row_model
from megatron_stem.planning import traffic
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.traffic import Layout, RowCounts, TableShape
from megatron_stem.training.tables.layout import TableLayout

PLACEMENTS = ("device", "host")
UPDATES = ("dense", "lazy")
PARTITIONS = ("replicated", "sharded")
# `none` and `next_step` are in the code (tables.overlap); `backward` (each table's path
# started as backward finishes it) and `delayed` (a one-step-delayed update, not exact)
# are the design's alternatives, modelled for comparison.
OVERLAPS = ("none", "next_step", "backward", "delayed")
OPTIMIZERS = ("cpu", "accelerator")
CHUNKS_PER_TABLE = 4  # `backward`/`delayed`: a table's rows go through the path in chunks
# Activation memory per token per layer in bf16 without recompute, with flash attention
# (Korthikanti et al. 2022: 34 x hidden bytes per token per layer, the s^2 term gone).
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 34
# Passes over the partition's fp32 grads that DeepSpeed's ZeRO-1/2 step makes besides
# Adam: into new buffers (the flattened partition, the norm's copy), and in place (clip,
# the updated partition copied into the params).
ZERO_STEP_BUFFER_PASSES = 2
ZERO_STEP_PASSES = 2
# Passes over the backbone's grads as DeepSpeed reduces them: into new buffers (the
# bucket, its flattened copy for the collective; and the partition's share, 1/DP), and
# in place (the averaging divide, the reduced values copied back into the bucket).
# DeepSpeed's new buffers are costed as fresh pages whatever their size (as calibrated;
# how it allocates them, not modelled), where our own are by size (`alloc_copy_seconds`).
ZERO_REDUCE_BUFFER_PASSES = 2
ZERO_REDUCE_PASSES = 2
# ZeRO-1/2 backbone: bf16 params and grads on the device, fp32 master and moments / DP.
BACKBONE_OPTIMIZER_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Option:
    """One way to train the tables (the `tables.*` fields of the config)."""

    placement: str
    update: str
    partition: str
    overlap: str
    optimizer: str = "cpu"

    @property
    def exact(self) -> bool:
        return self.overlap != "delayed"

    @property
    def today(self) -> bool:
        """The path before issue 11 (still there as `partition: replicated`)."""
        return self.partition == "replicated"

    @property
    def implemented(self) -> bool:
        """Whether the config (and so the trainer) accepts this combination."""
        return TableLayout(self.placement, self.partition, self.update, self.overlap,
                           self.optimizer).problem() is None

    def __str__(self) -> str:
        return "/".join((self.placement, self.update, self.partition, self.overlap,
                         self.optimizer))

    @classmethod
    def parse(cls, text: str) -> "Option":
        parts = text.split("/")
        if len(parts) != 5:
            raise UserError(f"--choose: expected placement/update/partition/overlap/optimizer "
                            f"(e.g. device/dense/sharded/next_step/cpu), got {text!r}")
        option = cls(*parts)
        if option not in all_options():
            raise UserError(f"--choose: {text} is not a supported combination")
        return option


def all_options() -> list[Option]:
    """Every combination the code has or the design considered: `replicated` runs
    serially with a CPU optimizer; the optimizer on the accelerator, and `next_step`, need
    sharded device tables; `backward`/`delayed` are modelled for sharded tables."""
    out = []
    for p, u, part, o, opt in itertools.product(PLACEMENTS, UPDATES, PARTITIONS, OVERLAPS,
                                                OPTIMIZERS):
        option = Option(p, u, part, o, opt)
        if part == "replicated" and (o != "none" or opt != "cpu"):
            continue
        if (opt == "accelerator" or o == "next_step") and (p, part) != ("device", "sharded"):
            continue
        out.append(option)
    return out


def configured_option(recipe: Recipe) -> Option:
    """The option a recipe trains with."""
    t, opt = recipe.tables, recipe.optimizer.tables
    return Option(t.placement, opt.update, t.partition, t.overlap, opt.device)


# -- the workload -------------------------------------------------------------------------


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
    dp: int
    tp: int
    microbatches: int
    tokens_per_microbatch: int
    flops_per_token: float  # forward + backward, as the trainer's MFU counts them
    head_share: float  # of those FLOPs, the output layer's (first in backward)
    num_layers: int
    stem_layers: tuple[int, ...]
    backbone_params: int  # per TP rank
    activation_bytes: float
    dtype_bytes: int
    zero_stage: int
    kernel: str  # the tables' CPU Adam: "deepspeed" | "torch"
    shape: TableShape
    rows: RowCounts
    # The busiest owner's received rows over the mean in the grads-to-owners all-to-all:
    # 1 with the shards' interleaved rows (training/tables/shards.py); contiguous ranges of
    # a frequency-ordered BPE vocabulary would give the first owner ~3x (docs/tables.md).
    owner_skew: float = 1.0

    @property
    def tokens(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    def layout(self, option: Option, cluster: Cluster, hw: Hardware) -> Layout:
        return Layout(option.placement, option.update, option.partition, option.optimizer,
                      dp=self.dp, ranks_per_copy=min(self.dp, cluster.gpus_per_node),
                      grad_bytes=self.dtype_bytes, param_bytes=self.dtype_bytes,
                      device_is_host=hw.device_is_host, overlap=option.overlap)


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
    flops = training_flops_per_token(recipe.model)
    head = 6 * m.vocab_size * m.hidden_size / tp
    stem = m.stem_layer_indices
    shape = TableShape(len(stem), m.vocab_size, m.ffn_hidden_size // par.tensor_parallel)
    counts = expected_rows(shape.rows, dp, mbs, per_mb, exponent, rows_override or {})
    activations = ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN * per_mb * m.hidden_size * \
        m.num_layers / tp
    return Workload(
        name=name, dp=dp, tp=tp, microbatches=mbs, tokens_per_microbatch=per_mb,
        flops_per_token=flops / tp, head_share=min(head / flops, 0.9),
        num_layers=m.num_layers, stem_layers=tuple(stem),
        backbone_params=account(m).active_params // tp, activation_bytes=activations,
        dtype_bytes=2 if t.dtype == "bf16" else 4, zero_stage=recipe.optimizer.zero_stage,
        kernel=recipe.optimizer.tables.kernel, shape=shape, rows=counts)


def expected_rows(vocab: int, dp: int, microbatches: int, per_microbatch: int,
                  exponent: float, override: dict) -> RowCounts:
    """Distinct rows per rank, per micro-batch and over DP from the Zipf model; `override`
    replaces any of `rank_rows`, `union_rows`, `microbatch_rows`, `longest_rank_rows`
    (measured counts)."""
    rank_tokens = microbatches * per_microbatch
    rank = override.get("rank_rows") or row_model.expected_distinct(rank_tokens, vocab, exponent)
    union = override.get("union_rows") or row_model.expected_distinct(rank_tokens * dp, vocab,
                                                                      exponent)
    mb = override.get("microbatch_rows") or microbatches * row_model.expected_distinct(
        per_microbatch, vocab, exponent)
    return RowCounts(rank_rows=round(rank), union_rows=round(union),
                     owned_rows=round(union / dp), microbatch_rows=round(mb),
                     longest_rank_rows=round(override.get("longest_rank_rows") or rank))


def rows_for(counts: RowCounts, lay: Layout) -> RowCounts:
    """The counts with this layout's shares (rows split evenly over the ranks that share
    the tables' optimizer: see `owner_skew` for when they are not)."""
    owned = round(counts.union_rows / lay.sharers)
    return replace(counts, owned_rows=owned, longest_owned_rows=owned,
                   self_rows=round(counts.rank_rows / lay.sharers))


# -- components ---------------------------------------------------------------------------


@dataclass
class Component:
    name: str
    resource: str  # gpu | net | d2h | h2d | cpu | mem (the accelerator's memory)
    amount: float
    unit: str  # FLOP | B | elem
    seconds: float
    phase: str  # compute | backbone | tables | staging


@dataclass
class Plan:
    option: Option | None  # None: the dense baseline
    components: list[Component]
    step_s: float
    exposed_tables_s: float
    mfu: float
    fits: bool = True
    why_not: str = ""
    counters: dict = field(default_factory=dict)

    def seconds(self, phase: str) -> float:
        return sum(c.seconds for c in self.components if c.phase == phase)

    @property
    def table_seconds(self) -> float:
        """The table path's work, hidden or not: sync, update, staging."""
        return self.seconds("sync") + self.seconds("tables") + self.seconds("staging")


def _ring_seconds(bytes_: float, ranks: int, factor: float, hw: Hardware,
                  ranks_per_node: int) -> float:
    """factor x bytes x (n-1)/n over the ring's bus bandwidth (all-reduce: factor 2)."""
    if ranks <= 1 or bytes_ == 0:
        return 0.0
    return factor * bytes_ * (ranks - 1) / ranks / hw.ring_busbw(ranks, ranks_per_node)


def compute_components(w: Workload, cluster: Cluster, hw: Hardware) -> list[Component]:
    rpn = min(cluster.gpus_per_node, w.dp * w.tp)
    out = [Component("forward/backward", "gpu", w.flops, "FLOP",
                     w.flops / hw.compute_rate(rpn), "compute")]
    if w.shape.tables:
        # lookup writes the rows, backward writes their sparse grads, coalescing reads and
        # writes them again: four passes over tokens x width per table
        b = 4 * w.tokens * w.shape.width * w.shape.tables * w.dtype_bytes
        bw = hw.table_rows_bw or hw.memory_bw
        if hw.device_is_host:
            bw *= hw.threads_per_rank(rpn)
        out.append(Component("table rows in fwd/bwd (memory)", "mem", b, "B", b / bw,
                             "compute"))
    return out


def backbone_components(w: Workload, cluster: Cluster, hw: Hardware) -> list[Component]:
    """DeepSpeed's ZeRO-1/2 as configured (overlap_comm off, DeepSpeed's default
    `use_multi_rank_bucket_allreduce`): at the accumulation boundary (ZeRO-2: every
    micro-batch) the grads are copied into the reduction bucket, flattened and all-reduced
    (the whole grads, not a reduce-scatter), and the partition's share copied out; then
    the partition's Adam and the all-gather of the updated params."""
    p, dp = w.backbone_params, w.dp
    rpn = min(cluster.gpus_per_node, dp)
    grads = p * w.dtype_bytes
    reductions = 1 if w.zero_stage == 1 else w.microbatches
    out = [Component(f"backbone grad all-reduce (ZeRO-{w.zero_stage})", "net",
                     grads * reductions, "B",
                     reductions * _ring_seconds(grads, dp, 2, hw, rpn), "backbone")]
    bw = hw.memory_bw if not hw.device_is_host else hw.memory_bw * hw.threads_per_rank(rpn)
    # (on one rank too: DeepSpeed still buckets, flattens and all-reduces over a world of 1)
    fresh = reductions * grads * (ZERO_REDUCE_BUFFER_PASSES + 1 / dp)
    in_place = reductions * grads * ZERO_REDUCE_PASSES
    out.append(Component("backbone grad buffers (memory)", "mem", fresh + in_place, "B",
                         hw.alloc_copy_seconds(fresh, rpn) + in_place / bw, "backbone"))
    elems = p / dp
    if hw.device_is_host:
        rate = hw.backbone_adam_rate or hw.torch_adam_rate
        opt_s = elems / (rate * hw.threads_per_rank(rpn))
    else:
        opt_s = elems * (hw.adam_bytes_per_element + w.dtype_bytes) / hw.memory_bw
    out.append(Component("backbone Adam (partition)", "mem", elems, "elem", opt_s, "backbone"))
    # DeepSpeed's passes over the partition's fp32 grads around its Adam
    fresh, in_place = ZERO_STEP_BUFFER_PASSES * elems * 4, ZERO_STEP_PASSES * elems * 4
    out.append(Component("backbone ZeRO bookkeeping (memory)", "mem", fresh + in_place, "B",
                         hw.alloc_copy_seconds(fresh, rpn) + in_place / bw, "backbone"))
    received = grads * (dp - 1) / dp
    out.append(Component("backbone param all-gather", "net", received, "B",
                         hw.allgather_seconds(received, dp, rpn), "backbone"))
    return out


def table_components(w: Workload, option: Option, cluster: Cluster,
                     hw: Hardware) -> tuple[list[Component], Layout]:
    """The table path's stages for all tables, in the order the code runs them; the
    gradient sync's stages have phase `sync` (they run at the accumulation boundary, on
    the critical path, whatever the overlap), the update's `tables`."""
    lay = w.layout(option, cluster, hw)
    s, c = w.shape, rows_for(w.rows, lay)
    gpn = min(cluster.gpus_per_node, w.dp)
    rpn = gpn
    out: list[Component] = []

    def add(name, resource, amount, unit, seconds, calls=0, phase="tables"):
        """`calls`: collectives issued (each costs the latency)."""
        if amount:
            out.append(Component(name, resource, amount, unit,
                                 seconds + calls * hw.collective_latency, phase))

    T = s.tables
    sharded = lay.partition == "sharded"
    sync = "sync" if option.overlap in ("none", "next_step") else "tables"
    ids = traffic.index_bytes(s, lay, c)
    if sharded:  # counts and ids to owners, all-to-all (next_step: twice)
        add("row ids and counts (all-to-all)", "net", ids, "B",
            hw.alltoall_seconds(ids, w.dp, cluster.gpus_per_node), 2, sync)
    else:  # padded ids all-gathered (device placement: per table)
        add("row ids all-gather", "net", ids, "B", _ring_seconds(ids, w.dp, 1, hw, gpn),
            2 * (T if lay.placement == "device" else 1), sync)
    b = traffic.grad_allreduce_bytes(s, lay, c)
    add("grad all-reduce of the union (fp32)", "net", b, "B",
        _ring_seconds(b, w.dp, 2, hw, gpn), T, sync)
    b = traffic.grad_reduce_bytes(s, lay, c)
    add("grad reduce to owners in node (fp32)", "net", b, "B",
        _ring_seconds(b, lay.ranks_per_copy, 1, hw, lay.ranks_per_copy),
        T * lay.ranks_per_copy, sync)  # one reduce per owner's chunk
    b = traffic.cross_copy_allreduce_bytes(s, lay, c)
    add("owned grads all-reduce across nodes (fp32)", "net", b, "B",
        _ring_seconds(b, lay.copies, 2, hw, 1), T, sync)
    b = traffic.grads_to_owners_bytes(s, lay, c)
    add("grads to owners (all-to-all)", "net", b, "B",
        hw.alltoall_seconds(b, w.dp, cluster.gpus_per_node) * w.owner_skew, 1, sync)
    pinned = sharded
    kind = "pinned" if pinned else "pageable"
    b = traffic.grad_d2h_bytes(s, lay, c)
    add(f"D2H grads ({kind})", "d2h", b, "B", b / hw.copy_bw(pinned, rpn), 0, sync)
    elems = traffic.adam_elements(s, lay, c)
    if lay.optimizer == "cpu":
        add("CPU Adam", "cpu", elems, "elem", hw.cpu_adam_seconds(elems, rpn, w.kernel))
        if w.kernel == "torch" and (lay.update == "lazy" or lay.overlap == "next_step"):
            # index_select of master and moments into contiguous buffers, index_copy back
            # (DeepSpeed's arithmetic runs on the rows in place: AdamKernel.update_rows)
            b = elems * 3 * traffic.FP32 * 2
            add("row gather/scatter of the state (CPU)", "cpu", b, "B",
                b / hw.node_share(hw.gather_bw, rpn))
    else:
        add("accelerator Adam (owned rows)", "mem", elems, "elem",
            elems * hw.adam_bytes_per_element / hw.memory_bw)
    h2d = traffic.update_h2d_bytes(s, lay, c)
    if h2d and not (lay.partition == "replicated" and lay.update == "dense"):
        b = h2d / lay.param_bytes * (traffic.FP32 + lay.param_bytes)
        add("cast updated rows on CPU", "cpu", b, "B", b / hw.node_share(hw.dram_bw, rpn))
    add(f"H2D updated rows ({kind})", "h2d", h2d, "B", h2d / hw.copy_bw(pinned, rpn))
    ag = traffic.gather_bytes(s, lay, c)
    phases = 2 if lay.overlap == "next_step" else 1
    if lay.placement == "device":
        add("all-gather updated rows", "net", ag, "B",
            hw.allgather_seconds(ag, w.dp, gpn, T),  # (next_step: nearly all in one phase)
            T * phases * (2 if traffic.padded_gathers(lay) else 1))
        if ag and lay.partition == "sharded":
            # The gathered rows arrive in new buffers, one per owner (an owner's rows are
            # interleaved over the table, not one slice of it; padded row sets are padded
            # into one more, this rank's share), then index_copy puts them into the
            # table: read + write.
            placed = ag * w.dp / (w.dp - 1)
            fresh = placed * (1 + 1 / w.dp if traffic.padded_gathers(lay) else 1)
            add("place gathered rows into the table (memory)", "mem", placed, "B",
                hw.alloc_copy_seconds(fresh, rpn, placed / (T * w.dp)) +
                2 * placed / hw.memory_bw)
    else:
        add("all-gather updated rows across nodes (fp32)", "net", ag, "B",
            hw.allgather_seconds(ag, lay.copies, 1, T), T)
    return out, lay


def staging_components(w: Workload, lay: Layout, cluster: Cluster,
                       hw: Hardware) -> list[Component]:
    """Host placement: each micro-batch's rows gathered from the host copy, copied to the
    device (pinned staging buffers)."""
    if lay.placement != "host":
        return []
    rpn = min(cluster.gpus_per_node, w.dp)
    b = traffic.staging_h2d_bytes(w.shape, lay, rows_for(w.rows, lay))
    out = [Component("stage rows: gather from host copy", "cpu", b, "B",
                     b / hw.node_share(hw.gather_bw, rpn), "staging")]
    if not hw.device_is_host:
        out.append(Component("stage rows: H2D (pinned)", "h2d", b, "B",
                             b / hw.copy_bw(True, rpn), "staging"))
    return out


# -- the timeline -------------------------------------------------------------------------


def _earliest_gap(busy: list[tuple[float, float]], start: float, length: float) -> float:
    """The earliest time >= start at which `length` fits between busy intervals."""
    for lo, hi in busy:  # sorted
        if start + length <= lo:
            break
        start = max(start, hi)
    return start


def _flow_shop(jobs: list[tuple[float, list[Component]]], chunks: int,
               blocked: dict[str, tuple[float, float]]) -> list[float]:
    """When each job is done: jobs (ready time, stages), each in `chunks` pieces; a
    piece's stage starts when its previous stage is done and its resource has a free gap
    that long (resources: the network, each copy direction, the CPU, the device memory;
    `blocked` reserves a resource for a while, e.g. the network for the backbone)."""
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for res, window in blocked.items():
        busy[res].append(window)
    ends = []
    for ready, stages in jobs:
        end = ready
        for _ in range(chunks):
            t = ready
            for st in stages:
                d = st.seconds / chunks
                start = _earliest_gap(busy[st.resource], t, d)
                busy[st.resource].append((start, start + d))
                busy[st.resource].sort()
                t = start + d
            end = max(end, t)
        ends.append(end)
    return ends


def _scaled(stages: list[Component], share: float) -> list[Component]:
    return [replace(c, seconds=c.seconds * share) for c in stages]


def _layer_share_below(w: Workload, layer: int) -> float:
    """Share of one micro-batch's backward (or forward) spent in the layers below `layer`."""
    return (1 - w.head_share) * layer / w.num_layers


def exposed_table_seconds(w: Workload, option: Option, tables: list[Component],
                          compute_s: float, backbone: list[Component],
                          first_share: float = 1.0) -> float:
    """The update's seconds the step waits for (the gradient sync's are counted apart,
    `exposed_sync_seconds`)."""
    if option.overlap == "none" or not tables:
        return sum(c.seconds for c in tables)
    n = w.shape.tables
    bb_net = sum(c.seconds for c in backbone if c.resource == "net")
    bb_s = sum(c.seconds for c in backbone)
    forward_mb = compute_s / w.microbatches / 3
    if option.overlap == "next_step":
        # from the next step's start: each table's rows that step reads, in forward order,
        # then the rest; a table's first lookup waits for its rows, the next gradient sync
        # (after that step's backward) for everything
        layers = sorted(w.stem_layers)
        first = _scaled(tables, first_share / n)
        rest = _scaled(tables, (1 - first_share) / n)
        ends = _flow_shop([(0.0, first)] * n + [(0.0, rest)] * n, CHUNKS_PER_TABLE, {})
        wait = max(0.0, *(end - forward_mb * _layer_share_below(w, layer)
                          for end, layer in zip(ends[:n], layers)))
        return wait + max(0.0, max(ends) - wait - compute_s)
    per_table = _scaled(tables, 1 / n)
    blocked = {"net": (compute_s, compute_s + bb_net)}
    if option.overlap == "delayed":
        ends = _flow_shop([(0.0, per_table)] * n, CHUNKS_PER_TABLE, blocked)
        return max(0.0, max(ends) - (compute_s + bb_s))
    # `backward`: the update starts once the clipping factor is known, after the backbone's
    # step; the next forward runs until its first STEM layer meanwhile (device tables).
    window = forward_mb * _layer_share_below(w, min(w.stem_layers)) \
        if option.placement == "device" else 0.0
    return max(0.0, max(_flow_shop([(0.0, per_table)] * n, CHUNKS_PER_TABLE, {})) - window)


def exposed_sync_seconds(w: Workload, option: Option, sync: list[Component],
                         compute_s: float) -> float:
    """The gradient exchange's seconds the step waits for: all of it, except under
    `backward`, where each table's exchange runs as soon as backward has finished the
    table, and only what outlasts the backward is exposed."""
    if option.overlap != "backward" or not sync:
        return sum(c.seconds for c in sync)
    backward_mb = 2 * compute_s / w.microbatches / 3
    jobs = [(compute_s - backward_mb * _layer_share_below(w, layer),
             _scaled(sync, 1 / w.shape.tables))
            for layer in sorted(w.stem_layers, reverse=True)]
    return max(0.0, max(_flow_shop(jobs, CHUNKS_PER_TABLE, {})) - compute_s)


def first_share(w: Workload, lay: Layout) -> float:
    """`next_step`: the share of the update the next step reads (its rows over DP among
    the rows that change: all rows for `dense`, about all changed rows for `lazy`)."""
    if lay.update == "lazy":
        return 1.0
    return min(1.0, w.rows.union_rows / w.shape.rows)


def exposed_staging_seconds(w: Workload, staging: list[Component], compute_s: float) -> float:
    """The first micro-batch's staging waits; later ones hide behind a micro-batch's
    compute, one micro-batch ahead."""
    if not staging:
        return 0.0
    per_mb = sum(c.seconds for c in staging) / w.microbatches
    return per_mb + (w.microbatches - 1) * max(0.0, per_mb - compute_s / w.microbatches)


def memory_check(w: Workload, lay: Layout | None, hw: Hardware, cluster: Cluster,
                 host_memory_bytes: float) -> str:
    """Why this layout does not fit (device or host memory), or ''."""
    device = w.backbone_params * (2 * w.dtype_bytes + BACKBONE_OPTIMIZER_BYTES_PER_PARAM / w.dp)
    device += w.activation_bytes
    if lay is not None:
        device += traffic.device_state_bytes(w.shape, lay)
    if not hw.device_is_host and device > hw.memory_bytes:
        return f"device memory {device / 1e9:.0f} GB > {hw.memory_bytes / 1e9:.0f} GB"
    if lay is not None and host_memory_bytes:
        rpn = min(cluster.gpus_per_node, w.dp)
        host = traffic.cpu_state_bytes(w.shape, lay) * rpn
        if hw.device_is_host:
            host += device * rpn
        if host > host_memory_bytes:
            return f"host memory {host / 1e9:.0f} GB per node > {host_memory_bytes / 1e9:.0f} GB"
    return ""


def plan(w: Workload, option: Option | None, cluster: Cluster, hw: Hardware,
         host_memory_bytes: float = 0.0) -> Plan:
    """The predicted step of workload `w` (a STEM recipe trained per `option`, or a dense
    one when `option` is None)."""
    comp = compute_components(w, cluster, hw)
    backbone = backbone_components(w, cluster, hw)
    compute_s = sum(c.seconds for c in comp)
    components = comp + backbone
    exposed = 0.0
    lay = None
    if option is not None and w.shape.tables:
        path, lay = table_components(w, option, cluster, hw)
        staging = staging_components(w, lay, cluster, hw)
        components += path + staging
        update = [c for c in path if c.phase == "tables"]
        sync = [c for c in path if c.phase == "sync"]
        exposed = exposed_sync_seconds(w, option, sync, compute_s) + \
            exposed_table_seconds(w, option, update, compute_s, backbone,
                                  first_share(w, lay)) + \
            exposed_staging_seconds(w, staging, compute_s)
    step = compute_s + sum(c.seconds for c in backbone) + exposed
    why = memory_check(w, lay, hw, cluster, host_memory_bytes)
    counters = traffic.counters(w.shape, lay, rows_for(w.rows, lay)) if lay is not None else {}
    return Plan(option, components, step, exposed, w.flops / (step * hw.peak_flops),
                fits=not why, why_not=why, counters=counters)


def rank(w: Workload, cluster: Cluster, hw: Hardware,
         host_memory_bytes: float = 0.0) -> list[Plan]:
    """Every option's plan, fastest first (the ones that do not fit last); among equally
    fast ones (their table paths all hidden), the one whose path does less work."""
    plans = [plan(w, o, cluster, hw, host_memory_bytes) for o in all_options()]
    return sorted(plans, key=lambda p: (not p.fits, p.step_s,
                                        p.table_seconds))


def best(plans: list[Plan], states: str = "cpu") -> Plan:
    """The fastest exact option the code has that fits; `states="cpu"`: with the tables'
    optimizer states in CPU memory (the design's constraint for 1B), `"any"`: on the
    accelerator too."""
    ok = [p for p in plans if p.fits and p.option.exact and p.option.implemented
          and (states == "any" or p.option.optimizer == "cpu")]
    if not ok:
        raise UserError("no exact table option of the code fits this hardware's memory")
    return ok[0]
