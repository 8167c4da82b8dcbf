"""The one exception type for mistakes a user can fix (bad recipe, missing file, ...).

CLIs (`@cli` on their `main`) print its message as a single line and exit 2 (`USER_ERROR`);
anything else is a bug and keeps its traceback. In a job of many ranks every rank meets the
same mistake in the same recipe and files: rank 0 says it, once; another rank leaves its
line in the error file torchrun gives it, which slurm/torchrun.py prints when rank 0 did
not fail with it (so a mistake only one rank meets is never silent).
"""

import functools
import json
import os
import sys
import time

USER_ERROR = 2  # the exit code of a mistake a user can fix


class UserError(Exception):
    """A problem with the user's input, explained in one line that names the culprit.
    `reported`: already printed where it happened (a multi-rank run says it before its
    ranks shut down, which a launcher may cut short)."""

    reported = False


class ConfigError(UserError, ValueError):
    """A recipe or config field is unknown, mistyped or inconsistent."""


def rank() -> int:
    """This process's rank in its job (torchrun's RANK, srun's SLURM_PROCID), 0 alone."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def say(error: UserError) -> None:
    """`error: <message>` on stderr, once per job (module docstring)."""
    if error.reported:
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if rank() == 0 or not error_file:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return
    with open(error_file, "w") as f:  # a form torchrun reads (`ProcessFailure`)
        json.dump({"message": str(error), "timestamp": str(int(time.time()))}, f)


def cli(main):
    """Decorate a CLI's `main`: a `UserError` becomes `error: <message>` on stderr (`say`),
    exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            say(e)
            return USER_ERROR

    return wrapper
