"""A trial's figures as training/trial.py reads them from the trainer's log: the lines the
trainer prints on a GPU and on a CPU, a save in the background and a resume, a stop."""

import pytest

from megatron_stem.config import load_recipe
from megatron_stem.training import trial

GPU_STEP = ("step {step}/33 | loss {loss} | lr 4.00e-04 | grad 0.718 (backbone 0.718, tables "
            "0.003) | rows 474 | step {ms} ms (fwd/bwd 231.5, backbone 13.0, tables 1.4, "
            "exposed tables 5.0) | {tok} tok/s (123,846/GPU) | MFU 41.2% | prefetch wait "
            "1.0 ms, h2d 3.0 MB | peak mem {mem} GB")
CPU_STEP = ("step {step}/8 | loss {loss} | lr 3.00e-03 | grad 1.638 (backbone 1.638, tables "
            "0.010) | rows 322 | step {ms} ms (fwd/bwd 80.0, backbone 5.0, tables 1.0, exposed "
            "tables 2.0) | {tok} tok/s (1,024/rank) | peak mem {mem} GB")
START = ("model: total 4.98M, active 1.74M, tables 3.15M, 3.48M FLOPs/token (paper), 8.07M "
         "training FLOPs/token (MFU) | world 2 = TP 1 x DP 2 | {origin} | memory 0.31 GB "
         "for the model, 0.52 GB before the first step")


def _log(template, losses, ms=100.0, tok=1000, mem=1.0, origin="from scratch"):
    lines = [START.format(origin=origin)]
    lines += [template.format(step=i + 1, loss=f"{loss:.4f}", ms=f"{ms * (3 if i == 0 else 1):,.1f}",
                              tok=f"{tok:,}", mem=mem) for i, loss in enumerate(losses)]
    return "\n".join(lines) + "\n"


def test_a_gpu_step_line_and_a_cpu_one_give_the_same_figures():
    gpu = trial.steps_of(_log(GPU_STEP, [7.1234], tok=123846, mem=60.65))[0]
    assert gpu["tokens_per_s"] == 123846 and gpu["mfu"] == pytest.approx(0.412)
    assert gpu["peak_memory_gb"] == 60.65 and gpu["split_ms"]["tables_exposed"] == 5.0
    cpu = trial.steps_of(_log(CPU_STEP, [8.3484]))[0]
    assert cpu["mfu"] is None and cpu["split_ms"]["forward_backward"] == 80.0
    assert trial.steps_of("step 30 | saved runs/x/iter_0000030 (in 1.20 s)") == []


def test_figures_are_the_second_half_s_medians_and_mfu_is_counted_on_a_cpu():
    recipe = load_recipe("recipes/tiny_cpu.yaml", ["train.steps=7"])
    log = _log(CPU_STEP, [8.0, 7.5, 7.0, 6.5, 6.0, 5.5], ms=100.0, tok=2000, mem=0.5)
    f = trial.figures(log, recipe, steps=6)
    assert f["reached"] and f["steps"] == 6 and f["loss_falls"]
    assert f["step_ms"] == 100.0  # the first step's 300 ms (warm-up) is not in the median
    assert (f["loss_first"], f["loss_last"]) == (8.0, 5.5)
    assert f["world"] == 2 and f["model_memory_gb"] == 0.31 and f["state_memory_gb"] == 0.52
    from megatron_stem.model.accounting import mfu
    assert f["mfu"] == pytest.approx(mfu(2000, recipe.model, recipe.train.peak_flops, 2))
    assert f["asked_steps"] == 7 and f["asked_samples"] == 7 * recipe.train.global_batch_size
    short = trial.figures(_log(CPU_STEP, [8.0, 8.1]), recipe, steps=6)
    assert not short["reached"] and not short["loss_falls"]


def test_a_resumed_run_with_the_same_next_loss_and_one_without():
    saved = ("step 3 | saved /r/iter_0000003 (the step waited 0.25 s; written in the "
             "background, committed 1.50 s later)")
    a = _log(CPU_STEP, [8.0, 7.9, 7.8, 7.7]) + saved + "\n"
    resumed = "resuming from /r/iter_0000003 (read in 2.40 s, at most 0.06 GB by a rank)"
    b = START.format(origin=resumed) + "\n" + CPU_STEP.format(
        step=4, loss="7.7000", ms="100.0", tok="1,000", mem=1.0) + "\n"
    f = trial.checkpoint_figures(a, b, step=4)
    assert f["loss_equal"] and f["saved"] and f["resumed_from"]
    assert (f["waited_s"], f["committed_after_s"]) == (0.25, 1.5)
    assert (f["resume_s"], f["read_gb_per_rank"]) == (2.4, 0.06)
    other = trial.checkpoint_figures(a, b.replace("7.7000", "7.7001"), step=4)
    assert not other["loss_equal"]
    assert not trial.checkpoint_figures(a.replace(saved, ""), b, step=4)["saved"]


@pytest.mark.parametrize("exit_code,markers,requeue", [
    (0, ["stopped.node1", "stopped.node2"], True), (0, ["stopped.node1"], False),
    (138, ["stopped.node1", "stopped.node2"], False)])
def test_a_stop_is_a_requeue_when_every_node_left_its_marker_and_the_launcher_exit_0(
        tmp_path, exit_code, markers, requeue):
    log = _log(CPU_STEP, [8.0, 7.9]) + ("step 2 | saved /r/iter_0000002 (in 0.50 s)\n"
                                        "step 2 | stop signal: checkpoint saved, exiting for "
                                        "requeue\n")
    f = trial.stop_figures(log, exit_code, [tmp_path / m for m in markers], nodes=2)
    assert f["stopped_at"] == 2 and f["saved"] and f["save_s"] == 0.5
    assert f["requeue"] is requeue
