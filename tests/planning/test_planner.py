"""The step planner (megatron_stem/planning, tools/plan_step.py): its counters against
hand-computed bytes, its timeline, its CLI."""

import ast
import dataclasses
import json
import re
import subprocess
import sys

import pytest

from megatron_stem.config import ModelConfig, Recipe, TrainConfig, load_recipe
from megatron_stem.planning import backbone, compute, hardware, passes, report, rows, step, traffic
from megatron_stem.planning.traffic import Layout, RowCounts, TableShape

from support.processes import ROOT, subprocess_env, torchrun

SHAPE = TableShape(tables=2, rows=100, width=8)
COUNTS = RowCounts(rank_rows=10, union_rows=30, owned_rows=8, microbatch_rows=14,
                   longest_rank_rows=12, self_rows=3, longest_owned_rows=9)


def layout(partition, placement="device", update="dense", **kw):
    args = dict(optimizer="cpu", dp=4, ranks_per_copy=2, grad_bytes=2, param_bytes=2)
    args.update(kw)
    return Layout(placement, update, partition, dp=args.pop("dp"), **args)


def test_replicated_device_counts_by_hand():
    c = traffic.counters(SHAPE, layout("replicated"), COUNTS)
    assert c["tables/index_bytes"] == 4 * 12 * 8  # padded ids, all-gathered once
    assert c["tables/grad_bytes"] == 30 * 8 * 4 * 2  # the union's fp32 rows, all-reduced
    assert c["tables/gather_bytes"] == 0
    assert c["tables/grad_d2h_bytes"] == 30 * 8 * 4 * 2
    assert c["tables/update_h2d_bytes"] == 100 * 8 * 4 * 2  # dense: the whole fp32 master
    assert c["tables/adam_elements"] == 100 * 8 * 2
    assert c["tables/cpu_state_bytes"] == 100 * 8 * 2 * 12
    lazy = traffic.counters(SHAPE, layout("replicated", update="lazy"), COUNTS)
    assert lazy["tables/update_h2d_bytes"] == 30 * 8 * 2 * 2  # the union, cast to bf16 on the CPU
    assert lazy["tables/adam_elements"] == 30 * 8 * 2


def test_sharded_counts_are_total_over_sharers():
    c = traffic.counters(SHAPE, layout("sharded"), COUNTS)  # DP4, 3 of 10 rows its own
    assert c["tables/index_bytes"] == 2 * 4 * 8 + (10 - 3) * 8  # counts, then ids
    assert c["tables/grad_bytes"] == (10 - 3) * 8 * 2 * 2  # all tables' bf16 grads
    assert c["tables/gather_bytes"] == 3 * 25 * 8 * 2 * 2  # 3 other owners' bf16 shards
    assert c["tables/grad_d2h_bytes"] == 8 * 8 * 4 * 2  # owned touched rows' fp32 grads
    assert c["tables/adam_elements"] == 25 * 8 * 2  # rows/DP, dense
    assert c["tables/cpu_state_bytes"] == 25 * 8 * 2 * 12
    assert c["tables/cpu_state_bytes"] * 4 == traffic.cpu_state_bytes(SHAPE, layout("replicated"))
    assert c["tables/update_h2d_bytes"] == 25 * 8 * 2 * 2
    lazy = traffic.counters(SHAPE, layout("sharded", update="lazy"), COUNTS)
    assert lazy["tables/adam_elements"] == 8 * 8 * 2
    assert lazy["tables/gather_bytes"] == 3 * 9 * 8 * 2 * 2  # padded to the longest owner
    assert lazy["tables/index_bytes"] == 2 * 4 * 8 + 7 * 8 + 2 * 4 * (8 + 9 * 8)
    accelerator = traffic.counters(SHAPE, layout("sharded", optimizer="accelerator"), COUNTS)
    assert accelerator["tables/grad_d2h_bytes"] == accelerator["tables/update_h2d_bytes"] == 0
    assert accelerator["tables/cpu_state_bytes"] == 0


