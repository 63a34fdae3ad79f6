"""The docs cannot rot: every shell command in the README, the user guide and the manual is run, or listed here
with the reason it is not.

Each ```bash block's commands run in order in a scratch folder of the block's own, so a command may
use what an earlier one of its block wrote (``apply best.yaml`` after ``search``), and the
alternatives a block lists do not trip over each other's files across blocks. Every scratch folder
starts as a copy of one where the quick start's search (``paci-tune search examples/tiny-gpt.yaml``)
has run once (one search for both documents), so a block that only reports on or applies a
search finds its study and best.yaml, and a block's own search resumes it. The built-in example
there is the real ``examples/tiny-gpt.yaml`` reduced (a smaller model, a slice of the corpus, a few
steps, two trials on the rst clock over a hand-written profile, so nothing is measured);
``model.yaml`` in a command means that file too. A command the check does not run is listed in
``SKIPPED`` with why (a second machine, a database server, a GPU, minutes of training, or another
test that runs it for real); a ``paci-tune`` one among them must still parse (its options exist).
A new command in the docs is run, so it must work on the example; if it cannot, list it here.

Oracle: the exit status of each command (0, or the status the docs say), and for the commands
that write files, that those files appear.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml
from helpers import REPO
from helpers.cli import cpu_threads
from helpers.profiles import reference_profile

from paci_tune.cli.app import main as cli_main

pytestmark = pytest.mark.slow

DOCS = ("README.md", "docs/guide.md", "docs/manual.md")


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    block: int  # which ```bash block of the document

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


# (pattern found in the command, why it is not run). The first match wins.
SKIPPED: list[tuple[str, str]] = [
    (r"python -m pytest", "the test suite itself: .ci/run runs exactly this line (checked below)"),
    (
        r"postgresql(\+psycopg)?://",
        "needs a PostgreSQL server: tests/test_postgres.py runs searches against a real one",
    ),
    (
        r"--study-name gpt2m-p8",
        "a worker of the several-machines search on a PostgreSQL server (its URL from the "
        "environment): tests/test_security.py runs one against a real server that requires a password",
    ),
    (r"^torchrun .*--nnodes", "needs several machines: tests/test_runtimes.py runs a two-node launch on loopback"),
    (r"^optuna-dashboard", "a web server that runs until stopped (the study it reads is checked by test_report)"),
    (r"^paci-tune calibrate", "measures this machine for a minute: tests/test_sim_accuracy.py runs a calibration"),
    (r"^paci-tune search .*--storage journal:", "a new study on a journal: test_search.py runs two workers on one"),
    (r"--device cuda|backend nccl|device: cuda", "needs a GPU: bench/gpu_check.sh runs on a lent one"),
]
# Installation steps in a command line are not re-run here: tests/test_install.py installs a wheel
# into a fresh venv and searches with it. The rest of the line runs.
INSTALL = re.compile(r"^(python3? -m venv \S+|\. \S+/bin/activate|pip install .*)$")
# The example's long settings, reduced.
REDUCED = [
    ("--steps 100", "--steps 4"),
    ("--seconds 60", "--seconds 0.5"),
    ("model.yaml", "examples/tiny-gpt.yaml"),
    ("journal:///shared/fs/", "journal://SCRATCH/"),
]


def shell_commands(doc: str) -> list[Command]:
    """The commands of ``doc``'s ```bash/```sh blocks: continuation lines joined, comments dropped."""
    lines = (REPO / doc).read_text().splitlines()
    out: list[Command] = []
    in_block, pending, start, block = False, "", 0, 0
    for i, raw in enumerate(lines, 1):
        fence = raw.strip()
        if fence.startswith("```"):
            in_block = not in_block and fence[3:].strip() in ("bash", "sh", "shell", "console")
            block += in_block
            continue
        if not in_block:
            continue
        text = re.sub(r"(^|\s)#(\s.*)?$", "", raw).strip()
        if not pending:
            start = i
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        text = (pending + text).strip().removeprefix("$ ")
        pending = ""
        if text:
            out.append(Command(doc, start, text, block))
    return out


