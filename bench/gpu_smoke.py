"""The tables' GPU-only paths, checked on one GPU before anything is timed (the first stage
of bench/gpu/run_all.sh: 1-2 minutes).

    python bench/gpu_smoke.py [--steps 6] [--dry-run] [--kernel torch]

Each variant trains the same STEM model on the same random token batches in this process
(one DeepSpeed engine at a time, released before the next), through `train.train_step`:

* bf16 through DeepSpeed: bf16 parameters and tables (so the tables' fp32 master is a
  copy of its own), gradients accumulated and reduced in fp32 by DeepSpeed's ZeRO
  optimizer, the state sharded in CPU memory (DeepSpeed's CPU Adam; the gradients cross
  to it on a side stream): the loss falls;
* the tables' state on the accelerator (torch's Adam there) against CPU memory: close;
* `tables.overlap: next_step` (its arithmetic on a second thread and stream, its
  publications on a third stream from the main thread, events, recorded tensors;
  4 micro-batches a step, so the first micro-batch's rows go first and the later ones'
  are waited for) against `none`, with deterministic algorithms and the math attention kernel: the same
  losses bit for bit;
* host placement (a pinned staging buffer, the side stream, the hot-row cache) against
  device placement: close;
* the row gradients' sum of a staged step (tables/row_grads.py: queued on a side stream
  as the last backward ends, its rows from the host's ids) against the unstaged sum: the
  same bits, and no host sync inside it (CUDA's sync debug mode set to error).

Prints one line per check (the losses' largest relative difference) and exits 1 if one
fails. `--dry-run`: the same at toy sizes on a CPU (the CI suite runs it).
"""

import argparse
import contextlib
import gc
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS
import torch  # noqa: E402

TOY = dict(hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=128, vocab_size=512, seq_length=64)
# 2 x 2,048 positions a micro-batch: over the 3,072 ids below which CUDA's embedding
# backward takes its small-input kernel, so the smoke runs the sort-based one, as the 1B run.
GPU = dict(hidden_size=1024, num_layers=4, num_attention_heads=16, num_query_groups=4,
           ffn_hidden_size=4096, vocab_size=32768, seq_length=2048)
VARIANTS = {  # name: recipe overrides of the bf16 STEM baseline below
    "cpu_state": {},
    "accelerator_state": {"optimizer": {"tables": {"device": "accelerator"}}},
    "overlap_none": {"tables": {"overlap": "none"}},
    "overlap_next_step": {"tables": {"overlap": "next_step"}},
    "device": {},
    "host": {"tables": {"placement": "host", "partition": "sharded", "cache_rows": 256}},
}


def recipe(model: dict, overrides: dict, kernel: str = "deepspeed"):
    from megatron_stem.config import Recipe, from_dict
    from megatron_stem.config.recipe_files import _deep_merge

    base = {"model": {**model, "stem_layers": "1/2"},
            "optimizer": {"lr": 3e-3, "warmup_steps": 0, "clip_grad": 1.0,
                          "tables": {"update": "dense", "device": "cpu", "kernel": kernel}},
            "tables": {"placement": "device", "partition": "sharded"},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "dtype": "bf16"}}
    return from_dict(Recipe, _deep_merge(base, overrides))


def batches(model: dict, steps: int, per_step: int, micro: int) -> list[list[dict]]:
    from megatron_stem.runtime.parallel import device

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        # Zipf-like ids, so the rows of a step repeat as text's do
        ids = (torch.rand(per_step, micro, model["seq_length"] + 1, generator=g) ** 3
               * model["vocab_size"]).long().to(device())
        out.append([{"tokens": w[:, :-1], "labels": w[:, 1:],
                     "loss_mask": torch.ones(w[:, 1:].shape, device=w.device)} for w in ids])
    return out


