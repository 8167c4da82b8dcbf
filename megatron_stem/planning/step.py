"""The step-time model: one training step of one rank, component by component.

A step is the forward/backward of the rank's micro-batches (`compute.py`), the backbone's
ZeRO gradient reduction, step and parameter all-gather (`backbone.py`), and the tables'
path: at the step boundary the gradient sync (collecting the row gradients, sending them to
their owners, the norm's squares, the copy to where the optimizer state is: `passes.py`
and `traffic.py` count it op by op), then the update (Adam, the updated rows to every
holder). Everything is priced over the links and rates of `hardware.py`. What overlaps
what:

* `none`: the table path runs after the last backward, its stages one after another.
* Whatever the overlap, sharded CPU state's gradient copies to the host run on a side
  stream under DeepSpeed's step (phase `UNDER_BACKBONE_STEP`): only what outlasts it waits.
* Device tables' row gradients are summed on a side stream as the last backward ends
  (`none`, `next_step`; the rows known from the host's ids: no sync), while the host
  waits in DeepSpeed's epilogue for the backbone reduction's tail (phase
  `UNDER_REDUCTION_TAIL`): only what outlasts that tail waits. On a CPU (no side stream)
  the sum runs inline, serial.
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
* `next_step` (the code's, `tables.overlap`): the update runs from the next step's start,
  first the rows that step reads (table by table in forward order: a table's first lookup
  waits for its rows), then the rest, which must be done by the next gradient sync (the
  trainer's log does not wait for it: `tables.stats(wait=False)`). Each job's publication
  is priced as starting when its arithmetic ends; the code issues it from the main thread
  at the next lookup or before the last backward (tables/overlap.py), later where the
  arithmetic ends between those points.

Host placement stages each micro-batch's rows one micro-batch ahead: the staging of the
first micro-batch is exposed, the others only by what exceeds a micro-batch's compute.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from megatron_stem.config import Recipe
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.planning import passes, traffic
from megatron_stem.planning.backbone import BACKBONE_OPTIMIZER_BYTES_PER_PARAM, backbone_components
from megatron_stem.planning.compute import compute_components
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.traffic import Layout, RowCounts
from megatron_stem.planning.workload import Cluster, Component, Workload, expected_rows, workload  # noqa: F401
from megatron_stem.runtime.errors import UserError
from megatron_stem.tables.overlap import READY_STAGES

PLACEMENTS = ("device", "host")
UPDATES = ("dense", "lazy")
PARTITIONS = ("replicated", "sharded")
# `none` and `next_step` are in the code (tables.overlap); `backward` (each table's path
# started as backward finishes it) and `delayed` (a one-step-delayed update, not exact)
# are the design's alternatives, modelled for comparison.
OVERLAPS = ("none", "next_step", "backward", "delayed")
OPTIMIZERS = ("cpu", "accelerator")
CHUNKS_PER_TABLE = 4  # `backward`/`delayed`: a table's rows go through the path in chunks
# The torch kernel on the accelerator (`optimizer.tables.device: accelerator`), per element
# of a row subset: master and moments gathered (read + write 12 + 12), the gradient rows
# placed into zeros (4 + 8) and clipped (8), AdamW in torch ops (mul_, lerp_, mul_ +
# addcmul_, sqrt, div, add_, addcdiv_: 68), the rows scattered back (24) and written in
# the table's dtype (6).
ACCELERATOR_ROW_ADAM_BYTES = 24 + 12 + 8 + 68 + 24 + 6
# The phase of work at the step boundary that runs beside DeepSpeed's step (the gradients'
# copies to CPU state, on a side stream): exposed only by what outlasts that step.
UNDER_BACKBONE_STEP = "under_backbone_step"
# ... and beside the backbone reduction's tail (the row gradients' sum, queued on a side
# stream as the last backward ends, tables/row_grads.py): exposed by what outlasts it.
UNDER_REDUCTION_TAIL = "under_reduction_tail"
TABLE_PHASES = ("sync", UNDER_REDUCTION_TAIL, UNDER_BACKBONE_STEP, "tables", "staging")


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


# -- the table path ---------------------------------------------------------------------


def layout_of(w: Workload, option: Option, cluster: Cluster, hw: Hardware) -> Layout:
    return Layout(option.placement, option.update, option.partition, option.optimizer,
                  dp=w.dp, ranks_per_copy=min(w.dp, cluster.gpus_per_node),
                  grad_bytes=w.dtype_bytes, param_bytes=w.dtype_bytes,
                  device_is_host=hw.device_is_host, overlap=option.overlap)


def rows_for(counts: RowCounts, lay: Layout) -> RowCounts:
    """The counts with this layout's shares (rows split evenly over the ranks that share
    the tables' optimizer: see `owner_skew` for when they are not)."""
    owned = round(counts.union_rows / lay.sharers)
    return replace(counts, owned_rows=owned, longest_owned_rows=owned,
                   self_rows=round(counts.rank_rows / lay.sharers))


