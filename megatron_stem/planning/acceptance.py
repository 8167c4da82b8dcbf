"""The acceptance run's report: every measurement of the run next to what the step planner
predicted for it, a verdict, and for each failed check or stage the one thing to do
(docs/acceptance.md); and the hardware profile refit from the measurements.

    python -m megatron_stem.planning.acceptance --work WORK --out REPORT \
        --nodes 4 --gpus-per-node 8 --hardware auto

reads what the stages left in WORK (`stages.jsonl`: each stage's status; `environment/`,
`collectives.json`, the trials' figures `<stage>.json`, the refit of the single-GPU
constants `refit.json`) and writes to REPORT:

* `summary.json`: the verdict, the stages, every check (measured, predicted, ratio,
  verdict, fix; `predicted_refit`: the prediction with the refit profile), the nodes'
  environments, the refit profile's changes;
* `summary.md`: the same as tables;
* `measured_vs_predicted.png`: each check's measured value against its prediction;
* `<profile>.json` (h100.json, h200.json): the refit profile (planning/refit.py), for
  `tools/plan_step.py --profile` and `python -m megatron_stem.train --check --hardware`.

A measured figure is judged by its ratio to the prediction: within `TOLERANCE` (25%) of it,
as predicted; worse by more, failed; better by more, better than predicted (the profile
is pessimistic there: the refit takes it up). A part of the step under `SMALL` of it, in
both, is not judged.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_stem.config import load_recipe
from megatron_stem.planning import hardware, memory, refit
from megatron_stem.planning.budget import checkpoint_bytes, configured_plan
from megatron_stem.planning.collectives import Collective, predicted_seconds
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.workload import Cluster, workload
from megatron_stem.runtime.durable import write_durably
from megatron_stem.runtime.errors import cli

TOLERANCE = 0.25
SMALL = 0.05
GIB = 2 ** 30  # the trainer's "GB" (training/metrics.py) are GiB
AS_PREDICTED, BETTER, WORSE = "as predicted", "better than predicted", "worse than predicted"
OK, FAILED, SMALL_PART, UNPREDICTED = "ok", "failed", "not judged (small)", "not predicted"
TRIALS = ("train_dense", "train_stem", "long_context")

TROUBLESHOOTING = "docs/troubleshooting.md"
# What to do when a stage did not finish: one thing, then its log.
STAGE_FIXES = {
    "environment": "the nodes' Python lacks what the run needs (the log names it): set "
                   "STEM_CONTAINER or STEM_VENV (docs/install.md)",
    "data": "the synthetic tokens could not be written: check the work folder's free space",
    "smoke": "a GPU-only path gave wrong numbers on this GPU (the log's FAIL lines): do not "
             "train until it passes; report it with the log",
    "collectives": "a collective failed or hung: rerun with NCCL_DEBUG=INFO "
                   f"({TROUBLESHOOTING}#nccl-and-infiniband)",
    "train_dense": "the trainer stopped (the log's last lines say why): `python -m "
                   "megatron_stem.train --recipe <recipe> --check --nodes N --gpus-per-node G` "
                   f"finds most causes ({TROUBLESHOOTING}#the-job-stops-before-training)",
    "checkpoint": "saving or resuming failed on the run's filesystem (the log): "
                  f"{TROUBLESHOOTING}#a-damaged-checkpoint",
    "stop": "SIGUSR1 did not end in a checkpoint and a requeue (the log): "
            "docs/slurm.md#who-does-what-with-a-stop-signal; a save that needs longer: "
            "STEM_SHUTDOWN_TIMEOUT",
    "refit": "the single-GPU constants could not be measured (the log); the profile "
             "refits the rest from the trials",
}
STAGE_FIXES["train_stem"] = STAGE_FIXES["long_context"] = STAGE_FIXES["train_dense"]
TIMEOUT_FIX = "it ran out of its limit: the log shows where it stopped (a cold JIT build: " \
              "`python tools/build_ops.py` first; a slow filesystem)"
# What to do about a failed check, by its key.
FIXES = {
    "nodes_alike": "run the job on nodes of one kind (sbatch --constraint or --nodelist): "
                   "the table of nodes says how they differ",
    "gpus": "the nodes have fewer GPUs than the job runs ranks on: ask for whole nodes "
            "(--gpus-per-node, --exclusive)",
    "infiniband": "a node has no active InfiniBand port: NCCL falls back to TCP across "
                  "nodes; set NCCL_IB_HCA in STEM_SETUP, or ask the cluster's admins "
                  f"({TROUBLESHOOTING}#nccl-and-infiniband)",
    "ops": "the JIT ops did not build in time, so the tables ran the torch kernel: run "
           "`python tools/build_ops.py` once in the job's environment",
    "node": "NVLink between a node's GPUs is slower than planned: `nvidia-smi topo -m` "
            "should show NV links; unset NCCL_P2P_DISABLE and NCCL_P2P_LEVEL",
    "world": "the network across nodes is slower than planned: NCCL_DEBUG=INFO should show "
             "NET/IB on every NIC; set NCCL_IB_HCA and NCCL_SOCKET_IFNAME in STEM_SETUP "
             f"({TROUBLESHOOTING}#nccl-and-infiniband)",
    "compute": "the forward/backward is slower than planned: check the GPUs' clocks "
               "(`nvidia-smi -q -d PERFORMANCE`: no power or thermal slowdown), then plan "
               "and budget with the refit profile (--hardware <profile>.json)",
    "backbone": "the backbone's gradient reduction and step are slower than planned: look "
                "at the collectives across nodes first",
    "tables": "the tables' update is not hidden as planned: `python tools/plan_step.py "
              "--recipe <recipe> --choose best --profile <profile>.json` names the table "
              "option to set",
    "memory": "more memory than planned: lower train.micro_batch_size, or set "
              "parallel.recompute=selective and parallel.loss_chunk_tokens "
              "(docs/training.md#the-32k-stage-on-80-gb)",
    "loss": "the loss did not fall over the trial's steps: report it with the trial's log",
    "ratio": "STEM's step costs more over dense than planned: see the STEM trial's exposed "
             "tables and the collectives",
    "resume": "the resumed run's next loss differs from the uninterrupted run's: resume is "
              "not exact here; report it with the checkpoint stage's log",
    "save": "the step waited longer for its save than a copy to host memory takes: check "
            "train.async_save is on and the nodes' free host memory",
    "read": "a rank read more of the checkpoint than its share: report it with the "
            "checkpoint stage's log",
    "requeue": "the stop did not end in a checkpoint and a requeue exit: "
               "docs/slurm.md#who-does-what-with-a-stop-signal",
}


@dataclass
class Check:
    """One measured figure of a stage against its prediction (or a yes/no fact)."""

    stage: str
    name: str
    key: str  # what it is about: its fix in FIXES
    unit: str
    measured: float | bool | None
    predicted: float | None = None
    higher_is_better: bool = False
    whole: float | None = None  # what it is a part of (the step's ms, the peak's GB), in
    # its unit: a part under SMALL of it is not judged
    verdict: str = ""
    fix: str = ""
    predicted_refit: float | None = None

    @property
    def ratio(self) -> float | None:
        if isinstance(self.measured, bool) or self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted

    def judge(self) -> "Check":
        if isinstance(self.measured, bool):
            self.verdict = OK if self.measured else FAILED
        elif self.measured is None:
            self.verdict = FAILED
        elif not self.predicted:
            self.verdict = UNPREDICTED
        elif self.whole and max(self.measured, self.predicted) < SMALL * self.whole:
            self.verdict = SMALL_PART
        else:
            r = self.ratio if not self.higher_is_better else 1 / self.ratio
            self.verdict = WORSE if r > 1 + TOLERANCE else BETTER if r < 1 / (1 + TOLERANCE) \
                else AS_PREDICTED
        self.fix = FIXES[self.key] if self.failed else ""
        return self

    @property
    def failed(self) -> bool:
        return self.verdict in (FAILED, WORSE)


# -- predictions ----------------------------------------------------------------------


def trial_predictions(recipe, cluster: Cluster, hw: Hardware) -> dict:
    """What the planner predicts a trial of `recipe` logs: the step and its parts (ms),
    tokens/s, MFU, and the memory once the model is built (its weights, the tables on the
    device), before the first step (with the optimizer's states) and at the step's peak
    (GB)."""
    p = configured_plan(recipe, cluster, hw)
    mem = memory.memory_per_gpu(recipe, cluster, hw)
    tokens = recipe.train.global_batch_size * recipe.model.seq_length
    state = sum(mem.total(kind) for kind in ("parameters", "optimizer", "tables"))
    model = mem.total("parameters") + sum(p.bytes for p in mem.parts
                                          if p.name == memory.TABLE_WEIGHTS)
    return {"step_ms": p.step_s * 1e3, "tokens_per_s": tokens / p.step_s, "mfu": p.mfu,
            "forward_backward_ms": p.seconds("compute") * 1e3,
            "backbone_ms": (p.exposed_reduction_s + p.seconds("backbone")) * 1e3,
            "tables_exposed_ms": p.exposed_tables_s * 1e3,
            "model_gb": model / 1e9, "state_gb": state / 1e9, "peak_gb": mem.total() / 1e9}


def _recipe(figures: dict):
    return load_recipe(figures["recipe"], figures.get("overrides", []))


# -- checks -----------------------------------------------------------------------------


def environment_checks(records: list[dict], cluster: Cluster) -> list[Check]:
    """The nodes: alike, with the GPUs the job runs on, InfiniBand across nodes, the ops."""
    if not records:
        return []

    def kind(r):
        return tuple(r.get(k) for k in ("gpu", "gpus", "driver", "cuda", "nccl", "torch",
                                        "megatron-core", "deepspeed"))
    out = [Check("environment", f"nodes reported: {len(records)} of {cluster.nodes}", "gpus",
                 "", len(records) == cluster.nodes),
           Check("environment", "nodes alike (GPU, driver, CUDA, NCCL, versions)",
                 "nodes_alike", "", len({kind(r) for r in records}) == 1)]
    if any(r.get("gpus") for r in records):
        out.append(Check("environment", f"{cluster.gpus_per_node} GPUs on every node", "gpus",
                         "", all(r.get("gpus", 0) >= cluster.gpus_per_node for r in records)))
        if cluster.nodes > 1:
            active = [r for r in records if any(p.get("state", "").endswith("ACTIVE")
                                                for p in r.get("infiniband", []))]
            out.append(Check("environment", "an active InfiniBand port on every node",
                             "infiniband", "", len(active) == len(records)))
    out.append(Check("environment", "JIT ops built (else the torch kernel)", "ops", "",
                     all(r.get("ops_built") for r in records)))
    return out


def collective_checks(found: dict, hw: Hardware) -> list[Check]:
    out = []
    per_node = found.get("gpus_per_node", 1)
    for c in found.get("collectives", []):
        coll = Collective(c["kind"], c["what"], c["bytes"])
        out.append(Check("collectives", f"{c['kind']} of {c['what']}, {c['ranks']} ranks "
                         f"({c['scope']})", c["scope"], "ms", c["seconds"] * 1e3,
                         predicted_seconds(coll, c["ranks"], min(c["ranks"], per_node), hw)
                         * 1e3))
    return out


def trial_checks(stage: str, figures: dict, cluster: Cluster, hw: Hardware) -> list[Check]:
    """A trainer trial's figures against the planner's predictions for its recipe."""
    p = trial_predictions(_recipe(figures), cluster, hw)
    split = figures.get("split_ms") or {}
    step = figures.get("step_ms")
    out = [Check(stage, "tokens/s", "compute", "tok/s", figures.get("tokens_per_s"),
                 p["tokens_per_s"], higher_is_better=True),
           Check(stage, "MFU", "compute", "%", _percent(figures.get("mfu")),
                 _percent(p["mfu"]), higher_is_better=True),
           Check(stage, "forward/backward", "compute", "ms", split.get("forward_backward"),
                 p["forward_backward_ms"], whole=step),
           Check(stage, "backbone reduction and step", "backbone", "ms",
                 split.get("backbone_step"), p["backbone_ms"], whole=step)]
    if figures.get("tables"):
        out.append(Check(stage, "tables on the step's path (exposed)", "tables", "ms",
                         split.get("tables_exposed"), p["tables_exposed_ms"], whole=step))
    # the peak's parts, as they come: the model built, the optimizer's states added before
    # the first step, the gradients and activations the step adds
    model, state, peak = (_gb(figures.get(f"{part}_memory_gb"))
                          for part in ("model", "state", "peak"))
    parts = (("memory: weights and device tables", model, p["model_gb"]),
             ("memory: optimizer states", _minus(state, model), p["state_gb"] - p["model_gb"]),
             ("memory: the step's gradients and activations", _minus(peak, state),
              p["peak_gb"] - p["state_gb"]))
    out += [Check(stage, name, "memory", "GB", measured, predicted, whole=p["peak_gb"])
            for name, measured, predicted in parts]
    out.append(Check(stage, "peak memory", "memory", "GB", peak, p["peak_gb"]))
    if stage != "long_context":
        out.append(Check(stage, "loss falls", "loss", "", bool(figures.get("loss_falls"))))
    return out


def ratio_check(dense: dict, stem: dict, cluster: Cluster, hw: Hardware) -> Check:
    """STEM's step over dense's, measured and predicted."""
    pd, ps = (trial_predictions(_recipe(f), cluster, hw) for f in (dense, stem))
    measured = stem["step_ms"] / dense["step_ms"] if stem.get("step_ms") and \
        dense.get("step_ms") else None
    return Check("train_stem", "STEM step / dense step", "ratio", "x", measured,
                 ps["step_ms"] / pd["step_ms"])


def checkpoint_checks(figures: dict, cluster: Cluster, hw: Hardware) -> list[Check]:
    """The background save and the resume: the next loss equal, the step's wait against a
    copy of the rank's share to host memory, the bytes a rank read against its share
    twice (its checksums, its part of the load)."""
    share = checkpoint_bytes(_recipe(figures)) / cluster.world
    copy_s = share / hw.copy_bw(False, cluster.gpus_per_node)
    read = figures.get("read_gb_per_rank")
    return [Check("checkpoint", "the resumed run's next loss equals the uninterrupted one's",
                  "resume", "", bool(figures.get("loss_equal"))),
            Check("checkpoint", "the step's wait for a background save", "save", "s",
                  figures.get("waited_s"), copy_s),
            Check("checkpoint", "bytes a rank read to resume", "read", "GB",
                  read, 2 * share / 1e9),
            Check("checkpoint", "resume (read and load)", "read", "s", figures.get("resume_s"))]


def stop_checks(figures: dict) -> list[Check]:
    return [Check("stop", "SIGUSR1: checkpoint saved, every node stopped for a requeue",
                  "requeue", "", bool(figures.get("requeue")))]


def all_checks(work: Path, cluster: Cluster, hw: Hardware) -> list[Check]:
    """Every check the stages' outputs allow (a stage that left nothing has none)."""
    fig = {name: _json(work / f"{name}.json") for name in
           (*TRIALS, "checkpoint", "stop", "collectives")}
    out = environment_checks(environment_records(work), cluster)
    if fig["collectives"]:
        out += collective_checks(fig["collectives"], hw)
    for stage in TRIALS:
        if fig[stage] and fig[stage].get("steps"):
            out += trial_checks(stage, fig[stage], cluster, hw)
    if fig["train_dense"] and fig["train_stem"]:
        out.append(ratio_check(fig["train_dense"], fig["train_stem"], cluster, hw))
    if fig["checkpoint"]:
        out += checkpoint_checks(fig["checkpoint"], cluster, hw)
    if fig["stop"]:
        out += stop_checks(fig["stop"])
    return [c.judge() for c in out]


# -- the refit ----------------------------------------------------------------------------


def refit_profile(work: Path, cluster: Cluster, hw: Hardware) -> Hardware:
    """`hw` (or the refit stage's single-GPU refit of it) with the compute fitted to the
    dense trial and the links to the collectives (planning/refit.py)."""
    base = hw
    measured = work / "refit.json"
    if measured.is_file():
        found = hardware.read(measured)
        base = found if found.name == hw.name else hw
    dense = _json(work / "train_dense.json")
    fwd_bwd = (dense.get("split_ms") or {}).get("forward_backward") if dense else None
    if fwd_bwd:
        w = workload(_recipe(dense), cluster)
        base = refit.fit_compute(base, w, cluster, fwd_bwd / 1e3)
    collectives = _json(work / "collectives.json") or {}
    all_reduces = [c for c in collectives.get("collectives", []) if c["kind"] == "all_reduce"]
    return refit.fit_links(base, all_reduces, cluster.gpus_per_node)


# -- the report -------------------------------------------------------------------------


def environment_records(work: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((work / "environment").glob("*.json"))]


def stage_records(work: Path) -> list[dict]:
    """Each stage's last record (a stage run twice: its second)."""
    path = work / "stages.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.is_file() else []
    last = {r["name"]: r for r in records}
    for r in last.values():
        r["fix"] = "" if r["status"] == "ok" else \
            (TIMEOUT_FIX if r["status"] == "timeout" else STAGE_FIXES.get(r["name"], "")) + \
            f"; its log: {work / 'logs' / (r['name'] + '.log')}"
    return list(last.values())


def profile_named(name: str, work: Path) -> Hardware:
    """The profile to predict with: a name, a file, or `auto`: the nodes' GPUs, as the
    environment stage recorded them (else nvidia-smi here)."""
    gpus = [r["gpu"] for r in environment_records(work) if r.get("gpu")] \
        if name == "auto" else None
    return hardware.load_detected(name, (lambda: gpus) if gpus else None,
                                  " with STEM_HARDWARE")


def report(work: Path, out: Path, cluster: Cluster, hw: Hardware) -> dict:
    """Write the report's files (the module docstring); its summary."""
    stages = stage_records(work)
    checks = all_checks(work, cluster, hw)
    fitted = refit_profile(work, cluster, hw)
    again = {(c.stage, c.name): c for c in all_checks(work, cluster, fitted)}
    for c in checks:
        c.predicted_refit = again[(c.stage, c.name)].predicted
    failed_stages = [s for s in stages if s["status"] != "ok"]
    failed = [c for c in checks if c.failed]
    summary = {
        "verdict": "pass" if stages and not failed_stages and not failed else "fail",
        "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "hardware": hw.name, "tolerance": TOLERANCE, "stages": stages,
        "checks": [{**asdict(c), "ratio": c.ratio} for c in checks],
        "to_do": [f"{s['name']}: {s['fix']}" for s in failed_stages] + to_do(failed),
        "environment": environment_records(work),
        "profile": {"file": f"{fitted.name}.json",
                    "changes": refit.changes(hw, fitted)}}
    out.mkdir(parents=True, exist_ok=True)
    hardware.save(fitted, out / f"{fitted.name}.json")
    write_durably(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_durably(out / "summary.md", markdown(summary))
    plot(checks, summary["verdict"], out / "measured_vs_predicted.png")
    return summary


def to_do(failed: list[Check]) -> list[str]:
    """One line per stage and fix: the failed checks it is about, then the fix."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for c in failed:
        grouped.setdefault((c.stage, c.fix), []).append(c.name)
    return [f"{stage}: {', '.join(names)}: {fix}" for (stage, fix), names in grouped.items()]


def _number(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if unit != "%" else f"{value:.1f}%"


def markdown(summary: dict) -> str:
    """The summary as Markdown tables."""
    lines = [f"# Acceptance run: {summary['verdict']}", "",
             f"{summary['nodes']} node(s) x {summary['gpus_per_node']} rank(s), predicted "
             f"with the {summary['hardware']} profile; a figure is as predicted within "
             f"{summary['tolerance']:.0%}.", "",
             "| stage | status | seconds | limit |", "|---|---|---:|---:|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['limit_s']} |"
              for s in summary["stages"]]
    lines += ["", "| stage | check | measured | predicted | ratio | verdict | refit predicts |",
              "|---|---|---:|---:|---:|---|---:|"]
    for c in summary["checks"]:
        figure = [_figure(c[k], c["unit"]) for k in ("measured", "predicted", "predicted_refit")]
        lines.append(f"| {c['stage']} | {c['name']} | {figure[0]} | {figure[1]} | "
                     f"{'-' if c['ratio'] is None else format(c['ratio'], '.2f')} | "
                     f"{c['verdict']} | {figure[2]} |")
    if summary["to_do"]:
        lines += ["", "## What to do", ""] + [f"- {line}" for line in summary["to_do"]]
    lines += ["", "## Nodes", "", "| host | GPU | GPUs | driver | CUDA | NCCL | torch | "
              "megatron-core | DeepSpeed | InfiniBand ports active | JIT ops |",
              "|---|---|---:|---|---|---|---|---|---|---:|---|"]
    for r in summary["environment"]:
        active = sum(p.get("state", "").endswith("ACTIVE") for p in r.get("infiniband", []))
        lines.append(f"| {r['host']} | {r.get('gpu') or 'none'} | {r.get('gpus', 0)} | "
                     f"{r.get('driver') or '-'} | {r.get('cuda') or '-'} | "
                     f"{r.get('nccl') or '-'} | {r.get('torch')} | {r.get('megatron-core')} | "
                     f"{r.get('deepspeed')} | {active} | "
                     f"{'built' if r.get('ops_built') else 'torch kernel'} |")
    changes = summary["profile"]["changes"]
    lines += ["", f"## The refit profile: {summary['profile']['file']}", ""]
    lines += [f"- `{k}`: {_short(a)} -> {_short(b)}" for k, (a, b) in changes.items()] or \
        ["- unchanged: nothing was measured that it fits"]
    return "\n".join(lines) + "\n"


def _figure(value, unit: str) -> str:
    """A value with its unit ("%" is _number's), "-" for none."""
    text = _number(value, unit)
    return f"{text} {unit}" if unit and unit != "%" and value is not None and \
        not isinstance(value, bool) else text


def _short(value) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def plot(checks: list[Check], verdict: str, path: Path) -> None:
    """Each check with a prediction as its measured / predicted ratio (log scale; a time's
    or memory's above 1 is worse, a rate's below 1), the tolerance band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {AS_PREDICTED: "tab:green", BETTER: "tab:blue", WORSE: "tab:red"}
    points = [c for c in checks if c.ratio]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.22 * max(len(points), 1)))
    ax.axvspan(1 / (1 + TOLERANCE), 1 + TOLERANCE, color="tab:green", alpha=0.12)
    ax.axvline(1.0, color="black", lw=0.8)
    for i, c in enumerate(reversed(points)):
        ax.scatter(c.ratio, i, color=colors.get(c.verdict, "tab:gray"), s=18, zorder=3)
    ax.set_yticks(range(len(points)))
    ax.set_yticklabels([f"{c.stage}: {c.name}" for c in reversed(points)], fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("measured / predicted (the step planner)")
    ax.set_title(f"acceptance run: {verdict} (shaded: within {TOLERANCE:.0%}; red: worse, "
                 "blue: better, gray: not judged)", fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=150)
    plt.close(fig)
    tmp.replace(path)


def _gb(gib: float | None) -> float | None:
    return None if gib is None else gib * GIB / 1e9


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--work", required=True, help="the stages' folder")
    ap.add_argument("--out", required=True, help="the report's folder")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    ap.add_argument("--hardware", default="auto",
                    help="the profile predicted with: h100, h200, a file, or auto (the nodes' "
                         "GPUs) (default: %(default)s)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    hw = profile_named(args.hardware, work)
    summary = report(work, Path(args.out), Cluster(args.nodes, args.gpus_per_node), hw)
    print(markdown(summary), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
