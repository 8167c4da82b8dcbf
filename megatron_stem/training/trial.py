"""A trial of a recipe: the trainer's first steps, read back from its log as figures (the
acceptance run's trainer stages, docs/acceptance.md).

    python -m megatron_stem.training.trial figures --log LOG --steps N --out F.json \
        --recipe R [overrides]
    python -m megatron_stem.training.trial checkpoint --uninterrupted A.log --resumed B.log \
        --step K --out F.json --recipe R [overrides]
    python -m megatron_stem.training.trial stop --log LOG --exit-code RC --markers PREFIX \
        --nodes N --out F.json

The trainer runs unmodified (`python -m megatron_stem.train ... --stop-after N`, launched
by the acceptance run on every rank: `trial_args` in slurm/acceptance.sh) with `train.steps`
a tenth and one beyond the trial's steps (it builds the data of those samples only, and
its schedule does not end inside the trial), no save or evaluation due, a line every step. This module reads what
rank 0 printed:

* `figures`: tokens/s, the step's split (forward/backward, backbone step, tables, exposed
  tables), MFU (the trainer's, as the field counts it; computed the same way on a CPU, where
  the trainer logs none), each the median over the second half of the steps (the first
  ones include warm-up); the memory once the model was built, before the first step and
  at the step's peak (the most over that half); the loss at the first and last steps.
  Fails (exit 1) when the trainer stopped short or the loss did not fall.
* `checkpoint`: a run that saved at step K in the background and went on (A) against one
  resumed from that save (B): the step after K has the same loss in both (bit for bit: the
  resumed state is the saved one), with the time A's step waited for the save, how long it
  was written, and how long B's reading took and the most bytes a rank read.
* `stop`: SIGUSR1 during a run: the ranks saved a checkpoint at the step they were in and
  stopped for a requeue (each node's marker, `$STEM_STOP_MARKER.<host>`, and the
  launcher's exit code 0: what slurm/launch.sh requeues on).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from megatron_stem.runtime.errors import UserError, cli

NUMBER = r"([\d,]+(?:\.\d+)?)"
# training/metrics.py's step line (a CPU's has no MFU; host tables add their figures)
STEP = re.compile(
    rf"^step (\d+)/\d+ \| loss {NUMBER} \|.*\| step {NUMBER} ms \(fwd/bwd {NUMBER}, "
    rf"backbone {NUMBER}, tables {NUMBER}, exposed tables {NUMBER}\) \| {NUMBER} tok/s"
    rf" \([^)]*\)(?: \| MFU {NUMBER}%)?.*\| peak mem {NUMBER} GB", re.M)
# metrics.py's first line, with checkpointer.py's origin
START = re.compile(rf"^model: .* \| world (\d+) = .* \| (.*) \| memory {NUMBER} GB for the "
                   rf"model, {NUMBER} GB before the first step$", re.M)
READ = re.compile(rf"\(read in {NUMBER} s, at most {NUMBER} GB by a rank\)")
# checkpointer.py's line of a save committed
SAVED = re.compile(rf"^step (\d+) \| saved (\S+) \((?:the step waited {NUMBER} s; written in "
                   rf"the background, committed {NUMBER} s later|in {NUMBER} s)\)$", re.M)
STOPPED = re.compile(r"^step (\d+) \| stop signal: checkpoint saved, exiting for requeue$",
                     re.M)
SPLIT = ("forward_backward", "backbone_step", "tables_step", "tables_exposed")


def _number(text: str | None) -> float | None:
    return None if text is None else float(text.replace(",", ""))


def steps_of(log: str) -> list[dict]:
    """Every step line's figures, in order."""
    out = []
    for m in STEP.finditer(log):
        step, loss, step_ms, *split, tok_s, mfu, memory = (_number(g) for g in m.groups())
        out.append({"step": int(step), "loss": loss, "tokens_per_s": tok_s,
                    "mfu": None if mfu is None else mfu / 100, "peak_memory_gb": memory,
                    "step_ms": step_ms, "split_ms": dict(zip(SPLIT, split))})
    return out


def start_of(log: str) -> dict:
    """The first line's world size, origin, memory once the model was built and before
    the first step and, when it started from a checkpoint, how long reading it took and
    the most a rank read."""
    m = START.search(log)
    if m is None:
        return {}
    out = {"world": int(m[1]), "origin": m[2], "model_memory_gb": _number(m[3]),
           "state_memory_gb": _number(m[4])}
    read = READ.search(m[2])
    if read:
        out.update(read_s=_number(read[1]), read_gb_per_rank=_number(read[2]))
    return out


def saves_of(log: str) -> dict[int, dict]:
    """{step: {"path", "waited_s", "committed_after_s"}} of every save committed (a save
    written by the step itself: waited_s is its whole time, committed_after_s 0)."""
    out = {}
    for m in SAVED.finditer(log):
        waited, later, whole = (_number(g) for g in m.groups()[2:])
        out[int(m[1])] = {"path": m[2], "waited_s": whole if waited is None else waited,
                          "committed_after_s": 0.0 if later is None else later}
    return out


