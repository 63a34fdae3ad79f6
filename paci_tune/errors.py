"""User-facing errors.

Bad input must end the command with one clear line naming the key, the value and what is
allowed, and exit code 2 -- never a traceback. Everything that validates user input raises
:class:`ConfigError`; the CLI turns it into that line. May import: nothing (the ground under every
layer).
"""

from __future__ import annotations


class ConfigError(Exception):
    """Bad user input. `key` is the dotted config key, `value` what was given, `allowed` what is accepted."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: got {value!r}; allowed: {allowed}")
