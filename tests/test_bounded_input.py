"""Every bad input is refused quickly, with exit 2 and the key named, before any work: never a hang.

Each case runs the real CLI in a subprocess, in an empty folder, under a ``timeout`` and a memory
cap (so a regression hangs or fails here, not the machine), and checks: exit code 2, one ``error:``
line naming the key, no traceback, under :data:`WALL_S` seconds including Python's start-up on a
loaded machine, and no file written. Oracle: the project's rule for bad input (README, "Bad input
and failures"); the values are ones a reviewer found to hang, run out of memory or never start.
"""

from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO
from helpers.cli import cli_env

from paci_tune.errors import ConfigError

WALL_S = 20.0  # the refusal itself takes well under 5 s; the rest is start-up on a shared 2-core machine
TIMEOUT_S = 60.0
MEMORY_CAP = 6 << 30  # address space: torch's import fits; a 56 GiB array or a billion-laughs repr does not
EXAMPLE = REPO / "examples" / "tiny-gpt.yaml"
PROFILE = REPO / "examples" / "profiles" / "tiny-gpt.yaml"


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _example(**changes: dict[str, Any]) -> dict[str, Any]:
    """The example config (its profile path made absolute), each section updated by ``changes``."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["budget"]["profile"] = str(PROFILE)
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    return doc


def _files(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def _refused(folder: Path, config: Path, command: str, key: str, *extra: str) -> str:
    """Run ``paci-tune COMMAND CONFIG`` in ``folder``; assert the refusal (module docstring); its error line."""
    before = _files(folder)
    env = {**cli_env(), "XDG_CACHE_HOME": str(folder / ".cache"), "HOME": str(folder)}
    argv = [sys.executable, "-m", "paci_tune.cli", command, str(config), *extra]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=folder, env=env, preexec_fn=_cap_memory
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"paci-tune {command} did not refuse {key} within {TIMEOUT_S:.0f} s")
    took = time.monotonic() - start
    out = f"exit {proc.returncode} after {took:.1f} s\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stderr, out
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and key in errors[0], out
    assert len(errors[0]) < 2000, f"an unbounded error line: {len(errors[0])} characters"
    assert took < WALL_S, out
    assert _files(folder) == before, f"files written: {sorted(map(str, _files(folder) - before))}"
    return errors[0]


def _write(folder: Path, doc: dict[str, Any] | str, name: str = "run.yaml") -> Path:
    path = folder / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("command", ["train", "search", "simulate"])
def test_a_huge_batch_is_refused_without_listing_every_divisor(tmp_path: Path, command: str) -> None:
    config = _write(tmp_path, _example(training={"global_batch": 10**12}, pipeline={"window": 7}))
    line = _refused(tmp_path, config, command, "pipeline.window")
    assert "1000000000000" in line and "169 divisors" in line, line


def _alias_bomb(levels: int = 9) -> str:
    """Billion laughs, where the config reads a value (``data.max_bytes``): 9**9 items from a few hundred bytes."""
    names = "abcdefghijklmnop"[:levels]
    parts = ['&a ["x","x","x","x","x","x","x","x","x"]']
    parts += [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in itertools.pairwise(names)]
    return "model: {preset: tiny}\ndata:\n  source: stdlib\n  max_bytes: [" + ", ".join(parts) + "]\n"


def test_a_yaml_alias_bomb_is_refused_naming_the_file(tmp_path: Path) -> None:
    text = _alias_bomb()
    assert len(text) < 700
    config = _write(tmp_path, text)
    line = _refused(tmp_path, config, "train", "config")
    assert "run.yaml" in line and "expand to at most 1,000,000 values" in line, line


def test_a_few_aliases_read_as_written_out_in_full_and_plain_files_read_fast(tmp_path: Path) -> None:
    """Anchors stay allowed (a hand-written config may share a section): each alias becomes a copy of its own."""
    from paci_tune.base.files import read_yaml

    doc = read_yaml(_write(tmp_path, "a: &m {lr: 1, b: [1, 2]}\nb: *m\n", "anchored.yaml"))
    assert doc == {"a": {"lr": 1, "b": [1, 2]}, "b": {"lr": 1, "b": [1, 2]}}
    assert doc["a"] is not doc["b"] and doc["a"]["b"] is not doc["b"]["b"]  # editing one never edits the other
    with pytest.raises(ConfigError) as e:
        read_yaml(_write(tmp_path, "a: &a [1, *a]\n", "loop.yaml"), "search.space")  # contains itself
    assert e.value.key == "search.space" and "loop.yaml" in str(e.value)
    start = time.perf_counter()
    for _ in range(20):
        read_yaml(PROFILE)
    assert (time.perf_counter() - start) / 20 < 0.1  # the C loader: a few ms a profile


def test_an_error_message_shows_a_huge_value_bounded() -> None:
    shared: Any = ["x"] * 9
    for _ in range(8):
        shared = [shared] * 9  # 9**9 leaves, shared: what an alias bomb builds
    start = time.perf_counter()
    message = str(ConfigError("data.max_bytes", shared, "an integer"))
    long = str(ConfigError("data.path", "y" * 100_000, "a path"))
    assert time.perf_counter() - start < 1.0
    assert len(message) < 600 and "characters)" in message, message[:300]
    assert len(long) < 600 and "(100000 characters)" in long
    assert str(ConfigError("k", [1, 2], "x")) == "k: got [1, 2]; allowed: x"  # small values as before


def test_a_seconds_budget_too_long_to_simulate_is_refused_by_search(tmp_path: Path) -> None:
    config = _write(tmp_path, _example(budget={"seconds": 10**9}))
    line = _refused(tmp_path, config, "search", "budget.seconds")
    assert "1000000000" in line and "at most" in line, line


def test_a_seconds_budget_too_long_to_simulate_is_refused_by_train(tmp_path: Path) -> None:
    doc = _example(training={"seconds": 10**9, "clock": "rst", "profile": str(PROFILE)})
    for section in ("target", "budget", "hardware", "search"):
        doc.pop(section)
    doc["training"].pop("steps")
    config = _write(tmp_path, doc)
    line = _refused(tmp_path, config, "train", "training.seconds", "--metrics", str(tmp_path / "m.jsonl"))
    assert "at most" in line, line


def test_a_synthetic_vocabulary_too_large_to_build_is_refused(tmp_path: Path) -> None:
    doc = _example(data={"source": "synthetic", "vocab_size": 50257})
    config = _write(tmp_path, doc)
    line = _refused(tmp_path, config, "train", "data.vocab_size")
    assert "50257" in line and "an integer in [2, " in line and "56.5 GiB" in line, line


def test_a_named_pipe_in_a_text_folder_is_refused_naming_it(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to train on\n" * 200)
    (corpus / "b.txt").write_text("more text to train on\n" * 200)
    os.mkfifo(corpus / "pipe.txt")
    config = _write(tmp_path, _example(data={"source": "text", "path": str(corpus)}))
    line = _refused(tmp_path, config, "train", "data.path")
    assert "pipe.txt" in line, line
