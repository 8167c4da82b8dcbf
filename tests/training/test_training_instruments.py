"""A long run's instruments, carried by one host-table run killed and resumed
(torchrun/gloo, tiny model): W&B (offline), a profiler window, named validation sets and
lm-eval in the loop; none of them changes the curve."""

import json
import re

import pytest

from support.lm_eval_tasks import lm_eval_offline_env, run_lm_eval_cli, write_local_lm_eval_tasks
from support.processes import tool
from support.training_runs import (assert_same_curve, progressions, tensorboard_scalars,
                           write_documents)

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


def test_host_tables_two_ranks_one_copy_killed_and_resumed(host_run, reference):
    """tables.placement=host: 2 DP ranks share one host copy (each updates the rows it
    owns), with a hot-row cache and activation recompute; killed at step 3 and resumed,
    the curve is the device-resident single-rank one, with every instrument of a long run
    on (below: they change nothing). The host metrics are logged."""
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    assert first["step"] == 3 and second["step"] == 6
    assert_same_curve(first["losses"] + second["losses"], reference["lazy"]["losses"])
    log = tensorboard_scalars(save_dir / "tensorboard")
    for tag in ("tables/prefetch_wait_ms", "tables/h2d_bytes", "tables/cache_hit_rate"):
        assert sorted(log[tag]) == list(range(1, 7)), tag
    assert all(v > 0 for v in log["tables/h2d_bytes"].values())
    # Each run starts with an empty cache, then hot rows hit.
    assert log["tables/cache_hit_rate"][1] == log["tables/cache_hit_rate"][4] == 0
    assert all(0 < log["tables/cache_hit_rate"][s] < 1 for s in (2, 3, 5, 6))

@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """40 documents of stride 5 (the training data's are 1-3): a validation set apart."""
    return write_documents(str(tmp_path_factory.mktemp("held_out") / "held_out"), 1,
                           progressions(strides=(5, 6), lengths=(30, 60)), count=40)

@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory, corpus_texts) -> str:
    """A 256-piece SentencePiece model (the tiny model's vocabulary is 300) for lm-eval's
    text. No pad id: megatron's dataset masks the labels equal to a tokenizer's pad id,
    which would change the toy data's samples."""
    import sentencepiece

    prefix = tmp_path_factory.mktemp("text_tokenizer") / "sp256"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts[:1000]), model_prefix=str(prefix), vocab_size=256,
        hard_vocab_limit=False, minloglevel=2)
    return str(prefix.with_suffix(".model"))

@pytest.fixture(scope="module")
def host_run(train, held_out, text_tokenizer, tmp_path_factory):
    """2 ranks sharing one host copy of the tables (a hot-row cache, recompute), stopped
    after step 3 and resumed to step 6, carrying every instrument of a long run: W&B
    (offline), a profiler window over steps 2-3 on rank 1, the split's validation and a
    named set, two local lm-eval tasks every 3 steps (a real tokenizer)."""
    root = tmp_path_factory.mktemp("host_run")
    tasks = write_local_lm_eval_tasks(root / "tasks")
    options = ["tables.placement=host", "tables.cache_rows=64", "parallel.recompute=full",
               f"data.tokenizer_model={text_tokenizer}",
               f"data.validation={{held_out: {held_out}}}", "metrics.wandb_project=stem-tests",
               "profile.start_step=2", "profile.steps=2", "profile.ranks=[1]",
               "lm_eval.interval=3", "lm_eval.tasks=[my_local_task, my_local_perplexity]",
               f"lm_eval.include_path={tasks}", "lm_eval.batch_size=4"]
    save_dir = root / "ckpt"
    with pytest.MonkeyPatch.context() as env:
        for name, value in lm_eval_offline_env(root).items():
            env.setenv(name, value)
        env.setenv("WANDB_MODE", "offline")
        first = train(2, *options, save_dir=save_dir, preempt_at=3, name="host_lazy")
        second = train(2, *options, save_dir=save_dir, name="host_lazy_resumed")
    return {"first": first, "second": second, "save_dir": save_dir, "tasks": tasks,
            "root": root, "tokenizer": text_tokenizer}

