"""Weights & Biases, when `metrics.wandb_project` names a project: rank 0 logs the scalars
TensorBoard gets, with the resolved recipe as the run's config.

A run is one W&B run however often it stops: its id is kept in `<save_dir>/wandb_run_id`,
so a resumed or requeued job continues it (`resume="allow"`). Steps a stopped run logged
after its last checkpoint are logged again by the resumed one with the same values (resume
is exact); W&B keeps the first and warns about the repeats. `WANDB_MODE=offline` writes
`<save_dir>/wandb/offline-run-*` (each resumed job one more, all with the same id) for a
later `wandb sync`.
"""

from __future__ import annotations

import importlib.util
import secrets
from pathlib import Path

from megatron_stem.config import Recipe, to_dict
from megatron_stem.runtime.errors import ConfigError

ID_FILE = "wandb_run_id"


def check_installed(recipe: Recipe) -> None:
    """Before anything starts: a W&B project needs the package."""
    if recipe.metrics.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.wandb_project: {recipe.metrics.wandb_project!r} needs the "
                          "wandb package, which is not installed (pip install wandb, or "
                          "pip install -r requirements.txt)")


def run_id(save_dir: Path) -> str:
    """This training run's W&B id: the one saved in `save_dir`, else a new one (saved)."""
    path = save_dir / ID_FILE
    if path.is_file():
        return path.read_text().strip()
    save_dir.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)  # W&B's ids: 8 lowercase letters and digits
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new + "\n")
    tmp.rename(path)
    return new


class WandbRun:
    """The W&B run of this training run (rank 0 only)."""

    def __init__(self, recipe: Recipe):
        import wandb

        m, save_dir = recipe.metrics, Path(recipe.train.save_dir)
        try:
            self.run = wandb.init(project=m.wandb_project, entity=m.wandb_entity,
                                  name=m.wandb_name or save_dir.resolve().name,
                                  id=run_id(save_dir), resume="allow", dir=str(save_dir))
        except wandb.errors.Error as e:
            raise ConfigError(
                f"metrics.wandb_project: W&B did not start ({str(e).splitlines()[0]}); log in "
                "(wandb login, or WANDB_API_KEY) or log locally with WANDB_MODE=offline"
            ) from None
        # A resumed run may change a field by override (a lower lr): the newest wins.
        self.run.config.update(to_dict(recipe), allow_val_change=True)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