def test_host_counts_by_hand():
    rep = traffic.counters(SHAPE, layout("replicated", "host"), COUNTS)  # 2 copies of 2
    assert rep["tables/index_bytes"] == 4 * 12 * 8  # once for all tables
    assert rep["tables/grad_bytes"] == 30 * 8 * 4 * 2 + 8 * 8 * 4 * 2  # in node, across
    assert rep["tables/h2d_bytes"] == 14 * 8 * 2 * 2  # staged rows, training dtype
    assert rep["tables/adam_elements"] == 50 * 8 * 2  # the copy's rows / its 2 ranks
    assert rep["tables/cpu_state_bytes"] == 50 * 8 * 2 * 12
    sh = traffic.counters(SHAPE, layout("sharded", "host"), COUNTS)
    assert sh["tables/adam_elements"] == 25 * 8 * 2
    assert sh["tables/cpu_state_bytes"] == 50 * 8 * 2 * 4 + 25 * 8 * 2 * 8
    assert sh["tables/gather_bytes"] == 25 * 8 * 4 * 2  # from the other copy's owner, fp32
    # The owner's fp32 rows cross to the accelerator for the all-gather (NCCL), and the
    # other copy's rows come back into this node's copy.
    assert sh["tables/update_h2d_bytes"] == 25 * 8 * 4 * 2
    assert sh["tables/publish_d2h_bytes"] == sh["tables/gather_bytes"]
    assert rep["tables/update_h2d_bytes"] == rep["tables/publish_d2h_bytes"] == 0


def test_cpu_training_moves_nothing_between_devices():
    lay = layout("replicated", param_bytes=4, grad_bytes=4, device_is_host=True)
    assert lay.own_master
    c = traffic.counters(SHAPE, lay, COUNTS)
    assert c["tables/grad_d2h_bytes"] == c["tables/update_h2d_bytes"] == 0
    assert c["tables/cpu_state_bytes"] == 100 * 8 * 2 * 8  # moments only


def test_zipf_model():
    assert rows.expected_distinct(1, 1000) == pytest.approx(1.0)
    assert rows.expected_distinct(1e9, 1000) == pytest.approx(1000, rel=1e-6)
    measured = {n: rows.expected_distinct(n, 5000, 1.2) for n in (500, 5000, 50000)}
    s, err = rows.fit_exponent(measured, 5000)
    assert s == pytest.approx(1.2, abs=0.006) and err < 0.01


def test_flow_shop_pipelines_and_respects_blocked_windows():
    a = step.Component("a", "net", 0, "B", 1.0, "tables")
    b = step.Component("b", "cpu", 0, "B", 1.0, "tables")
    assert step._flow_shop([(0.0, [a, b])], 1, {}) == [2.0]
    assert step._flow_shop([(0.0, [a, b])], 2, {}) == [1.5]  # chunks overlap the stages
    assert step._flow_shop([(0.0, [a, b])] * 2, 1, {}) == [2.0, 3.0]
    assert step._flow_shop([(0.0, [a])], 1, {"net": (0.5, 2.0)}) == [3.0]


def _small_workload(hw_name="h200", **model):
    model = ModelConfig(**{**dict(hidden_size=2048, num_layers=16, num_attention_heads=16,
                                  ffn_hidden_size=4096, vocab_size=16000, seq_length=2048,
                                  stem_layers="1/3"), **model})
    recipe = Recipe(model=model, train=TrainConfig(micro_batch_size=4, global_batch_size=256))
    cluster = step.Cluster(1, 8)
    return step.workload(recipe, cluster), cluster, hardware.load(hw_name)


def test_ranking_marks_an_exact_option_when_overlap_hides_the_path():
    w, cluster, hw = _small_workload()
    plans = step.rank(w, cluster, hw)
    by = {str(p.option): p for p in plans}
    hidden = by["device/dense/sharded/next_step/accelerator"]

    def boundary(p):  # the gradient sync, and what outlasts the work it runs beside
        return p.seconds("sync") + p.exposed_beside_tail_s + p.exposed_beside_step_s
    assert hidden.exposed_tables_s == pytest.approx(boundary(hidden))  # the update all hidden
    assert hidden.seconds("sync") > 0
    assert by["device/dense/sharded/delayed/accelerator"].step_s <= hidden.step_s
    best = step.best(plans, "any")
    assert best.option.exact and best.option.implemented and best.option.overlap == \
        "next_step" and best.exposed_tables_s == pytest.approx(boundary(best))  # hidden too
    assert best.step_s == pytest.approx(hidden.step_s, rel=1e-3)
    dense = step.plan(w, None, cluster, hw)
    marked = [line for line in report.ranking(plans, dense, best) if line.startswith("  *")]
    assert len(marked) == 1 and "delayed" not in marked[0] and "next_step" in marked[0]
    # today's path is serial: compute, the backbone's exposed reduction and step, and its
    # whole table path, but for the row gradients' sum beside the reduction's tail
    today = by["device/dense/replicated/none/cpu"]
    beside = today.seconds(step.UNDER_REDUCTION_TAIL)
    assert beside > 0
    assert today.step_s == pytest.approx(
        today.seconds("compute") + today.exposed_reduction_s + today.seconds("backbone") +
        today.table_seconds - beside + today.exposed_beside_tail_s)


