"""The real trainer (`python -m megatron_stem.train`) for a fixed number of steps, and its
figures: one stage of bench/gpu/run_all.sh.

    python bench/gpu/trainer.py --recipe recipes/stem_1b.yaml --steps 30 --log-every 5 \
        --figures stem.json [section.field=value ...]

The trainer runs unmodified, its step count set a tenth beyond `--steps` (`asked_steps`:
it builds the data for those steps' samples only, `asked_samples`), its checkpoint and
validation intervals beyond that (none falls due: a 1B-shaped STEM model's checkpoint is
tens of GB); once it has logged step `--steps` it is stopped (SIGKILL: SIGTERM would
save). Its log lines
give the figures: tokens/s and the step's split over the last logged interval (the first
ones include warm-up), MFU (the trainer's, as the field counts it: 6 x active parameters
plus attention per token, against `train.peak_flops`; computed the same way on a CPU, where
the trainer logs none), peak memory, and the loss at the first and last logged steps.
Exits 1 when the trainer stopped before step `--steps` or the loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

NUMBER = r"([\d,]+(?:\.\d+)?)"
LINE = re.compile(
    rf"^step (\d+)/\d+ \| loss {NUMBER} \|.*\| step {NUMBER} ms \(fwd/bwd {NUMBER}, "
    rf"backbone {NUMBER}, tables {NUMBER}, exposed tables {NUMBER}\) \| {NUMBER} tok/s"
    rf" \([^)]*\)(?: \| MFU {NUMBER}%)?.*\| peak mem {NUMBER} GB")
FAR = 1_000_000  # save and eval intervals that never fall due


def _number(text: str | None) -> float | None:
    return None if text is None else float(text.replace(",", ""))


def parse(line: str) -> dict | None:
    """A trainer step line's figures, or None for any other line."""
    m = LINE.match(line)
    if m is None:
        return None
    step, loss, step_ms, fwd, backbone, tables, exposed, tok_s, mfu, memory = (
        _number(g) for g in m.groups())
    return {"step": int(step), "loss": loss, "tokens_per_s": tok_s,
            "mfu": None if mfu is None else mfu / 100, "peak_memory_gb": memory,
            "step_ms": step_ms, "split_ms": {"forward_backward": fwd, "backbone_step": backbone,
                                             "tables_step": tables, "tables_exposed": exposed}}


def asked_steps(steps: int) -> int:
    """The trainer's `train.steps` for a stage of `steps`: a tenth more (rounded down), so
    that step `steps` is not its last (the last step saves and evaluates)."""
    return steps + steps // 10


def figures(lines: list[dict], recipe, steps: int) -> dict:
    """The stage's figures from the step lines it logged (`recipe`: as the trainer ran it)."""
    from megatron_stem.model.accounting import mfu
    from megatron_stem.config.table_layout import TableLayout
    from megatron_stem.training.batches import Samples

    asked = {"asked_steps": recipe.train.steps,
             "asked_samples": Samples.of(recipe, data_parallel=1).train}
    if not lines:
        return {"steps": 0, **asked}
    first, last = lines[0], lines[-1]
    if last["mfu"] is None:  # a CPU: the trainer logs MFU on GPUs only
        last["mfu"] = mfu(last["tokens_per_s"], recipe.model, recipe.train.peak_flops, 1)
    return {"steps": last["step"], "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"],
            "peak_memory_gb": last["peak_memory_gb"], "step_ms": last["step_ms"],
            "split_ms": last["split_ms"], "loss_first": first["loss"],
            "loss_last": last["loss"], "loss_falls": last["loss"] < first["loss"],
            "tokens_per_step": recipe.train.global_batch_size * recipe.model.seq_length,
            "tables": str(TableLayout.of(recipe)) if recipe.model.stem_layers != "none" else None,
            "kernel": recipe.optimizer.tables.kernel, "torch": metadata.version("torch"),
            "reached": last["step"] >= steps, **asked}


def stage_overrides(steps: int, log_every: int) -> list[str]:
    """What the stage sets besides the recipe's overrides (the module docstring)."""
    return [f"train.steps={asked_steps(steps)}", f"train.save_interval={FAR}",
            f"train.eval_interval={FAR}", f"train.log_interval={log_every}"]


def run(recipe_path: str, overrides: list[str], steps: int, log) -> list[dict]:
    """Run the trainer with `overrides` until it logs step `steps`; its step lines'
    figures."""
    trainer = subprocess.Popen(
        [sys.executable, "-m", "megatron_stem.train", "--recipe", recipe_path, *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True)
    lines = []
    try:
        for line in trainer.stdout:
            log.write(line)
            log.flush()
            figures_of_line = parse(line)
            if figures_of_line is not None:
                lines.append(figures_of_line)
                if figures_of_line["step"] >= steps:
                    break
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--figures", required=True, help="where to write the figures (JSON)")
    ap.add_argument("--log", help="the trainer's output (default: <figures>.log)")
    ap.add_argument("--no-loss-check", action="store_true",
                    help="succeed whether the loss falls or not (a few steps)")
    ap.add_argument("overrides", nargs="*", help="section.field=value, as the trainer takes")
    args = ap.parse_args(argv)
    # `timeout` stops this stage with SIGTERM: the `finally` below then stops the trainer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from megatron_stem.config import load_recipe

    # a step line at step `--steps` itself
    overrides = args.overrides + stage_overrides(args.steps,
                                                 math.gcd(args.log_every, args.steps))
    recipe = load_recipe(args.recipe, overrides)
    log_path = Path(args.log or Path(args.figures).with_suffix(".log"))
    with open(log_path, "w") as log:
        lines = run(args.recipe, overrides, args.steps, log)
    result = figures(lines, recipe, args.steps)
    Path(args.figures).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result.get("reached") and (args.no_loss_check or result["loss_falls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
