"""Peak memory of import and export of a model whose tables dominate (run as a script).

    MALLOC_MMAP_THRESHOLD_=1048576 python hf_memory.py DIR

Writes a synthetic HF folder (8 STEM tables of 16 MiB, 140 MiB in all) tensor by tensor,
imports it, exports the import, and prints JSON: the largest tensor, the model size, and
the peak anonymous memory (RSS minus file-backed pages) each conversion added. Measured:
export about 2x the largest tensor (the tensor plus one chunk being read into it); import
well under 1x (safetensors maps the file, so the data it writes out are page cache).
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from megatron_stem.config import ModelConfig
from megatron_stem.hf import names
from megatron_stem.hf.export import export
from megatron_stem.hf.import_model import import_hf
from megatron_stem.hf.safetensors_io import Entry, ShardWriter, plan_shards, shard_name, \
    write_index

MODEL = ModelConfig(hidden_size=128, num_layers=9, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=2048, vocab_size=2048, seq_length=64, stem_layers="full")
PAGE = os.sysconf("SC_PAGE_SIZE")


def anon_bytes() -> int:
    with open("/proc/self/statm") as f:
        _, resident, shared = map(int, f.read().split()[:3])
    return (resident - shared) * PAGE


def peak_during(fn) -> int:
    """Peak anonymous memory above the starting level while `fn` runs (sampled every ms)."""
    start, peak, done = anon_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], anon_bytes()) - start


def write_synthetic(folder: Path) -> list[Entry]:
    folder.mkdir()
    entries = [[Entry(n, s, torch.float32) for n, s in zip(t.hf, t.hf_shapes)]
               for t in names.tensor_map(MODEL)]
    shards = [[e for i in members for e in entries[i]]
              for members in plan_shards(entries, 100 * 2**20)]
    for i, shard in enumerate(shards):
        with ShardWriter(folder / shard_name(i, len(shards)), shard) as writer:
            for e in shard:
                writer.write(e.name, torch.randn(e.shape) * 0.02)
    write_index(folder, shards)
    (folder / "config.json").write_text(json.dumps(names.hf_config(MODEL, "float32")))
    return [e for group in entries for e in group]


def main():
    root = Path(sys.argv[1])
    entries = write_synthetic(root / "synthetic")
    result = {"largest": max(e.nbytes for e in entries),
              "total": sum(e.nbytes for e in entries)}
    result["import_peak"] = peak_during(lambda: import_hf(root / "synthetic", root / "ckpt"))
    result["export_peak"] = peak_during(lambda: export(root / "ckpt", root / "exported"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
