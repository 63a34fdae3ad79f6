"""Acceptance (mutation) test: every broken input is refused by every command that reads it.

Broken variants of the example config, a shipped search space, a ``best.yaml`` and a profile are
generated from the documents themselves (:mod:`mutants`), plus bad command-line options, and each
is given to every command that reads it. Each must end with exit code 2, one ``error:`` line that
names the key, no traceback, and nothing written (the folder it ran in holds only its inputs, and
no profile was cached). The work itself is replaced by a tripwire, so a variant that got through
validation fails loudly (exit 1, ``WorkStarted``) instead of training; the unbroken documents are
run to that tripwire first, so a variant is refused for its own defect, not for the base's.

Run in-process with click's runner for speed; a handful run as real subprocesses to show the exit
code and the absent traceback end to end. Huge values that are allowed (``ALLOWED_HUGE``: a long
run, a long search, a target any run reaches) are settings, not mistakes; what cannot work is refused
(a batch beyond the data, a depth beyond the model's units, values beyond 64 bits, a grid of
millions of validations, an LR that turns weights to inf).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO
from helpers.broken import BEST, SMALL, Variant, variants
from helpers.cli import cli_env, invoke_in
from helpers.configs import BASE_CONFIG

EXAMPLE = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())
SPACE = yaml.safe_load((REPO / "search_spaces" / "cpu-small.yaml").read_text())

ALLOWED_HUGE = frozenset(
    {
        "training.steps",
        "training.seed",
        "training.eval_every",
        "optimizer.weight_decay",
        "target.value",
        "budget.seconds",
        "search.trials",
        "training.eval_microbatch_size",
    }
)
"""Leaves of the example where 10**12 / 1e300 is a legitimate setting (documented in the README; a huge
evaluation chunk is the whole validation set in one forward, which the memory budget then refuses)."""


BEST_HUGE = frozenset(
    {
        *(f"run.{k}" for k in ALLOWED_HUGE),
        "run.optimizer.eps",
        "evidence.best_val_loss",
        "evidence.score",
        "evidence.tokens_per_s",
        "evidence.steps",
        "target.value",
        "budget.seconds",
    }
)
BEST_FREE = frozenset({"evidence.trial", "provenance.study_name"})


def _profile() -> dict[str, Any]:
    cost = {"forward_s": 0.002, "backward_s": 0.004, "activation_bytes": 4096, "saved_bytes": 16384}
    units = [
        {"name": f"u{i}", "param_bytes": 65536, "optimizer_s": 0.001, "microbatch": {2: dict(cost)}} for i in range(4)
    ]
    units[0]["microbatch"][4] = dict(cost)  # one unit measured at two sizes (the others interpolate)
    return {
        "format": "paci-tune-profile/1",
        "device": "cpu",
        "dtype": "fp32",
        "seq_len": 32,
        "units": units,
        "p2p": {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e9, "backend": "gloo"},
    }


PROFILE = _profile()
PROFILE_FREE = frozenset({"device", *(f"units[{i}].name" for i in range(4)), "p2p.backend"})


class WorkStarted(Exception):
    """The tripwire: the command got past validation to real work."""


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    import paci_tune.calibrate
    import paci_tune.calibrate.cache
    import paci_tune.sim.simulator
    import paci_tune.train.run
    import paci_tune.tune.search

    def trip(*_a: Any, **_k: Any) -> Any:
        raise WorkStarted()

    for module, name in [
        (paci_tune.train.run, "run_training"),
        (paci_tune.train.run, "measured_profile"),
        (paci_tune.calibrate.cache, "measured_profile"),
        (paci_tune.calibrate, "calibrate"),
        (paci_tune.sim.simulator, "simulate"),
        (paci_tune.tune.search.Search, "run"),
    ]:
        monkeypatch.setattr(module, name, trip)
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return cache


def _refused(folder: Path, inputs: set[str], args: list[str], key: str, cache: Path) -> str | None:
    """None when ``args`` was refused as it must be, else what went wrong."""
    r = invoke_in(folder, args)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return f"raised {type(r.exception).__name__}: {r.exception}"
    out = r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    left = {p.name for p in folder.iterdir()} - inputs
    problems = []
    if r.exit_code != 2:
        problems.append(f"exit {r.exit_code}")
    if "Traceback" in out:
        problems.append("a traceback")
    if left or (cache.exists() and any(cache.rglob("*"))):
        problems.append(f"wrote {sorted(left) or 'the profile cache'}")
    if (
        r.exit_code == 2
        and not (len(lines) == 1 and lines[0].lower().startswith("error") and key in lines[0])
        and not (
            lines and lines[-1].startswith("Error:") and key in out  # click's usage error: usage lines, then one Error
        )
    ):
        problems.append(f"message does not name {key!r}")
    last = next((ln for ln in reversed(out.splitlines()) if ln.strip()), "")
    return f"{'; '.join(problems)}: {last[:300]}" if problems else None


def _run_all(tmp_path: Path, cache: Path, cases: list[tuple[Variant, dict[str, bytes], list[list[str]]]]) -> int:
    """Each (variant, input files, command lines) refused by every command line; returns the runs made."""
    failures, runs = [], 0
    for i, (v, files, commands) in enumerate(cases):
        folder = tmp_path / f"v{i}"
        folder.mkdir(parents=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        for args in commands:
            runs += 1
            why = _refused(folder, set(files), args, v.key, cache)
            if why:
                failures.append(f"{v.id} :: {' '.join(args[:1])}: {why}")
    assert not failures, f"{len(failures)} of {runs} runs not refused cleanly:\n" + "\n".join(failures[:40])
    return runs


def _reaches_work(tmp_path: Path, files: dict[str, bytes], args: list[str]) -> None:
    folder = tmp_path / ("base-" + args[0])
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    r = invoke_in(folder, args)
    assert r.exit_code == 1 and "WorkStarted" in r.stderr, f"the unbroken input did not pass: {r.stderr[-1500:]}"


def _dump(doc: Any) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False).encode()


CONFIG_COMMANDS = [
    ["train", "c.yaml", "--no-live", "--metrics", "m.jsonl"],
    ["search", "c.yaml", "--no-live"],
    ["simulate", "c.yaml", "--json", "--timeline", "t.png"],
    ["calibrate", "c.yaml", "--out", "p.yaml"],
]
COUNTS: dict[str, int] = {}


def test_broken_example_configs_are_refused_by_every_command(tmp_path: Path, tripwire: Path) -> None:
    for args in CONFIG_COMMANDS:
        _reaches_work(tmp_path, {"c.yaml": _dump(EXAMPLE)}, args)
    vs = variants(EXAMPLE, allowed_huge=ALLOWED_HUGE)
    COUNTS["config"] = len(vs)
    runs = _run_all(tmp_path, tripwire, [(v, {"c.yaml": v.text}, CONFIG_COMMANDS) for v in vs])
    assert len(vs) >= 100 and runs == 4 * len(vs)


def test_broken_search_spaces_are_refused_by_search(tmp_path: Path, tripwire: Path) -> None:
    carrier = _dump({**SMALL, "search": {**SMALL["search"], "space": "s.yaml"}})
    args = ["search", "c.yaml", "--no-live"]
    _reaches_work(tmp_path, {"c.yaml": carrier, "s.yaml": _dump(SPACE)}, args)
    vs = variants(SPACE, free_text=frozenset({"description"}), huge_int=2**64, root_key="space")
    extra = [  # values of the right type that cannot work
        Variant("stages=range-of-a-billion", _dump({**SPACE, "stages": {"low": 1, "high": 10**9}}), "stages"),
        Variant("stages=empty-range", _dump({**SPACE, "stages": {"low": 5, "high": 1}}), "stages"),
        Variant("stages=all-beyond-units", _dump({**SPACE, "stages": [50, 60]}), "stages"),
        Variant(
            "free-batch=microbatch-beyond-data",
            _dump({**SPACE, "global_batch": "free", "window": [2], "microbatch_size": [10**9]}),
            "microbatch_size",
        ),
        Variant("lr_scale=inf-lr", _dump({**SPACE, "lr_scale": [1.0, 1e300]}), "lr"),
        Variant("lr_scale=range-to-inf-lr", _dump({**SPACE, "lr_scale": {"low": 1.0, "high": 1e300}}), "lr"),
    ]
    vs += extra
    COUNTS["space"] = len(vs)
    _run_all(tmp_path, tripwire, [(v, {"c.yaml": carrier, "s.yaml": v.text}, [args]) for v in vs])
    # A confirmation seed past 2**63 is a trial the search would start: refused before it does.
    seed = _dump(
        {
            **SMALL,
            "training": {**SMALL["training"], "seed": 2**63 - 2},
            "search": {**SMALL["search"], "confirm": {"top": 1, "seeds": 3}},
        }
    )
    _run_all(tmp_path / "seed", tripwire, [(Variant("confirm-seed", seed, "seed"), {"c.yaml": seed}, [args])])


def test_broken_best_yaml_is_refused_by_apply(tmp_path: Path, tripwire: Path) -> None:
    commands = [["apply", "best.yaml", "--dry-run"], ["apply", "best.yaml", "--no-live", "--metrics", "m.jsonl"]]
    _reaches_work(tmp_path, {"best.yaml": _dump(BEST)}, commands[1])
    vs = variants(
        BEST,
        allowed_huge=BEST_HUGE,
        free_text=BEST_FREE,
        skip=frozenset({"provenance.study_name", "provenance.bogus_key"}),  # informative: free-form
        root_key="best.yaml",
    )
    COUNTS["best"] = len(vs)
    _run_all(tmp_path, tripwire, [(v, {"best.yaml": v.text}, commands) for v in vs])


def test_broken_profiles_are_refused_by_every_reader(tmp_path: Path, tripwire: Path) -> None:
    config = _dump(BASE_CONFIG)
    rst = _dump({**SMALL, "budget": {"clock": "rst", "seconds": 0.3, "grid": 3, "profile": "p.yaml"}})
    commands = [
        ["simulate", "c.yaml", "--profile", "p.yaml", "--json"],
        ["train", "c.yaml", "--clock", "rst", "--profile", "p.yaml", "--no-live"],
        ["search", "s.yaml", "--no-live"],
    ]
    for args in commands:
        _reaches_work(tmp_path, {"c.yaml": config, "s.yaml": rst, "p.yaml": _dump(PROFILE)}, args)
    vs = variants(
        PROFILE,
        allowed_huge=frozenset({"p2p.bandwidth_Bps"}),
        free_text=PROFILE_FREE,
        skip=PROFILE_FREE,
        huge_int=2**64,
        root_key="profile",
    )
    COUNTS["profile"] = len(vs)
    _run_all(tmp_path, tripwire, [(v, {"c.yaml": config, "s.yaml": rst, "p.yaml": v.text}, commands) for v in vs])


OPTIONS: list[tuple[list[str], str]] = [
    *[
        (["train", "c.yaml", flag, value], flag.lstrip("-").split("-")[0])
        for flag in (
            "--stages",
            "--window",
            "--microbatch-size",
            "--inflight",
            "--global-batch",
            "--steps",
            "--seconds",
            "--seed",
            "--eval-every",
            "--checkpoint-every",
        )
        for value in ("-3", "lots")
    ],
    (["train", "c.yaml", "--stages", "1000000"], "stages"),
    (["train", "c.yaml", "--global-batch", "1000000000000"], "global_batch"),
    (["train", "c.yaml", "--seed", str(2**64)], "seed"),
    (["train", "c.yaml", "--schedule", "zigzag"], "schedule"),
    (["train", "c.yaml", "--metrics", "c.yaml/m.jsonl"], "--metrics"),
    (["train", "c.yaml", "--checkpoint-every", "2", "--checkpoint-dir", "c.yaml"], "checkpoint_dir"),
    (["search", "c.yaml", "--trials", "-3"], "trials"),
    (["search", "c.yaml", "--seed", "-3"], "seed"),
    (["search", "c.yaml", "--seed", "lots"], "seed"),
    (["search", "c.yaml", "--space", "no-such-space"], "space"),
    (["search", "c.yaml", "--out", "c.yaml/best.yaml"], "--out"),
    (["search", "c.yaml", "--workdir", "c.yaml"], "workdir"),
    (["search", "c.yaml", "--study-name", ""], "study"),
    (["search", "c.yaml", "--storage", "not-a-url"], "--storage"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--repeats", "-3"], "repeats"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--threads", "0"], "threads"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--threads", "100000"], "threads"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--microbatch-sizes", "-3"], "microbatch-sizes"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--microbatch-sizes", "4,lots"], "microbatch-sizes"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--microbatch-sizes", "1000000000"], "microbatch-sizes"),
    (["calibrate", "c.yaml", "--out", "p.yaml", "--stages", "1000000"], "stages"),
    (["calibrate", "c.yaml", "--out", "c.yaml/p.yaml"], "--out"),
    (["simulate", "c.yaml", "--batches", "-3"], "batches"),
    (["simulate", "c.yaml", "--batches", "1000000000"], "batches"),
    (["simulate", "c.yaml", "--memory-gib", "-3"], "memory-gib"),
    (["simulate", "c.yaml", "--memory-gib", "lots"], "memory-gib"),
    (["simulate", "c.yaml", "--window", "-3"], "window"),
    (["simulate", "c.yaml", "--stages", "1000000"], "stages"),
    (["simulate", "c.yaml", "--timeline", "t.gif"], "timeline"),
    (["simulate", "c.yaml", "--profile", "no-such.yaml"], "profile"),
    (["apply", "c.yaml"], "best.yaml"),
]


def test_bad_options_are_refused(tmp_path: Path, tripwire: Path) -> None:
    config = _dump(SMALL)
    COUNTS["options"] = len(OPTIONS)
    cases = [
        (
            Variant(" ".join(a), b"", key),
            {"c.yaml": config},
            [[*a, *(["--no-live"] if a[0] in ("train", "search") else [])]],
        )
        for a, key in OPTIONS
    ]
    _run_all(tmp_path, tripwire, cases)


# A user model's units, through every command that reads a config (docs/guide.md, "What a unit may
# take and return"): a unit returning a tuple or a dict, and a model with nothing to train, are refused;
# a unit without any parameter is fine (it has nothing to train), so that config reaches the work.
UNIT_CASES = [
    ("tuple-output", "build_tuple", {}),
    ("dict-output", "build_dict", {}),
    ("nothing-to-train", "build_frozen", {"frozen": list(range(6))}),
]


def _with_model(entry: str, kwargs: dict[str, Any]) -> bytes:
    """SMALL with a model of tests/helpers/guide_models.py at its size."""
    from helpers.guide_models import SMALL as SIZE

    spec = {"entry": f"helpers.guide_models:{entry}", "kwargs": {**SIZE, **kwargs}, "block_size": SIZE["block_size"]}
    return _dump({**SMALL, "model": spec})


def test_units_that_break_the_interface_are_refused_by_every_command(tmp_path: Path, tripwire: Path) -> None:
    for args in CONFIG_COMMANDS:
        _reaches_work(tmp_path, {"c.yaml": _with_model("build_with_gelu", {})}, args)  # a parameter-free unit
    cases = [
        (Variant(f"model={name}", text, "model.entry"), {"c.yaml": text}, CONFIG_COMMANDS)
        for name, entry, kwargs in UNIT_CASES
        for text in [_with_model(entry, kwargs)]
    ]
    COUNTS["units"] = len(cases)
    _run_all(tmp_path, tripwire, cases)


def test_variant_count_is_recorded() -> None:
    """The count the report quotes: variants per document (each run by every command that reads it)."""
    n = {"config": len(variants(EXAMPLE, allowed_huge=ALLOWED_HUGE)), "options": len(OPTIONS)}
    assert n["config"] >= 100, n


# ------------------------------------------------------------------------- end to end, as processes
SUBPROCESS_CASES = [
    ("train-negative-seed", "train", {"training": {**EXAMPLE["training"], "seed": -3}}, "training.seed"),
    ("search-negative-seed", "search", {"training": {**EXAMPLE["training"], "seed": -3}}, "training.seed"),
    ("train-negative-target", "train", {"target": {**EXAMPLE["target"], "value": -3}}, "target.value"),
    ("search-garbage-budget", "search", {"budget": {**EXAMPLE["budget"], "grid": "lots"}}, "budget.grid"),
    ("simulate-empty", "simulate", None, "config"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "command", "change", "key"), SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_refusals_end_to_end(tmp_path: Path, case: str, command: str, change: dict | None, key: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("" if change is None else yaml.safe_dump({**EXAMPLE, **change}, sort_keys=False))
    extra = ["--no-live"] if command in ("train", "search") else []
    proc = subprocess.run(
        [sys.executable, "-m", "paci_tune", command, str(config), *extra],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=cli_env(),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"], "a refused command wrote something"
