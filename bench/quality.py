"""The paper's quality comparison at sizes a CPU can train: dense and STEM 1/3, 1/2 and full
at two model sizes, on the same tokens, through the real trainer (torchrun, 2 ranks).

    nice -n 15 python bench/quality.py [--sizes 64x4,128x4] [--steps 600] [--docs]
        [--semantics official]    # the official STEM code's conventions: runs/quality_official
    python bench/quality.py --quick        # toy sizes, a few steps: the pipeline only

Every run trains `recipes/tiny_cpu.yaml` (its optimizer, batch, sequence length and seed)
at the size given, on the quickstart's tokenizer and token files (made as
`tools/quickstart.sh` makes them when they are missing): one seed and one data order, so
every model sees the same tokens in the same order. A size `DxL` is hidden size D and L
layers, d_ff = 3 D and heads of 32 with half as many key/value heads (128x4 is tiny_cpu's
own shape). Validation loss is the trainer's, every --eval-interval steps on one fixed set
of held-out sequences, read back from its TensorBoard scalars.

Each run is a folder `<out>/<size>/<variant>/` (the trainer's checkpoints, TensorBoard and
log); when it finishes, its `result.json` records the curve, the accounting and the CPU
time, and a rerun skips it. An interrupted run resumes from its last checkpoint. The report
(`quality.md`: the table; `quality.png`: the curves) goes to <out>, and with --docs also to
docs/quality.md (between its markers) and docs/quality.png.

Time is CPU time (user + system of the ranks, torchrun and start-up included): on a shared
machine wall time measures the neighbours. CPU s / ranks estimates the wall time alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_stem.model.accounting import account
from megatron_stem.config import load_recipe
from megatron_stem.runtime.errors import UserError, cli

ROOT = Path(__file__).resolve().parent.parent

RECIPE = "recipes/tiny_cpu.yaml"
HEAD_DIM = 32
# folder name -> (model.stem_layers, label); dense first: it is what the others are read against.
VARIANTS = {"dense": ("none", "dense"), "third": ("1/3", "STEM 1/3"),
            "half": ("1/2", "STEM 1/2"), "full": ("full", "STEM full")}
DOCS_PAGE, DOCS_PNG = ROOT / "docs" / "quality.md", ROOT / "docs" / "quality.png"
BEGIN, END = "<!-- bench/quality.py: begin -->", "<!-- bench/quality.py: end -->"
QUICK = {"sizes": "32x4,64x4", "steps": 20, "eval_interval": 10, "eval_iters": 2}
# --semantics: the training conventions every run follows (docs/design.md, "Fidelity to the
# paper's code"). "megatron": tiny_cpu.yaml's own; "official": the official STEM code's, as
# the paper's recipes train (its BOS documents aside: the runs share one set of token files).
SEMANTICS = {"megatron": [],
             "official": ["model.init=truncated_fan_in", "optimizer.clip_tables=separate",
                          "optimizer.decay_norms=true", "optimizer.warmup_from_zero=true",
                          "optimizer.min_lr_ratio=1.0e-6"]}


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int

    @property
    def name(self) -> str:
        return f"{self.hidden}x{self.layers}"

    def overrides(self) -> list[str]:
        heads = self.hidden // HEAD_DIM
        return [f"model.hidden_size={self.hidden}", f"model.num_layers={self.layers}",
                f"model.num_attention_heads={heads}",
                f"model.num_query_groups={max(1, heads // 2)}",
                f"model.ffn_hidden_size={3 * self.hidden}"]


def parse_sizes(text: str) -> list[Size]:
    sizes = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", item.strip())
        if not m or int(m[1]) % HEAD_DIM or int(m[1]) == 0 or int(m[2]) < 2:
            raise UserError(f"--sizes: {item!r} is not DxL, hidden size D (a multiple of "
                            f"{HEAD_DIM}) by L >= 2 layers, e.g. 128x4")
        sizes.append(Size(int(m[1]), int(m[2])))
    return sizes


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise UserError(f"--variants: unknown {', '.join(unknown)} (choose from "
                        f"{', '.join(VARIANTS)})")
    return names


# --- data: the quickstart's tokenizer and token files ----------------------------------

def prepare_data(folder: Path, nproc: int) -> tuple[str, str]:
    """The tokenizer and token-file prefix under `folder`, made as tools/quickstart.sh
    makes them (same commands, same outputs) when they are not there yet."""
    tokenizer, prefix = folder / "tokenizer" / "gcide.model", folder / "data" / "gcide"
    python, corpus = sys.executable, str(ROOT / "data_corpus" / "gcide.jsonl.gz")
    if not tokenizer.is_file():
        print(f"quality: training the quickstart's tokenizer into {tokenizer}", flush=True)
        subprocess.run([python, str(ROOT / "tools" / "train_tokenizer.py"), "--input", corpus,
                        "--output-prefix", str(tokenizer.with_suffix("")),
                        "--vocab-size", "4096"], check=True)
    documents = f"{prefix}_text_document"
    if not Path(documents + ".idx").is_file():
        print(f"quality: tokenizing the shipped corpus into {documents}", flush=True)
        subprocess.run([python, str(ROOT / "tools" / "preprocess_data.py"), "--input", corpus,
                        "--json-keys", "text", "--output-prefix", str(prefix),
                        "--tokenizer-type", "sentencepiece", "--tokenizer-model",
                        str(tokenizer), "--append-eod", "--workers", str(nproc),
                        "--single-prefix"], check=True)
    return str(tokenizer), documents


# --- one training run --------------------------------------------------------------------

@dataclass
class Run:
    size: Size
    variant: str
    folder: Path
    overrides: list[str]
    nproc: int

    @property
    def label(self) -> str:
        return f"{self.size.name} {VARIANTS[self.variant][1]}"

    @property
    def settings(self) -> dict:
        """What makes two runs the same run: a folder trained otherwise is not reused."""
        return {"recipe": RECIPE, "overrides": self.overrides, "nproc": self.nproc}


def plan_runs(args, tokenizer: str, documents: str) -> list[Run]:
    common = [f"data.prefixes=[{documents}]", f"data.tokenizer_model={tokenizer}",
              f"train.steps={args.steps}", f"train.eval_interval={args.eval_interval}",
              f"train.eval_iters={args.eval_iters}", f"train.log_interval={args.eval_interval}",
              f"train.save_interval={args.eval_interval}", "train.keep_last=1",
              *SEMANTICS[args.semantics]]
    runs = []
    for size in args.sizes:
        for variant in args.variants:
            folder = args.out / size.name / variant
            overrides = [*common, *size.overrides(),
                         f"model.stem_layers={VARIANTS[variant][0]}",
                         f"train.save_dir={folder / 'ckpt'}"]
            load_recipe(ROOT / RECIPE, overrides)  # a bad setting fails before any training
            runs.append(Run(size, variant, folder, overrides, args.nproc))
    return runs


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # whole or absent: an interrupted write leaves no half result


def valid_curve(save_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) as the trainer wrote them to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("valid/loss")]


def train(run: Run, say) -> dict:
    """`run`'s result: read back when it finished before, else trained (or resumed) now."""
    result_file, settings_file = run.folder / "result.json", run.folder / "settings.json"
    for path in (result_file, settings_file):
        if path.is_file() and json.loads(path.read_text())["settings"] != run.settings:
            raise UserError(f"{run.folder}: trained with other settings than these "
                            f"(see {path}); pass another --out or remove the folder")
    if result_file.is_file():
        say(f"{run.label}: finished before, read from {result_file}")
        return json.loads(result_file.read_text())
    run.folder.mkdir(parents=True, exist_ok=True)
    _write_json(settings_file, {"settings": run.settings})
    attempts = json.loads(settings_file.read_text()).get("attempts", [])
    say(f"{run.label}: training" + (" (resuming)" if attempts else ""))
    attempt = _train_once(run, say)
    attempts.append(attempt)
    _write_json(settings_file, {"settings": run.settings, "attempts": attempts})
    if attempt["exit"] != 0:
        sys.exit(f"quality: {run.label}: the trainer exited {attempt['exit']}; its log: "
                 f"{run.folder / 'train.log'}")
    model = load_recipe(ROOT / RECIPE, run.overrides).model
    result = {"settings": run.settings, "size": run.size.name, "variant": run.variant,
              "stem_layers": model.stem_layer_indices, "accounting": account(model).as_dict(),
              "valid": valid_curve(run.folder / "ckpt"), "attempts": attempts,
              "cpu_s": sum(a["cpu_s"] for a in attempts),
              "wall_s": sum(a["wall_s"] for a in attempts)}
    _write_json(result_file, result)
    say(f"{run.label}: valid loss {result['valid'][-1][1]:.4f}, {result['cpu_s']:.0f} CPU s")
    return result


