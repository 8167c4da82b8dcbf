"""The one exception type for mistakes a user can fix (bad recipe, missing file, ...).

CLIs (`@cli` on their `main`) print its message as a single line and exit 2; anything else
is a bug and keeps its traceback.
"""

import functools
import sys


class UserError(Exception):
    """A problem with the user's input, explained in one line that names the culprit.
    `reported`: already printed where it happened (a multi-rank run says it before its
    ranks shut down, which a launcher may cut short)."""

    reported = False


class ConfigError(UserError, ValueError):
    """A recipe or config field is unknown, mistyped or inconsistent."""


def cli(main):
    """Decorate a CLI's `main`: a `UserError` becomes `error: <message>` on stderr, exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if not e.reported:
                print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapper
