"""The tables' training path where a GPU node differs from a CPU run: which memory each
collective is handed, the overlapped update's streams, device and exit, and the layouts
the code accepts (tables/)."""

import contextlib
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from support.processes import subprocess_env
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.tables import comm as table_comm
from megatron_stem.tables.comm import (Comm, Devices, HostStaging, host_tracking,
                                                is_host)
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.overlap import Job, Overlap

CPU = Devices(torch.device("cpu"))


def test_check_mode_follows_host_memory_through_operations():
    """On a CPU run host and accelerator memory are one: check mode tells them apart the
    way a GPU node's devices would (anything computed from host memory is host memory,
    except copies into accelerator tensors and what `to_accelerator` moves)."""
    assert table_comm.check_mode()  # the suite runs with it (conftest.py)
    with host_tracking():
        host = CPU.host_zeros((6, 4))
        accelerator = torch.ones(6, 4)
        ids = torch.tensor([1, 3])
        assert is_host(host[ids]) and is_host(host.sum(1)) and is_host(host.to(torch.bfloat16))
        assert is_host(torch.cat([accelerator, host])) and is_host(accelerator.cpu())
        assert not is_host(accelerator * 2) and not is_host(ids + 1)
        accelerator.copy_(host)  # a copy into an accelerator tensor stays there
        accelerator[:2] = host[:2]
        assert not is_host(accelerator)
        moved = CPU.to_accelerator(host[ids])
        assert not is_host(moved) and torch.equal(moved, host[ids])
        alias = CPU.to_host(accelerator)  # the accelerator's tensor is not marked itself
        assert is_host(alias) and not is_host(accelerator)


def test_a_collective_refuses_host_memory_and_says_where(world1):
    group = Comm(None, CPU, "the data-parallel group")
    with host_tracking():
        rows = CPU.host_zeros((4, 2))[torch.tensor([0, 2])]
        with pytest.raises(RuntimeError, match=r"^tables: all_gather over the data-parallel "
                                               r"group was handed host memory; .*\(NCCL on a "
                                               r"GPU node takes accelerator tensors only"):
            group.all_gather([torch.empty(2, 2)], rows)
        with pytest.raises(RuntimeError, match="all_reduce over the data-parallel group"):
            group.all_reduce(rows)
        out = [torch.empty(2, 2)]
        group.all_gather(out, CPU.to_accelerator(rows))  # what the tables' path does
        assert torch.equal(out[0], rows)
    # On a GPU node the device itself is checked: a CPU tensor for an NCCL group.
    cuda = Comm(None, Devices(torch.device("cuda", 0)), "the data-parallel group")
    with pytest.raises(RuntimeError, match=r"was handed a tensor on cpu; the group "
                                           r"communicates on cuda:0"):
        cuda.all_reduce(torch.zeros(2))


@pytest.mark.parametrize("layout, message", [
    (TableLayout("host", overlap="next_step"),
     r"^tables\.overlap: next_step needs tables\.partition: sharded and tables\.placement: "
     r"device \(got partition: sharded, placement: host\)$"),
    (TableLayout(partition="replicated", state_device="accelerator"),
     r"^optimizer\.tables\.device: accelerator needs tables\.partition: sharded"),
    (TableLayout(update="adagrad"), r"^optimizer\.tables\.update: expected one of"),
])
def test_a_layout_is_checked_in_one_place(layout, message):
    """The recipe loader, the trainer and the planner ask the same question."""
    from megatron_stem.config import Recipe, from_dict
    from megatron_stem.planning.step import Option
    from workers.common import TINY

    with pytest.raises(ConfigError, match=message):
        layout.validate()
    option = Option(layout.placement, layout.update, layout.partition, layout.overlap,
                    layout.state_device)
    assert not option.implemented
    recipe = {"model": TINY, "tables": {"placement": layout.placement,
                                        "partition": layout.partition,
                                        "overlap": layout.overlap},
              "optimizer": {"tables": {"device": layout.state_device}}}
    if layout.update in ("dense", "lazy"):  # a bad value fails the field's own check first
        with pytest.raises(ConfigError, match=message):
            from_dict(Recipe, recipe)
    assert TableLayout().problem() is None and Option("device", "dense", "sharded", "none",
                                                      "cpu").implemented