def skip_reason(cmd: Command) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, cmd.text)), None)


def runnable(cmd: Command, scratch: Path) -> str:
    """The part of the line to run here, reduced."""
    parts = [p.strip() for p in cmd.text.split("&&")]
    text = " && ".join(p for p in parts if not INSTALL.match(p))
    for old, new in REDUCED:
        text = text.replace(old, new.replace("SCRATCH", str(scratch)))
    return text


def _reduced_example(scratch: Path) -> None:
    example = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())
    doc = dict(example)
    doc["model"] = {**example["model"], "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 64}  # 4 units
    profile = scratch / "profile.yaml"
    profile.write_text(yaml.safe_dump(reference_profile(doc["model"]["n_layer"] + 2, doc["model"]["block_size"])))
    doc["data"] = {**example["data"], "max_bytes": 1_000_000}
    doc["training"] = {**example["training"], "steps": 6, "eval_every": 3, "eval_sequences": 16}
    doc["budget"] = {"clock": "rst", "seconds": 0.2, "grid": 2, "profile": "profile.yaml"}
    # The example's device memory is sized to its own model; the reduced model's points all fit it or none
    # does, depending on the hand profile's reserve, so the reduced run has no budget (tested elsewhere).
    doc["hardware"] = {k: v for k, v in example["hardware"].items() if k != "memory"}
    doc["search"] = {
        **example["search"],
        "trials": 1,
        "confirm": {"top": 0},
        "warm_start": {"steps": 8},
    }  # the example's warm start, shortened past its LR ramp
    (scratch / "examples").mkdir()
    (scratch / "examples" / "tiny-gpt.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _parses(cmd: Command) -> None:
    """A paci-tune command the check does not run still names a real command and real options."""
    import shlex

    args = shlex.split(cmd.text.split("&&")[-1])
    if not args or args[0] != "paci-tune":
        return
    name, rest = args[1], args[2:]
    sub = cli_main.get_command(click.Context(cli_main), name)
    assert sub is not None, f"no command {name!r}: {cmd.where()}"
    try:
        sub.make_context(name, rest, resilient_parsing=True)
    except (click.NoSuchOption, click.BadOptionUsage) as e:
        pytest.fail(f"{e.format_message()}: {cmd.where()}")


def test_the_readme_test_command_is_what_ci_runs() -> None:
    (line,) = [c.text for c in shell_commands("README.md") if "python -m pytest" in c.text]
    ci = (REPO / ".ci" / "run").read_text()
    install = next(p.strip() for p in line.split("&&") if p.strip().startswith("pip install"))
    assert f"{install} && python -m pytest -q" in ci, "the README's test command must be the one .ci/run calls"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=cpu_threads(), PYTHONUNBUFFERED="1", TERM="dumb")  # TERM: plain lines
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # paci-tune, python
    return env


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every block starts from: the reduced example, searched once (for both docs)."""
    base = tmp_path_factory.mktemp("docs-base")
    _reduced_example(base)
    first = subprocess.run(
        ["bash", "-c", "paci-tune search examples/tiny-gpt.yaml"],
        cwd=base,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    return base


@pytest.mark.parametrize("doc", [d for d in DOCS if (REPO / d).is_file()])
def test_every_command_in_the_docs_runs_or_says_why_not(doc: str, searched: Path, tmp_path: Path) -> None:
    commands = shell_commands(doc)
    assert commands, f"no shell commands found in {doc}"
    env = _env()
    ran = 0
    for cmd in commands:
        if skip_reason(cmd) is not None:
            _parses(cmd)
            continue
        scratch = tmp_path / f"block{cmd.block}"
        if not scratch.exists():
            shutil.copytree(searched, scratch)
        text = runnable(cmd, scratch)
        if not text:
            continue
        proc = subprocess.run(
            ["bash", "-c", text], cwd=scratch, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert proc.returncode == 0, f"{cmd.where()}\nran: {text}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        ran += 1
    assert ran, f"{doc}: every command was skipped"
