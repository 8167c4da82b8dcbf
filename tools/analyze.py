"""Interpretability analyses of a STEM model on real text: angular spread of its tables,
distinct parameters activated against context length, and the accounting report.

    python tools/analyze.py --checkpoint runs/stem_350m --dense-checkpoint runs/dense_350m \\
        --input data_corpus/gcide.jsonl.gz --max-tokens 8192 --output runs/analysis \\
        [--accuracy 0.5420 --dense-accuracy 0.4972]

Models are megatron-stem checkpoints (`--checkpoint`) or Hugging Face exports (`--hf`);
the dense baseline is optional. `--input` takes what tools/preprocess_data.py reads. Writes
<output>/analysis.json, angular_spread.png and distinct_params.png, and prints a summary.
See docs/editing.md.
"""

import argparse
import json
import sys
from pathlib import Path

from megatron_stem.editing.backend import add_model_arguments, open_backend, open_tokenizer
from megatron_stem.runtime.errors import UserError, cli


def _summary(report: dict) -> str:
    lines = [f"model: {report['model']['source']} ({report['model']['kind']}): "
             f"{report['model']['summary']}"]
    if "dense" in report:
        lines.append(f"dense: {report['dense']['source']}: {report['dense']['summary']}")
    if "roi" in report:
        r = report["roi"]
        lines.append(f"ROI vs dense: {r['roi']:.3f} (accuracy {r['accuracy']:.4f} at "
                     f"{r['flops_per_token']:,} FLOPs/token vs {r['dense_accuracy']:.4f} at "
                     f"{r['dense_flops_per_token']:,})")
    lines.append(f"text: {report['text_tokens']:,} tokens, {report['distinct_tokens']:,} "
                 "distinct")
    lines.append("angular spread (|cos| over pairs of distinct tokens' vectors):")
    for name, spreads in [("", report["spread"])] + (
            [("dense ", report["dense"]["spread"])] if "dense" in report else []):
        for layer, s in spreads.items():
            what = "rows" if s["kind"] == "stem_rows" else "W_up x"
            lines.append(f"  {name}layer {layer:>2} {what:<6} P50 {s['p50']:.3f}  P95 "
                         f"{s['p95']:.3f}  (random Gaussian P95 {s['gaussian_p95']:.3f}, "
                         f"{s['vectors']} vectors)")
    if "capacity" in report:
        c = report["capacity"]
        lines.append("distinct STEM parameters by context length: " + ", ".join(
            f"{n}: {p:,}" for n, p in zip(c["lengths"], c["stem_params"])))
    return "\n".join(lines)


def run(args) -> None:
    from megatron_stem.analysis.plots import plot_capacity, plot_spread
    from megatron_stem.analysis.report import analyze
    from megatron_stem.analysis.text import read_token_ids

    output = Path(args.output)
    with open_backend(args.checkpoint, args.hf) as backend:
        tokenizer = open_tokenizer(backend, args.tokenizer, args.tokenizer_type)
        ids = read_token_ids(args.input, tokenizer, args.max_tokens, args.json_key)
        if len(ids) < 2:
            raise UserError(f"--input {' '.join(args.input)}: fewer than 2 tokens of text")
        dense = open_backend(args.dense_checkpoint, args.dense_hf) \
            if args.dense_checkpoint or args.dense_hf else None
        try:
            report = analyze(backend, ids, args.rows, args.seed, dense, args.accuracy,
                             args.dense_accuracy)
        finally:
            if dense is not None:
                dense.close()
    output.mkdir(parents=True, exist_ok=True)
    (output / "analysis.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_spread(report, output / "angular_spread.png")
    if "capacity" in report:
        plot_capacity(report, output / "distinct_params.png")
    print(_summary(report))
    print(f"wrote {output}/analysis.json and plots")


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_model_arguments(ap)  # a dense baseline must share the tokenizer
    dense = ap.add_mutually_exclusive_group()
    dense.add_argument("--dense-checkpoint", help="dense baseline checkpoint to compare with")
    dense.add_argument("--dense-hf", help="dense baseline HF export to compare with")
    ap.add_argument("--input", nargs="+", required=True,
                    help="text: files, globs or folders (jsonl/txt/parquet, .gz/.zst)")
    ap.add_argument("--json-key", default="text", help="text field of jsonl/parquet records")
    ap.add_argument("--max-tokens", type=int, default=8192, help="text read, in tokens")
    ap.add_argument("--rows", type=int, default=1024,
                    help="distinct tokens sampled for the angular spread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accuracy", type=float, help="the model's average accuracy, for ROI")
    ap.add_argument("--dense-accuracy", type=float, help="the dense baseline's, for ROI")
    ap.add_argument("--output", required=True, help="folder for analysis.json and the plots")
    args = ap.parse_args(argv)
    if (args.accuracy is None) != (args.dense_accuracy is None):
        ap.error("ROI needs both --accuracy and --dense-accuracy")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
