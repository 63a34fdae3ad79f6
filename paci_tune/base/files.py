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
    """Parse a YAML file, turning a missing or unreadable file or a syntax error into a ConfigError naming ``key``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, str(path), "an existing YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(key, str(path), "a UTF-8 text file (YAML)") from None
    except OSError as e:
        raise ConfigError(key, str(path), f"a readable YAML file ({e.strerror or e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(key, str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(key, str(path), "valid YAML (nested too deeply)") from None


def read_mapping(path: str | Path, key: str, what: str) -> dict[str, Any]:
    """A YAML file that must hold a non-empty mapping (``what`` says of which keys).

    An empty file is refused rather than read as "all defaults": a config, space, profile or
    ``best.yaml`` that says nothing is almost always a mistake (a truncated copy, the wrong file),
    and running a default in its place would hide it.
    """
    doc = read_yaml(path, key)
    if doc is None or doc == {}:
        raise ConfigError(key, str(path), f"a non-empty YAML mapping ({what}); the file is empty")
    if not isinstance(doc, dict):
        raise ConfigError(key, str(path), f"a YAML mapping ({what}), not a {type(doc).__name__}")
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{key}.{bad[0]!r}", doc[bad[0]], "string keys only")
    return doc


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
