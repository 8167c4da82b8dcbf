"""Writing one checkpoint so that it is whole or absent: `with Writer(save_dir, step,
recipe) as folder:` every rank writes its parts into `iter_N.tmp/`, makes each file
durable and `record`s its size and checksum (computed as it was written); on a clean exit
(the commit) the folders are fsynced, COMPLETE lists every rank's files, the folder is
renamed into place and `latest` replaced, each durably, so a crash mid-save never touches
the last good checkpoint. The commit reads no file its writers recorded; one no rank
recorded (written by other means) is hashed and fsynced then.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist
import yaml

from megatron_stem.checkpoint import checksums
from megatron_stem.checkpoint.finding import latest
from megatron_stem.checkpoint.layout import CODE_VERSION, COMPLETE, LATEST, RECIPE, iter_name
from megatron_stem.config import to_dict
from megatron_stem.runtime import durable
from megatron_stem.runtime.code_version import code_version
from megatron_stem.runtime.errors import UserError


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Writer:
    """Collectively write one checkpoint: `with Writer(save_dir, step, recipe) as folder:`
    every rank saves its parts under `folder`; on a clean exit it is committed."""

    def __init__(self, save_dir: str | Path, step: int, recipe):
        self.save_dir = Path(save_dir)
        self.final = self.save_dir / iter_name(step)
        self.tmp = self.save_dir / (iter_name(step) + ".tmp")
        self.recipe = recipe
        self._recorded: dict[str, dict] = {}

    def __enter__(self) -> Path:
        if is_writer():
            self.save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)  # leftovers of a crashed save
            self.tmp.mkdir()
            checksums.write_file(self.tmp / RECIPE, yaml.safe_dump(
                to_dict(self.recipe), sort_keys=False).encode())  # checked by its content
            self.record({CODE_VERSION: checksums.write_file(
                self.tmp / CODE_VERSION, (code_version() + "\n").encode())})
        barrier()
        return self.tmp

    def record(self, entries: dict[str, dict]) -> None:
        """Files this rank wrote under the folder and made durable: {name relative to the
        folder: {"bytes", "xxh3_64"}}, for COMPLETE."""
        self._recorded.update(entries)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # the .tmp folder is left; the last good one is untouched
            # (torch's CheckpointException, what a failed write raises, is a BaseException)
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)) \
                    and durable.full(self.save_dir, exc):
                kept = latest(self.save_dir)
                raise UserError(f"no space left on device while saving {self.final}; "
                                + (f"{kept} is intact" if kept else
                                   f"no earlier checkpoint in {self.save_dir}")) from None
            return False
        barrier()  # every rank has finished writing its parts
        entries = checksums.record(self.tmp, RECIPE, self._recorded)
        if is_writer():
            checksums.check_sizes(self.tmp, entries)  # what was recorded is what is there
            durable.fsync_folders(self.tmp)
            checksums.write(self.tmp / COMPLETE, entries)
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            durable.fsync_path(self.save_dir)  # the rename, before `latest` names it
            point_latest(self.save_dir, self.final)
        barrier()
        return False


def point_latest(save_dir: Path, ckpt: Path) -> None:
    """Make `ckpt` the checkpoint `latest` names, durably (the rename of `ckpt` too)."""
    durable.write_durably(save_dir / LATEST, ckpt.name + "\n")
