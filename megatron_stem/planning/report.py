"""The planner's printout: component tables, the ranking, the one-line verdict."""

from __future__ import annotations

from megatron_stem.planning.step import UNDER_BACKBONE_STEP, UNDER_REDUCTION_TAIL, Plan, Workload
from megatron_stem.planning.traffic import RowCounts


def amount(value: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if value >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    if unit == "FLOP":
        return f"{value:.3g} FLOP"
    if unit == "sync":
        return f"{value:.0f} syncs"
    return f"{value / 1e6:.1f}M elem" if value >= 1e6 else f"{value:.0f} elem"


_OVERLAP_NOTE = {
    "compute": "serial",
    "reduction": "with the last backward (overlap_comm)",
    "backbone": "serial after backward",
    "staging": "one micro-batch ahead of compute",
}


def components(title: str, p: Plan) -> list[str]:
    lines = [title, f"  {'component':<58}{'amount':>16}{'seconds':>10}  overlaps"]
    for c in p.components:
        note = _OVERLAP_NOTE.get(c.phase, "")
        if c.phase == "reduction" and c.resource == "mem":
            note = "serial (the hooks, in backward)"
        if c.phase == "sync":
            note = "serial, at the last backward"
        if c.phase == UNDER_BACKBONE_STEP:
            note = "under DeepSpeed's step"
        if c.phase == UNDER_REDUCTION_TAIL:
            note = "beside the backbone reduction's tail"
        if c.phase == "tables":
            note = {"none": "serial after backward",
                    "next_step": "with the next step; its rows first",
                    "backward": "with backward/backbone, pipelined per table",
                    "delayed": "with the next step (one step stale)"}[p.option.overlap]
        lines.append(f"  {c.name:<58}{amount(c.amount, c.unit):>16}{c.seconds:>10.4f}  {note}")
    lines.append(f"  {'backbone reduction: serial sum / exposed':<58}{'':>16}"
                 f"{p.seconds('reduction'):>10.4f}  exposed {p.exposed_reduction_s:.4f}")
    tables = p.table_seconds
    if tables:
        lines.append(f"  {'table path: serial sum / exposed':<58}{'':>16}{tables:>10.4f}  "
                     f"exposed {p.exposed_tables_s:.4f}")
    fit = "" if p.fits else f"  DOES NOT FIT: {p.why_not}"
    lines.append(f"  {'step':<58}{'':>16}{p.step_s:>10.4f}  MFU {p.mfu:.1%}{fit}")
    for name, value in p.counters.items():
        lines.append(f"  counter {name:<50}{value:>16,.0f}")
    return lines


def ranking(plans: list[Plan], dense: Plan, best: Plan) -> list[str]:
    fastest_exact = next((p for p in plans if p.fits and p.option.exact
                          and p.option.implemented), None)
    lines = ["ranking (per rank per step; * the fastest exact option the code has, > the one "
             "--choose best takes (CPU optimizer states)):",
             f"  {'':2}{'placement':<10}{'update':<7}{'partition':<11}{'overlap':<10}"
             f"{'optimizer':<12}{'step s':>9}{'vs dense':>9}{'MFU':>7}{'tables s':>10}"
             f"{'exposed s':>10}  notes"]
    for p in plans:
        o = p.option
        mark = ("*" if p is fastest_exact else " ") + (">" if p is best else " ")
        notes = [n for n in ("today's path" if o.today else "",
                             "" if o.implemented else "not in the code",
                             "" if o.exact else "not exact", "" if p.fits else p.why_not) if n]
        lines.append(f"  {mark}{o.placement:<10}{o.update:<7}{o.partition:<11}{o.overlap:<10}"
                     f"{o.optimizer:<12}{p.step_s:>9.4f}{p.step_s / dense.step_s:>9.3f}"
                     f"{p.mfu:>7.1%}{p.table_seconds:>10.4f}"
                     f"{p.exposed_tables_s:>10.4f}  {', '.join(notes)}")
    return lines


def workload_line(w: Workload, exponent: float) -> str:
    r: RowCounts = w.rows
    return (f"per rank per step: {w.tokens:,} tokens in {w.microbatches} micro-batches of "
            f"{w.tokens_per_microbatch:,}; {w.shape.tables} tables of {w.shape.rows:,} x "
            f"{w.shape.width:,}; distinct rows: rank {r.rank_rows:,}, union over DP{w.dp} "
            f"{r.union_rows:,}, owned {r.owned_rows:,}, staged {r.microbatch_rows:,} "
            f"(Zipf s={exponent:g} unless overridden)")


def verdict(stem: Plan, dense: Plan) -> str:
    return (f"predicted step time STEM {stem.step_s:.3f} s, dense {dense.step_s:.3f} s, "
            f"ratio {stem.step_s / dense.step_s:.2f}")
