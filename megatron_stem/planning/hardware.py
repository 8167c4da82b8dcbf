"""Hardware profiles: the bandwidths and rates the step model divides by.

GPU profiles are published numbers (per GPU unless said; GB = 1e9 bytes):

| | H100 SXM | H200 SXM | source |
|---|---|---|---|
| dense bf16 | 989 TFLOP/s | 989 TFLOP/s | NVIDIA H100/H200 datasheets (without sparsity) |
| HBM | 3.35 TB/s, 80 GB | 4.8 TB/s, 141 GB | same datasheets (HBM3 / HBM3e) |
| NVLink 4 | 900 GB/s bidirectional = 450 GB/s per direction | same | same |
| PCIe Gen5 x16 | 64 GB/s per direction; ~55 GB/s measured pinned | same | PCIe 5.0 spec; nvbandwidth-style measurements |
| InfiniBand | 8 x ConnectX-7 NDR 400 Gb/s = 50 GB/s per NIC, one per GPU | same | DGX H100/H200 system guide |
| node DRAM | 2-socket Sapphire Rapids, 8 ch DDR5-4800 per socket = 2 x 307 GB/s peak | same | Intel Xeon 8480+ spec (DGX H100 CPUs) |

Derived, and stated as assumptions (bench/gpu/run_all.sh refits them on one H200):
- achievable MFU of the forward/backward: 40% (Megatron-class 1B training in bf16 at
  seq 2048; the 0.76 s/step of issue 11's estimate is the same 400 TFLOP/s);
- collectives reach 80% of link bandwidth (NCCL ring bus bandwidth, large messages) and
  cost 30 us per call (NCCL small-message latency across nodes);
- pageable (unpinned) host<->device copies: 20 GB/s; pinned: 55 GB/s;
- node DRAM achievable: 70% of peak = 430 GB/s, shared by the node's ranks;
- host<->device copies of all a node's GPUs land in the same DRAM: a rank's copy rate is
  at most the node DRAM bandwidth over its ranks.

The `cpu` profile is this machine, measured by `planning/calibrate.py` and cached in a
small JSON (`--calibrate` re-measures): everything is one node, "device" memory is host
memory (no copies), collectives are gloo's. Its rates are a rank's CPU time (one thread)
while every core runs a rank, at the calibration step's sizes: the clock
bench/plan_calibration.py compares in on this shared machine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_stem.errors import UserError

GB = 1e9

# glibc's malloc serves a buffer over its mmap threshold with fresh pages, returned to the
# system when it is freed; smaller ones reuse the heap's pages. The threshold rises to the
# size of the large buffers freed, up to 32 MiB on 64-bit: in a training loop, that.
MMAP_THRESHOLD = 32 << 20

# Where `cpu` constants are cached, and the h200 refit from bench/gpu/run_all.sh.
CACHE_DIR = Path.home() / ".cache" / "megatron_stem" / "planner"


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per accelerator, the dtype training uses (bf16 on GPUs)
    mfu: float  # achievable share of peak_flops in forward/backward
    memory_bw: float  # accelerator memory (HBM; the CPU profile: its memcpy), B/s
    memory_bytes: float  # accelerator memory capacity
    nvlink_bw: float  # per GPU per direction, B/s (CPU profile: unused)
    nic_bw: float  # per NIC per direction, B/s
    nics_per_node: int
    pinned_copy_bw: float  # host<->device per GPU, pinned, B/s
    pageable_copy_bw: float  # host<->device per GPU, pageable, B/s
    dram_bw: float  # node DRAM, achievable, B/s (read + write bytes)
    gather_bw: float  # node: rows gathered (index_select), bytes written per second
    cpu_adam_rate: float  # CPU Adam, DeepSpeed kernel: elements/s per core
    torch_adam_rate: float  # the same in torch ops (`kernel: torch`): elements/s per core
    cores: int  # CPU cores per node
    adam_bytes_per_element: int = 28  # fp32 master, 2 moments, grad read; 3 written
    collective_efficiency: float = 0.8
    collective_latency: float = 30e-6  # s per collective call (NCCL, small messages)
    # STEM tables' rows in forward/backward (lookup, sparse grads, coalescing), B/s of one
    # rank: measured on the CPU profile and by run_all.sh; 0 = the memory bandwidth
    table_rows_bw: float = 0.0
    # CPU profile: torch.optim.AdamW's elements/s per core (the backbone's optimizer there)
    backbone_adam_rate: float = 0.0
    # Copies into newly allocated buffers, B/s written: on the CPU a large allocation is
    # fresh pages (page faults) every time; 0 = memory_bw (GPUs' caching allocators)
    alloc_copy_bw: float = 0.0
    # CPU profile only: "device" memory is host memory, collectives are gloo's (measured).
    device_is_host: bool = False
    gloo_allreduce_busbw: float = 0.0
    gloo_alltoall_bw: float = 0.0
    # bytes received per second per rank, beyond the copy of the whole output through a
    # new buffer (`allgather_seconds`)
    gloo_allgather_bw: float = 0.0

    # -- rates ---------------------------------------------------------------------------

    def threads_per_rank(self, ranks_per_node: int) -> float:
        """CPU threads one rank runs: GPU nodes give each rank its share of the cores; on
        the CPU profile a rank runs one intra-op thread, time-sharing when ranks > cores."""
        if self.device_is_host:
            return min(1.0, self.cores / ranks_per_node)
        return self.cores / ranks_per_node

    def node_share(self, node_rate: float, ranks_per_node: int) -> float:
        """One rank's part of a node-wide rate when every rank of the node draws on it."""
        if self.device_is_host:  # one thread per rank: at most one core's part
            return node_rate / max(ranks_per_node, self.cores)
        return node_rate / ranks_per_node

    def compute_rate(self, ranks_per_node: int) -> float:
        """FLOP/s of one rank's forward/backward."""
        share = self.threads_per_rank(ranks_per_node) if self.device_is_host else 1.0
        return self.peak_flops * self.mfu * share

    def ring_busbw(self, ranks: int, gpus_per_node: int) -> float:
        """Ring bus bandwidth over `ranks` ranks: within a node NVLink; across nodes the
        rings leave each node through its NICs (one per GPU, rail-aligned): of the g hops
        a GPU sends on over the g rings, g-1 are NVLink and one is its NIC, so its share is
        min(NVLink x g/(g-1), NICs x NIC bw). CPU: gloo's measured bus bandwidth, shared
        by the ranks when they outnumber the cores."""
        if self.device_is_host:
            return self.gloo_allreduce_busbw * self.threads_per_rank(ranks)
        if ranks <= gpus_per_node:
            link = self.nvlink_bw
        else:
            g = gpus_per_node
            link = min(self.nvlink_bw * g / max(g - 1, 1), self.nics_per_node * self.nic_bw)
        return link * self.collective_efficiency

    def allgather_seconds(self, received_bytes: float, ranks: int,
                          ranks_per_node: int, calls: int = 1) -> float:
        """All-gathers (`calls` of one size) in which this rank receives `received_bytes`
        from the others: the ring's bus bandwidth on GPUs; gloo's measured all-gather rate
        on the CPU profile (its all-gather is not its all-reduce's algorithm)."""
        if ranks <= 1 or received_bytes == 0:
            return 0.0
        if self.device_is_host and self.gloo_allgather_bw:
            # gloo gathers into a new flat buffer (ProcessGroupGloo), one per call, and
            # copies it out: the whole output, besides the bytes received
            output = received_bytes * ranks / (ranks - 1)
            return self.alloc_copy_seconds(output, ranks, output / calls) + received_bytes / (
                self.gloo_allgather_bw * self.threads_per_rank(ranks))
        return received_bytes / self.ring_busbw(ranks, ranks_per_node)

    def alltoall_seconds(self, sent_bytes: float, ranks: int, gpus_per_node: int) -> float:
        """All-to-all in which this rank sends `sent_bytes` to the other ranks, evenly: the
        part for other nodes leaves through this GPU's NIC, the part for the node's GPUs
        over NVLink, at the same time."""
        if ranks <= 1:
            return 0.0
        if self.device_is_host:
            return sent_bytes / (self.gloo_alltoall_bw * self.threads_per_rank(ranks))
        local = min(ranks, gpus_per_node)
        remote = sent_bytes * (ranks - local) / (ranks - 1)
        near = sent_bytes * (local - 1) / (ranks - 1)
        nic_per_gpu = self.nics_per_node * self.nic_bw / gpus_per_node
        eff = self.collective_efficiency
        return max(remote / (nic_per_gpu * eff), near / (self.nvlink_bw * eff))

    def alloc_copy_seconds(self, nbytes: float, ranks_per_node: int,
                           buffer_bytes: float | None = None) -> float:
        """One rank's copy of `nbytes` into newly allocated buffers of `buffer_bytes` each
        (default: one buffer): the accelerator's memory (its caching allocator); on the CPU
        profile, fresh pages with their page faults for buffers over glibc's mmap
        threshold, the heap's reused pages under it."""
        size = nbytes if buffer_bytes is None else buffer_bytes
        bw = self.alloc_copy_bw if self.alloc_copy_bw and size > MMAP_THRESHOLD else \
            self.memory_bw
        if self.device_is_host:
            bw *= self.threads_per_rank(ranks_per_node)
        return nbytes / bw

    def copy_bw(self, pinned: bool, ranks_per_node: int) -> float:
        """One rank's host<->device copy rate while every rank of the node copies."""
        link = self.pinned_copy_bw if pinned else self.pageable_copy_bw
        return min(link, self.dram_bw / ranks_per_node)

    def cpu_adam_seconds(self, elements_per_rank: float, ranks_per_node: int,
                         kernel: str = "deepspeed") -> float:
        """Every rank of a node runs its CPU Adam at once: the cores and the DRAM
        bandwidth are shared (28 B of DRAM traffic per element). The CPU profile's rate
        was measured on DRAM-sized tensors: it already holds the memory's limit."""
        per_core = self.torch_adam_rate if kernel == "torch" else self.cpu_adam_rate
        compute = elements_per_rank / (per_core * self.threads_per_rank(ranks_per_node))
        if self.device_is_host:
            return compute
        memory = elements_per_rank * self.adam_bytes_per_element / self.node_share(
            self.dram_bw, ranks_per_node)
        return max(compute, memory)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _gpu(name: str, memory_bw: float, memory_bytes: float) -> Hardware:
    return Hardware(
        name=name, peak_flops=989e12, mfu=0.40, memory_bw=memory_bw,
        memory_bytes=memory_bytes, nvlink_bw=450 * GB, nic_bw=50 * GB, nics_per_node=8,
        pinned_copy_bw=55 * GB, pageable_copy_bw=20 * GB,
        dram_bw=0.7 * 2 * 8 * 38.4 * GB,  # 2 sockets x 8 channels x DDR5-4800
        gather_bw=0.7 * 2 * 8 * 38.4 * GB / 2,  # a gather reads and writes
        # AVX-512 CPU Adam, per core (assumed; DRAM binds first at 28 B/element), 2 x 56
        # cores; the torch kernel several times slower (ZeRO-Offload paper: CPU-Adam is
        # 5-7x PyTorch's CPU Adam).
        cpu_adam_rate=0.5e9, torch_adam_rate=0.08e9, cores=112)