def test_removed_up_projections_save_what_their_gemms_cost():
    """A STEM layer's fc1 is the gate alone: the STEM model computes the dense shape less,
    per STEM layer and micro-batch, the fused gate+up GEMMs' time minus the gate's, both
    priced on the GEMM curve, forward and both backward GEMMs."""
    w, cluster, hw = _small_workload()
    t, h, f = w.tokens_per_microbatch, 2048, 4096
    per_layer = 3 * (hw.gemm_seconds(2 * t * h * 2 * f, 8) - hw.gemm_seconds(2 * t * h * f, 8))
    flops, seconds = compute.fc1_saving(w, hw, 8)
    assert seconds == pytest.approx(len(w.stem_layers) * w.microbatches * per_layer)
    assert flops == len(w.stem_layers) * w.microbatches * 3 * 2 * t * h * f
    # more efficient than the step's average: they save less than their FLOPs at the MFU
    assert seconds < flops / (hw.peak_flops * hw.mfu)
    assert hw.gemm_efficiency(1e13) == pytest.approx(0.80) and hw.gemm_efficiency(1e8) == 0.10
    dense_w, _, _ = _small_workload(stem_layers="none")
    dense = step.plan(dense_w, None, cluster, hw)
    stem = step.plan(w, step.Option.parse("device/lazy/sharded/none/accelerator"), cluster, hw)
    assert stem.components[0].seconds == pytest.approx(dense.components[0].seconds)
    assert stem.components[1].seconds == pytest.approx(-seconds)


def test_the_step_boundary_segment():
    """From the last backward to the next step's first lookup: the reduction's tail, the
    sync, DeepSpeed's step, then the forward to the first STEM layer or the first table's
    rows, whichever is later (`next_step`); the whole update first otherwise."""
    w, cluster, hw = _small_workload()
    for text in ("device/dense/sharded/next_step/cpu", "device/dense/sharded/none/cpu"):
        p = step.plan(w, step.Option.parse(text), cluster, hw)
        before = p.exposed_reduction_s + p.exposed_beside_tail_s + p.seconds("sync") + \
            p.seconds("backbone")
        forward = p.seconds("compute") / w.microbatches / 3 * (1 - w.head_share) * \
            min(w.stem_layers) / w.num_layers
        segment = step.boundary_segment_seconds(w, p)
        if text.endswith("none/cpu"):
            assert segment == pytest.approx(before + p.seconds("tables") + forward)
        else:  # the first table's rows first: less than its whole update, more than none
            first = step.stage_shares(w, p.option)[0] * p.seconds("tables") / w.shape.tables
            assert before + forward <= segment <= before + max(forward, first) + 1e-9
            assert segment > before


def test_the_row_grads_sum_runs_beside_the_backbone_reductions_tail():
    """On a GPU the row gradients' sum (a side stream's, queued as the last backward ends)
    costs the step only what outlasts the backbone reduction's exposed tail; on a CPU (no
    side stream) it is serial at the boundary."""
    w, cluster, hw = _small_workload()
    option = step.Option.parse("device/dense/sharded/next_step/cpu")

    def at(bw):
        p = step.plan(w, option, cluster, dataclasses.replace(hw, row_grads_bw=bw))
        collect, = [c for c in p.components if c.name.startswith("collect row grads")]
        return p, collect

    free, _ = at(1e18)
    p, collect = at(hw.row_grads_bw or hw.memory_bw)
    assert collect.phase == step.UNDER_REDUCTION_TAIL and collect.seconds > 0
    assert p.exposed_reduction_s > 0
    assert p.exposed_beside_tail_s == pytest.approx(
        max(0.0, collect.seconds - p.exposed_reduction_s), abs=1e-12)
    slow, slow_collect = at((hw.row_grads_bw or hw.memory_bw) / 100)
    assert slow_collect.seconds > slow.exposed_reduction_s  # outlasts the tail: the rest waits
    assert slow.step_s == pytest.approx(free.step_s + slow_collect.seconds -
                                        slow.exposed_reduction_s)
    if collect.seconds <= p.exposed_reduction_s:
        assert p.step_s == pytest.approx(free.step_s)
    host = dataclasses.replace(hw, device_is_host=True, gloo_allreduce_busbw=1e10,
                               gloo_alltoall_bw=1e10, gloo_allgather_bw=1e10)  # a CPU run
    inline = step.plan(w, option, cluster, host)
    collect, = [c for c in inline.components if c.name.startswith("collect row grads")]
    assert collect.phase == "sync" and inline.exposed_beside_tail_s == 0