def train(model: dict, overrides: dict, data, deterministic: bool,
          kernel: str = "deepspeed") -> dict:
    """Losses of a fresh engine over `data`; the engine is released before returning."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_stem.model import build_model
    from megatron_stem.training.loop import train_step
    from megatron_stem.training.engine import build_engine

    r = recipe(model, overrides, kernel)
    # build_model reseeds megatron's RNG tracker: every variant starts from the same weights.
    engine, tables, update = build_engine(build_model(r.model, r.parallel, tables=r.tables), r)
    zero = engine.optimizer
    facts = {"optimizer": type(zero).__name__,
             "grad_accum": str(getattr(zero, "gradient_accumulation_dtype", None)),
             "table_dtype": str(tables.tables[0].param.dtype),
             "master": "separate" if tables.tables[0].separate else "the table"}
    losses = []
    with sdpa_kernel(SDPBackend.MATH) if deterministic else contextlib.nullcontext():
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        for mbs, upcoming in zip(data, data[1:] + [None]):
            loss, outcome = train_step(update, mbs, 3e-3,
                                       upcoming and [mb["tokens"] for mb in upcoming])
            losses.append(loss if outcome.applied else float("nan"))
        tables.finish()
        torch.use_deterministic_algorithms(False)
    tables.close()
    del engine, tables, update, zero
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {"losses": losses, **facts}


def staged_row_grads(model: dict) -> tuple[bool, str]:
    """Four bf16 backwards of two tables, their sum staged on the side stream against the
    same backwards unstaged."""
    from megatron_stem.runtime.parallel import device
    from megatron_stem.tables.row_grads import StepRows, row_grads_of, take_same_rows
    from megatron_stem.tables.streams import side_streams

    dev, g = device(), torch.Generator().manual_seed(1)
    vocab, width = model["vocab_size"], model["ffn_hidden_size"]
    weights = [torch.randn(vocab, width, generator=g).to(dev, torch.bfloat16) for _ in "ab"]
    ids = [(torch.rand(2, model["seq_length"], generator=g) ** 3 * vocab).long()
           for _ in range(4)]
    upstream = torch.randn(2, model["seq_length"], width, generator=g).to(dev, torch.bfloat16)
    syncs = []

    def sums(staged: bool):
        tables = [torch.nn.Parameter(w.clone()) for w in weights]
        row_grads = [row_grads_of(t) for t in tables]
        if staged:
            rows, streams = StepRows(ids, dev), side_streams(dev)
            for r in row_grads:
                r.expect(rows, streams)
                own = r._sum

                def checked(own=own):  # the sum itself: no host sync (CUDA's debug mode)
                    if torch.cuda.is_available():
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        return own()
                    except RuntimeError as e:
                        syncs.append(str(e).splitlines()[0])
                        raise
                    finally:
                        if torch.cuda.is_available():
                            torch.cuda.set_sync_debug_mode("default")
                r._sum = checked
        for mb in ids:
            x = mb.to(dev)
            sum((torch.nn.functional.embedding(x, t, sparse=True) * upstream).float().sum()
                for t in tables).backward()
        queued = all(r._result is not None for r in row_grads)  # before take: queued
        rows, grads, _ = take_same_rows(row_grads)
        return rows, grads, queued

    plain_rows, plain, _ = sums(False)
    rows, staged, queued = sums(True)
    same = torch.equal(rows, plain_rows) and all(torch.equal(a, b) for a, b in zip(staged, plain))
    return same and queued and not syncs, (f"{rows.numel()} rows, bits {'equal' if same else 'DIFFER'}"
                                           f", queued at the last backward: {queued}"
                                           + (f", a sync: {syncs[0]}" if syncs else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU")
    ap.add_argument("--kernel", choices=("deepspeed", "torch"), default="deepspeed",
                    help="the tables' CPU Adam (torch: the ops were not built)")
    args = ap.parse_args(argv)
    from megatron_stem.config import ParallelConfig
    from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_smoke: no GPU (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    model = TOY if args.dry_run else GPU
    init_distributed(ParallelConfig())
    data = batches(model, args.steps, 4, 2)
    runs = {name: train(model, o, data, deterministic=name.startswith("overlap"),
                        kernel=args.kernel) for name, o in VARIANTS.items()}
    destroy_distributed()
    base = runs["cpu_state"]

    def close(a: str, b: str, rel: float | None = 2e-2) -> tuple[bool, str]:
        """Losses of variants `a` and `b` within `rel` (None: bit for bit)."""
        x, y = runs[a]["losses"], runs[b]["losses"]
        diff = max(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(x, y))
        return (x == y if rel is None else diff < rel), f"max relative difference {diff:.2e}"

    checks = [
        ("bf16 through DeepSpeed: fp32 accumulation, a separate fp32 master, the loss falls",
         base["optimizer"] == "DeepSpeedZeroOptimizer" and base["grad_accum"] ==
         "torch.float32" and base["table_dtype"] == "torch.bfloat16" and
         base["master"] == "separate" and base["losses"][-1] < base["losses"][0],
         f"losses {base['losses'][0]:.3f} -> {base['losses'][-1]:.3f}"),
        ("state on the accelerator vs CPU memory: close", *close("accelerator_state",
                                                                 "cpu_state")),
        ("next_step vs none, deterministic: bit for bit",
         *close("overlap_next_step", "overlap_none", rel=None)),
        ("host vs device placement: close", *close("host", "device")),
        ("the row gradients' staged sum on the side stream: the unstaged bits, no sync",
         *staged_row_grads(model)),
    ]
    for name, passed, detail in checks:
        print(f"{'ok  ' if passed else 'FAIL'} {name} ({detail})", flush=True)
    return 0 if all(passed for _, passed, _ in checks) else 1

if __name__ == "__main__":
    sys.exit(main())
