"""tools/build_data_cache.py builds the indices the trainer reads: the same sample counts
for the same recipe and rank count (the trainer then builds nothing), once for the dense
and STEM recipes of a stage, only what is missing, on several workers."""

import re

import pytest

from support.processes import ROOT, tool_main, torchrun
from support.token_files import write_set

pytestmark = pytest.mark.integration  # the trainer on 2 ranks

RECIPE = str(ROOT / "recipes" / "tiny_cpu.yaml")


def cache_files(folder) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.startswith(".")}


def test_the_tool_builds_once_what_the_stages_runs_read(tmp_path, sp_model, capsys):
    write_set(tmp_path / "set", [3000, 2000, 1000], seed=1, vocab_size=1000)
    stage = [f"data.prefixes=[{tmp_path / 'set'}]", f"data.tokenizer_model={sp_model}",
             "parallel.tensor_parallel=2", "train.steps=3", "train.micro_batch_size=2",
             "train.global_batch_size=8", "train.eval_iters=2", "train.eval_interval=3",
             "train.save_interval=100", "optimizer.warmup_steps=1"]
    dense, stem = stage + ["model.stem_layers=none"], stage + ["model.stem_layers=1/2"]
    build = tool_main("tools/build_data_cache.py")
    cache = tmp_path / "cache"  # beside the data: every run of it shares it

    assert build(["--recipe", RECIPE, "--ranks", "2", "--workers", "2", *dense]) == 0
    lines = capsys.readouterr().out.splitlines()
    # each prefix's train and valid split, and their two blends
    assert lines[0].startswith(f"building into {cache}: 8 index(es) of 3 prefixes, ~")
    assert lines[1] == "3 prefix(es) to index, 2 worker(s)"
    assert all(re.fullmatch(rf"\[{k}/3\] {tmp_path / 'set'}/00000-0000{k - 1}: [\d.]+ s", line)
               for k, line in enumerate(lines[2:5], 1)), lines
    assert [line.split(",")[0] for line in lines[5:7]] == [
        "training blend of 3 prefixes", "training blend of 3 prefixes"]
    assert lines[-1].startswith("done in ")
    built = cache_files(cache)

    assert build(["--recipe", RECIPE, "--ranks", "2", *stem]) == 0  # the stage's other run
    assert capsys.readouterr().out == f"up to date: {cache} holds every index of the 3 prefixes\n"

    log = torchrun(2, "trainer.py", "--recipe", RECIPE, *stem,
                   f"train.save_dir={tmp_path / 'ckpt'}")
    assert "data cache: building" not in log and "step 3 |" in log, log[-3000:]
    assert cache_files(cache) == built  # its validation samples too: nothing to build