def test_boundary_passes_by_hand():
    """RowGradSum.take, the owners' sums and the norm, counted op by op (passes.py)."""
    lay = layout("sharded", grad_bytes=2)
    # 2 tables, 20 positions: bf16 upcast (2 + 4), embedding_dense_backward (read 4; zero
    # and write the micro-batches' 14 rows), the union's zeros (10 rows), index_add (read
    # 14 rows, read + write them in the total), the cast back (read 4, write 2)
    per_table = 20 * 8 * 6 + 20 * 8 * 4 + 14 * 8 * 8 + 10 * 8 * 4 + 14 * 8 * 12 + 10 * 8 * 6
    assert passes.collect_bytes(SHAPE, 20, COUNTS, 2) == 2 * per_table
    assert passes.COLLECT_SYNCS == 1  # rows staged from the host's ids: no unique
    assert passes.norm_bytes(SHAPE, lay, COUNTS) == 8 * 8 * 2 * 36  # owned rows, fp64
    fp32 = layout("sharded", grad_bytes=4)
    assert passes.collect_bytes(SHAPE, 20, COUNTS, 4) == 2 * (
        20 * 8 * 4 + 14 * 8 * 8 + 10 * 8 * 4 + 14 * 8 * 12)  # no casts in fp32
    rows, owned = 10 * 16, 8 * 16  # this rank's rows, all tables; the owned ones
    assert passes.pack_bytes(SHAPE, fp32, COUNTS) == 2 * rows * 2 * 4 + rows * 4 * 3 + \
        owned * 4 + 2 * owned * 4
    # The publication's placing at DP4 of 300 bytes received (100 from each other owner):
    # a separate bf16 table takes them and its own 100 (index_copy_, read + write); a CPU
    # fp32 table is its own master: it takes the 300 and gives its own 100 out for the
    # all-gather (index_select)
    assert passes.placed_bytes(lay, 300) == 400 and passes.place_bytes(lay, 300) == 800
    own = layout("sharded", grad_bytes=4, param_bytes=4, device_is_host=True)
    assert passes.placed_bytes(own, 300) == 300 and passes.place_bytes(own, 300) == 800


def test_the_backbone_reduction_overlaps_the_last_backward():
    """DeepSpeed's buckets as its hook launches them, and what the step waits for: the
    input embedding's gradient is last, so its reduction is never hidden; the engine's
    bucket size (Megatron-LM's) waits within 2% of the best size for the 1B pair, less than
    DeepSpeed's default (5e8 elements), and less than the reduction takes."""
    grads = [backbone.Grad(3, 0.1), backbone.Grad(4, 0.2), backbone.Grad(10, 0.5),
             backbone.Grad(2, 0.9)]
    assert backbone.buckets(grads, 8) == [(7, 0.5), (10, 0.9), (2, 1.0)]
    cluster, hw = step.Cluster(4, 8), hardware.load("h200")
    for name in ("dense_1b", "stem_1b"):
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        w = step.workload(recipe, cluster)
        compute_s = w.flops / hw.compute_rate(8)
        back = backbone.backward_seconds(w, compute_s)
        size = backbone.zero_reduction_config(recipe, w.dp)["reduce_bucket_size"]
        busy, waited = backbone.reduction_seconds(w, hw, 8, back, size)
        _, least = backbone.best_bucket_elements(w, cluster, hw, compute_s)
        _, default = backbone.reduction_seconds(w, hw, 8, back, 500_000_000)
        embedding = backbone._bucket_seconds(w.model.vocab_size * 2048, w, hw, 8)
        assert embedding < least <= waited <= 1.02 * least < default and waited < busy / 3


