"""bench/quality.py at toy size: trains dense and STEM 1/2 through torchrun, reports the
curves and the table, skips what it finished when rerun, refuses a folder trained otherwise."""

import json
import re
import subprocess
import sys

import pytest

from support.processes import ROOT, subprocess_env
from megatron_stem.data.preprocess import PreprocessConfig, preprocess

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


@pytest.fixture
def data_dir(tmp_path, sp_model, corpus_texts):
    """tokenizer/ and data/ laid out as tools/quickstart.sh writes them, from a slice of the
    shipped corpus (the bench would otherwise make the quickstart's own, a minute's work)."""
    folder = tmp_path / "quickstart"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "tokenizer" / "gcide.model").write_bytes(open(sp_model, "rb").read())
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts))
    preprocess(PreprocessConfig(inputs=[str(docs)], output_prefix=str(folder / "data" / "gcide"),
                                tokenizer_type="sentencepiece",
                                tokenizer_model=str(folder / "tokenizer" / "gcide.model"),
                                append_eod=True, single_prefix=True), log=None)
    return folder


def bench(data_dir, out, *flags) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bench" / "quality.py"), "--quick", "--sizes", "32x4",
           "--variants", "dense,half", "--steps", "10", "--eval-interval", "5", "--nproc", "1",
           "--data-dir", str(data_dir), "--out", str(out), *flags]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=600)


def test_quality_bench_trains_reports_and_resumes(data_dir, tmp_path):
    out = tmp_path / "quality"
    first = bench(data_dir, out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert re.search(r"^\[1/2 +\d+ s\] 32x4 dense: training$", first.stdout, re.M)
    assert re.search(r"^\[2/2 +\d+ s\]   step 10 \| valid loss", first.stdout, re.M)
    results = {v: json.loads((out / "32x4" / v / "result.json").read_text())
               for v in ("dense", "half")}
    for result in results.values():
        (_, before), (last_step, after) = result["valid"]
        assert last_step == 10 and after < before  # it learned, and the bench read it back
    dense, half = (results[v]["accounting"] for v in ("dense", "half"))
    assert results["half"]["stem_layers"] == [1, 3]
    # The table: STEM 1/2 has fewer active parameters and FLOPs, more in all.
    rows = {row[1]: row for row in (line.split(" | ") for line in
                                    (out / "quality.md").read_text().splitlines()[2:4])}
    assert rows["STEM 1/2"][3] == f"{half['active_params'] / 1e6:.2f}M"
    assert half["active_params"] < dense["active_params"]
    assert half["flops_per_token"] == 2 * half["active_params"]
    assert half["total_params"] > dense["total_params"]
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "quality.md").read_text()

    again = bench(data_dir, out)  # nothing left to train: the same report from the results
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished before") == 2 and "training" not in again.stdout
    assert (out / "quality.md").read_text() == report

    other = bench(data_dir, out, "--steps", "12")
    assert other.returncode == 2
    assert other.stderr.strip() == (f"error: {out / '32x4' / 'dense'}: trained with other "
                                    f"settings than these (see {out / '32x4' / 'dense'}"
                                    "/result.json); pass another --out or remove the folder")
