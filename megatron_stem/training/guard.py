"""The divergence guard: what a run does when a step is not finite or its loss spikes.

A step whose loss, backbone norm or table norm is not finite is skipped whole, on every
rank (training/update.py); the guard counts them. Every skip and every spike is one line;
the newest checkpoint saved before it is kept whatever `train.keep_last` says (the
`Checkpointer` pins it). After `guard.max_skipped_steps` skips in a row (or a spike, with
`guard.stop_on_spike`) the run stops: `latest` is pointed back at that checkpoint and the
run ends with one `error:` line saying so, a non-zero exit that the launchers do not
requeue. Rerunning then resumes from the last good checkpoint, typically with a lower
learning rate given as an override.

A spike is a loss above `guard.spike_factor` times the median of the last
`guard.spike_window` applied steps' losses (as many as the run has had, at its start or
after a resume; a median, not a mean: one spike does not move the bar for the next). A spike or a skip opens an incident, which a stretch of
`guard.spike_window` healthy steps closes: the last good checkpoint is the one before the
incident's first sign (a run that diverges spikes before its loss is not finite).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable, Optional

from megatron_stem.runtime.errors import UserError


class Diverged(UserError):
    """The run stopped on purpose: its last steps were not finite, or its loss spiked."""


class Guard:
    """`config`: the recipe's `guard` section; `pin(step)`: keep the newest checkpoint
    saved before `step` and return its path (None: there is none); `rewind(path)`: make
    it the one a rerun resumes from; `say(step, line)`: log a line."""

    def __init__(self, config, pin: Callable[[int], Optional[str]],
                 rewind: Callable[[str], None], say: Callable[[int, str], None]):
        self.config, self.pin, self.rewind, self.say = config, pin, rewind, say
        self.losses: deque[float] = deque(maxlen=config.spike_window)
        self.skipped: list[int] = []  # the steps of the current run of skips
        self.good: Optional[str] = None  # the checkpoint kept before the open incident
        self.healthy = 0  # applied steps without a spike since the incident's last sign

    def after(self, step: int, loss: float, outcome, ranks: str = "") -> None:
        """After step `step` (its data-parallel mean `loss` and the update's `outcome`;
        `ranks`: which ranks' values were not finite, when known)."""
        if not outcome.applied:
            self._skipped(step, outcome, ranks)
            return
        self.skipped = []
        if not self._spike(step, loss):
            self.healthy += 1
            if self.healthy >= self.config.spike_window:
                self.good = None  # the incident is over
        self.losses.append(loss)

    def _incident(self, step: int) -> None:
        """A sign of divergence at `step`: keep the last checkpoint before the first one.
        Step k's loss and gradients are those of the weights step k-1 made, so the good
        checkpoint is one saved before step k-1."""
        self.healthy = 0
        if self.good is None:
            self.good = self.pin(step - 1)

    def _skipped(self, step: int, outcome, ranks: str) -> None:
        self._incident(step)
        self.skipped.append(step)
        limit = self.config.max_skipped_steps
        self.say(step, f"step {step} | skipped: {', '.join(outcome.nonfinite)} not finite"
                       f"{ranks}; nothing was updated ({len(self.skipped)} in a row; the "
                       f"run stops at {limit})")
        if len(self.skipped) >= limit:
            self._stop(f"guard.max_skipped_steps: {limit} steps in a row were skipped "
                       f"(steps {self.skipped[0]}-{step}: {', '.join(outcome.nonfinite)} not "
                       "finite)")

    def _spike(self, step: int, loss: float) -> bool:
        factor = self.config.spike_factor
        if not factor or not self.losses:
            return False
        median = statistics.median(self.losses)
        if loss <= factor * median:
            return False
        self._incident(step)
        self.say(step, f"step {step} | loss spike: {loss:.4f} is {loss / median:.1f} x the "
                       f"median {median:.4f} of the last {len(self.losses)} steps")
        if self.config.stop_on_spike:
            self._stop(f"guard.stop_on_spike: the loss spiked at step {step} ({loss:.4f}, "
                       f"{loss / median:.1f} x the median of the last {len(self.losses)} "
                       "steps)")
        return True

    def _stop(self, why: str) -> None:
        if self.good is None:
            raise Diverged(f"{why}; no checkpoint was saved before it: rerun with a lower "
                           "learning rate (e.g. optimizer.lr=...) to start again")
        self.rewind(self.good)
        raise Diverged(f"{why}; latest now names the last good checkpoint, {self.good}: "
                       "rerun to resume from it, with a lower learning rate (e.g. "
                       "optimizer.lr=...) or another guard setting")