# -- the overlapped update's threads and streams --------------------------------------------


class RecordingStreams:
    """What the overlap asks of CUDA's streams, recorded with the asking thread."""

    def __init__(self):
        self.calls = []

    def enter_worker(self):
        self.calls.append(("enter_worker", threading.current_thread().name))

    def hand_over(self, tensors):
        self.calls.append(("hand_over", threading.current_thread().name, list(tensors)))

    @contextlib.contextmanager
    def running(self):
        self.calls.append(("running", threading.current_thread().name))
        yield

    def mark(self):
        self.calls.append(("mark", threading.current_thread().name))
        return "event"

    def wait(self, event):
        self.calls.append(("wait", threading.current_thread().name, event))

    def follow(self, event):
        self.calls.append(("follow", threading.current_thread().name, event))

    def synchronize(self, event):
        self.calls.append(("synchronize", threading.current_thread().name, event))

    def join(self):
        self.calls.append(("join", threading.current_thread().name))


class TwoMemories(Devices):
    """A GPU node's two memories as far as `HostStaging` can tell on a CPU: separate, with
    unpinned host buffers (pinning needs an accelerator)."""

    @property
    def separate(self) -> bool:
        return True

    def host_empty(self, shape, dtype=torch.float32, pin=False):
        return super().host_empty(shape, dtype)


def test_the_gradients_cross_to_the_host_on_a_side_stream_into_reused_buffers():
    """CPU state's gradient copies: queued on the side stream after the kernels that made
    them (the tensor recorded there), so DeepSpeed's step does not queue behind them; the
    host waits for them before it reads; the next step's copy reuses the buffer."""
    streams = RecordingStreams()
    staging = HostStaging(TwoMemories(torch.device("cpu")), streams)
    grads = torch.arange(12.0).view(3, 4)
    out = staging.copy("table 0", grads)
    assert streams.calls == [("hand_over", "MainThread", [grads]),
                             ("running", "MainThread"), ("mark", "MainThread")]
    staging.wait()
    assert streams.calls[-1] == ("synchronize", "MainThread", "event")
    assert torch.equal(out, grads) and out.data_ptr() != grads.data_ptr()
    staging.wait()  # nothing queued since: no second wait
    assert len(streams.calls) == 4
    smaller = torch.ones(2, 4)
    again = staging.copy("table 0", smaller)
    staging.wait()
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, smaller)
    assert staging.copy("table 1", grads).data_ptr() != out.data_ptr()


def _tables_step(monkeypatch):
    """One overlapped step of a sharded table at DP1, its streams RecordingStreams: (the
    worker's streams, the publications', the optimizer's jobs as it made them)."""
    import torch.nn.functional as F

    from megatron_stem.tables import streams as streams_module
    from megatron_stem.tables.optimizer import TableOptimizer

    monkeypatch.setattr(streams_module, "NoStreams", RecordingStreams)
    table = torch.nn.Parameter(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)))
    opt = TableOptimizer([("t", table)], TableLayout(overlap="next_step", kernel="torch",
                                                     update="lazy"), 1.0, 0.1, (0.9, 0.95))
    F.embedding(torch.tensor([[1, 5, 7]]), table, sparse=True).sum().backward()
    opt.sync_grads()
    opt.grad_norm_sq()
    launched = []
    launch = opt.overlap.launch
    opt.overlap.launch = lambda stages, rest: (launched.append((stages, rest)),
                                               launch(stages, rest))[-1]
    opt.step(1e-2, next_ids=[torch.tensor([[5, 9]]), torch.tensor([[3, 1]])])
    table.pending_rows(torch.tensor([[5, 9]]))  # the next step's first lookup
    opt.finish()
    return opt.overlap.streams, opt.overlap.publishing, launched


