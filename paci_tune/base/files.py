"""Reading YAML and writing files atomically (a crash leaves the old file or the new one, never half).

Every file the program writes for a user or another process to read -- profiles, ``best.yaml``,
metrics, checkpoints, pictures -- goes through :func:`atomic_write`, so a reader never sees a
half-written file. May import: the standard library, PyYAML, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError


def read_yaml(path: str | Path, key: str = "config") -> Any:
    """Parse a YAML file, turning a missing file or a syntax error into a ConfigError naming ``key``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, str(path), "an existing YAML file")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(key, str(path), f"valid YAML ({str(e).splitlines()[0]})") from None


def atomic_write(path: str | Path, write: Callable[[str], None], *, suffix: str = "") -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place.

    ``suffix`` keeps the temporary name's extension for writers that read it (matplotlib picks
    the format from it). On any failure the temporary file is removed and the old ``path`` stays.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` atomically, flushed to disk before the rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def write_yaml(path: str | Path, doc: Any, header: str = "") -> Path:
    """``doc`` as block YAML in its own key order (with an optional comment ``header``), atomically."""
    return atomic_write_text(path, header + yaml.safe_dump(doc, sort_keys=False))