def _cli(*args, home=None):
    """The CLI as a user runs it; a fresh HOME: no cached or refit profiles."""
    env = subprocess_env(HOME=str(home)) if home else None
    return subprocess.run([sys.executable, str(ROOT / "tools/plan_step.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env)


LAST_LINE = re.compile(r"predicted step time STEM \d+\.\d{3} s, dense \d+\.\d{3} s, "
                       r"ratio (\d+\.\d{2})")


def test_cli_last_line_and_the_1b_pair(tmp_path):
    pair = ["--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
            "--nodes", "4", "--gpus-per-node", "8", "--hardware", "h200"]
    recipe = _cli(*pair, home=tmp_path)
    today = _cli(*pair, "--choose", "device/dense/replicated/none/cpu", home=tmp_path)
    assert recipe.returncode == today.returncode == 0, recipe.stderr + today.stderr
    ratios = []
    for proc in (recipe, today):
        last = proc.stdout.rstrip("\n").splitlines()[-1]
        ratios.append(float(LAST_LINE.fullmatch(last).group(1)))
    # The recipe's step is within a few % of the dense step (what the tables' boundary
    # costs against the up-projections it saves); the path the tables had before they
    # were sharded, several times slower.
    assert 0.95 < ratios[0] < 1.05 and ratios[1] > 3


def test_cli_plans_any_recipe_in_a_short_summary(tmp_path):
    """A dense recipe alone, and a STEM one against its baseline: a few lines by default,
    each recipe's step and memory; `--details` adds the components, ranking and parts."""
    dense = _cli("--recipe", "recipes/dense_1b.yaml", "--nodes", "4", home=tmp_path)
    assert dense.returncode == 0, dense.stderr
    lines = dense.stdout.splitlines()
    assert len(lines) <= 5 and re.fullmatch(r"predicted step time \d+\.\d{3} s, MFU [\d.]+%",
                                            lines[-1]), lines
    assert re.search(r"^recipes/dense_1b\.yaml: step [\d.]+ s, MFU [\d.]+%; memory per GPU "
                     r"[\d.]+ GB of 141: fits$", dense.stdout, re.M), lines
    pair = ["--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
            "--nodes", "4"]
    short, full = _cli(*pair, home=tmp_path), _cli(*pair, "--details", home=tmp_path)
    assert len(short.stdout.splitlines()) <= 8 < 100 < len(full.stdout.splitlines())
    assert short.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    help_text = _cli("--help").stdout
    assert "--choose CHOOSE" in help_text and "(default: recipe)" in help_text


@pytest.mark.parametrize("args, message", [
    (["--recipe", "recipes/nope.yaml", "--baseline", "recipes/dense_1b.yaml"],
     "recipe file not found"),
    (["--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
      "--hardware", "tpu"], "--hardware: unknown profile 'tpu'"),
    (["--recipe", "recipes/dense_1b.yaml", "--choose", "best"],
     "--choose: recipes/dense_1b.yaml has no STEM tables to choose an option for"),
    (["--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
      "--choose", "device/dense"], "--choose: expected"),
    (["--recipe", "recipes/stem_1b.yaml", "--baseline", "recipes/dense_1b.yaml",
      "--choose", "host/dense/replicated/next_step/cpu"], "not a supported combination"),
])
def test_cli_errors_are_one_line(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr


def test_cpu_profile_is_read_from_its_cache_and_never_measured_on_the_way(tmp_path):
    with pytest.raises(hardware.UserError, match="python -m megatron_stem.planning.calibrate"):
        hardware.load("cpu", cache_dir=tmp_path)  # missing: one line saying how to make it
    measured = hardware.Hardware(**{**hardware.PUBLISHED["h200"].__dict__, "name": "cpu",
                                    "device_is_host": True, "cores": 2, "gemm_curve": (),
                                    "alloc_copy_bw": 2e9, "version": hardware.PROFILE_VERSION})
    hardware.save(measured, tmp_path / "cpu.json")
    assert hardware.load("cpu", cache_dir=tmp_path) == measured
    hardware.save(dataclasses.replace(measured, version=1), tmp_path / "cpu.json")
    with pytest.raises(hardware.UserError, match="older calibration"):
        hardware.load("cpu", cache_dir=tmp_path)
    (tmp_path / "cpu.json").write_text("{}")
    with pytest.raises(hardware.UserError, match="not a hardware profile"):
        hardware.load("cpu", cache_dir=tmp_path)
    # and the modules import one way: measuring is calibrate.py's, reading hardware.py's
    tree = ast.parse((ROOT / "megatron_stem/planning/hardware.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not any("calibrate" in m for m in imported)


@pytest.mark.integration  # torchrun
def test_the_trainers_counters_are_what_the_planner_predicts(tmp_path):
    """On two ranks, a step of each device layout: every `tables/*` counter the table
    optimizer logs equals `planning.traffic.counters` on the step's measured row counts
    (the host store logs the staging's `h2d_bytes` itself)."""
    out = tmp_path / "traffic.json"
    torchrun(2, "traffic_worker.py", out)
    result = json.loads(out.read_text())
    assert len(result) == 2 * 4
    for case, counters in result.items():
        predicted = {k: v for k, v in counters["predicted"].items() if k != "h2d_bytes"}
        measured = {k: counters["measured"][k] for k in predicted}
        assert measured == predicted, case
        assert counters["measured"]["comm_bytes"] > 0, case
