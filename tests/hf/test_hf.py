"""Hugging Face export and import, proven against the megatron model itself.

One torchrun job (`workers/hf_reference.py`, 2 ranks) saves STEM and dense checkpoints at
TP=2 and at PP=2 with their full-vocab logits and greedy decodes, and loads the imports of
two random HF models at both layouts. Everything else runs in this process: export, HF
loading (`trust_remote_code`), generate, round trips, errors, memory, lm-eval.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.lm_eval_tasks import LM_EVAL_DOCS, run_lm_eval_cli, write_local_lm_eval_tasks
from support.processes import ROOT, hf_tensors, subprocess_env, tool, torchrun
from megatron_stem import checkpoint
from megatron_stem.runtime.errors import UserError
from megatron_stem.hf.export import export
from megatron_stem.hf.import_model import import_hf
from megatron_stem.data.tokenizer import load_tokenizer
from workers.common import TINY, hf_shape

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
import transformers  # noqa: E402,F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_stem.hf.remote.configuration_stem import StemConfig  # noqa: E402
from megatron_stem.hf.remote.modeling_stem import StemForCausalLM  # noqa: E402

pytestmark = pytest.mark.integration  # the reference checkpoints come from torchrun runs

VOCAB = TINY["vocab_size"]  # 300 real ids; megatron pads embeddings/logits to 384
CASES = ["stem_tp2", "stem_pp2", "dense_tp2", "dense_pp2"]
HF_SOURCES = {"hf_stem": dict(stem_layers=[1, 3], tie_word_embeddings=False),
              "hf_dense": dict(stem_layers=[], tie_word_embeddings=True)}


def load_hf(folder: Path, **kwargs):
    """As users load an export: a STEM model with its code, a dense one as transformers'
    own Llama (no remote code)."""
    remote = (folder / "modeling_stem.py").is_file()
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote,
                                                **kwargs).eval()


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory):
    """Random HF models (STEM untied, dense tied), saved by transformers' own
    `save_pretrained`, with their logits, and their imports as megatron checkpoints."""
    root = tmp_path_factory.mktemp("hf_sources")
    sources = {}
    for i, (name, fields) in enumerate(HF_SOURCES.items()):
        torch.manual_seed(i)
        config = StemConfig(**hf_shape(VOCAB), **fields)
        model = StemForCausalLM(config).eval()
        with torch.no_grad():  # norms away from 1, so a norm mix-up cannot go unnoticed
            for p in model.parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        ckpt = import_hf(root / name, root / f"{name}_ckpt")
        sources[name] = {"dir": root / name, "ckpt": ckpt, "model": model}
    return sources


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, hf_sources):
    out = tmp_path_factory.mktemp("megatron")
    torchrun(2, "hf_reference.py", "--out", out,
             "--load", *[f"{name}={s['ckpt']}" for name, s in hf_sources.items()])
    reference = torch.load(out / "reference.pt")
    reference["root"] = out
    return reference


@pytest.fixture(scope="module")
def exported(megatron, tmp_path_factory):
    root = tmp_path_factory.mktemp("exported")
    # A tiny shard limit, so the multi-shard index path is what gets tested.
    return {case: export(megatron["root"] / case, root / case, max_shard_bytes=100_000)
            for case in CASES}


# ---------------------------------------------------------------------------------------
# Parity with megatron
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_exported_logits_equal_megatron(case, megatron, exported):
    model = load_hf(exported[case])
    if case.startswith("stem"):
        assert model.config.stem_layers == [1, 3]
    else:
        assert type(model) is transformers.LlamaForCausalLM
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    assert logits.shape[-1] == VOCAB
    torch.testing.assert_close(logits, megatron[case]["logits"][..., :VOCAB],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_generate_equals_megatron_greedy_decode(case, megatron, exported):
    """HF decodes with its KV cache, megatron recomputes the whole sequence every step."""
    model = load_hf(exported[case])
    reference = megatron[case]["greedy"]
    prompt = megatron["prompt"]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=reference.shape[1] - prompt.shape[1],
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert isinstance(out.cache, transformers.DynamicCache)
    assert out.cache.get_seq_length() == reference.shape[1] - 1  # the last token is not fed


@pytest.mark.parametrize("name", list(HF_SOURCES))
def test_imported_checkpoint_matches_hf_at_tp2_and_pp2(name, hf_sources, megatron):
    with torch.no_grad():
        expected = hf_sources[name]["model"](megatron["tokens"]).logits
    # Tied embeddings cannot be built at PP>1 on CPU (see workers/hf_reference.py).
    tied = HF_SOURCES[name]["tie_word_embeddings"]
    for layout in ("tp2",) if tied else ("tp2", "pp2"):
        logits = megatron[f"{name}@{layout}"]
        torch.testing.assert_close(logits[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HF_SOURCES))
def test_hf_megatron_hf_round_trip_is_bit_exact(name, hf_sources, tmp_path):
    """HF (as transformers saves it) -> megatron -> HF: identical tensors."""
    source = hf_sources[name]
    again = hf_tensors(export(source["ckpt"], tmp_path / "again"))
    original = hf_tensors(source["dir"])
    assert again.keys() == original.keys()
    for key, value in original.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key


def test_export_import_export_is_bit_exact_and_keeps_the_recipe(megatron, exported, tmp_path):
    first = exported["stem_pp2"]
    again = export(import_hf(first, tmp_path / "ckpt", step=7), tmp_path / "again")
    a, b = hf_tensors(first), hf_tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "config.json").read_text() == (again / "config.json").read_text()
    # The import re-creates the exact model recipe ("1/2", not [1, 3]), so a run resumed
    # with the original recipe passes its shape check.
    original = checkpoint.read_recipe(checkpoint.resolve(megatron["root"] / "stem_pp2"))
    imported = checkpoint.read_recipe(checkpoint.resolve(tmp_path / "ckpt"))
    checkpoint.check_same_shape(imported, original, tmp_path / "ckpt")
    assert imported.model.stem_layers == "1/2"


def test_import_of_a_model_re_saved_by_transformers(megatron, exported, tmp_path):
    """Fine-tune or edit in HF, save_pretrained, import to continue training: the same
    tensors and the same recipe come back (HF drops the tied lm_head; config extras stay)."""
    for case in ("stem_tp2", "dense_tp2"):  # untied and tied
        resaved = tmp_path / case
        load_hf(exported[case]).save_pretrained(resaved)
        ckpt = import_hf(resaved, tmp_path / f"{case}_ckpt")
        again = hf_tensors(export(ckpt, tmp_path / f"{case}_again"))
        original = hf_tensors(exported[case])
        assert again.keys() == original.keys()
        assert all(torch.equal(again[k], original[k]) for k in original)
        native = checkpoint.resolve(megatron["root"] / case)
        assert checkpoint.read_recipe(ckpt).model == checkpoint.read_recipe(native).model


def test_import_writes_the_same_dist_checkpoint_keys_as_megatron(megatron, hf_sources):
    """Guards the hand-built dist checkpoint against megatron format drift."""
    from megatron_stem.checkpoint.streaming import CheckpointReader
    from torch.distributed.checkpoint import FileSystemReader

    def keys(ckpt):
        return set(FileSystemReader(str(ckpt / checkpoint.MODEL)).read_metadata()
                   .state_dict_metadata)

    native = checkpoint.resolve(megatron["root"] / "stem_tp2")
    imported = hf_sources["hf_stem"]["ckpt"]
    assert keys(imported) == keys(native)
    a, b = CheckpointReader(imported / checkpoint.MODEL), CheckpointReader(native / "model")
    assert all(a.shape(k) == b.shape(k) for k in a.keys())
    assert json.loads((imported / "model/metadata.json").read_text()) == \
        json.loads((native / "model/metadata.json").read_text())


# ---------------------------------------------------------------------------------------
# The HF model itself
# ---------------------------------------------------------------------------------------


def test_tables_on_cpu_give_identical_logits_and_stay_on_the_host(megatron, exported):
    plain = load_hf(exported["stem_tp2"])
    host = load_hf(exported["stem_tp2"], stem_tables_on_cpu=True)
    assert host.config.stem_tables_on_cpu and not plain.config.stem_tables_on_cpu
    tables = [m for name, m in host.named_modules() if name.endswith("mlp.table")]
    staged_used = []  # per table call: did it get rows staged for exactly its ids?
    for t in tables:
        t.register_forward_pre_hook(lambda m, args: staged_used.append(
            m.staged is not None and m.staged[0] is args[0]))
    tokens = megatron["tokens"]
    with torch.no_grad():
        assert torch.equal(host(tokens).logits, plain(tokens).logits)
        # Remapped ids ([b, s] stem_ids) are what gets staged, not the input ids.
        remap = tokens.flip(-1)
        assert torch.equal(host(tokens, stem_ids=remap).logits,
                           plain(tokens, stem_ids=remap).logits)
    assert staged_used == [True] * 2 * len(tables)
    prompt = megatron["prompt"]
    out = host.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                        max_new_tokens=megatron["stem_tp2"]["greedy"].shape[1] - prompt.shape[1])
    assert torch.equal(out, megatron["stem_tp2"]["greedy"])
    tables = [t.weight for t in tables]
    assert len(tables) == 2
    host.to(torch.bfloat16)  # casts apply to tables too ...
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tables)
    host.to("meta")  # ... moves do not (meta stands in for an accelerator here)
    assert host.lm_head.weight.device.type == "meta"
    assert all(t.device.type == "cpu" for name, t in host.named_parameters()
               if name.endswith("mlp.table.weight"))


def test_host_tables_with_a_decode_cache_give_identical_logits(megatron, exported):
    """A cache far smaller than the vocabulary (evictions all along): greedy decoding and
    full-sequence logits are unchanged, decoding is partly served by the cache, and a
    table edited in place is never read stale from it. The export carries the row cache
    module itself (shared with the trainer, imports only torch), not the package's
    re-export of it."""
    bundled = (exported["stem_tp2"] / "row_cache.py").read_text()
    assert bundled == (ROOT / "megatron_stem/model/row_cache.py").read_text()
    plain = load_hf(exported["stem_tp2"])
    host = load_hf(exported["stem_tp2"], stem_tables_on_cpu=True, stem_table_cache_rows=8)
    prompt, greedy = megatron["prompt"], megatron["stem_tp2"]["greedy"]
    out = host.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                        max_new_tokens=greedy.shape[1] - prompt.shape[1])
    assert torch.equal(out, greedy)
    tokens, stager = megatron["tokens"], host.model.host_rows
    with torch.no_grad():
        assert torch.equal(host(tokens).logits, plain(tokens).logits)
        hits = stager.hits
        assert torch.equal(host(tokens).logits, plain(tokens).logits)  # now partly cached
        assert stager.hits > hits
        hot = int(host.model.host_rows.cache.id_of[0])
        for model in (plain, host):
            model.model.layers[1].mlp.table.weight[hot] += 1.0
        assert torch.equal(host(tokens).logits, plain(tokens).logits)


def test_left_padded_batch_generates_like_each_prompt_alone(exported):
    model = load_hf(exported["stem_tp2"])
    a, b = [5, 17, 42, 7, 99, 3], [8, 250, 31]
    batch = torch.tensor([a, [0] * 3 + b])
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8,
                         pad_token_id=0)
    for row, prompt in enumerate((a, b)):
        alone = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                               do_sample=False, max_new_tokens=8, pad_token_id=0)
        assert out[row, 6:].tolist() == alone[0, len(prompt):].tolist()


def test_conversion_memory_stays_near_the_largest_tensor(tmp_path):
    # A fixed malloc mmap threshold: freed tensors go back to the OS at once, so RSS shows
    # live memory (glibc's adaptive threshold would keep freed 16 MB blocks on the heap).
    proc = subprocess.run([sys.executable, str(ROOT / "tests/workers/hf_memory.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=subprocess_env(PYTHONWARNINGS="ignore",
                                             MALLOC_MMAP_THRESHOLD_=str(2**20)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 3 * result["largest"]
    assert result["total"] > 2 * bound  # so the check can tell streaming from loading it all
    assert result["import_peak"] < bound and result["export_peak"] < bound, result


# ---------------------------------------------------------------------------------------
# CLI, tokenizer, dtype
# ---------------------------------------------------------------------------------------

TEXTS = ["the stem table and the token", "  hugging face, export!", "alpha\nbeta 42 é",
         "model of the gamma delta."]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny unigram SentencePiece model: the kind LlamaTokenizer would get wrong."""
    import sentencepiece

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "stem", "table", "token", "model", "the", "of",
             "and", "hugging", "face", "export", "42", "é"]
    sentences = [" ".join(rng.choice(words) for _ in range(10)) + "." for _ in range(200)]
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(prefix), vocab_size=48,
        hard_vocab_limit=False, minloglevel=2)
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def cli_export(megatron, sp_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "stem_bf16"
    rc = tool("to_hf")(["--checkpoint", str(megatron["root"] / "stem_pp2"), "--output", str(out),
                        "--dtype", "bf16", "--tokenizer", str(sp_model)])
    assert rc == 0
    return out


def test_cli_export_bf16_with_sentencepiece_tokenizer(cli_export, sp_model, megatron):
    import sentencepiece

    config = AutoConfig.from_pretrained(cli_export, trust_remote_code=True)
    assert config.dtype == torch.bfloat16 and config.eos_token_id == 2
    assert all(t.dtype == torch.bfloat16 for t in hf_tensors(cli_export).values())
    tok = AutoTokenizer.from_pretrained(cli_export, trust_remote_code=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    for text in TEXTS:  # the exact training ids, no special tokens added, decoded alike
        assert tok(text)["input_ids"] == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    model = load_hf(cli_export)
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits.float()
    torch.testing.assert_close(logits, megatron["stem_pp2"]["logits"][..., :VOCAB],
                               atol=0.05, rtol=0.05)


@pytest.mark.parametrize("with_config", [False, True])
def test_export_with_a_tokenizer_json(megatron, tmp_path, with_config):
    """A tokenizer.json ships as is; special tokens come from a tokenizer_config.json beside
    it, or else from their usual names."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<s>", "</s>", "stem", "table", "the", "of"]
    raw = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    if with_config:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<s>",
             "chat_template": "{{ messages }}"}))
    out = export(megatron["root"] / "dense_tp2", tmp_path / "hf",
                 tokenizer=tmp_path / "tokenizer.json")
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok("the stem of the table")["input_ids"] == \
        raw.encode("the stem of the table").ids == [5, 3, 6, 5, 4]
    eos = 1 if with_config else 2
    assert tok.eos_token_id == eos
    # Every special id is the one training used (the config leaves bos unsaid: `<s>`).
    trained = load_tokenizer("huggingface", tmp_path)
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (config.bos_token_id, config.eos_token_id, config.pad_token_id) == \
        (trained.bos, trained.eod, trained.pad) == (1, eos, None)
    assert (tok.chat_template is not None) == with_config


def test_cli_user_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert tool("to_hf")(["--checkpoint", str(tmp_path / "nope"),
                          "--output", str(tmp_path / "out")]) == 2
    assert tool("from_hf")(["--hf", str(tmp_path), "--save-dir", str(tmp_path / "ckpt")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines)
    # And as a real process, from a shell: no traceback, one line.
    proc = subprocess.run([sys.executable, str(ROOT / "tools/to_hf.py"), "--checkpoint",
                           str(tmp_path / "nope"), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'nope'}: no such checkpoint folder"


# ---------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------


def _copy_checkpoint(megatron, case: str, dest: Path) -> Path:
    import shutil

    shutil.copytree(checkpoint.resolve(megatron["root"] / case), dest)
    return dest


def test_unfinished_checkpoint_is_refused(megatron, tmp_path):
    partial = _copy_checkpoint(megatron, "stem_tp2", tmp_path / "run" / "iter_0000002.tmp")
    (partial / checkpoint.COMPLETE).unlink()
    for path in (partial, tmp_path / "run"):
        with pytest.raises(UserError, match="not a complete megatron-stem checkpoint"):
            export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_foreign_checkpoints_are_refused(megatron, tmp_path):
    megatron_lm = tmp_path / "megatron_lm"  # Megatron-LM's own layout
    (megatron_lm / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (megatron_lm / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(UserError, match="no COMPLETE marker"):
        export(megatron_lm, tmp_path / "out")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / checkpoint.COMPLETE).write_text("")
    with pytest.raises(UserError, match="not a megatron-stem checkpoint"):
        export(bare, tmp_path / "out")
    # Tensors that contradict the recipe: nothing may be dropped or invented silently.
    edited = _copy_checkpoint(megatron, "stem_tp2", tmp_path / "edited")
    recipe = (edited / checkpoint.RECIPE).read_text()
    (edited / checkpoint.RECIPE).write_text(recipe.replace("stem_layers: 1/2", "stem_layers: none"))
    with pytest.raises(UserError, match="missing decoder.layers.1.mlp.linear_fc1.weight"):
        export(edited, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizer_larger_than_the_vocab_is_refused(megatron, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(VOCAB + 100)}
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match=f"has {VOCAB + 100} tokens but the model's vocab_size "
                                        f"is {VOCAB}"):
        export(megatron["root"] / "dense_tp2", tmp_path / "out",
               tokenizer=tmp_path / "tokenizer.json")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(megatron, exported):
    with pytest.raises(UserError, match="already exists"):
        export(megatron["root"] / "stem_tp2", exported["stem_tp2"])


def test_import_refuses_foreign_or_incomplete_hf_folders(hf_sources, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    foreign = shutil.copytree(hf_sources["hf_stem"]["dir"], tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type is 'gpt2'; only 'megatron_stem' .* and "
                                        "'llama' import"):
        import_hf(foreign, tmp_path / "ckpt")
    # A Llama is dense: STEM tensors under that name are not one.
    (foreign / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(UserError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        import_hf(foreign, tmp_path / "ckpt")
    partial = shutil.copytree(hf_sources["hf_stem"]["dir"], tmp_path / "partial")
    weights = load_file(partial / "model.safetensors")
    del weights["model.layers.1.mlp.table.weight"]
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="missing tensor model.layers.1.mlp.table.weight"):
        import_hf(partial, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------
# lm-evaluation-harness, offline
# ---------------------------------------------------------------------------------------

def test_lm_eval_harness_runs_on_the_export_offline(cli_export, tmp_path):
    """docs/export.md's command and local task (a YAML over a JSONL file), with the hub and
    datasets offline: nothing is downloaded, and lm-eval's accuracies are the ones computed
    here from the export's own log-likelihoods: each document's answer is the choice with
    the largest log p(" " + choice | question) (acc), or per character of the choice
    (acc_norm), each from one forward of the HF model (lm-eval at batch size 1: the same
    bf16 arithmetic)."""
    tasks = write_local_lm_eval_tasks(tmp_path / "tasks")
    results = run_lm_eval_cli(cli_export, tasks, ["my_local_task"], tmp_path, batch_size=1)
    assert results["n-samples"]["my_local_task"]["effective"] == len(LM_EVAL_DOCS)
    model = load_hf(cli_export, dtype="auto", stem_tables_on_cpu=True)  # as lm-eval loads it
    tok = AutoTokenizer.from_pretrained(cli_export, trust_remote_code=True)
    right = right_norm = 0
    for doc in LM_EVAL_DOCS:
        context = tok(doc["question"])["input_ids"]
        scores = []
        for choice in doc["choices"]:
            continuation = tok(doc["question"] + " " + choice)["input_ids"][len(context):]
            with torch.no_grad():
                logits = model(torch.tensor([(context + continuation)[:-1]])).logits[0]
            logprobs = torch.log_softmax(logits, -1)[len(context) - 1:]
            scores.append(float(logprobs[torch.arange(len(continuation)),
                                         torch.tensor(continuation)].sum()))
        right += max(range(3), key=lambda i: scores[i]) == doc["answer"]
        right_norm += max(range(3), key=lambda i: scores[i] / len(doc["choices"][i])) == \
            doc["answer"]
    measured = results["results"]["my_local_task"]
    assert measured["acc,none"] == right / len(LM_EVAL_DOCS)
    assert measured["acc_norm,none"] == right_norm / len(LM_EVAL_DOCS)
