"""Token sources: where training and validation tokens come from.

Every source is deterministic -- the same spec gives the same arrays on every rank and every
run -- because pipeline stages load data independently and must agree token for token, and
because tuning compares runs that differ only in their pipeline settings.

- ``stdlib``: the running Python's standard library sources. Always present, needs no
  download, real code text. Depends on the Python version, which is part of its name.
- ``text``: a user's text file or folder, byte tokens.
- ``bin``: a nanoGPT-style folder of ``train.bin``/``val.bin`` uint16 or uint32 tokens (or llm.c's
  files with their header), memory-mapped and checked by :mod:`.binfile`.
- ``synthetic``: a random order-1 Markov chain whose entropy rate is known exactly, so a
  loss curve can be judged against the best achievable loss, not just against another run. Its
  stationary distribution is solved densely (three V x V arrays), so ``vocab_size`` is capped
  (:data:`SYNTHETIC_VOCAB_MAX`) and those arrays must fit in this machine's RAM.

Validation is held out by whole files, chosen by a stable hash of the relative path, so adding
a file does not reshuffle which others are held out, and no file is in both splits. May import:
numpy, :mod:`paci_tune.errors`, :mod:`paci_tune.base` and the data layer's tokenizer and binfile.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import os
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paci_tune.base.processes import physical_memory_bytes
from paci_tune.data.binfile import check_dtype, is_regular, read_tokens
from paci_tune.data.stream import DEFAULT_DRAW, DRAWS
from paci_tune.data.tokenizer import ByteTokenizer
from paci_tune.errors import ConfigError

SEPARATOR = b"\x00"  # ends every file: never appears in text, so it acts as end-of-text
BYTE_VOCAB = ByteTokenizer.vocab_size
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
TEXT_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
SNIFF_BYTES = 8192
SYNTHETIC_VOCAB_MAX = 32768
"""The largest synthetic vocabulary (the CUDA memory bench's): its chain's stationary distribution is a
dense solve, three V x V float64 arrays (24 GiB at 32768, 56 GiB at GPT-2's 50257) and 2/3 V**3 flops."""
_DENSE_BYTES = 3 * 8  # per V x V entry: the transition matrix, the linear system and the identity, float64
GPT2_VOCAB = 50257  # what nanoGPT's prepare scripts emit; the bin default when nothing else says
SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "stdlib": ("max_bytes", "val_fraction"),
    "text": ("path", "val_fraction"),
    "bin": ("path", "vocab_size", "dtype"),
    "synthetic": ("vocab_size", "branching", "n_train", "n_val", "seed"),
}


@dataclass
class TokenSource:
    """1-D integer token arrays plus what is known about the data's difficulty.

    ``entropy_rate`` (nats/token) is the exact best achievable loss when known (synthetic data);
    ``unigram_entropy`` is the loss of a model that ignores context, a sanity floor for learning.
    """

    name: str
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    entropy_rate: float | None = None
    unigram_entropy: float | None = None


def _positive_int(key: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"data.{key}", value, f"an integer >= {minimum}")
    return value


def _fits_in_memory(key: str, value: int, items: int) -> None:
    """Refuse a source whose arrays (8 bytes an item) could not be held by this machine: it cannot work."""
    ram = physical_memory_bytes()
    if ram is not None and 8 * items > ram:
        raise ConfigError(f"data.{key}", value, f"a size whose arrays fit in this machine's {ram / 2**30:.0f} GiB")


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ConfigError("data.val_fraction", value, "a number strictly between 0 and 1")
    return float(value)


def is_held_out(rel_path: str, val_fraction: float) -> bool:
    """Whether a file belongs to validation: a stable hash (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(rel_path.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


def _byte_tokens(chunks: list[bytes]) -> np.ndarray:
    joined = b"".join(part for chunk in chunks for part in (chunk, SEPARATOR))
    return np.frombuffer(joined, dtype=np.uint8)


def _split_files(
    files: Iterable[tuple[str, bytes]], val_fraction: float, max_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate files (in the given, sorted order) into train and held-out val byte tokens.

    Reading stops once ``max_bytes`` (separators included) is reached; the last file is cut.
    If the hash happens to hold out none (or all) of the files, one file is moved across so
    both splits are non-empty whenever there are at least two files.
    """
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for rel, whole in files:
        data = whole
        if max_bytes is not None:
            room = max_bytes - total - len(SEPARATOR)
            if room <= 0:
                break
            data = whole[:room]
        (val if is_held_out(rel, val_fraction) else train).append(data)
        total += len(data) + len(SEPARATOR)
    if not val and len(train) > 1:
        val.append(train.pop())
    if not train and len(val) > 1:
        train.append(val.pop(0))
    return _byte_tokens(train), _byte_tokens(val)


def _walk(root: Path, skip_dirs: frozenset[str], suffix: str | None = None) -> list[tuple[str, Path]]:
    """Files under ``root`` as (relative posix path, path), sorted by relative path; hidden ones skipped."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(dirpath, name)
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def stdlib_corpus(max_bytes: int = 8_000_000, val_fraction: float = 0.05) -> TokenSource:
    """The ``.py`` files of the running Python's standard library (no tests, no site-packages).

    Fast enough (well under a second for 8 MB) that nothing is cached on disk.
    """
    max_bytes = _positive_int("max_bytes", max_bytes, minimum=2)
    val_fraction = _fraction(val_fraction)
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = _walk(root, STDLIB_SKIP_DIRS, suffix=".py") if root.is_dir() else []
    files = ((rel, data) for rel, path in listing if (data := path.read_bytes()))
    train, val = _split_files(files, val_fraction, max_bytes)
    if not train.size or not val.size:
        raise ConfigError(
            "data.source", "stdlib", f"a Python whose standard library is .py files under {root}; try text"
        )
    name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
    return TokenSource(name, train, val, BYTE_VOCAB)


def _read_text(path: Path, key: str = "data.path") -> bytes | None:
    """The file's bytes if it looks like UTF-8 text (judged on its start), else None.

    Only a regular file is opened: a named pipe would block the load forever, a device never end.
    """
    if not is_regular(path):
        raise ConfigError(key, str(path), "a folder of regular files (a pipe, socket or device cannot be read as text)")
    with path.open("rb") as fh:
        head = fh.read(SNIFF_BYTES)
        if SEPARATOR in head:
            return None
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError:
            return None
        return head + fh.read()


def _split_tail(data: bytes, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(data) - max(1, round(len(data) * val_fraction))
    tokens = np.frombuffer(data, dtype=np.uint8)
    return tokens[:cut], tokens[cut:]


def text_source(path: str, val_fraction: float = 0.05) -> TokenSource:
    """A text file (val = its tail) or a folder of text files (val = held-out files), as bytes."""
    val_fraction = _fraction(val_fraction)
    if not isinstance(path, str | os.PathLike):
        raise ConfigError("data.path", path, "a path to an existing file or folder")
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError("data.path", path, "an existing file or folder")
    if not root.is_dir() and not is_regular(root):  # a pipe would block the read forever
        raise ConfigError("data.path", path, "a regular text file or a folder (not a pipe, socket or device)")
    if root.is_file():
        data = root.read_bytes()
        if not data:
            raise ConfigError("data.path", path, "a non-empty text file")
        train, val = _split_tail(data, val_fraction)
    else:
        files = [(rel, data) for rel, p in _walk(root, TEXT_SKIP_DIRS) if (data := _read_text(p))]
        if not files:
            raise ConfigError("data.path", path, "a folder containing non-empty text files")
        if len(files) == 1:
            train, val = _split_tail(files[0][1], val_fraction)
        else:
            train, val = _split_files(files, val_fraction)
    return TokenSource(f"text:{root.name}", train, val, BYTE_VOCAB)


def bin_source(
    path: str, vocab_size: int, *, vocab_key: str = "model.vocab_size", dtype: str | None = None
) -> TokenSource:
    """nanoGPT's prepared format: ``train.bin`` and ``val.bin`` of tokens, memory-mapped read-only.

    The files carry no vocabulary size, so the caller supplies it (``vocab_key`` names the config
    key it came from, for errors). ``dtype`` (``data.dtype``) is the tokens' width, uint16 when
    neither it nor an llm.c header says; :func:`~paci_tune.data.binfile.read_tokens` checks each
    file's size, header and first and last tokens.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ConfigError(vocab_key, vocab_size, "a positive integer")
    dtype = check_dtype(dtype)
    if not isinstance(path, str | os.PathLike):
        raise ConfigError("data.path", path, "a folder with train.bin and val.bin")
    folder = Path(path).expanduser()
    wanted = "a folder with train.bin and val.bin (uint16 or uint32 tokens, nanoGPT or llm.c format)"
    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "val"):
        file = folder / f"{split}.bin"
        if not file.exists():
            raise ConfigError("data.path", path, f"{wanted}; {file.name} is missing")
        arrays[split] = read_tokens(file, dtype, vocab_size, vocab_key)
    return TokenSource(f"bin:{folder.name}", arrays["train"], arrays["val"], vocab_size)