# -- components ---------------------------------------------------------------------------


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
    exposed_reduction_s: float = 0.0  # of the backbone's gradient reduction
    # of the boundary's work beside DeepSpeed's step (UNDER_BACKBONE_STEP): what outlasts it
    exposed_beside_step_s: float = 0.0
    # ... beside the backbone reduction's tail (UNDER_REDUCTION_TAIL)
    exposed_beside_tail_s: float = 0.0

    def seconds(self, phase: str) -> float:
        return sum(c.seconds for c in self.components if c.phase == phase)

    @property
    def table_seconds(self) -> float:
        """The table path's work, hidden or not: sync, update, staging."""
        return sum(self.seconds(phase) for phase in TABLE_PHASES)


def table_components(w: Workload, option: Option, cluster: Cluster,
                     hw: Hardware) -> tuple[list[Component], Layout]:
    """The table path's stages for all tables, in the order the code runs them; the
    gradient sync's stages have phase `sync` (they run at the accumulation boundary, on
    the critical path, whatever the overlap), the update's `tables`."""
    lay = layout_of(w, option, cluster, hw)
    s, c = w.shape, rows_for(w.rows, lay)
    gpn = min(cluster.gpus_per_node, w.dp)
    rpn = gpn
    out: list[Component] = []

    def add(name, resource, amount, unit, seconds, calls=0, phase="tables", syncs=0):
        """`calls`: collectives issued (each costs the latency); `syncs`: host syncs."""
        if amount:
            out.append(Component(name, resource, amount, unit, seconds + calls *
                                 hw.collective_latency + hw.syncs_seconds(syncs), phase))

    def memory(name, nbytes, syncs=0, phase="sync", bw=0.0):
        add(name, "mem", nbytes, "B", hw.device_pass_seconds(nbytes, rpn, bw), phase=phase,
            syncs=syncs)

    T = s.tables
    sharded = lay.partition == "sharded"
    sync = "sync" if option.overlap in ("none", "next_step") else "tables"
    if lay.placement == "device":  # host tables' staged rows are summed as they arrive
        beside_tail = sync == "sync" and not hw.device_is_host  # a side stream's
        memory("collect row grads (RowGradSum, rows staged)",
               passes.collect_bytes(s, w.tokens, c, w.dtype_bytes), passes.COLLECT_SYNCS,
               UNDER_REDUCTION_TAIL if beside_tail else sync, hw.row_grads_bw)
    ids = traffic.index_bytes(s, lay, c)
    if sharded:  # counts and ids to owners, all-to-all (next_step: twice)
        add("row ids and counts (all-to-all)", "net", ids, "B",
            hw.alltoall_seconds(ids, w.dp, cluster.gpus_per_node), 2, sync)
    else:  # padded ids all-gathered (device placement: per table)
        add("row ids all-gather", "net", ids, "B", hw.ring_seconds(ids, w.dp, gpn, 1),
            2 * (T if lay.placement == "device" else 1), sync)
    memory("pack, sum and average grads (memory)", passes.pack_bytes(s, lay, c),
           passes.pack_syncs(lay), sync, hw.pack_bw)
    b = traffic.grad_allreduce_bytes(s, lay, c)
    add("grad all-reduce of the union (fp32)", "net", b, "B",
        hw.ring_seconds(b, w.dp, gpn, 2), T, sync)
    b = traffic.grad_reduce_bytes(s, lay, c)
    add("grad reduce to owners in node (fp32)", "net", b, "B",
        hw.ring_seconds(b, lay.ranks_per_copy, lay.ranks_per_copy, 1),
        T * lay.ranks_per_copy, sync)  # one reduce per owner's chunk
    b = traffic.cross_copy_allreduce_bytes(s, lay, c)
    add("owned grads all-reduce across nodes (fp32)", "net", b, "B",
        hw.ring_seconds(b, lay.copies, 1, 2), T, sync)
    b = traffic.grads_to_owners_bytes(s, lay, c)
    add("grads to owners (all-to-all)", "net", b, "B",
        hw.alltoall_seconds(b, w.dp, cluster.gpus_per_node) * w.owner_skew, 1, sync)
    memory("finite check of own row grads", passes.finite_bytes(s, c, w.dtype_bytes))
    memory("norm: row sums of squares (fp64)", passes.norm_bytes(s, lay, c), 0, sync,
           hw.norm_bw)
    memory("norm: the squares in row order, zeroed, placed, summed (fp64)",
           2 * passes.norm_rows_bytes(s), 1, sync)  # (read with the step's values: a sync)
    memory("tables' grads made contiguous", passes.split_bytes(s, lay, c), 0, sync)
    # Sharded CPU state: into reused pinned buffers on a side stream (comm.HostStaging),
    # queued before DeepSpeed's step and run under it; the replicated path's copies are
    # pageable and serial.
    pinned = sharded
    kind = "pinned" if pinned else "pageable"
    b = traffic.grad_d2h_bytes(s, lay, c)
    add(f"D2H grads ({kind}{', side stream' if pinned else ''})", "d2h", b, "B",
        b / hw.copy_bw(pinned, rpn), 0, UNDER_BACKBONE_STEP if pinned else sync)
    b = passes.norm_reduce_bytes(s, lay)
    holders = passes.norm_holders(lay)
    add("norm: every row's squares all-reduced (fp64)", "net", b, "B",
        hw.ring_seconds(b, holders, min(holders, gpn), 2), 1, sync)
    add("launch: the next step's rows first", "gpu", passes.launch_syncs(lay), "sync",
        0.0, 2 if lay.dp > 1 else 0, sync, passes.launch_syncs(lay))
    elems = traffic.adam_elements(s, lay, c)
    if lay.optimizer == "cpu":
        scattered = lay.update == "lazy" or (lay.own_master and sharded)
        add("CPU Adam (row op, writes the table-dtype rows)", "cpu", elems, "elem",
            hw.cpu_adam_seconds(elems, rpn, w.kernel, scattered))
        if w.kernel == "torch" and (lay.update == "lazy" or lay.overlap == "next_step"):
            # index_select of master and moments into contiguous buffers, index_copy back
            # (DeepSpeed's arithmetic runs on the rows in place: AdamKernel.update_rows)
            b = elems * 3 * traffic.FP32 * 2
            add("row gather/scatter of the state (CPU)", "cpu", b, "B",
                b / hw.node_share(hw.gather_bw, rpn))
    else:
        add("accelerator Adam (owned rows, torch ops)", "mem", elems, "elem",
            hw.device_pass_seconds(elems * ACCELERATOR_ROW_ADAM_BYTES, rpn))
    h2d = traffic.update_h2d_bytes(s, lay, c)
    add(f"H2D updated rows ({kind})", "h2d", h2d, "B", h2d / hw.copy_bw(pinned, rpn))
    ag = traffic.gather_bytes(s, lay, c)
    phases = READY_STAGES + 1 if lay.overlap == "next_step" else 1
    if lay.placement == "device":
        add("all-gather updated rows", "net", ag, "B",
            hw.allgather_seconds(ag, w.dp, gpn, T),  # (next_step: nearly all in one phase)
            T * phases * (2 if traffic.padded_gathers(lay) else 1))
        if ag and lay.partition == "sharded":
            # The gathered rows arrive in buffers, one per other owner (padded row sets are
            # padded into one more, this rank's share), then placed into the table
            # (`passes.place_bytes`). On a GPU the buffers are new (the list-form
            # all-gather's copy out of its flat buffer, into the caching allocator's
            # blocks); in host memory reused (comm.HostBuffers: no fresh pages), except the
            # padded gathers' own.
            own = passes.own_shard_bytes(lay, ag)
            fresh = 0.0 if hw.device_is_host else ag
            fresh += own if traffic.padded_gathers(lay) else 0.0
            add("place gathered rows into the table (memory)", "mem",
                passes.placed_bytes(lay, ag), "B", hw.alloc_copy_seconds(fresh, rpn, own / T) +
                hw.device_pass_seconds(passes.place_bytes(lay, ag), rpn, hw.place_bw))
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
                          shares: tuple[float, float] = (1.0, 0.0)) -> float:
    """The update's seconds the step waits for (the gradient sync's are counted apart,
    `exposed_sync_seconds`)."""
    if option.overlap == "none" or not tables:
        return sum(c.seconds for c in tables)
    n = w.shape.tables
    backbone = [c for c in backbone if c.phase == "backbone"]
    bb_net = sum(c.seconds for c in backbone if c.resource == "net")
    bb_s = sum(c.seconds for c in backbone)
    forward_mb = compute_s / w.microbatches / 3
    if option.overlap == "next_step":
        ends = _next_step_ends(w, tables, shares)
        wait = _next_step_wait(w, ends, compute_s)
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


