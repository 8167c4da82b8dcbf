"""Edit or inject knowledge in a STEM model through its table rows; show and measure it.

    python tools/edit_knowledge.py --checkpoint runs/stem-1b/checkpoints --edits edits.yaml \\
        --prompt "The capital of Spain is" [--top-k 5] [--max-new-tokens 8] \\
        [--bake] [--output runs/stem_1b_edited] [--eval facts.yaml --json report.json]

`--checkpoint` is a megatron-stem save dir or iter_N folder (loaded in this process at
TP=1), `--hf` a Hugging Face export. The edit spec (YAML/JSON, see
megatron_stem/editing/spec.py) lists remaps (source -> target, strategy, layers) and
injections (copy / average / vectors). For each prompt the top-k next tokens are printed
before and after: remaps act at inference time (the STEM lookups of the source's positions
read the target's rows; the text is unchanged) unless `--bake` or `--output`, which write
them into the rows as the saved model will have them. `--eval` measures edit success and
locality on a facts file, on the model as loaded. See docs/editing.md.
"""

import argparse
import json
import sys
from pathlib import Path

from megatron_stem.editing import forward
from megatron_stem.editing.backend import add_model_arguments, open_backend, open_tokenizer
from megatron_stem.editing.evaluate import evaluate, format_report, load_eval_spec
from megatron_stem.editing.inject import apply_writes, inject_writes
from megatron_stem.editing.remap import bake_writes, find_occurrences
from megatron_stem.editing.resolve import resolve
from megatron_stem.editing.spec import load_edits
from megatron_stem.runtime.errors import cli


def _top(logprobs, k, tokenizer) -> str:
    values, ids = logprobs.exp().topk(k)
    return " | ".join(f"{tokenizer.decode([int(i)])!r} {v:.3f}" for v, i in zip(values, ids))


def _show_edits(remaps, injects, tokenizer) -> None:
    def pieces(ids):
        return [tokenizer.decode([i]) for i in ids]
    for r in remaps:
        print(f"edit {r.label}: {pieces(r.source)} -> {pieces(r.target)} ({r.strategy}, "
              f"layers {list(r.layers)})")
    for j in injects:
        print(f"edit {j.label}: writes {pieces(j.tokens)} in layers {list(j.layers)}")


def run(args) -> None:
    # Spec files first: a typo should fail before minutes of model loading.
    eval_spec = load_eval_spec(args.eval) if args.eval else None
    edits = load_edits(args.edits) if args.edits else None
    with open_backend(args.checkpoint, args.hf) as backend:
        tokenizer = open_tokenizer(backend, args.tokenizer, args.tokenizer_type)
        print(f"model: {backend.source} ({backend.kind}, STEM layers "
              f"{backend.stem_layers or 'none'})")
        if eval_spec is not None:
            report = evaluate(backend, tokenizer, eval_spec, args.eval)
            print(format_report(report))
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
                print(f"wrote {args.json}")
        if edits is None:
            return
        remaps, injects = resolve(edits, tokenizer, backend.config, args.edits)
        _show_edits(remaps, injects, tokenizer)
        prompts = [tokenizer.encode(p) for p in args.prompt]
        before = forward.next_token_logprobs(backend, prompts) if prompts else None
        greedy_before = [forward.greedy(backend, p, args.max_new_tokens, stop=tokenizer.eod)
                         for p in prompts]
        bake = args.bake or args.output is not None
        # Every write is computed from the unedited rows before any is applied.
        writes = [w for j in injects for w in inject_writes(backend, j)]
        writes += bake_writes(backend, remaps) if bake else []
        apply_writes(backend, writes)
        live = [] if bake else remaps
        if prompts:
            after = forward.next_token_logprobs(backend, prompts, [live] * len(prompts))
        for i, (text, ids) in enumerate(zip(args.prompt, prompts)):
            hits = [r.label for r in remaps if find_occurrences(ids, r.source)]
            print(f"prompt {text!r}" + (f": remaps here {hits}" if hits else ""))
            print(f"  before  {_top(before[i], args.top_k, tokenizer)}")
            print(f"  after   {_top(after[i], args.top_k, tokenizer)}")
            if args.max_new_tokens:
                new = forward.greedy(backend, ids, args.max_new_tokens, live, tokenizer.eod)
                print(f"  greedy  before {tokenizer.decode(greedy_before[i])!r}")
                print(f"          after  {tokenizer.decode(new)!r}")
        if args.output:
            print(f"wrote {backend.save(Path(args.output))}")


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--edits", help="edit spec, YAML or JSON")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=0,
                    help="also print greedy continuations of this length")
    ap.add_argument("--bake", action="store_true",
                    help="show remaps written into the rows (as --output saves them)")
    ap.add_argument("--output", help="write the edited model here (a checkpoint save dir for "
                                     "--checkpoint, an HF folder for --hf)")
    ap.add_argument("--eval", help="facts file: measure edit success and locality")
    ap.add_argument("--json", help="with --eval: write the report here")
    args = ap.parse_args(argv)
    if not (args.edits or args.eval):
        ap.error("nothing to do: give --edits and/or --eval")
    if args.edits and not (args.prompt or args.output):
        ap.error("--edits needs --prompt to show and/or --output to write")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
