"""User-facing errors.

Bad input must end the command with one clear line naming the key, the value and what is
allowed, and exit code 2 -- never a traceback. Everything that validates user input raises
:class:`ConfigError`; the CLI turns it into that line. What fails for another reason (the file
system, a storage) is a :class:`Failure` where the code knows what it was doing, exit code 1.
May import: nothing (the ground under every layer).
"""

from __future__ import annotations


class ConfigError(Exception):
    """Bad user input. `key` is the dotted config key, `value` what was given, `allowed` what is accepted."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: got {value!r}; allowed: {allowed}")

    def __reduce__(self) -> tuple:  # a process pool sends it back whole (Exception's default pickles args only)
        return (type(self), (self.key, self.value, self.allowed))


class Failure(Exception):
    """Something the input did not cause failed -- a file that cannot be written, a disk that is full,
    a storage that cannot be reached. ``what`` names it (``writing best.yaml``), ``reason`` says why.

    The CLI prints ``error: {what}: {reason}`` and exits 1 (bad input is :class:`ConfigError`, exit 2).
    """

    def __init__(self, what: str, reason: str) -> None:
        self.what, self.reason = what, reason
        super().__init__(f"{what}: {reason}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.what, self.reason))
