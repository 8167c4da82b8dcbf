import fcntl
import functools
import importlib.util
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_stem  # noqa: F401  (first of ours: before any test module imports megatron-core)

import launcher
from training_runs import progressions, write_documents

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
# The tables' path refuses host memory handed to a collective, as NCCL would on a GPU node
# (tables/comm.py): on in this process and in every process it starts.
os.environ.setdefault("STEM_CHECK_HOST_TENSORS", "1")


def pytest_configure(config):
    """The warning filters every process of the package has (runtime/warning_filters.py, installed by its
    import) in every test as well: pytest restores the filters after collecting and after
    each test, which would drop those installed by an import during collection."""
    from megatron_stem.runtime import warning_filters

    warning_filters.install()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set in this process by init_distributed (the world1 fixture): a child must not inherit
# them, or it joins (or collides with) this process's rendezvous.
_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra: str) -> dict:
    """This process's environment for a child process, minus its distributed identity."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env.update(extra)
    return env


def tool(name: str):
    """A CLI's main(), imported from tools/ as a user would run it."""
    return tool_main(f"tools/{name}.py")


def tensorboard_steps(folder, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard shows them (it drops what a resumed run purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def torchrun(nproc: int, script: str, *args: str, timeout: int = 600, exit_code: int = 0) -> str:
    """Run tests/workers/<script> under torchrun with `nproc` gloo ranks; its stdout (and
    stderr, when `exit_code` is not 0: the run is expected to fail with it); fail the test
    with its log when it exits otherwise. (torchrun's launcher, and its ranks, are forked
    from a process that imported the libraries: tests/launcher.py.)"""
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = launcher.torchrun([f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                              str(WORKERS / script), *map(str, args)], env, WORKERS, timeout)
    if proc.returncode != exit_code:
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return proc.stdout + (proc.stderr if exit_code else "")


@functools.cache
def tool_main(path: str):
    """The `main` of a tools/ or bench/ script (a repository path), imported without
    running it."""
    assert (ROOT / path).is_file(), f"{path} does not exist"
    name = "_tool_" + re.sub(r"\W", "_", path)  # tools/x.py and bench/x.py may share a stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model folder's safetensors files, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def merge_rank_dumps(folder: Path) -> dict:
    """Union of the per-rank result dumps written by a worker."""
    merged = {"params": {}, "grads": {}}
    for f in sorted(folder.glob("rank*.pt")):
        dump = torch.load(f)
        for key, value in dump.items():
            if key in ("params", "grads"):
                merged[key].update(value)
            else:
                merged[key] = value
    return merged


@pytest.fixture(scope="session")
def world1():
    """megatron parallel state for a single in-process rank (TP=PP=DP=1)."""
    from megatron_stem.config import ParallelConfig
    from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    yield
    destroy_distributed()


def once_per_run(tmp_path_factory, name: str, make):
    """`make(folder)`'s result, made once per test run by whichever xdist worker asks
    first; the others wait for it, then read it. (A session fixture is made once per
    worker.) For work whose result is on disk, read-only to its tests, and pickles."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed making it
            folder.mkdir()
            partial = done.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(make(folder)))
            partial.rename(done)
        return pickle.loads(done.read_bytes())


# --- the trainer's end-to-end runs (tests/test_training*.py) ---

@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """400 arithmetic-progression documents over a 300-token vocabulary (eod = 299)."""
    return write_documents(str(tmp_path_factory.mktemp("data") / "toy"), 0, progressions())


@pytest.fixture(scope="session")
def train(toy_data, tmp_path_factory):
    """`train(nproc, *overrides, ...)`: a trainer run's result, its log and folders
    (tests/workers/train_worker.py on `toy_data`). A plain run (its own folder, nothing
    planted or stopped) is run once per session (per xdist worker) and shared by the tests
    that ask for the same one, in any file: its folders are read-only to them."""
    done = {}

    def shared(nproc, *overrides, name="run", **options):
        if options:
            return run(nproc, *overrides, name=name, **options)
        key = (nproc, overrides)
        if key not in done:
            done[key] = run(nproc, *overrides, name=name)
        return done[key]

    def run(nproc, *overrides, name="run", save_dir=None, preempt_at=0, rss=False,
            delay_rest=0.0, plant_nan=0, exit_code=0, worker=(), record_collectives=False):
        folder = tmp_path_factory.mktemp(name)
        out = folder / "result.json"
        options = ["--data", toy_data, "--out", out, "--preempt-at", preempt_at,
                   "--delay-rest", delay_rest, "--plant-nan", plant_nan,
                   *(["--rss"] if rss else []), *worker,
                   *(["--record-collectives"] if record_collectives else [])]
        save_dir = save_dir or folder / "ckpt"
        log = torchrun(nproc, "train_worker.py", *options, f"train.save_dir={save_dir}",
                       *overrides, exit_code=exit_code)
        result = json.loads(out.read_text()) if out.is_file() else {}
        return {**result, "folder": folder, "save_dir": save_dir, "log": log}
    return shared


@pytest.fixture(scope="session")
def reference(train, tmp_path_factory):
    """The single-rank runs every layout's curve is compared with, one per table update
    (made once per run: most trainer test files ask for them)."""
    return once_per_run(tmp_path_factory, "reference", lambda _: {
        update: train(1, f"optimizer.tables.update={update}", name=f"ref_{update}")
        for update in ("lazy", "dense")})


# --- data preparation: a real English corpus and tokenizers built from it, once per run ---

CORPUS = ROOT / "data_corpus" / "gcide.jsonl.gz"
# Characters the dictionary lacks, so UTF-8 beyond ASCII (and byte fallback) is exercised.
UNICODE_DOCS = ["naïve café, déjà vu — über 東京 🚀", "Ωmega ≤ ∞ ½",
                "  leading  and trailing spaces\n\n ", "tabs\tand\nnewlines\r\nkept"]


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """The first 1,500 documents of the shipped GCIDE corpus, plus a few non-ASCII ones."""
    import gzip
    import json
    import itertools

    with gzip.open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 1500)]
    return texts + UNICODE_DOCS


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> str:
    """A 1,000-piece SentencePiece model trained (by our trainer) on the shipped corpus."""
    from megatron_stem.data.tokenizer_training import (TokenizerTrainingConfig,
                                                       train_sentencepiece)

    prefix = tmp_path_factory.mktemp("sp") / "gcide"
    info = train_sentencepiece(TokenizerTrainingConfig(
        inputs=[str(CORPUS)], output_prefix=str(prefix), vocab_size=1000, max_docs=3000,
        threads=2), log=None)
    return info["model"]


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory, corpus_texts) -> str:
    """A folder with a small byte-level BPE tokenizer.json (Hugging Face `tokenizers`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


# --- knowledge editing and analysis: tiny STEM and dense models that learned facts, once ---


def _mark_facts_model_tests(items) -> None:
    """A test that needs `facts_models` (a minute of training) is an integration test."""
    for item in items:
        if "facts_models" in item.fixturenames:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def facts_models(world1, tmp_path_factory):
    """`workers/facts.py`'s STEM model and dense control, trained in this process and
    saved as checkpoints whose recipes name the word-level tokenizer (about a minute, once
    per run: test_editing.py and test_analysis.py may run on different workers)."""
    from types import SimpleNamespace

    from workers import facts

    def make(root):
        tokenizer = facts.write_tokenizer(root / "tokenizer")
        stem = facts.train(root / "stem", tokenizer, facts.STEM_LAYERS)
        dense = facts.train(root / "dense", tokenizer, "none")
        return SimpleNamespace(root=root, tokenizer=tokenizer, stem=stem, dense=dense)
    return once_per_run(tmp_path_factory, "facts", make)


# --- lm-evaluation-harness tasks over local files (offline) ---

LM_EVAL_DOCS = [{"question": f"the {w} of the {v}", "choices": ["stem table", "model token",
                                                                "alpha and beta"],
                 "answer": i % 3}
                for i, (w, v) in enumerate(zip(
                    ["alpha", "beta", "gamma", "delta", "stem", "word", "sense", "noun"],
                    ["dictionary", "verb", "plant", "water", "table", "light", "form", "act"]))]

# A perplexity task (lm-eval's rolling log-likelihood) over the same file.
ROLLING_TASK_YAML = """\
task: my_local_perplexity
dataset_path: json
dataset_kwargs: {data_files: {test: /data/my_task.jsonl}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
"""


def write_local_lm_eval_tasks(folder: Path) -> Path:
    """`folder` with docs/export.md's local multiple-choice task (`my_local_task`,
    verbatim) and a rolling perplexity one (`my_local_perplexity`) over LM_EVAL_DOCS."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    docs = (ROOT / "docs" / "export.md").read_text()
    multiple_choice = docs.split("```yaml\n", 1)[1].split("```", 1)[0]
    for name, text in [("my_local_task", multiple_choice),
                       ("my_local_perplexity", ROLLING_TASK_YAML)]:
        (folder / f"{name}.yaml").write_text(text.replace("/data/my_task.jsonl", str(data)))
    return folder


def lm_eval_offline_env(tmp: Path) -> dict:
    """An environment in which lm-eval and the hub download nothing."""
    return subprocess_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                          HF_HOME=str(tmp / "hf_home"), PYTHONWARNINGS="ignore")


def run_lm_eval_cli(export: Path, tasks: Path, names: list[str], tmp: Path,
                    batch_size: int = 4) -> dict:
    """`lm_eval --model hf` (docs/export.md's command) on an export, over tasks `names`
    of the folder `tasks`, offline, on CPU; its results JSON."""
    import json

    out = tmp / "lm_eval_results"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={export},trust_remote_code=True,stem_tables_on_cpu=True",
         "--include_path", str(tasks), "--tasks", ",".join(names), "--device", "cpu",
         "--batch_size", str(batch_size), "--output_path", str(out)],
        capture_output=True, text=True, timeout=300, env=lm_eval_offline_env(tmp), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())


# --- the order the files run in ---

# The slowest files, slowest first (their test time under `-n 2`, docs/development.md). The
# suite runs on two xdist workers, a file at a time each, in this order (pyproject.toml:
# `--dist loadfile --no-loadscope-reorder`): a worker takes the next file when it is free,
# so a long file left to the end would run alone on one core while the other waits. Files
# not named run after these, in their usual order.
SLOWEST_FIRST = [
    "test_training_instruments.py", "test_slurm.py", "test_gpu_script.py",
    "test_training_state.py", "test_quickstart.py", "test_hf.py", "test_analysis.py",
    "test_training.py", "test_training_tables.py", "test_output.py",
    "test_preprocess_identity.py", "test_quality_bench.py", "test_training_guard.py",
    "test_parallel_parity.py", "test_planner.py", "test_preprocess.py", "test_lm_eval.py",
    "test_editing.py", "test_lazy_imports.py", "test_training_stages.py", "test_full_disk.py",
    "test_stop.py",
]


def _slowest_files_first(items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_collection_modifyitems(items):
    _mark_facts_model_tests(items)
    _slowest_files_first(items)
