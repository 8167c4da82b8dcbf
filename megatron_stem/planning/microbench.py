"""One rank's CPU rates, each measured with the trainer's own functions where it has one.

Run by `calibrate.py` in one one-thread process per core at once (what a rank gets while
the others run), timed in the process's CPU time (which other jobs on a shared machine do
not inflate), best of a few repeats; the step boundary's ops on cold caches (`best`'s
`cold`), as the trainer runs them after a backward. Bytes are the planner's own counts of
each op (`passes.py`), so a rate measured here is what the planner divides those counts by.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megatron_stem.planning import passes
from megatron_stem.planning.traffic import Layout, RowCounts, TableShape

# Sizes of the calibration step (DP2): a table's rows one owner updates (16,000 x 512),
# the backbone's ZeRO partition (10M elements); the row gradients of a rank's step (2
# micro-batches of 512 tokens, 4 tables of 512 over a 32k vocabulary).
TABLE_ROWS, TABLE_WIDTH, TABLE_VOCAB = 16000, 512, 32000
BACKBONE_PARTITION_ELEMENTS = 10 << 20
STEP_TOKENS, STEP_MICROBATCHES, STEP_TABLES = 1024, 2, 4
# The calibration step's table layout, whose passes the sharded rates are counted by: DP2,
# fp32 tables in CPU memory (their own masters).
DP2_SHARDED = Layout("device", "dense", "sharded", "cpu", dp=2, ranks_per_copy=2,
                     grad_bytes=4, param_bytes=4, device_is_host=True)


def clock():
    """One-thread CPU work is timed in this process's CPU time, which other jobs on a
    shared machine do not inflate; anything threaded, waiting or on a GPU in wall time."""
    if torch.get_num_threads() == 1 and not torch.cuda.is_available():
        return time.process_time
    return time.perf_counter


# Written before each call of a `cold` measurement: more than a CPU's last-level cache
# (32 MB here), so the call finds its inputs in DRAM.
EVICT_BYTES = 256 << 20


def best(fn, repeats: int = 5, timer=None, setup=None, cold: bool = False) -> float:
    """The fastest of `repeats` calls of `fn` (after a warm-up: allocations, first-touch
    pages); `setup` runs untimed before each. `cold`: each call starts with its inputs
    out of the caches, as the step boundary's ops find the row gradients a backward made
    (at the calibration's sizes they fit in the last-level cache of a repeated call, and
    ran 1.2-3.5x faster there than in the trainer: the norm's squares most)."""
    timer = timer or clock()
    evict = torch.empty(EVICT_BYTES // 4) if cold else None
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        if evict is not None:
            evict.fill_(float(i))
        start = timer()
        fn()
        if i:
            times.append(timer() - start)
    return min(times)


def row_adam_rate(kernel: str = "deepspeed", rows: int = TABLE_ROWS, width: int = TABLE_WIDTH,
                  scattered: bool = False) -> float:
    """Elements/s of `AdamKernel.update_rows` as the tables' optimizer calls it: every row
    of an owner's shard with a clipping scale (folded into the op) and the new rows written
    in bf16 (a separate table's dtype). `scattered`: the shard's rows interleaved over a
    table that is its own master (fp32 CPU tables, the calibration model's), no copy out."""
    from megatron_stem.tables.adam import AdamKernel
    from megatron_stem.tables.shards import interleaved_order

    k = AdamKernel(kernel, (0.9, 0.95), 1e-8)
    state = torch.arange(rows)
    if scattered:
        vocab = rows * 2
        param = torch.rand(vocab, width)
        param_rows = interleaved_order(vocab)[:rows].sort().values
        out = None
    else:
        param, param_rows = torch.rand(rows, width), state
        out = torch.empty(rows, width, dtype=torch.bfloat16)
    m, v, g = torch.rand(rows, width), torch.rand(rows, width), torch.rand(rows, width)
    step = iter(range(1, 1 << 30))
    return rows * width / best(lambda: k.update_rows(next(step), 1e-3, 0.1, param, m, v, g,
                                                     param_rows, state, state, out,
                                                     grad_scale=0.5))


def flat_adam_rate(kernel: str, elements: int = TABLE_ROWS * TABLE_WIDTH) -> float:
    """Elements/s of `AdamKernel.update` on contiguous fp32 tensors (the torch kernel's
    arithmetic without the row gathers, which the planner counts apart)."""
    from megatron_stem.tables.adam import AdamKernel

    k = AdamKernel(kernel, (0.9, 0.95), 1e-8)
    p, g, m, v = (torch.rand(elements) for _ in range(4))
    step = iter(range(1, 1 << 30))
    return elements / best(lambda: k.update(next(step), 1e-3, 0.1, p, g, m, v))


def optimizer_rate(elements: int = BACKBONE_PARTITION_ELEMENTS) -> float:
    """Elements/s of torch.optim.AdamW's step (what DeepSpeed runs for the backbone with a
    torch optimizer on CPU)."""
    param = torch.nn.Parameter(torch.rand(elements))
    param.grad = torch.rand(elements)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1)
    return elements / best(opt.step)


def copy_rates(rows: int = 65536, width: int = 1024, picked: int = 16384) -> tuple[float, float]:
    """(gather: bytes written per second, copy: bytes read + written per second) into
    reused buffers (64 MB: the size of the calibration step's grads and tables)."""
    table = torch.randn(rows, width)
    ids = torch.randperm(rows)[:picked].sort().values
    out = torch.empty(picked, width)
    src = torch.randn(picked, width)
    nbytes = out.numel() * 4
    gather = nbytes / best(lambda: torch.index_select(table, 0, ids, out=out))
    memcpy = 2 * nbytes / best(lambda: out.copy_(src))
    return gather, memcpy


def dram_copy_rate(nbytes: int = 256 << 20) -> float:
    """Bytes read + written per second of a copy between buffers far larger than the
    caches (a node's DRAM as a stream of copies sees it)."""
    src, dst = torch.empty(nbytes // 4).uniform_(), torch.empty(nbytes // 4)
    return 2 * nbytes / best(lambda: dst.copy_(src), 3)


def alloc_copy_rate(nbytes: int = 64 << 20) -> float:
    """Bytes written per second of a copy into a newly allocated buffer (what `clone`,
    `torch.cat` or a flatten does): on the CPU, glibc maps a buffer this large afresh and
    every page faults on its first write. The page faults' cost moves from call to call in
    a virtual machine (0.89 and 1.13 GB/s as the best of 5 in two profiles 20 minutes
    apart here, the trainer's parts it prices unchanged): the best of 12."""
    src = torch.randn(nbytes // 4)
    return nbytes / best(src.clone, 12)


def _step_ids(seed: int = 0) -> list[torch.Tensor]:
    """A step's micro-batches of token ids, Zipf-like (text's few frequent ids)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, TABLE_VOCAB + 1, dtype=torch.float64) ** -1.1
    per = STEP_TOKENS // STEP_MICROBATCHES
    return [torch.multinomial(weights, per, replacement=True, generator=g)
            for _ in range(STEP_MICROBATCHES)]


def _counts(mbs: list[torch.Tensor], owned_share: float = 0.5) -> RowCounts:
    rank = torch.unique(torch.cat(mbs)).numel()
    return RowCounts(rank_rows=rank, union_rows=rank, owned_rows=round(rank * owned_share),
                     microbatch_rows=sum(torch.unique(x).numel() for x in mbs))


def row_grads_bw() -> float:
    """Bytes/s (`passes.collect_bytes`) of the row gradients' sum as the trainer runs it:
    the step's rows staged from the host's ids (`StepRows`), the tables' hooks collect each
    micro-batch's sparse gradient (row_grads_of), `take_same_rows` sums them (on a CPU the
    trainer's sum runs inline at the last backward's end; the same ops)."""
    from megatron_stem.tables.row_grads import StepRows, row_grads_of, take_same_rows

    tables = [torch.nn.Parameter(torch.randn(TABLE_VOCAB, TABLE_WIDTH))
              for _ in range(STEP_TABLES)]
    sums = [row_grads_of(p) for p in tables]
    mbs = _step_ids()
    upstream = torch.randn(STEP_TOKENS // STEP_MICROBATCHES, TABLE_WIDTH)

    def backwards():
        rows = StepRows(mbs, torch.device("cpu"))
        for s in sums:
            s.expect(rows)  # (no side stream: summed by `take`, timed)
        for ids in mbs:
            sum(F.embedding(ids, p, sparse=True).mul(upstream).sum() for p in tables).backward()

    seconds = best(lambda: take_same_rows(sums), setup=backwards, cold=True)
    shape = TableShape(STEP_TABLES, TABLE_VOCAB, TABLE_WIDTH)
    return passes.collect_bytes(shape, STEP_TOKENS, _counts(mbs), 4) / seconds


def pack_bw() -> float:
    """Bytes/s (`passes.pack_bytes`, sharded DP2) of the owners' side of `to_owners` in
    its own ops: the tables' grads concatenated, put in owner order, the received rows summed
    into the owned ones (`index_add_`, one per sender), averaged."""
    mbs = _step_ids()
    counts = _counts(mbs)
    rows, width = counts.rank_rows, STEP_TABLES * TABLE_WIDTH
    grads = [torch.randn(rows, TABLE_WIDTH) for _ in range(STEP_TABLES)]
    order = torch.randperm(rows)
    owned = counts.owned_rows
    senders = [torch.randint(0, owned, (rows // 2,)) for _ in range(2)]

    def pack():
        values = torch.cat(grads, 1)[order]
        summed = torch.zeros(owned, width)
        for where, part in zip(senders, values.split(rows // 2)):
            summed.index_add_(0, where, part[:where.numel()].float())
        return summed / 2

    shape = TableShape(STEP_TABLES, TABLE_VOCAB, TABLE_WIDTH)
    return passes.pack_bytes(shape, DP2_SHARDED, counts) / best(pack, cold=True)


def norm_bw() -> float:
    """Bytes/s (`passes.norm_bytes`) of the norm's squares as `sync_grads` takes them:
    each owned row's sum of squares in float64, per table, each table's grads a column
    slice of the owners' one [rows, tables x width] tensor (shards.py `to_owners`)."""
    mbs = _step_ids()
    counts = _counts(mbs)
    grads = torch.randn(counts.owned_rows, STEP_TABLES * TABLE_WIDTH).split(TABLE_WIDTH, 1)
    seconds = best(lambda: torch.stack([g.double().square().sum(1) for g in grads], 1),
                   cold=True)
    return counts.owned_rows * TABLE_WIDTH * STEP_TABLES * passes.NORM_BYTES_PER_ELEMENT / seconds


def place_bw() -> float:
    """Bytes/s (`passes.place_bytes`, sharded DP2, the calibration model's fp32 tables,
    their own masters) of the publication's placing in its own ops (shards.py
    `gather_shards`): each table's own updated rows gathered out of it for the all-gather
    (`index_select` into a reused buffer), the other owner's rows put into it (`index_copy_`),
    both at the rows of a shard (interleaved over the table)."""
    from megatron_stem.tables.shards import interleaved_order

    rows = TABLE_VOCAB // 2
    order = interleaved_order(TABLE_VOCAB)
    mine, theirs = order[:rows], order[rows:]
    tables = [torch.randn(TABLE_VOCAB, TABLE_WIDTH) for _ in range(STEP_TABLES)]
    own = torch.empty(rows, TABLE_WIDTH)
    received = torch.randn(rows, TABLE_WIDTH)

    def place():
        for table in tables:
            torch.index_select(table, 0, mine, out=own)
            table.index_copy_(0, theirs, received)

    gathered = STEP_TABLES * received.numel() * received.element_size()
    return passes.place_bytes(DP2_SHARDED, gathered) / best(place)


def rank_rates(kernel: str = "deepspeed") -> dict:
    """One rank's CPU rates (one thread), at the calibration step's sizes."""
    torch.set_num_threads(1)
    gather, memcpy = copy_rates()
    return {"cpu_adam_rate": row_adam_rate(kernel),
            "scattered_adam_rate": row_adam_rate(kernel, scattered=True),
            "torch_adam_rate": flat_adam_rate("torch"),
            "backbone_adam_rate": optimizer_rate(),
            "gather_bw": gather, "memory_bw": memcpy, "alloc_copy_bw": alloc_copy_rate(),
            "row_grads_bw": row_grads_bw(), "pack_bw": pack_bw(), "norm_bw": norm_bw(),
            "place_bw": place_bw()}
