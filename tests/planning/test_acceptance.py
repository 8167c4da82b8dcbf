"""The acceptance report (planning/acceptance.py): verdicts, the planner's predictions of a
trial, the refit profile predicting what was measured (planning/refit.py), the
collectives' sizes (planning/collectives.py), and the report's files from a work folder."""

import json

import pytest

from megatron_stem.config import load_recipe
from megatron_stem.planning import acceptance, collectives, hardware, refit, traffic
from megatron_stem.planning.acceptance import Check
from megatron_stem.planning.backbone import reduce_bucket_elements
from megatron_stem.planning.budget import step_seconds
from megatron_stem.planning.step import configured_option, layout_of, rows_for
from megatron_stem.planning.workload import Cluster, workload

H200 = hardware.PUBLISHED["h200"]
CLUSTER = Cluster(4, 8)


@pytest.mark.parametrize("measured,predicted,higher,verdict", [
    (110.0, 100.0, False, "as predicted"), (130.0, 100.0, False, "worse than predicted"),
    (70.0, 100.0, False, "better than predicted"), (80.0, 100.0, True, "as predicted"),
    (70.0, 100.0, True, "worse than predicted"), (130.0, 100.0, True, "better than predicted"),
    (True, None, False, "ok"), (False, None, False, "failed"), (None, 5.0, False, "failed"),
    (3.0, None, False, "not predicted")])
def test_a_figure_is_judged_by_its_ratio_to_the_prediction(measured, predicted, higher,
                                                            verdict):
    c = Check("s", "n", "compute", "ms", measured, predicted, higher_is_better=higher).judge()
    assert c.verdict == verdict
    assert bool(c.fix) is (verdict in ("worse than predicted", "failed"))


def test_a_small_part_of_the_step_is_not_judged():
    small = Check("s", "n", "tables", "ms", 30.0, 10.0, whole=1000.0).judge()
    assert small.verdict == "not judged (small)" and not small.failed
    big = Check("s", "n", "tables", "ms", 80.0, 10.0, whole=1000.0).judge()
    assert big.verdict == "worse than predicted" and big.fix == acceptance.FIXES["tables"]


def test_a_trial_s_prediction_is_the_planner_s():
    for path in ("recipes/stem_1b.yaml", "recipes/dense_1b.yaml"):
        recipe = load_recipe(path)
        p = acceptance.trial_predictions(recipe, CLUSTER, H200)
        assert p["step_ms"] == pytest.approx(step_seconds(recipe, CLUSTER, H200) * 1e3)
        tokens = recipe.train.global_batch_size * recipe.model.seq_length
        assert p["tokens_per_s"] == pytest.approx(tokens / p["step_ms"] * 1e3)
        assert p["forward_backward_ms"] + p["backbone_ms"] + p["tables_exposed_ms"] == \
            pytest.approx(p["step_ms"])
        assert 0 < p["state_gb"] < p["peak_gb"] < H200.memory_bytes / 1e9


def test_a_trials_memory_is_judged_part_by_part():
    """The model built, the optimizer's states, the step's gradients and activations: the
    part that grew is the one that fails, its fix the memory's; the others as predicted.
    The 1B STEM recipe's tables are on the device: their weights are part of the model's."""
    p = acceptance.trial_predictions(load_recipe("recipes/stem_1b.yaml"), Cluster(2, 8), H200)
    assert 0 < p["model_gb"] < p["state_gb"] < p["peak_gb"]
    dense = acceptance.trial_predictions(load_recipe("recipes/dense_1b.yaml"), Cluster(2, 8),
                                         H200)
    assert p["model_gb"] > dense["model_gb"] + 10  # 5 tables of 128k x 8k in bf16
    gib = {part: p[f"{part}_gb"] * 1e9 / 2 ** 30 for part in ("model", "state", "peak")}
    gib["peak"] += 0.5 * (gib["peak"] - gib["state"])  # the step's own memory 1.5 x
    figures = {"recipe": "recipes/stem_1b.yaml", "overrides": [],
               "tables": "x", "loss_falls": True,
               **{f"{part}_memory_gb": v for part, v in gib.items()}}
    checks = {c.name: c.judge() for c in acceptance.trial_checks("train_stem", figures,
                                                                   Cluster(2, 8), H200)}
    assert checks["memory: weights and device tables"].verdict == "as predicted"
    # 1 GB of the 40 (ZeRO-1 over 16 ranks; the tables' states are in host memory)
    assert checks["memory: optimizer states"].verdict == "not judged (small)"
    grown = checks["memory: the step's gradients and activations"]
    assert grown.verdict == "worse than predicted" and grown.fix == acceptance.FIXES["memory"]
    assert grown.ratio == pytest.approx(1.5)


