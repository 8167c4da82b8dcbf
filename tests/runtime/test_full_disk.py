"""A full disk is one line naming the path, and loses nothing: a save that runs out of
space leaves the previous checkpoint whole; preprocessing leaves its parts to resume.
Both on a real small filesystem (a tmpfs mounted for the test), through the real CLIs."""

import re
import subprocess
import sys

import pytest

from support.processes import ROOT, free_port, subprocess_env
from megatron_stem import checkpoint

pytestmark = pytest.mark.integration  # torchrun and the preprocessing CLI on a small disk


@pytest.fixture
def small_disk(tmp_path):
    """`small_disk(megabytes)`: a folder on a tmpfs of that size (needs root)."""
    mounted = []

    def mount(megabytes: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs",
                               str(folder)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(folder)
        return folder
    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_previous(small_disk, toy_data,
                                                                   hf_tokenizer):
    """2 ranks; a checkpoint is 78 MB: the disk takes the first, not the second. Before:
    `RuntimeError: Worker failure: [enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598`, naming no disk."""
    save_dir = small_disk(120) / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "megatron_stem.train",
         "--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"data.prefixes=[{toy_data}]",
         "data.tokenizer_type=huggingface", f"data.tokenizer_model={hf_tokenizer}",
         f"train.save_dir={save_dir}", "train.steps=2", "train.save_interval=1",
         f"data.cache_dir={save_dir.parent.parent / 'cache'}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    first, second = save_dir / "iter_0000001", save_dir / "iter_0000002"
    assert f"error: no space left on device while saving {second}; {first} is intact\n" \
        in proc.stderr, proc.stderr[-3000:]
    # The ranks' output, before torchrun's own report of a failed rank (log lines W1203 ...)
    ours = re.split(r"^[WEI]\d{4} ", proc.stderr, maxsplit=1, flags=re.M)[0]
    assert ours.count("error: no space left") == 1 and "Traceback" not in ours, ours  # rank 0
    checkpoint.verify(first)  # checksums included
    assert (save_dir / "latest").read_text() == "iter_0000001\n"


def test_preprocessing_on_a_full_disk_is_one_line_and_resumes(small_disk, sp_model, tmp_path):
    """Before: `OSError: [Errno 28] No space left on device` as a traceback."""
    def preprocess(prefix):
        return subprocess.run(
            [sys.executable, "tools/preprocess_data.py", "--input",
             "data_corpus/gcide.jsonl.gz", "--output-prefix", str(prefix),
             "--tokenizer-type", "sentencepiece", "--tokenizer-model", sp_model,
             "--workers", "2", "--single-prefix"], capture_output=True, text=True, timeout=300,
            cwd=ROOT,
            env=subprocess_env())

    disk = small_disk(2)
    proc = preprocess(disk / "out")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        f"error: no space left on device writing {disk}; the finished parts in "
        f"{disk / 'out.parts'} are kept: free space and rerun the same command to resume")
    assert "Traceback" not in proc.stderr
    subprocess.run(["mount", "-o", "remount,size=40m", str(disk)], check=True)
    resumed = preprocess(disk / "out")
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"reused [1-9]\d* chunk", resumed.stdout), resumed.stdout
    assert preprocess(tmp_path / "ref").returncode == 0
    for ext in (".bin", ".idx"):
        assert (disk / f"out_text_document{ext}").read_bytes() == \
            (tmp_path / f"ref_text_document{ext}").read_bytes()


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tmp_path):
    """tools/to_hf.py whose weights do not fit. Before: `OSError: [Errno 28]` as a
    traceback from safetensors_io.py, exit 1, a partial `<output>.tmp` left behind."""
    from megatron_stem.hf.import_model import import_hf
    from megatron_stem.hf.remote.configuration_stem import StemConfig
    from megatron_stem.hf.remote.modeling_stem import StemForCausalLM
    from workers.common import hf_shape

    model = StemForCausalLM(StemConfig(**{**hf_shape(20_000), "stem_layers": [1, 3]}))
    model.save_pretrained(tmp_path / "hf")  # ~50 MB of fp32 weights, mostly tables
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    disk = small_disk(8)
    proc = subprocess.run([sys.executable, "tools/to_hf.py", "--checkpoint", str(ckpt),
                           "--output", str(disk / "hf")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=subprocess_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"error: no space left on device writing {disk / 'hf'} \(about \d+\.\d GB\); nothing "
        r"was kept: free space, or choose another --output", lines[0]), proc.stderr
    assert list(disk.iterdir()) == []  # no hf, no hf.tmp
