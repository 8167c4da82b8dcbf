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
- achievable MFU of the dense forward/backward at the 1B shapes: 37%, by the field's count
  of FLOPs (model/accounting.py): a Llama-3.2-1B-shaped baseline trains at ~42k tokens/s per H100
  (8 GPUs), 34.9% of 989 TFLOP/s at 8.22 GFLOP/token for the whole step, of which the
  forward/backward is ~95%; MPT-1B at seq 2048 reports 41.5%;
- one bf16 GEMM's share of peak by its FLOPs (`GEMM_CURVE`, interpolated in log FLOPs):
  80% at the top (the maximum achievable matmul FLOP/s of an H100 SXM, 794.5 of 989
  TFLOP/s, "H200 is the same": stas00/ml-engineering's MAMF table), ~70% at the 1B
  model's FFN GEMMs (8192 x 2048 x 8192-16384), falling to ~35% at 1e10 FLOP; the STEM
  layers' fc1 (the gate alone, half the fused gate+up GEMM) is priced on it, so a removed
  up-projection saves what it costs (`planning/compute.py`);
- collectives reach 80% of link bandwidth (NCCL ring bus bandwidth, large messages) and
  cost 30 us per call (NCCL small-message latency across nodes);
- a host sync (`.item()`, `.tolist()`, `torch.unique`'s size) costs 50 us: the GPU's queue
  drains and the kernels after it start from an idle device (launch latency, assumed);
- elementwise passes over accelerator memory (upcasts, sums, copies) reach 80% of HBM;
- pageable (unpinned) host<->device copies: 20 GB/s; pinned: 55 GB/s;
- node DRAM achievable: 70% of peak = 430 GB/s, shared by the node's ranks;
- host<->device copies of all a node's GPUs land in the same DRAM: a rank's copy rate is
  at most the node DRAM bandwidth over its ranks.
- the node's CPU work (the tables' row Adam) per rank: its share of the cores at the rate
  one core of this machine reaches with every core busy (`NODE_CORE_SPEED` times it), or
  its share of the node's DRAM at the bytes per element it moves, whichever binds
  (`node_cpu_seconds`); bench/plan_calibration.py prints the model, run_all.sh measures
  it with 8 processes on the H200 host.

The `cpu` profile is this machine, measured by an explicit step, `python -m
megatron_stem.planning.calibrate` (three to four minutes, with progress; cached in a small
JSON): everything is one node, "device" memory is host memory (no copies), collectives are
gloo's. Its rates are a rank's CPU time (one thread) while every core runs a rank, at the
calibration step's sizes: the clock bench/plan_calibration.py compares in on this shared
machine. A missing or outdated profile is an error that says how to measure it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megatron_stem.runtime.errors import UserError

GB = 1e9

# glibc's malloc serves a buffer over its mmap threshold with fresh pages, returned to the
# system when it is freed; smaller ones reuse the heap's pages. The threshold rises to the
# size of the large buffers freed, up to 32 MiB on 64-bit: in a training loop, that.
MMAP_THRESHOLD = 32 << 20

# Where `cpu` constants are cached, and the h200 refit from bench/gpu/run_all.sh.
CACHE_DIR = Path.home() / ".cache" / "megatron_stem" / "planner"
# A `cpu` profile measured by another version of calibrate.py is not read (its fields or
# their meaning differ): raise with each change of what it measures.
PROFILE_VERSION = 7
MEASURE_COMMAND = "python -m megatron_stem.planning.calibrate"

# One bf16 GEMM's fraction of peak by its FLOPs (module docstring), H100/H200 SXM.
GEMM_CURVE = ((1e9, 0.10), (1e10, 0.35), (1e11, 0.62), (1e12, 0.76), (1e13, 0.80))
# Node CPU cores of a DGX H100/H200 (Xeon 8480C, AVX-512) against one core of the machine
# that measured the `cpu` profile, at the tables' row Adam: assumed equal (the op binds on
# DRAM at a GPU node's 14 cores per rank long before its core speed matters).
NODE_CORE_SPEED = 1.0


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per accelerator, the dtype training uses (bf16 on GPUs)
    mfu: float  # achievable MFU of a dense forward/backward (model/accounting.py's FLOPs)
    memory_bw: float  # accelerator memory (HBM; the CPU profile: its memcpy), B/s read + written
    memory_bytes: float  # accelerator memory capacity
    nvlink_bw: float  # per GPU per direction, B/s (CPU profile: unused)
    nic_bw: float  # per NIC per direction, B/s
    nics_per_node: int
    pinned_copy_bw: float  # host<->device per GPU, pinned, B/s
    pageable_copy_bw: float  # host<->device per GPU, pageable, B/s
    dram_bw: float  # node DRAM, achievable, B/s (read + write bytes)
    gather_bw: float  # node: rows gathered (index_select), bytes written per second
    cpu_adam_rate: float  # the tables' row Adam (DeepSpeed's arithmetic): elements/s per core
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
    # GEMM efficiency by FLOPs ((flops, fraction of peak), ...); empty: every GEMM at `mfu`
    gemm_curve: tuple = GEMM_CURVE
    host_sync_s: float = 50e-6  # one host sync on the accelerator (module docstring)
    elementwise_efficiency: float = 0.8  # of memory_bw, for passes over device memory
    # The row op's DRAM traffic per element (fp32 master, moments, grad read; master and
    # moments written; the table-dtype row written, bf16): bytes of the stream model
    row_adam_bytes_per_element: int = 30
    # CPU profile only, measured with the trainer's own functions (bytes by the planner's
    # count of each op, over its CPU time): collecting a step's row gradients
    # (RowGradSum._sum), the norm's squares, the owners' packing and sums, the
    # publication's placing of gathered rows into the table (`passes.place_bytes`: row
    # scatters and gathers, several times slower than a copy on a CPU); 0: memory_bw
    row_grads_bw: float = 0.0
    norm_bw: float = 0.0
    pack_bw: float = 0.0
    place_bw: float = 0.0
    # the row op's elements/s on one core when a shard's rows are not consecutive in the
    # master (an fp32 CPU table that is its own master); 0: cpu_adam_rate
    scattered_adam_rate: float = 0.0
    version: int = 0  # PROFILE_VERSION of a measured profile (published: 0)
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
        return self.peak_flops * self.mfu * self._share(ranks_per_node)

    def _share(self, ranks_per_node: int) -> float:
        """Of this profile's per-rank rates, the part a rank gets (CPU: time-sharing)."""
        return self.threads_per_rank(ranks_per_node) if self.device_is_host else 1.0

    def gemm_efficiency(self, flops: float) -> float:
        """One GEMM's fraction of peak (`gemm_curve`, linear in log FLOPs, clamped)."""
        curve = sorted(self.gemm_curve)
        if not curve:
            return self.mfu
        x = math.log10(max(flops, 1.0))
        points = [(math.log10(f), e) for f, e in curve]
        if x <= points[0][0]:
            return points[0][1]
        for (x0, e0), (x1, e1) in zip(points, points[1:]):
            if x <= x1:
                return e0 + (e1 - e0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def gemm_seconds(self, flops: float, ranks_per_node: int) -> float:
        """One GEMM of `flops` FLOPs."""
        return flops / (self.peak_flops * self.gemm_efficiency(flops) *
                        self._share(ranks_per_node))

    def device_pass_seconds(self, nbytes: float, ranks_per_node: int, bw: float = 0.0) -> float:
        """Elementwise passes moving `nbytes` (read + write) through device memory; `bw` a
        measured rate of the op (CPU profile) instead of the memory's."""
        rate = bw or self.memory_bw * (1.0 if self.device_is_host else
                                       self.elementwise_efficiency)
        return nbytes / (rate * self._share(ranks_per_node))

    def syncs_seconds(self, syncs: float) -> float:
        """`syncs` host syncs of the accelerator (none on the CPU: nothing to wait for)."""
        return 0.0 if self.device_is_host else syncs * self.host_sync_s

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

    def ring_seconds(self, bytes_: float, ranks: int, ranks_per_node: int,
                     factor: float = 2) -> float:
        """factor x bytes x (n-1)/n over the ring's bus bandwidth (`ring_busbw`): an
        all-reduce's ring (factor 2), or one half of it (1)."""
        if ranks <= 1 or bytes_ == 0:
            return 0.0
        return factor * bytes_ * (ranks - 1) / ranks / self.ring_busbw(ranks, ranks_per_node)

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
        """One rank's copy writing `nbytes` into newly allocated buffers of `buffer_bytes`
        each (default: one buffer): the accelerator's memory (its caching allocator); on
        the CPU profile, fresh pages with their page faults for buffers over glibc's mmap
        threshold, the heap's reused pages under it."""
        size = nbytes if buffer_bytes is None else buffer_bytes
        if self.alloc_copy_bw and size > MMAP_THRESHOLD:
            return nbytes / (self.alloc_copy_bw * self._share(ranks_per_node))
        return self.device_pass_seconds(2 * nbytes, ranks_per_node)  # read + write

    def copy_bw(self, pinned: bool, ranks_per_node: int) -> float:
        """One rank's host<->device copy rate while every rank of the node copies."""
        link = self.pinned_copy_bw if pinned else self.pageable_copy_bw
        return min(link, self.dram_bw / ranks_per_node)

    def cpu_adam_seconds(self, elements_per_rank: float, ranks_per_node: int,
                         kernel: str = "deepspeed", scattered: bool = False) -> float:
        """Every rank of a node runs its CPU Adam at once (`node_cpu_seconds`): the row op
        (DeepSpeed's arithmetic on the rows in place, the table-dtype rows written in the
        same pass) or the torch kernel. `scattered`: a shard's rows are not consecutive in
        the master (the CPU profile's own-master fp32 tables)."""
        if kernel == "torch":
            rate, nbytes = self.torch_adam_rate, self.adam_bytes_per_element
        else:
            rate = self.scattered_adam_rate if scattered and self.scattered_adam_rate \
                else self.cpu_adam_rate
            nbytes = self.row_adam_bytes_per_element
        return self.node_cpu_seconds(elements_per_rank, rate, nbytes, ranks_per_node)

    def node_cpu_seconds(self, elements: float, per_core_rate: float, bytes_per_element: float,
                         ranks_per_node: int) -> float:
        """A rank's CPU work while every rank of its node runs the same: its cores at
        `per_core_rate` (x NODE_CORE_SPEED on a GPU node), or its share of the node's
        DRAM at `bytes_per_element`, whichever is slower. The CPU profile's rates were
        measured with every core busy on DRAM-sized tensors: they hold both limits."""
        if self.device_is_host:
            return elements / (per_core_rate * self.threads_per_rank(ranks_per_node))
        compute = elements / (per_core_rate * NODE_CORE_SPEED *
                              self.threads_per_rank(ranks_per_node))
        memory = elements * bytes_per_element / self.node_share(self.dram_bw, ranks_per_node)
        return max(compute, memory)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _gpu(name: str, memory_bw: float, memory_bytes: float) -> Hardware:
    return Hardware(
        name=name, peak_flops=989e12, memory_bw=memory_bw,
        memory_bytes=memory_bytes, nvlink_bw=450 * GB, nic_bw=50 * GB, nics_per_node=8,
        pinned_copy_bw=55 * GB, pageable_copy_bw=20 * GB,
        dram_bw=0.7 * 2 * 8 * 38.4 * GB,  # 2 sockets x 8 channels x DDR5-4800
        gather_bw=0.7 * 2 * 8 * 38.4 * GB / 2,  # a gather reads and writes
        # CPU Adam per core (assumed, about this machine's one-core rate with every core
        # busy; DRAM binds first, `node_cpu_seconds`), 2 x 56 cores; the torch kernel
        # several times slower (ZeRO-Offload paper: CPU-Adam is 5-7x PyTorch's CPU Adam).
        cpu_adam_rate=1.0e9, torch_adam_rate=0.08e9, cores=112, mfu=0.37)


PUBLISHED = {"h100": _gpu("h100", 3.35e12, 80e9), "h200": _gpu("h200", 4.8e12, 141e9)}
NAMES = (*PUBLISHED, "cpu")


def detect(query=None) -> tuple[str | None, str]:
    """This machine's GPU as a profile name, and what `nvidia-smi` said of it: (name, said),
    or (None, why not) when it has no GPU or one without a profile. `query()` returns
    nvidia-smi's lines (for tests)."""
    try:
        lines = (query or _nvidia_smi)()
    except (OSError, subprocess.SubprocessError):
        return None, "no GPU here (nvidia-smi did not run)"
    names = sorted({line.strip() for line in lines if line.strip()})
    if not names:
        return None, "no GPU here (nvidia-smi lists none)"
    said = f"nvidia-smi: {', '.join(names)}"
    profiles = {name for name in PUBLISHED for gpu in names if name in gpu.lower()}
    if len(profiles) != 1:
        return None, f"{said}, which has no profile of its own"
    return profiles.pop(), said


def load_detected(name: str, query=None, naming: str = "") -> Hardware:
    """`load`, where "auto" is the profile of this machine's GPU (`detect`; `query`: the
    GPUs' names from elsewhere). `naming`: where else the profile can be named."""
    if name != "auto":
        return load(name)
    found, said = detect(query)
    if found is None:
        raise UserError(f"--hardware auto: {said}: name the GPUs' profile "
                        f"({', '.join(PUBLISHED)}){naming}")
    return load(found)


def _nvidia_smi() -> list[str]:
    return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()


def load(name: str, cache_dir: Path = CACHE_DIR) -> Hardware:
    """A profile by name, or from a profile file (a name ending in .json: the refit an
    acceptance run writes, docs/acceptance.md). `cpu`: this machine's measured constants,
    from the cache that `python -m megatron_stem.planning.calibrate` writes (never measured
    here: a missing or outdated profile is a UserError saying how to make it). A GPU
    profile refit on a real GPU (`<name>.json` in the cache folder) takes precedence over
    the published numbers."""
    if name.endswith(".json"):
        if not Path(name).is_file():
            raise UserError(f"--hardware: {name}: no such profile file")
        return read(Path(name))
    if name not in NAMES:
        raise UserError(f"--hardware: unknown profile {name!r} (choose from "
                        f"{', '.join(NAMES)}, or a profile file <name>.json)")
    path = cache_dir / f"{name}.json"
    if name == "cpu":
        if not path.is_file():
            raise UserError(f"no cpu profile at {path}: measure this machine first with "
                            f"`{MEASURE_COMMAND}` (3-4 minutes)")
        hw = read(path)
        if hw.version != PROFILE_VERSION:
            raise UserError(f"{path}: measured by an older calibration (version "
                            f"{hw.version}, this one is {PROFILE_VERSION}); measure again with "
                            f"`{MEASURE_COMMAND}` (3-4 minutes)")
        return hw
    return read(path) if path.is_file() else PUBLISHED[name]


def read(path: Path) -> Hardware:
    try:
        data = json.loads(Path(path).read_text())
        data["gemm_curve"] = tuple(tuple(p) for p in data.get("gemm_curve", GEMM_CURVE))
        return Hardware(**data)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a hardware profile ({e}); delete it and measure again "
                        f"(`{MEASURE_COMMAND}`)") from None


def save(hw: Hardware, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hw.to_json())
