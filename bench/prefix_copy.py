"""What the last step of preprocessing costs: parts merged into a prefix set's prefixes
(what each array task does with its own parts) and into one file (`--single-prefix`'s
journaled merge), on synthetic parts.

    python bench/prefix_copy.py --parts 100 --part-mb 8

A part is what one chunk of text becomes (8 MiB of text is about 2M Llama-3 tokens: 8 MB
of int32). The parts are written and synced first, then merged; they are still in the page
cache then, as they are not after a long tokenizing run, so the figures bound the read side
from above. Each copy starts after a sync of everything written before it, and ends with
its outputs synced. Everything is written under --dir (default: a temporary folder in the current
one, i.e. on the filesystem to be measured) and removed at the end.
"""

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from megatron_stem.data.indexed import PartWriter, bin_path, merge_resumable
from megatron_stem.data.prefix_sets import FORMAT, GroupWriter, Part, plan

TOKENS_PER_DOCUMENT = 1024


def make_parts(folder: str, count: int, part_bytes: int) -> list:
    tokens = part_bytes // 4
    block = np.random.default_rng(0).integers(0, 128256, tokens, dtype=np.int32)
    lengths = np.full(tokens // TOKENS_PER_DOCUMENT, TOKENS_PER_DOCUMENT, np.int32)
    parts = []
    for i in range(count):
        prefix = os.path.join(folder, f"part{i:06d}_text")
        w = PartWriter(prefix, np.int32)
        w.add(block[:lengths.sum()], lengths)
        w.close()
        parts.append(Part({"text": prefix}, len(lengths), {"text": int(lengths.sum())}))
    return parts


def timed(what: str, parts: list, run) -> None:
    size = sum(os.path.getsize(bin_path(p.prefixes["text"])) for p in parts)
    os.sync()  # what was written before is not this copy's write-back
    start = time.perf_counter()
    made = run()
    seconds = time.perf_counter() - start
    print(f"{what}: {len(parts)} parts, {size / 1e9:.2f} GB into {made} in {seconds:.2f} s: "
          f"{size / 1e9 / seconds:.2f} GB/s, {1e3 * seconds / len(parts):.1f} ms per part")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=100)
    ap.add_argument("--part-mb", type=float, default=8.0, help="MB of int32 tokens per part")
    ap.add_argument("--prefixes", type=int, default=4,
                    help="prefixes the parts make in the prefix-set layout")
    ap.add_argument("--dir", default=None, help="where to write (default: here)")
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="prefix_copy.", dir=args.dir or ".")
    try:
        parts = make_parts(os.path.join(folder), args.parts, int(args.part_mb * 1e6))
        limit = -(-sum(p.tokens["text"] for p in parts) // args.prefixes)
        writer = GroupWriter({"text": os.path.join(folder, "set")}, 0, 1, np.int32, "bench",
                             os.path.join(folder, "progress.json"))
        header = {"format": FORMAT, "dtype": "int32", "tokenizer": {}, "append_eod": True}
        timed("prefix set", parts, lambda: "{} prefixes".format(len(writer.write(
            plan(parts, limit, 2 ** 30), header, {})["text"]["prefixes"])))
        timed("one file (--single-prefix)", parts, lambda: merge_resumable(
            [p.prefixes["text"] for p in parts], os.path.join(folder, "one"), np.int32)
            and "1 prefix")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
