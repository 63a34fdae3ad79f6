"""Device memory in a config: ``hardware.memory``, each device's memory, as bytes or a size with a unit.

It is the one hardware key a run itself needs (``paci-tune train`` and ``apply`` refuse a run whose
predicted peak exceeds it, and a search drops the points that would), so it lives in the run's own
``hardware`` section (:class:`RunHardware`) while the search's keys of that section (``devices``,
``runtime``, ...) stay in :class:`paci_tune.config.tune.HardwareConfig`. Planners people trust take the
same number: Aceso's ``--memory-limit``, Alpa's per-device memory, a Metis cluster file. Units are the
ones ``nvidia-smi`` and PyTorch print: binary ``KiB/MiB/GiB/TiB`` and decimal ``KB/MB/GB/TB``, so
``24GiB`` is a 24 GiB device and ``80GB`` an A100 as its vendor counts it. May import: :mod:`paci_tune.errors`
and the standard library.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip
"""Size units, case-sensitive as written by nvidia-smi and torch (``k``/``M``/``G`` alone are ambiguous)."""
ALLOWED = "a positive number of bytes, or a number with a unit (" + ", ".join(UNITS) + "), e.g. 24GiB"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
MAX_BYTES = 2**60
"""An exbibyte: more memory than any device; a larger size is a typo."""


def parse_size(key: str, value: object) -> int:
    """Bytes of a size written as an integer (bytes), a number, or ``"<number> <unit>"``; refused naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(key, value, ALLOWED)
    if isinstance(value, (int, float)):
        number, unit = float(value), "B"
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        number, unit = float(m.group(1)), m.group(2) or "B"
        if unit not in UNITS:
            raise ConfigError(key, value, f"{ALLOWED}; unknown unit {unit!r}")
    else:
        raise ConfigError(key, value, ALLOWED)
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(key, value, ALLOWED)
    size = number * UNITS[unit]
    if size < 1 or size > MAX_BYTES:
        raise ConfigError(key, value, f"{ALLOWED}; between 1 byte and 1 EiB")
    return int(size)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below it, three significant digits (``23.5 MiB``): messages and tables."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit]:
            x = n / UNITS[unit]
            return f"{x:.2f} {unit}" if abs(x) < 10 else f"{x:.1f} {unit}" if abs(x) < 100 else f"{x:.0f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class RunHardware:
    """The run's ``hardware`` section: ``memory``, each device's memory (null: no budget).

    Kept as written (``24GiB`` stays ``24GiB`` in best.yaml); :attr:`memory_bytes` is the number.
    """

    memory: int | float | str | None = None

    def __post_init__(self) -> None:
        if self.memory is not None:
            parse_size("hardware.memory", self.memory)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_size("hardware.memory", self.memory)
