"""A hardware profile refit from what an acceptance run measured (docs/acceptance.md), so the
planner's next predictions start from the user's own cluster.

Starting from the profile the run was predicted with (or from its `calibrate --gpu` refit of
the single-GPU constants: CPU Adam, copies, DRAM, the GEMM curve), two things are fitted:

* the compute's efficiency: the achievable MFU and the GEMM curve scaled by one factor,
  found so that the planner's forward/backward of the dense trial equals the measured one
  (bisection: the parts priced by memory passes and syncs do not scale);
* the links: NVLink from the all-reduce over a node's GPUs, the NICs from the all-reduce
  over every rank (when the ring's bound is the NICs), each solved from the planner's ring
  formula (`Hardware.ring_busbw`) at the measured time less one call's latency.

What the run could not measure stays as it was; `changes` lists what moved.
"""

from __future__ import annotations

import dataclasses

from megatron_stem.planning.compute import compute_components
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.workload import Cluster, Workload


def scaled_compute(hw: Hardware, factor: float) -> Hardware:
    """`hw` with its achievable MFU and GEMM efficiencies times `factor` (at most 1)."""
    return dataclasses.replace(
        hw, mfu=min(1.0, hw.mfu * factor),
        gemm_curve=tuple((f, min(1.0, e * factor)) for f, e in hw.gemm_curve))


def compute_seconds(w: Workload, cluster: Cluster, hw: Hardware) -> float:
    return sum(c.seconds for c in compute_components(w, cluster, hw))


def fit_compute(hw: Hardware, w: Workload, cluster: Cluster, measured_s: float) -> Hardware:
    """`scaled_compute` by the factor at which the planner's forward/backward of `w` is
    `measured_s` (within 0.1%), clamped to efficiencies of at most 1."""
    low, high = 1e-4, 1.0 / max(hw.mfu, *(e for _, e in hw.gemm_curve), 1e-9)
    if compute_seconds(w, cluster, scaled_compute(hw, high)) >= measured_s:
        return scaled_compute(hw, high)  # slower than the fastest it may be: the ceiling
    for _ in range(60):
        mid = (low * high) ** 0.5
        if compute_seconds(w, cluster, scaled_compute(hw, mid)) > measured_s:
            low = mid
        else:
            high = mid
        if high / low < 1.001:
            break
    return scaled_compute(hw, (low * high) ** 0.5)


def fit_links(hw: Hardware, all_reduces: list[dict], gpus_per_node: int) -> Hardware:
    """NVLink and NIC bandwidths from all-reduces measured over a node's ranks (`scope`
    "node") and over every rank ("world"), as `collectives.py` records them."""
    fit = {}
    for c in all_reduces:
        seconds = c["seconds"] - hw.collective_latency
        ranks = c["ranks"]
        if seconds <= 0 or ranks < 2:
            continue
        link = 2 * c["bytes"] * (ranks - 1) / ranks / seconds / hw.collective_efficiency
        if c["scope"] == "node":
            fit["nvlink_bw"] = link
        elif ranks > gpus_per_node and hw.nics_per_node:
            g = gpus_per_node
            nvlink = fit.get("nvlink_bw", hw.nvlink_bw)
            if link < nvlink * g / max(g - 1, 1):  # the ring's bound is the NICs
                fit["nic_bw"] = link / hw.nics_per_node
    return dataclasses.replace(hw, **fit)


def changes(before: Hardware, after: Hardware) -> dict[str, tuple]:
    """{field: (before, after)} of the fields that moved."""
    old, new = dataclasses.asdict(before), dataclasses.asdict(after)
    return {k: (old[k], new[k]) for k in new if old[k] != new[k]}
