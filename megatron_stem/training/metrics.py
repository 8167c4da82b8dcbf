"""What a run reports: its first line, one readable console line and scalars per
`train.log_interval` steps (loss, lr, grad norms, table traffic, where the step's time
went, tokens/s, MFU, peak memory), the validation losses, the downstream scores, all from
rank 0, to the console, TensorBoard and, when `metrics.wandb_project` is set, Weights &
Biases. The loop calls `start`, `step`, `valid` and `downstream` and times its phases with
`timer`; what to log and how it reads lives here.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem.config import Recipe
from megatron_stem.model.accounting import account, mfu
from megatron_stem.runtime.parallel import on_rank0
from megatron_stem.training.profiling import TABLE_PHASES, PhaseTimer


def peak_memory_gb() -> float:
    """The accelerator's peak allocated memory; on CPU this process's peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30


def memory_gb() -> float:
    """The accelerator's allocated memory now; on CPU this process's resident set."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2 ** 30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 30


class Metrics:
    def __init__(self, recipe: Recipe, first_step: int):
        self.recipe = recipe
        self.enabled = dist.get_rank() == 0
        self.writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            # Purge from the first step this run logs: events a stopped run wrote after
            # its checkpoint go, the checkpoint step's own stay (TensorBoard drops step >=
            # purge_step), so a resumed run continues one clean curve in the same run.
            self.writer = SummaryWriter(str(Path(recipe.train.save_dir) / "tensorboard"),
                                        purge_step=first_step)
        self.wandb = None
        if recipe.metrics.wandb_project:
            from megatron_stem.training.wandb_run import WandbRun

            self.wandb = on_rank0(lambda: WandbRun(recipe))
        self.timer = PhaseTimer()  # the loop's phases, read at each log line
        self._t0 = time.perf_counter()
        self._tokens = 0
        self._steps = 0

    def count_tokens(self, tokens: int) -> None:
        self._tokens += tokens
        self._steps += 1

    def throughput(self) -> tuple[float, float]:
        """(tokens/s of the whole job, ms per step) since the last call."""
        now = time.perf_counter()
        seconds = max(now - self._t0, 1e-9)
        rate, step_ms = self._tokens / seconds, seconds * 1e3 / max(self._steps, 1)
        self._t0, self._tokens, self._steps = now, 0, 0
        return rate, step_ms

    @contextlib.contextmanager
    def paused(self):
        """Work between steps (validation, downstream evaluation) that is not training:
        left out of tokens/s and step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._t0 += time.perf_counter() - start

    def start(self, origin: str, model_gb: float) -> None:
        """The run's first line: the model's size, the layout, where it starts from, and
        the memory its parts hold: `model_gb` once the model was built (its weights, and
        the tables where they are on the device), then its state before the first step
        (with the optimizer's states): what the step's peak adds to is its gradients and
        activations."""
        self.log(0, {}, f"model: {account(self.recipe.model).summary()} | world "
                        f"{dist.get_world_size()} = TP {self.recipe.parallel.tensor_parallel}"
                        f" x DP {ps.get_data_parallel_world_size()} | {origin} | memory "
                        f"{model_gb:.2f} GB for the model, {memory_gb():.2f} GB before the "
                        "first step")

    def step(self, step: int, loss: float, lr: float, norms, tables) -> None:
        """After every training step (on every rank: the tables' figures are taken on all
        of them); logs every `train.log_interval` steps and at the last."""
        train = self.recipe.train
        self.count_tokens(train.global_batch_size * self.recipe.model.seq_length)
        self.timer.step_done()
        if step % train.log_interval and step != train.steps:
            return
        (tok_s, step_ms), memory = self.throughput(), peak_memory_gb()
        world = dist.get_world_size()
        scalars = {"train/loss": loss, "train/lr": lr,
                   "grad_norm/total": norms.total, "grad_norm/backbone": norms.backbone,
                   "grad_norm/tables": norms.tables,
                   # an overlapped table update still running: its last finished one's
                   **{f"tables/{k}": v for k, v in tables.stats(wait=False).items()},
                   "throughput/tokens_per_s": tok_s,
                   "throughput/tokens_per_s_per_rank": tok_s / world,
                   "memory/peak_gb": memory}
        host = tables.host_stats()  # per-step averages since the last log
        scalars.update({f"tables/{k}": v for k, v in host.items()})
        phases = self._phases(self.timer.take(), host.get("prefetch_wait_ms", 0.0))
        scalars.update({f"time/{k}_ms": v for k, v in phases.items()})
        scalars["time/step_ms"] = step_ms
        extra = ""  # MFU and host-table figures, where there are any
        if torch.cuda.is_available():
            scalars["throughput/mfu"] = mfu(tok_s, self.recipe.model, train.peak_flops, world)
            extra = f" | MFU {scalars['throughput/mfu']:.1%}"
        if host:
            hits = f", cache hits {host['cache_hit_rate']:.1%}" \
                if "cache_hit_rate" in host else ""
            extra += (f" | prefetch wait {host['prefetch_wait_ms']:.1f} ms, "
                      f"h2d {host['h2d_bytes'] / 2**20:.1f} MB{hits}")
        per = "GPU" if torch.cuda.is_available() else "rank"
        self.log(step, scalars,
                 f"step {step}/{train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad "
                 f"{norms.total:.3f} (backbone {norms.backbone:.3f}, tables "
                 f"{norms.tables:.3f}) | rows {tables.touched_rows} | {_time_line(step_ms, phases)}"
                 f" | {tok_s:,.0f} tok/s ({tok_s / world:,.0f}/{per}){extra} | peak mem "
                 f"{memory:.2f} GB")

    @staticmethod
    def _phases(timed: dict[str, float], prefetch_wait_ms: float) -> dict[str, float]:
        """The timer's phases (ms per step) plus `tables_exposed`: the table work on the
        step's path, with the forwards' wait for staged rows (host placement) moved there
        from forward_backward."""
        phases = {name: timed.get(name, 0.0) for name in
                  ("forward_backward", "backbone_step", *TABLE_PHASES)}
        phases["forward_backward"] = max(phases["forward_backward"] - prefetch_wait_ms, 0.0)
        phases["tables_exposed"] = sum(phases[n] for n in TABLE_PHASES) + prefetch_wait_ms
        return phases

    def valid(self, step: int, loss: float, name: str | None = None) -> None:
        """A validation set's loss: the split's (`valid/...`) or a named set's
        (`valid/<name>/...`)."""
        ppl = math.exp(min(loss, 50))
        tag, label = ("valid", "valid") if name is None else (f"valid/{name}", f"valid {name}")
        self.log(step, {f"{tag}/loss": loss, f"{tag}/ppl": ppl},
                 f"step {step} | {label} loss {loss:.4f} | ppl {ppl:.2f}")

    def downstream(self, step: int, scores: dict[str, dict[str, float]]) -> None:
        """lm-eval's scores, {task: {metric: value}}: `lm_eval/<task>/<metric>`."""
        for task, values in scores.items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items())
            self.log(step, {f"lm_eval/{task}/{k}": v for k, v in values.items()},
                     f"step {step} | lm_eval {task}: {shown}")

    def log(self, step: int, scalars: dict[str, float], line: str | None = None) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log(step, scalars)
        if line:
            print(line, file=sys.stdout, flush=True)

    def error(self, message: str) -> None:
        """The run's one `error:` line (rank 0), on stderr."""
        if self.enabled:
            print(f"error: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


def _time_line(step_ms: float, phases: dict[str, float]) -> str:
    """`step 812 ms (fwd/bwd 700, backbone 60, tables 40, exposed tables 52)`."""
    return (f"step {step_ms:,.1f} ms (fwd/bwd {phases['forward_backward']:,.1f}, backbone "
            f"{phases['backbone_step']:,.1f}, tables {phases['tables_step']:,.1f}, exposed "
            f"tables {phases['tables_exposed']:,.1f})")