def _next_step_ends(w: Workload, tables: list[Component],
                    shares: tuple[float, float]) -> list[float]:
    """`next_step`: when each job is done from the next step's start: each table's rows
    the next step's first micro-batch reads, in forward order, then those its later ones
    read, then the rest (`shares`: of the update, the first two); a table's lookup waits
    for its rows of the micro-batch, the next gradient sync (after that step's backward)
    for everything."""
    n = w.shape.tables
    parts = (*shares, max(0.0, 1 - sum(shares)))
    return _flow_shop([(0.0, _scaled(tables, share / n)) for share in parts
                       for _ in range(n)], CHUNKS_PER_TABLE, {})


def _next_step_wait(w: Workload, ends: list[float], compute_s: float) -> float:
    """How long the next step waits for its rows: a table's lookup in micro-batch k for
    its job of stage k (the last stage: of every later micro-batch, from the first of
    them)."""
    n = w.shape.tables
    forward_mb = compute_s / w.microbatches / 3
    layers = sorted(w.stem_layers)
    return max(0.0, *(ends[k * n + i] - (k * compute_s / w.microbatches +
                                         forward_mb * _layer_share_below(w, layer))
                      for k in range(READY_STAGES) for i, layer in enumerate(layers)))


def boundary_segment_seconds(w: Workload, p: "Plan") -> float:
    """From the end of the last backward to the next step's first table lookup, as the
    code runs a table option: the backbone reduction's tail, the gradient sync, the
    backbone's step, then (`next_step`) the next forward up to the first STEM layer or the
    first table's rows, whichever is later; otherwise the whole update, then that forward
    (bench/gpu/run_all.sh measures it)."""
    compute_s = p.seconds("compute")
    forward = compute_s / w.microbatches / 3 * _layer_share_below(w, min(w.stem_layers))
    update = [c for c in p.components if c.phase == "tables"]
    before = p.exposed_reduction_s + p.exposed_beside_tail_s + p.seconds("sync") + \
        p.seconds("backbone") + p.exposed_beside_step_s
    if p.option.overlap == "next_step":
        return before + max(forward, _next_step_ends(w, update, stage_shares(w, p.option))[0])
    return before + sum(c.seconds for c in update) + forward


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