def wandb_history(save_dir) -> tuple[set[str], dict[str, dict[int, float]], list[dict]]:
    """(run ids, {key: {step: value}}, run configs) of every offline W&B run folder."""
    from support.wandb_records import read_run

    ids, history, configs = set(), {}, []
    for folder in sorted((save_dir / "wandb").glob("offline-run-*")):
        run_id, rows, config = read_run(folder)
        ids.add(run_id)
        configs.append(config)
        for step, row in rows:
            for key, value in row.items():
                history.setdefault(key, {})[step] = value
    return ids, history, configs

def test_wandb_offline_holds_every_logged_step_across_a_resume(host_run):
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    assert first["step"] == 3 and second["step"] == 6
    ids, history, configs = wandb_history(save_dir)
    assert ids == {(save_dir / "wandb_run_id").read_text().strip()}  # one W&B run
    assert len(configs) == 2  # one offline folder per job
    losses = first["losses"] + second["losses"]
    assert history["train/loss"] == {s: pytest.approx(v, rel=1e-12)
                                     for s, v in enumerate(losses, start=1)}
    assert sorted(history["valid/held_out/loss"]) == sorted(history["valid/loss"]) == [3, 6]
    assert sorted(history["lm_eval/my_local_task/acc"]) == [3, 6]
    assert sorted(history["time/tables_exposed_ms"]) == list(range(1, 7))
    assert configs[-1]["optimizer"]["lr"] == 3e-3 and configs[-1]["lm_eval"]["interval"] == 3

def test_named_validation_sets_are_logged_under_their_names(host_run):
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    log = tensorboard_scalars(save_dir / "tensorboard")
    assert sorted(log["valid/loss"]) == sorted(log["valid/held_out/loss"]) == [3, 6]
    assert [log["valid/held_out/loss"][s] for s in (3, 6)] == pytest.approx(
        first["valid_sets"]["held_out"] + second["valid_sets"]["held_out"], rel=1e-6)
    assert [log["valid/loss"][s] for s in (3, 6)] == pytest.approx(
        first["valid"] + second["valid"], rel=1e-6)  # TensorBoard keeps float32
    assert log["valid/held_out/loss"][3] != log["valid/loss"][3]  # another set's loss
    assert "step 6 | valid held_out loss " in second["log"]

def test_a_profiler_window_writes_a_trace_that_loads_on_its_rank_only(host_run):
    folder = host_run["save_dir"] / "profile"
    (trace,) = folder.glob("*.pt.trace.json")  # rank 1's; rank 0 traces nothing
    assert trace.name.startswith("rank1.")
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert len({n for n in names if n.startswith("ProfilerStep#")}) == 2
    for phase, each_step in [("forward_backward", 2), ("backbone_step", 1),
                             ("tables_sync", 1), ("tables_step", 1)]:
        assert names.count(phase) == 2 * each_step, phase  # 2 micro-batches a step
    line = next(line for line in host_run["first"]["log"].splitlines()
                if line.startswith("step 3/6 |"))
    assert re.search(r"\| step [\d.,]+ ms \(fwd/bwd [\d.,]+, backbone [\d.,]+, tables "
                     r"[\d.,]+, exposed tables [\d.,]+\) \| [\d,]+ tok/s \([\d,]+/rank\) \|", line)

def test_in_loop_lm_eval_scores_equal_the_export_evaluated_by_lm_eval(host_run):
    """The scores of step 6, computed in the loop (DP2, host-resident tables, no export),
    are those of `tools/to_hf.py` + `lm_eval --model hf` on the step-6 checkpoint."""
    root, save_dir = host_run["root"], host_run["save_dir"]
    in_loop = host_run["second"]["downstream"][-1]
    assert in_loop["step"] == 6 and [r["step"] for r in host_run["first"]["downstream"]] == [3]
    export = root / "hf"
    assert tool("to_hf")(["--checkpoint", str(save_dir / "iter_0000006"), "--output",
                          str(export), "--tokenizer", host_run["tokenizer"]]) == 0
    results = run_lm_eval_cli(export, host_run["tasks"],
                              ["my_local_task", "my_local_perplexity"], root)
    for task in ("my_local_task", "my_local_perplexity"):
        exported = {k.split(",")[0]: v for k, v in results["results"][task].items()
                    if k.endswith(",none") and "_stderr" not in k}
        assert exported.keys() == in_loop["scores"][task].keys()
        assert in_loop["scores"][task] == pytest.approx(exported, rel=1e-5), task
    assert 0 < in_loop["scores"]["my_local_task"]["acc"] < 1  # a comparison of substance
