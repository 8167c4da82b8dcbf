import json
import os

import pytest

import megatron_stem  # noqa: F401  (first of ours: before any test module imports megatron-core)

from support.processes import CORPUS, UNICODE_DOCS, once_per_run, torchrun
from support.training_runs import progressions, write_documents

# The tables' path refuses host memory handed to a collective, as NCCL would on a GPU node
# (tables/comm.py): on in this process and in every process it starts.
os.environ.setdefault("STEM_CHECK_HOST_TENSORS", "1")


def pytest_configure(config):
    """The warning filters every process of the package has (runtime/warning_filters.py,
    installed by its import) in every test as well: pytest restores the filters after collecting and after
    each test, which would drop those installed by an import during collection."""
    from megatron_stem.runtime import warning_filters

    warning_filters.install()


@pytest.fixture(scope="session")
def world1():
    """megatron parallel state for a single in-process rank (TP=PP=DP=1)."""
    from megatron_stem.config import ParallelConfig
    from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    yield
    destroy_distributed()


@pytest.fixture
def in_process_trainer():
    """For a test that calls the trainer in this process: its stop handler takes SIGUSR1
    and SIGTERM (training/stop.py), which this process gets back after the test."""
    import signal

    kept = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, handler in kept.items():
        signal.signal(s, handler)


# --- the trainer's end-to-end runs (tests/training/, tests/checkpoint/test_resume.py) ---

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

@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """The first 1,500 documents of the shipped GCIDE corpus, plus a few non-ASCII ones."""
    import gzip
    import json
    import itertools

    with gzip.open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 1500)]
    return texts + UNICODE_DOCS


@pytest.fixture(scope="module")
def cluster():
    """A real two-node SLURM cluster on this machine (tests/support/slurm_cluster.py), one per
    test file that asks for it."""
    from support.slurm_cluster import SlurmCluster, missing_tools

    if os.geteuid() != 0:
        pytest.fail("the SLURM tests need root (network namespaces); run them through .ci/run "
                    "or set STEM_SKIP_SLURM_TESTS=1")
    if missing_tools():
        pytest.fail(f"missing {', '.join(missing_tools())}: apt-get install -y slurm-wlm munge "
                    "(.ci/run does), or set STEM_SKIP_SLURM_TESTS=1")
    with SlurmCluster(nodes=2) as c:
        yield c


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


# --- the order the files run in ---

# The slowest files, slowest first (their test time under `-n 2`, docs/development.md). The
# suite runs on two xdist workers, a file at a time each, in this order (pyproject.toml:
# `--dist loadfile --no-loadscope-reorder`): a worker takes the next file when it is free,
# so a long file left to the end would run alone on one core while the other waits. Files
# not named run after these, in their usual order.
SLOWEST_FIRST = [
    "test_training_instruments.py", "test_slurm.py", "test_slurm_acceptance.py",
    "test_shares.py", "test_gpu_script.py", "test_resume.py",
    "test_quickstart.py", "test_hf.py", "test_analysis.py", "test_training.py",
    "test_training_tables.py", "test_output.py", "test_preprocess_identity.py",
    "test_quality_bench.py", "test_guard.py", "test_parallel_parity.py", "test_planner.py",
    "test_preprocess.py", "test_lm_eval.py", "test_editing.py", "test_lazy_imports.py",
    "test_stages.py", "test_build_data_cache.py", "test_sample_cache.py", "test_full_disk.py",
    "test_stop.py",
]


def _slowest_files_first(items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_collection_modifyitems(items):
    _mark_facts_model_tests(items)
    _slowest_files_first(items)