PUBLISHED = {"h100": _gpu("h100", 3.35e12, 80e9), "h200": _gpu("h200", 4.8e12, 141e9)}
NAMES = (*PUBLISHED, "cpu")


def load(name: str, calibrate: bool = False, cache_dir: Path = CACHE_DIR) -> Hardware:
    """A profile by name. `cpu`: this machine's measured constants (cached; `calibrate`
    re-measures). A GPU profile refit on a real GPU (`<name>.json` in the cache folder,
    written by bench/gpu/run_all.sh) takes precedence over the published numbers."""
    if name not in NAMES:
        raise UserError(f"--hardware: unknown profile {name!r} (choose from "
                        f"{', '.join(NAMES)})")
    path = cache_dir / f"{name}.json"
    if name == "cpu":
        # a profile without `alloc_copy_bw` was measured one process at a time, partly in
        # wall time (before the calibration's method of docs/tables.md): measure again
        if calibrate or not path.is_file() or not read(path).alloc_copy_bw:
            from megatron_stem.planning.calibrate import measure_cpu

            save(measure_cpu(), path)
        return read(path)
    return read(path) if path.is_file() else PUBLISHED[name]


def read(path: Path) -> Hardware:
    try:
        data = json.loads(Path(path).read_text())
        return Hardware(**data)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{path}: not a hardware profile ({e}); delete it or re-run with "
                        "--calibrate") from None


def save(hw: Hardware, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hw.to_json())