def _train_once(run: Run, say) -> dict:
    """One torchrun of the trainer, its lines shown and logged; CPU time of all its ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={run.nproc}", "-m", "megatron_stem.train", "--recipe",
           str(ROOT / RECIPE), *run.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cpu0, wall0, load0 = _children_cpu_s(), time.perf_counter(), os.getloadavg()[0]
    with open(run.folder / "train.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith("step ") and "valid" not in line:
                    continue  # training lines: in the log; the curve is what is shown
                say(f"  {line.rstrip()}")
        finally:
            proc.wait()
    return {"exit": proc.returncode, "cpu_s": _children_cpu_s() - cpu0,
            "wall_s": time.perf_counter() - wall0,
            "load": [round(load0, 1), round(os.getloadavg()[0], 1)]}


# --- the report ----------------------------------------------------------------------------

def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def table(results: list[dict], nproc: int) -> str:
    dense = {r["size"]: r["valid"][-1][1] for r in results if r["variant"] == "dense"}
    lines = ["| size | model | STEM layers | active params | total params | "
             "FLOPs/token (forward, 2 x active) | final valid loss | vs dense | CPU s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        a, loss = r["accounting"], r["valid"][-1][1]
        versus = f"{loss - dense[r['size']]:+.3f}" if r["size"] in dense else "-"
        layers = ", ".join(map(str, r["stem_layers"])) or "none"
        lines.append(f"| {r['size']} | {VARIANTS[r['variant']][1]} | {layers} | "
                     f"{_millions(a['active_params'])} | {_millions(a['total_params'])} | "
                     f"{_millions(a['flops_per_token'])} | {loss:.4f} | {versus} | "
                     f"{r['cpu_s']:.0f} |")
    cpu = sum(r["cpu_s"] for r in results)
    loads = [x for r in results for a in r["attempts"] for x in a["load"]]
    steps = results[0]["valid"][-1][0]
    lines += ["", f"{steps} steps of {_tokens_per_step(results[0])} tokens, {nproc} ranks; "
              f"{cpu:,.0f} CPU s in all (about {cpu / nproc / 60:.0f} min of wall time on "
              f"{nproc} idle cores), load average {min(loads):g} to {max(loads):g} while "
              f"it ran."]
    return "\n".join(lines) + "\n"


def _tokens_per_step(result: dict) -> str:
    recipe = load_recipe(ROOT / RECIPE, result["settings"]["overrides"])
    return f"{recipe.train.global_batch_size * recipe.model.seq_length:,}"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in results))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False,
                             sharey=True)
    for ax, size in zip(axes[0], sizes):
        for r in (r for r in results if r["size"] == size):
            steps, losses = zip(*r["valid"])
            active = _millions(r["accounting"]["active_params"])
            ax.plot(steps, losses, marker=".",
                    label=f"{VARIANTS[r['variant']][1]} ({active} active): {losses[-1]:.3f}")
        ax.set_title(f"d x layers = {size}")
        ax.set_xlabel(f"step ({_tokens_per_step(results[0])} tokens each)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("validation loss")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_docs(report: str) -> None:
    """The table into docs/quality.md between its markers (the prose around it is kept)."""
    text = DOCS_PAGE.read_text()
    if BEGIN not in text or END not in text:
        raise UserError(f"{DOCS_PAGE}: no {BEGIN} ... {END} block to write the table into")
    head, rest = text.split(BEGIN, 1)
    DOCS_PAGE.write_text(f"{head}{BEGIN}\n{report}{END}{rest.split(END, 1)[1]}")


@cli
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64x4,128x4",
                    help="model sizes, hidden x layers, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"of {', '.join(VARIANTS)} (dense and the STEM placements)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=12,
                    help="validation micro-batches per rank (the same sequences every time)")
    ap.add_argument("--nproc", type=int, default=2, help="data-parallel ranks")
    ap.add_argument("--semantics", choices=list(SEMANTICS), default="megatron",
                    help="training conventions: the recipe's own (megatron's) or the "
                         "official STEM code's (init, clipping, decay, schedule)")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "runs" / "quickstart",
                    help="tokenizer/ and data/ as tools/quickstart.sh writes them (made if "
                         "missing)")
    ap.add_argument("--out", type=Path, default=None,
                    help="one folder per run and the report (default runs/quality, "
                         "runs/quality_official, runs/quality_quick with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help=f"toy sizes {QUICK['sizes']}, {QUICK['steps']} steps")
    ap.add_argument("--docs", action="store_true",
                    help="also write the table into docs/quality.md and the PNG to docs/")
    args = ap.parse_args()
    if args.quick:
        if args.docs:
            raise UserError("--docs: a --quick run is not the measurement the docs show")
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    if args.docs and args.semantics != "megatron":
        raise UserError("--docs: the docs' table is the megatron-semantics comparison; the "
                        "official runs' report is <out>/quality.md")
    suffix = "_quick" if args.quick else "" if args.semantics == "megatron" else "_official"
    args.out = args.out or ROOT / "runs" / f"quality{suffix}"
    args.sizes, args.variants = parse_sizes(args.sizes), parse_variants(args.variants)

    started = time.perf_counter()
    tokenizer, documents = prepare_data(args.data_dir, args.nproc)
    runs = plan_runs(args, tokenizer, documents)
    results = []
    for i, run in enumerate(runs, 1):
        results.append(train(run, lambda line, i=i: print(
            f"[{i}/{len(runs)} {time.perf_counter() - started:5.0f} s] {line}", flush=True)))
    report = table(results, args.nproc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.md").write_text(report)
    plot(results, args.out / "quality.png")
    print(report + f"wrote {args.out / 'quality.md'} and {args.out / 'quality.png'}")
    if args.docs:
        write_docs(report)
        plot(results, DOCS_PNG)
        print(f"wrote {DOCS_PAGE} (the table) and {DOCS_PNG}")


if __name__ == "__main__":
    sys.exit(main())