def test_every_tensor_the_jobs_read_is_handed_to_their_stream_first(monkeypatch):
    """Gradients and row ids are made on the compute stream and read on the worker's:
    each is recorded there (so the caching allocator keeps its memory) before the worker
    starts, from the main thread; the worker sets the main thread's device and marks each
    job's end; the main thread publishes each job after that event, on a stream of its
    own, and the compute stream waits for the publications a lookup needs and, at
    `finish`, for both streams."""
    streams, publishing, ((stages, rest),) = _tables_step(monkeypatch)
    handed = [c for c in streams.calls if c[0] == "hand_over"]
    assert len(handed) == 1 and handed[0][1] == "MainThread"
    recorded = {id(t) for t in handed[0][2]}
    jobs = [job for stage in stages for _, job in stage] + rest
    assert len(jobs) == 3  # the first micro-batch's rows, the second's, the others
    for job in jobs:
        # Every per-step tensor the job's arithmetic reads: rows, gradient rows, grads.
        closure = [c.cell_contents for c in job.compute.__closure__ or ()]
        step_tensors = [x for x in closure if isinstance(x, torch.Tensor)]
        assert step_tensors and all(id(t) in recorded for t in step_tensors), job.name
    assert streams.calls.count(("mark", "stem-table-update")) == 3  # after each job
    assert ("enter_worker", "stem-table-update") in streams.calls
    assert streams.calls[-1] == ("join", "MainThread")
    # The publications: only ever queued from the main thread, each after its job's event.
    worker_uses = {c[0] for c in publishing.calls if c[1] != "MainThread"}
    assert worker_uses == {"synchronize"}  # (the last launch's publications: none here)
    assert [c[0] for c in publishing.calls if c[0] in ("follow", "running")] == \
        ["follow", "running"] * 3
    # the first lookup published the first micro-batch's rows and the job after them,
    # and the compute stream waited for the former
    assert ("wait", "MainThread", "event") in publishing.calls
    assert publishing.calls[-1] == ("join", "MainThread")


