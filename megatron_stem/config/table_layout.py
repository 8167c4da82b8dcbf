"""How the STEM tables are kept and trained: one frozen description, checked in one place.

A layout is six choices (docs/tables.md): where the tables live (`placement`), who keeps
and updates their optimizer state (`partition`), which rows Adam moves (`update`), when
the update runs (`overlap`), where the fp32 master and moments live (`state_device`), and
which Adam arithmetic runs there (`kernel`). The recipe loader (`schema.py`), the trainer
(`tables/optimizer.py` picks the partition class from it) and the step planner
(`planning/step.py`, which options the code has) all ask `problem()` whether one is legal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_stem.runtime.errors import ConfigError

PLACEMENTS = ("device", "host")
PARTITIONS = ("sharded", "replicated")
UPDATES = ("dense", "lazy")
OVERLAPS = ("none", "next_step")
STATE_DEVICES = ("cpu", "accelerator")
KERNELS = ("deepspeed", "torch")

# Each field's recipe path, for messages.
FIELDS = {"placement": "tables.placement", "partition": "tables.partition",
          "update": "optimizer.tables.update", "overlap": "tables.overlap",
          "state_device": "optimizer.tables.device", "kernel": "optimizer.tables.kernel"}


@dataclass(frozen=True)
class TableLayout:
    placement: str = "device"
    partition: str = "sharded"
    update: str = "dense"
    overlap: str = "none"
    state_device: str = "cpu"
    kernel: str = "deepspeed"

    @classmethod
    def of(cls, recipe) -> "TableLayout":
        """The layout a recipe (`config.Recipe`) trains with."""
        t, opt = recipe.tables, recipe.optimizer.tables
        return cls(t.placement, t.partition, opt.update, t.overlap, opt.device, opt.kernel)

    @property
    def sharded(self) -> bool:
        return self.partition == "sharded"

    @property
    def on_host(self) -> bool:
        return self.placement == "host"

    @property
    def state_on_accelerator(self) -> bool:
        return self.state_device == "accelerator"

    @property
    def adam_kernel(self) -> str:
        """The kernel that really runs: DeepSpeed's is a CPU op, so state on the
        accelerator runs torch's arithmetic there."""
        return "torch" if self.state_on_accelerator else self.kernel

    def problem(self) -> Optional[str]:
        """Why this layout cannot train, as "<recipe field>: <reason>", or None."""
        for name, choices in (("placement", PLACEMENTS), ("partition", PARTITIONS),
                              ("update", UPDATES), ("overlap", OVERLAPS),
                              ("state_device", STATE_DEVICES), ("kernel", KERNELS)):
            if getattr(self, name) not in choices:
                return f"{FIELDS[name]}: expected one of {list(choices)}, got " \
                       f"{getattr(self, name)!r}"
        # The overlapped update and state on the accelerator are written for row shards of
        # device tables: a host copy's rows are written by its owners in place, and a
        # replicated state would be the whole table's on every accelerator.
        needs = {"overlap": self.overlap == "next_step",
                 "state_device": self.state_on_accelerator}
        for name, needed in needs.items():
            if needed and (self.partition, self.placement) != ("sharded", "device"):
                return (f"{FIELDS[name]}: {getattr(self, name)} needs tables.partition: "
                        f"sharded and tables.placement: device (got partition: "
                        f"{self.partition}, placement: {self.placement})")
        return None

    def validate(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ConfigError(problem)

    def __str__(self) -> str:
        return "/".join((self.placement, self.update, self.partition, self.overlap,
                         self.state_device))