def _median(rows: list[dict], key: str, part: str | None = None) -> float | None:
    values = [(r[key] if part is None else r[key][part]) for r in rows]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def figures(log: str, recipe, steps: int) -> dict:
    """A trial's figures from its log (`recipe`: as the trainer ran it; the module
    docstring)."""
    from megatron_stem.config.table_layout import TableLayout
    from megatron_stem.model.accounting import mfu
    from megatron_stem.training.batches import Samples

    lines, start = steps_of(log), start_of(log)
    asked = {"asked_steps": recipe.train.steps,
             "asked_samples": Samples.of(recipe, data_parallel=1).train,
             "tokens_per_step": recipe.train.global_batch_size * recipe.model.seq_length,
             "tables": str(TableLayout.of(recipe)) if recipe.model.is_stem else None,
             "kernel": recipe.optimizer.tables.kernel, **start}
    if not lines:
        return {"steps": 0, "reached": False, **asked}
    steady = lines[len(lines) // 2:]  # the second half: past the warm-up
    tok_s = _median(steady, "tokens_per_s")
    measured_mfu = _median(steady, "mfu")
    if measured_mfu is None:  # a CPU: the trainer logs MFU on GPUs only
        measured_mfu = mfu(tok_s, recipe.model, recipe.train.peak_flops, start.get("world", 1))
    first, last = lines[0], lines[-1]
    return {"steps": last["step"], "reached": last["step"] >= steps, "tokens_per_s": tok_s,
            "mfu": measured_mfu, "step_ms": _median(steady, "step_ms"),
            "split_ms": {part: _median(steady, "split_ms", part) for part in SPLIT},
            "peak_memory_gb": max(r["peak_memory_gb"] for r in steady),
            "loss_first": first["loss"], "loss_last": last["loss"],
            "loss_falls": last["loss"] < first["loss"], **asked}


def checkpoint_figures(uninterrupted: str, resumed: str, step: int) -> dict:
    """The save of step `step - 1` in run A, and run B resumed from it, at step `step`."""
    saved = saves_of(uninterrupted).get(step - 1)
    a = {r["step"]: r["loss"] for r in steps_of(uninterrupted)}
    b = {r["step"]: r["loss"] for r in steps_of(resumed)}
    start = start_of(resumed)
    out = {"step": step, "loss_uninterrupted": a.get(step), "loss_resumed": b.get(step),
           "saved": saved is not None,
           "resumed_from": start.get("origin", "").startswith("resuming from "),
           "waited_s": saved and saved["waited_s"],
           "committed_after_s": saved and saved["committed_after_s"],
           "resume_s": start.get("read_s"), "read_gb_per_rank": start.get("read_gb_per_rank")}
    out["loss_equal"] = out["loss_resumed"] is not None and \
        out["loss_resumed"] == out["loss_uninterrupted"]
    return out


def stop_figures(log: str, exit_code: int, markers: list[Path], nodes: int) -> dict:
    """SIGUSR1's outcome: the step the ranks stopped at, its checkpoint, every node's
    marker and the launcher's exit code (0: stopped to be requeued)."""
    stopped = STOPPED.search(log)
    step = int(stopped[1]) if stopped else None
    saved = saves_of(log).get(step) if step is not None else None
    return {"stopped_at": step, "saved": saved is not None,
            "save_s": saved and saved["waited_s"], "exit_code": exit_code,
            "markers": sorted(p.name for p in markers), "nodes": nodes,
            "requeue": stopped is not None and saved is not None and exit_code == 0
            and len(markers) == nodes}


def _write(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("figures", help="a trial's figures")
    f.add_argument("--log", required=True)
    f.add_argument("--steps", type=int, required=True)
    f.add_argument("--recipe", required=True)
    f.add_argument("--no-loss-check", action="store_true",
                   help="succeed whether the loss falls or not (a few steps)")
    f.add_argument("overrides", nargs="*")
    c = sub.add_parser("checkpoint", help="a save in the background and a resume from it")
    c.add_argument("--uninterrupted", required=True)
    c.add_argument("--resumed", required=True)
    c.add_argument("--step", type=int, required=True, help="the step after the save")
    c.add_argument("--recipe", required=True)
    c.add_argument("overrides", nargs="*")
    s = sub.add_parser("stop", help="SIGUSR1: save, stop, requeue")
    s.add_argument("--log", required=True)
    s.add_argument("--exit-code", type=int, required=True)
    s.add_argument("--markers", required=True, help="$STEM_STOP_MARKER of the run")
    s.add_argument("--nodes", type=int, required=True)
    for p in (f, c, s):
        p.add_argument("--out", required=True, help="where to write the figures (JSON)")
    args = ap.parse_args(argv)
    if args.what == "figures":
        from megatron_stem.config import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        result = figures(_read(args.log), recipe, args.steps)
        _write(args.out, {**result, "recipe": args.recipe, "overrides": args.overrides})
        return 0 if result["reached"] and (args.no_loss_check or result["loss_falls"]) else 1
    if args.what == "checkpoint":
        result = checkpoint_figures(_read(args.uninterrupted), _read(args.resumed), args.step)
        _write(args.out, {**result, "recipe": args.recipe, "overrides": args.overrides})
        return 0 if result["saved"] and result["resumed_from"] and result["loss_equal"] else 1
    marker = Path(args.markers)
    markers = sorted(marker.parent.glob(f"{marker.name}.*"))
    result = stop_figures(_read(args.log), args.exit_code, markers, args.nodes)
    _write(args.out, result)
    return 0 if result["requeue"] else 1


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as e:
        raise UserError(f"{path}: cannot read the trainer's log ({e.strerror})") from None


if __name__ == "__main__":
    sys.exit(main())
