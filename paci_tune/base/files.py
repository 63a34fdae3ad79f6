"""Reading YAML and writing files atomically (a crash leaves the old file or the new one, never half).

Every file the program writes for a user or another process to read -- profiles, ``best.yaml``,
metrics, checkpoints, pictures -- goes through :func:`atomic_write`, so a reader never sees a
half-written file; a write the file system refuses (permissions, a full disk) is a
:class:`~paci_tune.errors.Failure` naming the file. The file is on disk before its rename, and the
rename before :func:`atomic_write` returns (:func:`fsync_dir`): a power cut after it cannot bring
back the old file, nor leave the new name on an empty one. May import: the standard library, PyYAML,
:mod:`paci_tune.errors`.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, Failure

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""yaml.safe_load's loader, in C where PyYAML has libyaml: a search reads its files many times over."""


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
        doc = yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as e:
        raise ConfigError(key, str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(key, str(path), "valid YAML (nested too deeply)") from None
    except ValueError as e:  # an integer past Python's 4300 digits
        raise ConfigError(key, str(path), f"valid YAML ({str(e).splitlines()[0][:200]})") from None
    if "*" not in text:  # no alias, so nothing shared: the document is as large as the text
        return doc
    try:
        return _unshared(doc, [MAX_YAML_VALUES])
    except (_TooLarge, RecursionError):
        allowed = f"YAML whose aliases (*name) expand to at most {MAX_YAML_VALUES:,} values; this one expands past it"
        raise ConfigError(key, str(path), allowed) from None


MAX_YAML_VALUES = 1_000_000
"""The most values a YAML file may hold once its aliases are expanded (far above any file of this tool)."""


class _TooLarge(Exception):
    pass


def _unshared(node: Any, left: list[int]) -> Any:
    """``node`` with every alias expanded into a copy of its own, counting the values against ``left[0]``.

    YAML's loader hands an alias the anchor's own object, so a few hundred bytes of nested aliases
    (the "billion laughs") load at once as a small graph -- and then hang whatever walks it as a
    tree: a check, an error message, a copy. Expanding here, under a bound, refuses such a file in
    well under a second, and gives every key its own value (editing one never edits another), as
    if the file had been written out in full. A structure that contains itself never ends: refused too.
    """
    left[0] -= 1
    if left[0] < 0:
        raise _TooLarge
    if isinstance(node, dict):
        return {k: _unshared(v, left) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v, left) for v in node]
    return node


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: the umask can only be read by setting it


def atomic_write(path: str | Path, write: Callable[[str], None], *, suffix: str = "") -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place, durably.

    ``suffix`` keeps the temporary name's extension for writers that read it (matplotlib picks
    the format from it). The temporary file is fsynced before the rename and the folder after it,
    so once this returns the new file survives a crash of the machine, not just of the process.
    On any failure the temporary file is removed and the old ``path`` stays.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    except OSError as e:
        raise Failure(f"writing {path}", _why(e)) from e
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 suits the temporary; the file gets what open() gives
        fsync_file(tmp)  # its data on disk before its name: else a crash can leave ``path`` empty
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise Failure(f"writing {path}", _why(e)) from e
        raise
    try:
        fsync_dir(path.parent)  # the rename itself on disk
    except OSError as e:
        raise Failure(f"writing {path}", _why(e)) from e
    return path


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to disk (the writer may have closed it: any descriptor will do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_NO_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)
"""What a file system that cannot fsync a folder answers (some network and FUSE ones): nothing to flush."""


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename, a new file or folder in it) to disk.

    A file system that refuses to fsync a folder (EINVAL and the like) is taken to keep its
    entries durable by itself; any other error (EIO, a full disk) is raised.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _why(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on the device (the disk is full); the old file, if any, is unchanged"
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` atomically and durably (:func:`atomic_write`)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) atomically and durably (:func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode())


def write_yaml(path: str | Path, doc: Any, header: str = "") -> Path:
    """``doc`` as block YAML in its own key order (with an optional comment ``header``), atomically."""
    return atomic_write_text(path, header + yaml.dump(doc, Dumper=_WrittenOut, sort_keys=False))


class _WrittenOut(yaml.SafeDumper):
    """safe_dump, but a value used twice is written twice, not as an anchor and an alias: files read as they say."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def check_writable(path: str | Path, key: str, *, folder: bool = False) -> None:
    """Refuse, before any work, a ``path`` this process could not create (a file, or with ``folder`` a folder).

    The nearest existing ancestor must be a writable folder; nothing is created here, so a refused
    command leaves nothing behind. (Permissions can still change later, and a disk can fill: those
    are :class:`~paci_tune.errors.Failure`\\ s at write time.)
    """
    p = Path(path).absolute()
    if not folder and p.is_dir():
        raise ConfigError(key, str(path), "a file path, not an existing folder")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(key, str(path), "a folder, not an existing file")
    d = p if folder else p.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        raise ConfigError(key, str(path), f"a path under a folder ({d} is a file)")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(key, str(path), f"a location this user can write ({d} is not writable)")
    if not folder and p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(key, str(path), "a file this user can write (it is read-only)")
