"""The one exception type for mistakes a user can fix (bad recipe, missing file, ...).

CLIs catch it and print its message as a single line; anything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, explained in one line that names the culprit."""


class ConfigError(UserError, ValueError):
    """A recipe or config field is unknown, mistyped or inconsistent."""
