"""Token files that cannot be trained on are refused before training starts, in one line
naming the file and the recipe field (data/checks.py, through the trainer's
`check_training_data`): before, each failed late as a traceback (a truncated .bin when
training reached the damaged region, an id above the vocabulary at step 1, naming no file)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from support.processes import ROOT, subprocess_env
from megatron_stem.config import DataConfig
from megatron_stem.data.checks import SAMPLE_SPANS, SPAN_BYTES, max_token_id, size_text
from megatron_stem.runtime.errors import UserError
from megatron_stem.runtime import page_cache
from megatron_stem.training.batches import check_training_data
from support.token_files import write_prefix, write_set
from support.training_runs import progressions, write_documents


def _truncate_bin(prefix):
    path = f"{prefix}.bin"
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


def _empty_bin(prefix):
    open(f"{prefix}.bin", "wb").close()


def _garbage_idx(prefix):
    with open(f"{prefix}.idx", "wb") as f:
        f.write(np.random.default_rng(0).bytes(4000))


def _idx_of_another_prefix(prefix):
    other = write_documents(f"{prefix}_other", 1, progressions(), count=300)
    shutil.copy(f"{other}.idx", f"{prefix}.idx")


def _ids_above_vocab(prefix):
    write_documents(prefix, 0, lambda rng: np.full(30, 60000), count=50)


DAMAGES = {  # what is done to the prefix, the error after "data.prefixes: "
    "truncated .bin": (_truncate_bin, "{p}.bin is {half} but its .idx needs {full} (truncated, "
                       "or the .idx of another prefix)"),
    "empty .bin": (_empty_bin, "{p}.bin is empty but its .idx needs {full}"),
    "garbage .idx": (_garbage_idx, "{p}.idx: not a Megatron .idx file"),
    ".idx of another prefix": (_idx_of_another_prefix, "{p}.bin is {full} but its .idx needs "
                               "{other} (written with the .idx of another prefix)"),
    "ids above the vocabulary": (_ids_above_vocab, "token id 60000 in {p}.bin is >= "
                                 "model.vocab_size 4096 (or negative): data made with another "
                                 "tokenizer?"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_or_wrong_token_files_are_one_line(tmp_path, damage):
    prefix = write_documents(str(tmp_path / "toy"), 0, progressions())
    check_training_data(DataConfig(prefixes=[prefix]), 4096)  # whole: accepted
    full = os.path.getsize(f"{prefix}.bin")
    spoil, message = DAMAGES[damage]
    spoil(prefix)
    other = f"{prefix}_other.bin"
    with pytest.raises(UserError) as e:
        check_training_data(DataConfig(prefixes=[prefix]), 4096)
    assert str(e.value) == "data.prefixes: " + message.format(
        p=prefix, full=size_text(full), half=size_text(full // 2),
        other=size_text(os.path.getsize(other)) if os.path.exists(other) else None)


@pytest.mark.integration  # the trainer's CLI
def test_the_trainer_refuses_ids_above_the_vocabulary_before_it_starts(tmp_path):
    prefix = write_documents(str(tmp_path / "toy"), 0, lambda rng: np.full(30, 60000),
                             count=50)
    proc = subprocess.run([sys.executable, "-m", "megatron_stem.train", "--recipe",
                           str(ROOT / "recipes" / "tiny_cpu.yaml"), f"data.prefixes=[{prefix}]",
                           f"train.save_dir={tmp_path / 'ckpt'}"],
                          capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert (proc.returncode, proc.stderr) == (
        2, f"error: data.prefixes: token id 60000 in {prefix}.bin is >= model.vocab_size 4096 "
           "(or negative): data made with another tokenizer?\n")


def test_max_token_id_reads_every_id(tmp_path):
    prefix = write_documents(str(tmp_path / "toy"), 0, progressions())
    assert max_token_id(prefix) == 299  # the eod


def test_a_prefix_sets_largest_id_is_checked_whole_from_its_manifest(tmp_path):
    """Sampling reads a few spans of each .bin; a prefix set's manifest records each
    prefix's largest id, every id read by preprocessing, so one id above the vocabulary
    anywhere is refused at start."""
    import itertools
    import json

    from megatron_stem.data.prefix_sets import MANIFEST, set_record

    folder = tmp_path / "set"
    folder.mkdir()
    # One id above 4096, in document 3,000 of 20,000 (about 153k tokens into 1M): between
    # the spans sampling reads (16 of 4,096 tokens, spread evenly).
    rare = itertools.chain([False] * 3000, [True], itertools.repeat(False))
    entries = []
    for name, count in (("00000-00000", 20000), ("00000-00001", 50)):
        prefix = write_documents(str(folder / name), 0,
                                 lambda rng: np.append(progressions()(rng), 5000)
                                 if next(rare) else progressions()(rng), count=count)
        entries.append({"name": name, "documents": count,
                        "tokens": os.path.getsize(f"{prefix}.bin") // 2,
                        "max_token_id": max_token_id(prefix)})
    (folder / MANIFEST).write_text(json.dumps(set_record({"format": 1}, entries)))
    check_training_data(DataConfig(prefixes=[str(folder)]), 8192)  # below: accepted
    with pytest.raises(UserError) as e:
        check_training_data(DataConfig(prefixes=[str(folder)]), 4096)
    assert str(e.value) == (
        f"data.prefixes: token id 5000 in {folder / '00000-00000'}.bin is >= model.vocab_size "
        f"4096 (the largest, from {folder}/{MANIFEST}): data made with another tokenizer?")
    entries[0]["max_token_id"] = 299  # without the record, sampling misses it
    (folder / MANIFEST).write_text(json.dumps(set_record({"format": 1}, entries)))
    check_training_data(DataConfig(prefixes=[str(folder)]), 4096)


def resident_bins(folder) -> dict[str, int]:
    return {p.name: page_cache.resident(str(p)) for p in sorted(folder.rglob("*.bin"))}


def test_the_checks_read_only_the_pages_they_sample(tmp_path):
    """Each span of ids is read with the kernel's read-ahead off: the start brings 16 spans
    of 8 kB of each `.bin` into memory, not the windows around them (a mapping without
    MADV_RANDOM read 130 MB of a 0.9 GB file)."""
    paths = [str(tmp_path / f"p{i}") for i in range(3)]
    for i, path in enumerate(paths):
        write_prefix(path, 60_000, seed=i, vocab_size=70_000)  # int32 ids, 5 MB
        page_cache.drop(f"{path}.bin")
    assert set(resident_bins(tmp_path).values()) == {0}
    check_training_data(DataConfig(prefixes=paths), 70_000)
    assert set(resident_bins(tmp_path).values()) == {SAMPLE_SPANS * SPAN_BYTES}


def test_a_prefix_sets_ids_are_read_from_its_manifest_not_sampled(tmp_path):
    write_set(tmp_path / "set", [20_000, 20_000], seed=5, vocab_size=70_000)
    for path in (tmp_path / "set").glob("*.bin"):
        page_cache.drop(str(path))
    check_training_data(DataConfig(prefixes=[str(tmp_path / "set")]), 70_000)
    assert set(resident_bins(tmp_path).values()) == {0}