def _successors(vocab_size: int, branching: int, rng: np.random.Generator) -> np.ndarray:
    """(V, k) successor table. ``i -> i+1`` makes the chain irreducible; ``0 -> 0`` makes it aperiodic."""
    table = np.empty((vocab_size, branching), dtype=np.int64)
    for i in range(vocab_size):
        must = [(i + 1) % vocab_size]
        if i == 0 and branching >= 2:
            must.append(0)
        rest = np.setdiff1d(np.arange(vocab_size), must)
        extra = rng.choice(rest, size=branching - len(must), replace=False)
        table[i] = np.sort(np.concatenate([np.array(must), extra]))
    return table


def _stationary(table: np.ndarray) -> np.ndarray:
    """Exact stationary distribution: solve pi (P - I) = 0 with sum(pi) = 1."""
    v, k = table.shape
    trans = np.zeros((v, v))
    trans[np.arange(v)[:, None], table] = 1.0 / k
    system = trans.T - np.eye(v)
    system[-1] = 1.0  # irreducible => rank V-1, so one equation can become the normalisation
    rhs = np.zeros(v)
    rhs[-1] = 1.0
    pi = np.clip(np.linalg.solve(system, rhs), 0.0, None)
    return pi / pi.sum()


def _sample_chain(table: np.ndarray, pi: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """A chain started from its stationary distribution, so every sample is stationary."""
    v, k = table.shape
    state = int(rng.choice(v, p=pi))
    picks = rng.integers(0, k, size=n - 1).tolist()
    rows = table.tolist()
    out = [state]
    for c in picks:
        state = rows[state][c]
        out.append(state)
    return np.array(out, dtype=np.uint16 if v <= 1 << 16 else np.uint32)


def synthetic_source(
    vocab_size: int = 64, branching: int = 4, n_train: int = 1_000_000, n_val: int = 50_000, seed: int = 0
) -> TokenSource:
    """Order-1 Markov chain: each token has ``branching`` equally likely successors.

    Its entropy rate is exactly ``log(branching)`` nats/token (the best possible loss), while a
    context-free model can only reach the much higher unigram entropy of the stationary
    distribution -- so a run that learns context shows it clearly. Train and val are independent
    chains from child seeds, so ``n_train`` does not change the validation tokens.
    """
    vocab_size = _positive_int("vocab_size", vocab_size, minimum=2)
    ram = physical_memory_bytes()
    most = SYNTHETIC_VOCAB_MAX if ram is None else min(SYNTHETIC_VOCAB_MAX, math.isqrt(ram // _DENSE_BYTES))
    if vocab_size > most:
        here = (
            "" if most == SYNTHETIC_VOCAB_MAX else f" (they fit in this machine's {ram / 2**30:.0f} GiB up to {most})"
        )
        why = (
            f"an integer in [2, {most}]: the chain's stationary distribution is solved densely, "
            f"three V x V float64 arrays, {_DENSE_BYTES * vocab_size**2 / 2**30:.1f} GiB at V={vocab_size}{here}"
        )
        raise ConfigError("data.vocab_size", vocab_size, why)
    branching = _positive_int("branching", branching)
    if branching > vocab_size:
        raise ConfigError("data.branching", branching, f"an integer in [1, vocab_size={vocab_size}]")
    n_train = _positive_int("n_train", n_train, minimum=2)
    n_val = _positive_int("n_val", n_val, minimum=2)
    seed = _positive_int("seed", seed, minimum=0)
    for key, items in (("vocab_size", vocab_size * (branching + 1)), ("n_train", n_train), ("n_val", n_val)):
        _fits_in_memory(key, locals()[key], items)
    graph_seq, train_seq, val_seq = np.random.SeedSequence(seed).spawn(3)
    table = _successors(vocab_size, branching, np.random.default_rng(graph_seq))
    pi = _stationary(table)
    nz = pi[pi > 0]
    return TokenSource(
        name=f"synthetic-v{vocab_size}-b{branching}-s{seed}",
        train=_sample_chain(table, pi, n_train, np.random.default_rng(train_seq)),
        val=_sample_chain(table, pi, n_val, np.random.default_rng(val_seq)),
        vocab_size=vocab_size,
        entropy_rate=math.log(branching),
        unigram_entropy=float(-(nz * np.log(nz)).sum()),
    )


_PURE: dict[str, Any] = {"stdlib": stdlib_corpus, "synthetic": synthetic_source}
_CACHE: dict[tuple[Any, ...], TokenSource] = {}
_CACHE_SIZE = 4


def _pure_source(kind: str, kwargs: dict[str, Any]) -> TokenSource:
    """A source that is a pure function of its spec, built once per process.

    A command validates its run several times before training it (the space binding, a search's
    preflight, the run itself), and the built-in corpus takes seconds to read; its arrays are made
    read-only, so a cached copy can never be changed under another user of it.
    """
    try:
        key = (kind, *sorted((k, type(v).__name__, v) for k, v in kwargs.items()))  # 64 and 64.0 differ
        hash(key)
    except TypeError:  # an unhashable value: the builder refuses it
        return _PURE[kind](**kwargs)
    if key not in _CACHE:
        source = _PURE[kind](**kwargs)
        for arr in (source.train, source.val):
            arr.setflags(write=False)
        while len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = source
    return _CACHE[key]


def load_source(spec: Mapping[str, Any], vocab_size_hint: int | None) -> TokenSource:
    """Build the source a ``data:`` config section describes (``source`` defaults to ``stdlib``).

    ``vocab_size_hint`` is ``model.vocab_size`` when the user set one; the data's vocabulary must
    fit in it. ``bin`` data takes its vocabulary from ``data.vocab_size``, else the hint, else
    GPT-2's 50257 (nanoGPT's default encoding).
    """
    if not isinstance(spec, Mapping):
        raise ConfigError("data", spec, "a mapping with a 'source' key")
    kind = spec.get("source", "stdlib")
    if not isinstance(kind, str) or kind not in SOURCE_KEYS:
        raise ConfigError("data.source", kind, "one of: " + ", ".join(SOURCE_KEYS))
    for key, value in spec.items():
        if key not in ("source", "draw") and key not in SOURCE_KEYS[kind]:
            allowed = ", ".join(("source", *SOURCE_KEYS[kind], "draw"))
            raise ConfigError(f"data.{key}", value, f"one of: {allowed} (for source {kind})")
    if spec.get("draw", DEFAULT_DRAW) not in DRAWS:
        raise ConfigError("data.draw", spec.get("draw"), " or ".join(DRAWS))
    kwargs = {k: v for k, v in spec.items() if k not in ("source", "draw")}
    if kind == "text" and "path" not in kwargs:
        raise ConfigError("data.path", None, "a path to an existing file or folder")
    if kind == "bin":
        if "path" not in kwargs:
            raise ConfigError("data.path", None, "a folder with train.bin and val.bin")
        dtype = kwargs.get("dtype")
        if "vocab_size" in kwargs:
            source = bin_source(kwargs["path"], kwargs["vocab_size"], vocab_key="data.vocab_size", dtype=dtype)
        else:
            hint = GPT2_VOCAB if vocab_size_hint is None else vocab_size_hint
            source = bin_source(kwargs["path"], hint, dtype=dtype)
    elif kind in _PURE:
        source = _pure_source(kind, kwargs)
    else:
        source = text_source(**kwargs)
    if vocab_size_hint is not None and vocab_size_hint < source.vocab_size:
        allowed = f"at least {source.vocab_size}, the vocabulary of the {kind} data"
        raise ConfigError("model.vocab_size", vocab_size_hint, allowed)
    return source


__all__ = [
    "TokenSource",
    "bin_source",
    "is_held_out",
    "load_source",
    "stdlib_corpus",
    "synthetic_source",
    "text_source",
]
