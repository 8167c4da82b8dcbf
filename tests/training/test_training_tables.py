"""The tables' placements and update schedules through the trainer (torchrun/gloo, tiny
model): host-resident tables against device-resident ones bit for bit, the update
overlapped with the next step against the serial one, and the 1B recipe's bf16 table
path against the replicated reference."""


import json

import pytest

from support.training_runs import assert_same_checkpoints, assert_same_curve, tensorboard_scalars

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


# Each kernel, each update mode and each partition once (the suite's time: the full
# 2 x 2 x 2 adds four minutes and no path).
@pytest.mark.parametrize("kernel, update, partition", [
    ("torch", "lazy", "sharded"), ("deepspeed", "dense", "replicated")])
def test_host_tables_match_device_tables_bit_for_bit(train, kernel, update, partition):
    """Both placements sum a row's gradients the same way (tables/row_grads.py), compute
    the same grad norm and run the same update: the same losses and checkpoints, bit for
    bit, at DP2 (two micro-batches per rank, one host copy shared by both ranks)."""
    options = [f"optimizer.tables.kernel={kernel}", f"optimizer.tables.update={update}",
               f"tables.partition={partition}", "train.steps=8"]
    device = train(2, *options, name="placement_device")
    host = train(2, *options, "tables.placement=host", name="placement_host")
    assert host["losses"] == device["losses"]
    assert_same_checkpoints(host["save_dir"] / "iter_0000008",
                            device["save_dir"] / "iter_0000008")

def test_host_tables_dense_update_matches_device(train, reference):
    result = train(1, "optimizer.tables.update=dense", "tables.placement=host", "tables.cache_rows=32",
                   "optimizer.zero_stage=2", name="host_dense")
    assert_same_curve(result["losses"], reference["dense"]["losses"])

@pytest.mark.parametrize("update, zero", [("lazy", 1), ("dense", 2)])
def test_update_overlapped_with_the_next_step_gives_the_same_curve(train, update, zero):
    """`tables.overlap: next_step` updates the rows the next step's first micro-batch
    reads first, then its later micro-batches', and the rest while it runs: the same
    arithmetic, so the loss curve of the serial update, bit for bit, with the state
    sharded over two ranks (two micro-batches each). All but the first micro-batch's rows
    are held back until its forward has surely run, so a row a lookup needed but did not
    wait for would show."""
    options = [f"optimizer.tables.update={update}", f"optimizer.zero_stage={zero}"]
    serial = train(2, *options, name="dp2")  # test_data_parallel_2_matches_1's run
    overlapped = train(2, *options, "tables.overlap=next_step", name="overlapped",
                       delay_rest=0.3)
    assert overlapped["losses"] == serial["losses"]
    assert overlapped["valid"] == serial["valid"]

def test_one_thread_issues_every_collective_in_one_order_on_every_rank(train):
    """`tables.overlap: next_step` runs the update's arithmetic on a worker thread while
    the next step computes (its rows held back, so lookups wait for them), with a save
    written in the background meanwhile: every collective of the run (torch.distributed's
    functions wrapped in each rank: ours, DeepSpeed's, megatron's) is issued from the main
    thread, the same ones in the same order on both ranks (NCCL asks for one order of the
    communicators' collectives on every rank; tables/overlap.py)."""
    result = train(2, "tables.overlap=next_step", "optimizer.tables.update=dense",
                   "train.async_save=true", "train.save_interval=2", name="collectives",
                   delay_rest=0.1, worker=("--slow-save", "2:1"), record_collectives=True)
    ranks = [json.loads((result["folder"] / f"result.json.collectives{r}").read_text())
             for r in (0, 1)]
    for rank in ranks:
        assert {thread for thread, _, _ in rank} == {"MainThread"}
    assert ranks[0] == ranks[1]
    # the overlapped publications are among them: two all-gathers (ids, rows) per job of
    # each of the 2 tables' 3 parts, at each of the 5 steps that launch an update
    assert sum(op == "all_gather" for _, op, _ in ranks[0]) >= 5 * 2 * 3 * 2
    assert "step 2 | saved" in result["log"] and "step 6 | saved" in result["log"]


# The 1B recipe's table path: bf16 tables (so the fp32 master is a copy of its own), the
# state sharded, the update overlapped with the next step or not, the state in CPU or
# accelerator memory, each against the replicated path at the same data-parallel size.
BF16 = ["train.dtype=bf16", "optimizer.tables.update=dense", "train.steps=8",
        "train.eval_interval=8"]

@pytest.fixture(scope="module")
def bf16_replicated(train):
    return {dp: train(dp, *BF16, "tables.partition=replicated", name=f"bf16_replicated{dp}")
            for dp in (2,)}

# The recipe's overlap with each place of the state (DP4 sharding and `overlap: none` are
# the fp32 tests' too: the suite's time).
@pytest.mark.parametrize("dp, overlap, state", [
    (2, "next_step", "cpu"), (2, "next_step", "accelerator")])
def test_the_1b_table_path_in_bf16_follows_the_replicated_reference(
        train, bf16_replicated, dp, overlap, state):
    result = train(dp, *BF16, "tables.partition=sharded", f"tables.overlap={overlap}",
                   f"optimizer.tables.device={state}", name=f"bf16_{dp}_{overlap}_{state}")
    reference = bf16_replicated[dp]
    assert result["losses"][-1] < result["losses"][0]  # it trains
    assert_same_curve(result["losses"], reference["losses"], rel=2e-3)
    log = tensorboard_scalars(result["save_dir"] / "tensorboard")
    # The state really is where the recipe says (on a CPU run both are the CPU's memory:
    # the layout, not the device, decides where the optimizer allocates and copies).
    other = {"cpu": "accelerator", "accelerator": "cpu"}[state]
    assert f"tables/{state}_state_bytes" in log and f"tables/{other}_state_bytes" not in log
