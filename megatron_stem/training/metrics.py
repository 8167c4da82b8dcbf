"""What a run reports: its first line, one readable console line and TensorBoard scalars
per `train.log_interval` steps (loss, lr, grad norms, table traffic, tokens/s, MFU,
memory), the validation loss, all from rank 0. The loop calls `start`, `step` and
`valid`; what to log and how it reads lives here.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_stem.accounting import account, mfu
from megatron_stem.config import Recipe


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    try:  # resident set size of this process
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2 ** 30
    except OSError:
        return 0.0


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
        self._t0 = time.perf_counter()
        self._tokens = 0

    def count_tokens(self, tokens: int) -> None:
        self._tokens += tokens

    def throughput(self) -> float:
        """Tokens/s since the last call (the whole job's tokens, all ranks)."""
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t0, 1e-9)
        self._t0, self._tokens = now, 0
        return rate

    def start(self, origin: str) -> None:
        """The run's first line: the model's size, the layout, where it starts from."""
        self.log(0, {}, f"model: {account(self.recipe.model).summary()} | world "
                        f"{dist.get_world_size()} = TP {self.recipe.parallel.tensor_parallel}"
                        f" x DP {ps.get_data_parallel_world_size()} | {origin}")

    def step(self, step: int, loss: float, lr: float, norms, tables) -> None:
        """After every training step (on every rank: the tables' figures are taken on all
        of them); logs every `train.log_interval` steps and at the last."""
        train = self.recipe.train
        self.count_tokens(train.global_batch_size * self.recipe.model.seq_length)
        if step % train.log_interval and step != train.steps:
            return
        tok_s, memory = self.throughput(), memory_gb()
        scalars = {"train/loss": loss, "train/lr": lr,
                   "grad_norm/total": norms.total, "grad_norm/backbone": norms.backbone,
                   "grad_norm/tables": norms.tables,
                   # an overlapped table update still running: its last finished one's
                   **{f"tables/{k}": v for k, v in tables.stats(wait=False).items()},
                   "throughput/tokens_per_s": tok_s, "memory/gb": memory}
        extra = ""  # MFU and host-table figures, where there are any
        if torch.cuda.is_available():
            scalars["throughput/mfu"] = mfu(tok_s, self.recipe.model, train.peak_flops,
                                            dist.get_world_size())
            extra = f" | MFU {scalars['throughput/mfu']:.1%}"
        host = tables.host_stats()  # per-step averages since the last log
        scalars.update({f"tables/{k}": v for k, v in host.items()})
        if host:
            hits = f", cache hits {host['cache_hit_rate']:.1%}" \
                if "cache_hit_rate" in host else ""
            extra += (f" | prefetch wait {host['prefetch_wait_ms']:.1f} ms, "
                      f"h2d {host['h2d_bytes'] / 2**20:.1f} MB{hits}")
        self.log(step, scalars,
                 f"step {step}/{train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad "
                 f"{norms.total:.3f} (backbone {norms.backbone:.3f}, tables "
                 f"{norms.tables:.3f}) | rows {tables.touched_rows} | "
                 f"{tok_s:,.0f} tok/s{extra} | mem {memory:.2f} GB")

    def valid(self, step: int, loss: float) -> None:
        ppl = math.exp(min(loss, 50))
        self.log(step, {"valid/loss": loss, "valid/ppl": ppl},
                 f"step {step} | valid loss {loss:.4f} | ppl {ppl:.2f}")

    def log(self, step: int, scalars: dict[str, float], line: str | None = None) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if line:
            print(line, file=sys.stdout, flush=True)

    def error(self, message: str) -> None:
        """The run's one `error:` line (rank 0), on stderr."""
        if self.enabled:
            print(f"error: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