def stage_shares(w: Workload, option: Option | Layout) -> tuple[float, float]:
    """`next_step`: the shares of the update in its two first stages: the rows the next
    step's first micro-batch reads over DP, then those only its later micro-batches read,
    among the rows that change (all rows for `dense`; for `lazy` the touched ones, about
    all of which the next step reads)."""
    union = w.rows.union_rows
    first = min(w.rows.first_microbatch_union_rows or union, union)
    if option.update == "lazy":
        return (first / union, 1 - first / union) if union else (1.0, 0.0)
    first_share = min(1.0, first / w.shape.rows)
    return first_share, min(1.0, union / w.shape.rows) - first_share


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


def _outlasting(path: list[Component], phase: str, window_s: float) -> float:
    """What of `phase`'s work, run beside something `window_s` long, outlasts it."""
    return max(0.0, sum(c.seconds for c in path if c.phase == phase) - window_s)


def plan(w: Workload, option: Option | None, cluster: Cluster, hw: Hardware,
         host_memory_bytes: float = 0.0) -> Plan:
    """The predicted step of workload `w` (a STEM recipe trained per `option`, or a dense
    one when `option` is None)."""
    comp = compute_components(w, cluster, hw)
    compute_s = sum(c.seconds for c in comp)
    backbone, reduction_s = backbone_components(w, cluster, hw, compute_s)
    backbone_step_s = sum(c.seconds for c in backbone if c.phase == "backbone")
    components = comp + backbone
    exposed = beside_exposed = tail_exposed = 0.0
    lay = None
    if option is not None and w.shape.tables:
        path, lay = table_components(w, option, cluster, hw)
        staging = staging_components(w, lay, cluster, hw)
        components += path + staging
        update = [c for c in path if c.phase == "tables"]
        sync = [c for c in path if c.phase == "sync"]
        beside_exposed = _outlasting(path, UNDER_BACKBONE_STEP, backbone_step_s)
        tail_exposed = _outlasting(path, UNDER_REDUCTION_TAIL, reduction_s)
        exposed = exposed_sync_seconds(w, option, sync, compute_s) + beside_exposed + \
            tail_exposed + \
            exposed_table_seconds(w, option, update, compute_s, backbone,
                                  stage_shares(w, lay)) + \
            exposed_staging_seconds(w, staging, compute_s)
    step = compute_s + reduction_s + backbone_step_s + exposed
    why = memory_check(w, lay, hw, cluster, host_memory_bytes)
    counters = traffic.counters(w.shape, lay, rows_for(w.rows, lay)) if lay is not None else {}
    return Plan(option, components, step, exposed, w.flops / (step * hw.peak_flops),
                fits=not why, why_not=why, counters=counters, exposed_reduction_s=reduction_s,
                exposed_beside_step_s=beside_exposed, exposed_beside_tail_s=tail_exposed)


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