def test_the_worker_takes_the_device_the_main_thread_had(monkeypatch):
    """CUDA's current device is per thread (0 in a new one): the worker is given the main
    thread's, not `current_device()` asked inside it."""
    from megatron_stem.tables import streams as streams_module

    made, set_in = [], []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or "stream")
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: set_in.append((threading.current_thread().name, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a new thread's answer
    streams = streams_module.CudaStreams(torch.device("cuda", 3))
    streams.enter_worker()
    threading.Thread(target=streams.enter_worker, name="worker").start()
    time.sleep(0.2)
    assert made == [torch.device("cuda", 3)]
    assert set_in == [("MainThread", torch.device("cuda", 3)),
                      ("worker", torch.device("cuda", 3))]


def test_lookups_publish_their_rows_one_job_ahead_from_their_own_thread():
    """`next_step`: the next step's first lookup (and a replay of it, the same ids) needs
    the first micro-batch's rows (stage 0) only; a lookup of another micro-batch's ids
    needs every stage. A lookup publishes, in the jobs' order and on its own thread, the
    jobs up to the one it needs and one job more; the trainer publishes the rest before
    the step's last backward, `finish` whatever is left."""
    overlap = Overlap(None, CPU)
    tables = [torch.nn.Parameter(torch.zeros(4, 2)) for _ in range(2)]
    computed, published = [], []

    def job(name):
        def publish(comm):
            published.append((name, threading.current_thread().name))
        return Job(name, lambda: computed.append(name), publish)
    overlap.launch([[(t, job(f"first {i}")) for i, t in enumerate(tables)],
                    [(t, job(f"later {i}")) for i, t in enumerate(tables)]],
                   [job("other rows 0"), job("other rows 1")])
    first_ids, second_ids = torch.tensor([[1, 2]]).t(), torch.tensor([[3, 1]]).t()
    tables[0].pending_rows(first_ids)
    assert published == [("first 0", "MainThread"), ("first 1", "MainThread")]
    tables[0].pending_rows(first_ids.t().t())  # a recompute of the same ids: one more only
    tables[1].pending_rows(first_ids)
    assert [name for name, _ in published] == ["first 0", "first 1", "later 0", "later 1"]
    tables[0].pending_rows(second_ids)  # needs "later 0" (published): one more
    assert [name for name, _ in published][-1] == "other rows 0" and overlap.running_jobs
    overlap.publish_all()
    assert [name for name, _ in published][-1] == "other rows 1"
    assert not overlap.running_jobs
    overlap.finish()
    assert computed == [name for name, _ in published]
    assert {thread for _, thread in published} == {"MainThread"}
    assert all(t.pending_rows is None for t in tables)


def test_the_next_steps_rows_are_staged_by_their_first_micro_batch():
    """The rows any rank's next step reads, each tagged with the first micro-batch that
    reads it (0: the first, 1: any later), through one exchange with the owners."""
    from megatron_stem.tables.shards import RowShards, TrafficCounters, earliest

    rows, first = earliest(torch.tensor([5, 3, 5, 9, 3]), torch.tensor([1, 1, 0, 1, 1]), 2)
    assert rows.tolist() == [3, 5, 9] and first.tolist() == [1, 0, 1]
    shards = RowShards(12, Comm(None, CPU, "dp"))
    ids, stages = torch.tensor([2, 7, 11]), torch.tensor([1, 0, 1])
    local, first = shards.needed_by_any(ids, TrafficCounters(), stages, 2)
    assert sorted(zip(shards.ids_of(local).tolist(), first.tolist())) == \
        [(2, 1), (7, 0), (11, 1)]


def test_a_stuck_job_is_named_and_the_rank_exits_non_zero(tmp_path):
    """A job stuck in its arithmetic must not keep the rank alive: `close` waits at most
    its timeout, names the job, and the process exits with an error."""
    overlap = Overlap(None, CPU)
    never = threading.Event()
    overlap.launch([], [Job("step 7, decoder.layers.1.mlp.table: other rows", never.wait)])
    with pytest.raises(RuntimeError, match=r"stuck in step 7, decoder\.layers\.1\.mlp\.table: "
                                           r"other rows after 0 s"):
        overlap.close(timeout=0.2)
    never.set()
    script = tmp_path / "stuck.py"
    script.write_text(
        "import threading, torch\n"
        "from megatron_stem.tables.comm import Devices\n"
        "from megatron_stem.tables.overlap import Job, Overlap\n"
        "o = Overlap(None, Devices(torch.device('cpu')))\n"
        "o.launch([], [Job('stuck', threading.Event().wait)])\n"
        "o.close(timeout=0.5)\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=subprocess_env())
    assert proc.returncode == 1 and "stuck in stuck after" in proc.stderr
    assert time.perf_counter() - start < 30


def test_table_states_in_another_row_order_are_refused(tmp_path):
    """The saved row order has a version; a checkpoint in another one is refused in one
    line (its Adam moments would land on other rows)."""
    from megatron_stem.runtime.errors import UserError
    from megatron_stem.tables.shards import ROW_ORDER, check_row_order

    check_row_order(ROW_ORDER, tmp_path)
    check_row_order(None, tmp_path)  # saved before the version was written: this order
    with pytest.raises(UserError, match=rf"^{tmp_path}: its table optimizer states are in "
                                        rf"row order {ROW_ORDER + 1}, this version reads"):
        check_row_order(ROW_ORDER + 1, tmp_path)


@pytest.mark.integration
def test_the_overlaps_group_is_made_and_used_on_the_main_thread_only(tmp_path):
    from support.processes import torchrun

    out = tmp_path / "uses.json"
    torchrun(2, "overlap_worker.py", out)
    uses = json.loads(out.read_text())
    assert uses["at_construction"] == ["MainThread"]  # its first collective, at construction
    assert len(uses["all"]) > 1 and set(uses["all"]) == {"MainThread"}