def test_the_refit_predicts_the_forward_backward_it_was_fitted_to():
    w = workload(load_recipe("recipes/dense_1b.yaml"), CLUSTER)
    predicted = refit.compute_seconds(w, CLUSTER, H200)
    for measured in (1.7 * predicted, 0.9 * predicted):
        fitted = refit.fit_compute(H200, w, CLUSTER, measured)
        assert refit.compute_seconds(w, CLUSTER, fitted) == pytest.approx(measured, rel=2e-3)
    fast = refit.fit_compute(H200, w, CLUSTER, 0.01 * predicted)  # beyond the GPU's peak
    assert max(e for _, e in fast.gemm_curve) == pytest.approx(1.0)


def test_the_refit_links_predict_the_all_reduces_they_were_fitted_to():
    bucket = collectives.Collective("all_reduce", "bucket", 160e6)
    measured = [{"kind": "all_reduce", "scope": "node", "ranks": 8, "bytes": 160e6,
                 "seconds": 1.2 * collectives.predicted_seconds(bucket, 8, 8, H200)},
                {"kind": "all_reduce", "scope": "world", "ranks": 32, "bytes": 160e6,
                 "seconds": 2 * collectives.predicted_seconds(bucket, 32, 8, H200)}]
    fitted = refit.fit_links(H200, measured, gpus_per_node=8)
    for m in measured:
        assert collectives.predicted_seconds(bucket, m["ranks"], 8, fitted) == \
            pytest.approx(m["seconds"])
    assert set(refit.changes(H200, fitted)) == {"nvlink_bw", "nic_bw"}


def test_the_collectives_are_the_step_s_at_the_recipe_s_sizes():
    recipe = load_recipe("recipes/stem_1b.yaml")
    found = {c.kind: c for c in collectives.sizes(recipe, CLUSTER, H200)}
    w = workload(recipe, CLUSTER)
    assert found["all_reduce"].nbytes == reduce_bucket_elements(recipe.model, 1, 32) * 4
    lay = layout_of(w, configured_option(recipe), CLUSTER, H200)
    counts = rows_for(w.rows, lay)
    assert found["all_to_all"].nbytes == traffic.grads_to_owners_bytes(w.shape, lay, counts)
    assert found["all_gather"].nbytes == pytest.approx(
        traffic.gather_bytes(w.shape, lay, counts) / 5)
    assert [c.kind for c in collectives.sizes(load_recipe("recipes/dense_1b.yaml"), CLUSTER,
                                              H200)] == ["all_reduce"]
    assert collectives.groups(32, 8) == [("node", 8), ("world", 32)]
    assert collectives.groups(8, 8) == [("node", 8)] and collectives.groups(2, 1) == [
        ("world", 2)]
    assert collectives.groups(1, 1) == []


def _work(tmp_path, trials: dict, stages: dict) -> None:
    (tmp_path / "logs").mkdir(parents=True)
    (tmp_path / "stages.jsonl").write_text("".join(
        json.dumps({"name": n, "status": s, "seconds": 10, "limit_s": 60}) + "\n"
        for n, s in stages.items()))
    for name, figures in trials.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(figures))
    (tmp_path / "environment").mkdir()
    for host in ("node1", "node2"):
        (tmp_path / "environment" / f"{host}.json").write_text(json.dumps(
            {"host": host, "gpu": "NVIDIA H200", "gpus": 8, "driver": "580", "cuda": "13.0",
             "torch": "2.15.0", "ops_built": True,
             "infiniband": [{"device": "mlx5_0", "port": "1", "state": "4: ACTIVE"}]}))


