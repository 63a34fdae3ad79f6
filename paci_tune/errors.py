"""User-facing errors.

Bad input must end the command with one clear line naming the key, the value and what is
allowed, and exit code 2 -- never a traceback. Everything that validates user input raises
:class:`ConfigError`; the CLI turns it into that line. What fails for another reason (the file
system, a storage) is a :class:`Failure` where the code knows what it was doing, exit code 1.
May import: nothing (the ground under every layer).
"""

from __future__ import annotations

import reprlib

SHOWN_CHARS = 200
"""The most characters of a value an error message shows: a value can be a whole file's worth."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 12


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was.

    A value from an input file can be huge (a YAML list of millions of items, a long string), and
    its full repr would take minutes and gigabytes; reprlib walks only what it shows, so a shared
    structure that expands to billions of items costs no more than a small one.
    """
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # repr refuses past 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = _REPR.repr(value)
    return f"{text[:limit]}... ({len(text)} characters)" if len(text) > limit else text


class ConfigError(Exception):
    """Bad user input. `key` is the dotted config key, `value` what was given, `allowed` what is accepted.

    The message shows the value bounded (:func:`shown`) and ``allowed`` cut to a few thousand
    characters, so no input can make the one error line itself a hang.
    """

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        if len(allowed) > 10 * SHOWN_CHARS:
            allowed = f"{allowed[: 10 * SHOWN_CHARS]}... ({len(allowed)} characters)"
        shown_key = key if len(key) <= SHOWN_CHARS else f"{key[:SHOWN_CHARS]}... ({len(key)} characters)"
        super().__init__(f"{shown_key}: got {shown(value)}; allowed: {allowed}")

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