def _as_predicted(recipe: str, overrides: list[str], stem: bool) -> dict:
    """A trial's figures exactly as the planner predicts them (GB as the trainer's GiB)."""
    p = acceptance.trial_predictions(load_recipe(recipe, overrides), Cluster(2, 8), H200)
    return {"recipe": recipe, "overrides": overrides, "steps": 20, "loss_falls": True,
            "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"], "step_ms": p["step_ms"],
            "split_ms": {"forward_backward": p["forward_backward_ms"],
                         "backbone_step": p["backbone_ms"],
                         "tables_exposed": p["tables_exposed_ms"]},
            **{f"{part}_memory_gb": p[f"{part}_gb"] * 1e9 / 2 ** 30
               for part in ("model", "state", "peak")}, "tables": "x" if stem else None}


def test_a_run_as_predicted_passes_and_a_failed_stage_fails_it_with_its_fix(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    trials = {"train_dense": _as_predicted("recipes/dense_1b.yaml", [], False),
              "train_stem": _as_predicted("recipes/stem_1b.yaml", [], True)}
    # the dense trial's forward/backward 1.6 x the prediction: the refit takes it in
    trials["train_dense"]["split_ms"]["forward_backward"] *= 1.6
    _work(work, trials, {"environment": "ok", "train_dense": "ok", "train_stem": "ok"})
    summary = acceptance.report(work, out, Cluster(2, 8), H200)
    checks = {(c["stage"], c["name"]): c for c in summary["checks"]}
    slow = checks["train_dense", "forward/backward"]
    assert slow["verdict"] == "worse than predicted" and slow["ratio"] == pytest.approx(1.6)
    assert slow["predicted_refit"] == pytest.approx(slow["measured"], rel=2e-3)
    others = [c for k, c in checks.items() if k != ("train_dense", "forward/backward")
              and c["stage"] == "train_stem"]
    assert {c["verdict"] for c in others} <= {"as predicted", "ok", "not judged (small)"}
    assert summary["verdict"] == "fail" and summary["to_do"] == [
        f"train_dense: forward/backward: {acceptance.FIXES['compute']}"]
    assert {"mfu", "gemm_curve"} <= set(summary["profile"]["changes"])
    fitted = hardware.load(str(out / "h200.json"))  # as --check --hardware FILE reads it
    assert fitted.mfu == pytest.approx(H200.mfu / 1.6, rel=0.05)
    assert (out / "measured_vs_predicted.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "summary.md").read_text()
    assert md.startswith("# Acceptance run: fail") and "| node2 | NVIDIA H200 | 8 |" in md

    trials["train_dense"]["split_ms"]["forward_backward"] /= 1.6
    _work(tmp_path / "again", trials, {"environment": "ok", "smoke": "failed (exit 1)",
                                       "train_stem": "timeout"})
    summary = acceptance.report(tmp_path / "again", out, Cluster(2, 8), H200)
    assert summary["verdict"] == "fail"
    smoke, stem = summary["to_do"]
    assert smoke.startswith("smoke: " + acceptance.STAGE_FIXES["smoke"])
    assert stem.startswith("train_stem: " + acceptance.TIMEOUT_FIX)
    assert stem.endswith(f"its log: {tmp_path / 'again' / 'logs' / 'train_stem.log'}")


def test_the_nodes_must_be_alike_and_reach_each_other_over_infiniband():
    def node(host, **kw):
        return {"host": host, "gpu": "NVIDIA H100 80GB HBM3", "gpus": 8, "driver": "580",
                "ops_built": True, "infiniband": [{"state": "4: ACTIVE"}], **kw}

    checks = acceptance.environment_checks([node("a"), node("b", driver="570",
                                                               infiniband=[])], CLUSTER)
    failed = {c.key for c in (c.judge() for c in checks) if c.failed}
    assert failed == {"gpus", "nodes_alike", "infiniband"}  # and 2 of 4 nodes reported
