"""Warm-started searches (``search.warm_start``, :mod:`paci_tune.tune.warm`) end to end.

Each claim is checked against an oracle of its own, not against what the code printed: the trials'
``events.jsonl`` and ``trial.yaml`` under ``WORKDIR/trials/``, the files of the warm-up's folder
(their inodes and mtimes), the Optuna storage read back with Optuna, plain single-process training
(:func:`helpers.oracles.plain_training`: a 1F1B-flush warm-up is exact gradient accumulation), and
a warm-up trained straight through in another folder.

The search is ``bench/search_seeds.py``'s QUICK one (read, not copied) on its reference profile,
with a budget long enough that a trial trains a few steps. One search (``searched``) serves most
tests: it is killed once the confirmation has started, resumed, and run once more.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml
from helpers import REPO
from helpers.broken import BEST
from helpers.cli import check_error, check_ok, cli_env, invoke_in, read_metrics, run_cli, run_in_process
from helpers.configs import make_config, merge, write_config
from helpers.oracles import plain_training
from helpers.processes import kill_tree
from helpers.searches import quick_search, run, run_workers, search_cmd, studies
from optuna.trial import TrialState

from paci_tune.tune.record import StudyRecord

WARM = 6
"""The warm-up's global batches: every trial's first step is WARM + 1."""
OPTIMIZER = {"name": "adamw", "lr": 3.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8}
"""Spelled out: plain_training (the warm-up's oracle) reads every hyper-parameter from the document."""
TRAINING_LINE = "warm start: training"
"""The start of the line a search logs when it trains the warm-up (and only then)."""


def write_quick(
    folder: Path, warm: dict[str, Any] | None = None, *, relative: bool = False, **sections: dict[str, Any]
) -> Path:
    """QUICK as ``folder/model.yaml`` (its space and profile beside it, named by absolute paths unless
    ``relative``): a 0.6 s rst budget (a few steps a trial), an LR that warms up over half of a run (so a
    trial that warmed up again would show it), one trial per schedule confirmed on exactly seeds 1 and 2,
    and ``search.warm_start: warm``."""
    q = quick_search()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "space.yaml").write_text(yaml.safe_dump(q.QUICK_SPACE))
    (folder / "profile.yaml").write_text(yaml.safe_dump(q.QUICK_PROFILE))
    where = (lambda n: n) if relative else (lambda n: str(folder / n))
    doc = merge(
        q.QUICK,
        {
            "optimizer": OPTIMIZER,
            "lr_schedule": {"warmup_fraction": 0.5},
            "budget": {"seconds": 0.6, "profile": where("profile.yaml")},
            "search": {
                "space": where("space.yaml"),
                "trials": 1,
                "seed": 0,
                "confirm": {"top": 1, "seeds": 2, "max_seeds": 2},
            },
        },
    )
    doc = merge(doc, sections)
    doc["search"].pop("warm_start", None)
    if warm is not None:
        doc["search"]["warm_start"] = warm
    return write_config(folder, doc, "model.yaml")


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``folder`` but the lock: (inode, mtime in ns, size). Rewritten or retrained, it changes."""
    return {
        str(p.relative_to(folder)): (st.st_ino, st.st_mtime_ns, st.st_size)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
        for st in [p.stat()]
    }


def _train(path: Path) -> list[dict[str, Any]]:
    """The ``train`` records of an events or metrics file (none when it is not there), in file order."""
    return [r for r in read_metrics(path) if r.get("event") == "train"] if path.is_file() else []


def _evidence_losses(searched: Searched) -> tuple[list[float], bool]:
    """The recommended trial's training losses, and whether they are another layout's: a point answered
    from a shared curve (tune.sharing, tune.siblings) reads the run that trained it, whose losses are its
    own to float rounding (the same numerics, the global batch split another way)."""
    best = yaml.safe_load((searched.tmp / "best.yaml").read_text())
    study, number = best["evidence"]["trial"].rsplit("#", 1)
    source = studies(searched.storage)[study.rsplit(".", 1)[1]].trials[int(number)].user_attrs.get("shared_from")
    if source:
        study, number = source["study"], source["trial"]
    events = searched.tmp / "work" / "trials" / study / f"trial-{int(number):04d}" / "events.jsonl"
    return [r["loss"] for r in _train(events)], bool(source)


def _same_losses(got: list[float], want: list[float], shared: bool) -> bool:
    return got == want if not shared else got == pytest.approx(want, abs=1e-5, rel=0)


def _trial_folders(work: Path) -> list[Path]:
    return sorted(work.glob("trials/*/trial-*"))


def _check_trials_start_from(work: Path, done: dict[str, Any], may_lack: tuple[Path, ...] = ()) -> int:
    """Every trial of ``work`` named the warm-up's checkpoint and trained steps WARM + 1, WARM + 2, ... from
    the LR's peak (no second warm-up); the trials that trained a step. ``may_lack``: a killed trial's folder,
    which may hold no run file yet."""
    trained = 0
    for folder in _trial_folders(work):
        if folder in may_lack and not (folder / "trial.yaml").is_file():
            continue
        doc = yaml.safe_load((folder / "trial.yaml").read_text())
        assert doc["training"]["init_from"] == done["checkpoint"], folder
        train = _train(folder / "events.jsonl")
        if not train:
            assert folder in may_lack, f"{folder} trained no step"
            continue
        trained += 1
        steps = [r["step"] for r in train]
        assert steps == list(range(WARM + 1, WARM + 1 + len(steps))), f"{folder}: steps {steps}"
        peak = doc["optimizer"]["lr"]
        assert 0.9 * peak < train[0]["lr"] <= peak, f"{folder}: first LR {train[0]['lr']} (peak {peak})"
    return trained


def _same_weights(a: Path, b: Path) -> None:
    """Two checkpoint folders hold the same weights and optimizer state, bit for bit."""
    stages = sorted(p.name for p in a.glob("stage_*.pt"))
    assert stages and stages == sorted(p.name for p in b.glob("stage_*.pt"))
    for name in stages:
        x, y = (torch.load(f / name, map_location="cpu", weights_only=False) for f in (a, b))
        assert x["module"].keys() == y["module"].keys()
        for k in x["module"]:
            assert torch.equal(x["module"][k], y["module"][k]), f"{name}: {k}"
        for i, state in x["optimizer"]["state"].items():
            for k, v in state.items():
                other = y["optimizer"]["state"][i][k]
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(other)), f"{name}: optimizer {i}.{k}"


def _apply(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "paci_tune.cli", "apply", *map(str, args)])


# ------------------------------------------------------------------ one search: killed, resumed, run again
@dataclass
class Searched:
    tmp: Path
    config: Path
    storage: str
    warm_dir: Path  # beside the default SQLite storage: WORKDIR/STUDY-warm-start
    killed: Path  # the trial folder whose start triggered the kill
    first_log: str  # what the killed search printed
    at_kill: dict[tuple[str, int], tuple[TrialState, float | None, dict[str, Any] | None]]
    files_at_kill: dict[str, tuple[int, int, int]]
    resumed: subprocess.CompletedProcess[str]
    files_after_resume: dict[str, tuple[int, int, int]]


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Searched:
    """The warm-started QUICK search, SIGKILLed (its whole process group) as the second confirmation trial of
    PACI starts (the first done, flush's not begun), then the same command run again to its end."""
    tmp = tmp_path_factory.mktemp("warm-search")
    config = write_quick(tmp, warm={"steps": WARM})
    work = tmp / "work"
    killed = work / "trials" / "model.paci" / "trial-0002"  # trials: 1, so PACI's #1 and #2 are its confirmation
    log = tmp / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            search_cmd(config, tmp),
            cwd=REPO,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 400
            while not killed.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            kill_tree(proc)
    first_log = log.read_text()
    assert killed.exists(), f"the confirmation never started (exit {proc.returncode}):\n{first_log[-3000:]}"
    storage = f"sqlite:///{work / 'study.db'}"
    at_kill = {
        (s, t.number): (t.state, t.value, t.user_attrs.get("confirm"))
        for s, st in studies(storage).items()
        for t in st.trials
    }
    warm_dir = work / "model-warm-start"
    files_at_kill = _files(warm_dir)
    resumed = run(search_cmd(config, tmp), timeout=400)
    check_ok(resumed)
    return Searched(
        tmp, config, storage, warm_dir, killed, first_log, at_kill, files_at_kill, resumed, _files(warm_dir)
    )


@pytest.mark.slow
def test_every_trial_starts_at_the_step_after_the_warm_up(searched: Searched) -> None:
    done = json.loads((searched.warm_dir / "warm.json").read_text())
    assert done["step"] == WARM
    assert Path(done["checkpoint"]) == searched.warm_dir / f"batch_{WARM:08d}"
    trained = _check_trials_start_from(searched.tmp / "work", done, may_lack=(searched.killed,))
    # The storage's finished trials each trained in their own folder (a reused repeat, or a layout answered
    # from another trial's curve, has none).
    complete = [
        (s, t.number)
        for s, st in studies(searched.storage).items()
        for t in st.trials
        if t.state == TrialState.COMPLETE and not {"repeat_of", "shared_from"} & set(t.user_attrs)
    ]
    assert len(complete) >= 6, complete  # 1 search trial + 2 confirmations per schedule
    for s, n in complete:
        assert _train(searched.tmp / "work" / "trials" / f"model.{s}" / f"trial-{n:04d}" / "events.jsonl"), (s, n)
    assert trained >= len(complete)


@pytest.mark.slow
def test_the_warm_up_is_plain_training_of_the_run_as_written(searched: Searched) -> None:
    """1F1B-flush is exact gradient accumulation: the warm-up's validation loss is plain training's."""
    done = json.loads((searched.warm_dir / "warm.json").read_text())
    run_doc = done["run"]
    assert run_doc["pipeline"]["schedule"] == "1f1b" and run_doc["training"]["steps"] == WARM
    _, want_val, want_lrs = plain_training(run_doc)
    assert done["val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)
    assert want_lrs[-1] == pytest.approx(OPTIMIZER["lr"], rel=1e-12)  # warmed up, then held at the peak


@pytest.mark.slow
def test_best_yaml_names_the_warm_up_every_trial_started_from(searched: Searched) -> None:
    best = yaml.safe_load((searched.tmp / "best.yaml").read_text())
    done = json.loads((searched.warm_dir / "warm.json").read_text())
    ws = best["warm_start"]
    assert (ws["source"], ws["step"]) == ("warm-up", WARM)
    checkpoint = Path(ws["checkpoint"])
    assert checkpoint == Path(done["checkpoint"]) and checkpoint.parent == searched.warm_dir
    assert json.loads((checkpoint / "meta.json").read_text())["loop"]["batches_done"] == WARM
    assert (searched.warm_dir / "LATEST").read_text().strip() == checkpoint.name
    assert ws["val_loss"] == done["val_loss"] and ws["run"] == done["run"]
    assert best["run"]["training"]["init_from"] == ws["checkpoint"]
    # Recorded in the studies, so that a worker with another work folder finds the same folder.
    for st in studies(searched.storage).values():
        assert StudyRecord.read(st).warm_start == {"folder": str(searched.warm_dir), "checkpoint": str(checkpoint)}


@pytest.mark.slow
def test_a_search_killed_mid_confirmation_resumes_with_the_same_seeds(searched: Searched) -> None:
    at_kill = searched.at_kill
    confirm = {k: v for k, v in at_kill.items() if v[2] is not None}
    assert any(state == TrialState.COMPLETE for state, _, _ in confirm.values()), "killed before a confirmation ended"
    assert searched.first_log.count(TRAINING_LINE) == 1, searched.first_log[-3000:]
    assert TRAINING_LINE not in searched.resumed.stderr, "the resumed search trained the warm-up again"
    assert searched.files_after_resume == searched.files_at_kill, "the warm-up's files changed on resume"
    after = studies(searched.storage)
    for (s, n), (state, value, _) in at_kill.items():
        if state.is_finished():
            assert (after[s].trials[n].state, after[s].trials[n].value) == (state, value), f"{s}#{n} changed"
    planned = {c["seed"] for _, _, c in confirm.values()}
    for s, st in after.items():
        assert not [t for t in st.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        conf = [t for t in st.trials if t.state == TrialState.COMPLETE and "confirm" in t.user_attrs]
        assert sorted(t.user_attrs["confirm"]["seed"] for t in conf) == [1, 2], s  # training.seed 0 + 1, + 2
        (of,) = {t.user_attrs["confirm"]["of"] for t in conf}  # one point confirmed, on its own parameters
        assert all(t.params == st.trials[of].params for t in conf) and "confirm" not in st.trials[of].user_attrs
    assert planned <= {1, 2}
    killed = int(searched.killed.name.removeprefix("trial-"))
    if at_kill[("paci", killed)][0] == TrialState.RUNNING:  # claimed before the kill: now failed, and run again
        dead = after["paci"].trials[killed]
        assert dead.state == TrialState.FAIL and dead.user_attrs["fail_reason"].startswith("interrupted")
        assert any(t.user_attrs.get("retry_of") == killed for t in after["paci"].trials)
    best = yaml.safe_load((searched.tmp / "best.yaml").read_text())
    assert best["confirmation"]["seeds"] == [1, 2]
    assert {s: sorted(int(k) for k in best["confirmation"][s][0]["seeds"]) for s in ("paci", "1f1b")} == {
        "paci": [1, 2],
        "1f1b": [1, 2],
    }


@pytest.mark.slow
def test_the_same_search_again_does_not_train_the_warm_up_again(searched: Searched) -> None:
    work = searched.tmp / "work"
    before, folders = _files(searched.warm_dir), _trial_folders(work)
    n_trials = sum(len(st.trials) for st in studies(searched.storage).values())
    proc = run(search_cmd(searched.config, searched.tmp), timeout=300)
    check_ok(proc)
    assert TRAINING_LINE not in proc.stderr, proc.stderr[-3000:]
    assert _files(searched.warm_dir) == before, "warm.json or the checkpoint was written again"
    assert before == searched.files_at_kill  # nor by the resume before it
    assert (
        _trial_folders(work) == folders and sum(len(st.trials) for st in studies(searched.storage).values()) == n_trials
    )
    assert yaml.safe_load((searched.tmp / "best.yaml").read_text())["warm_start"]["step"] == WARM


@pytest.mark.slow
def test_apply_trains_what_the_recommended_trial_trained(searched: Searched) -> None:
    want, shared = _evidence_losses(searched)
    assert len(want) >= 3
    metrics = searched.tmp / "replay.jsonl"
    check_ok(
        _apply(
            searched.tmp / "best.yaml",
            "--no-live",
            "--metrics",
            metrics,
            "--checkpoint-dir",
            searched.tmp / "replay-checkpoints",
        )
    )
    got = [r["loss"] for r in _train(metrics)]
    assert _train(metrics)[0]["step"] == WARM + 1
    # The trial may have trained past its budget: a shared curve's first run trains its class's (tune/sharing.py).
    n = min(len(got), len(want))
    assert n >= 3 and _same_losses(got[:n], want[:n], shared)
    assert not (searched.tmp / "best-warm-start").exists(), "the warm-up was there: nothing to train first"


@pytest.mark.slow
def test_apply_trains_the_warm_up_first_when_its_checkpoint_is_gone(searched: Searched) -> None:
    tmp, warm_dir = searched.tmp, searched.warm_dir
    want, shared = _evidence_losses(searched)
    away, redo = tmp / "moved-warm-start", tmp / "best-warm-start"
    warm_dir.rename(away)
    try:
        dry = _apply(tmp / "best.yaml", "--dry-run")
        check_ok(dry)
        assert f"first train its {WARM}-step warm-up into {redo}" in dry.stderr.replace("\n", " "), dry.stderr
        assert not redo.exists(), "a dry run trains nothing"
        written = yaml.safe_load((tmp / "best.run.yaml").read_text())
        assert written["training"]["init_from"] == str(redo / f"batch_{WARM:08d}")

        metrics = tmp / "rewarmed.jsonl"
        check_ok(
            _apply(
                tmp / "best.yaml", "--no-live", "--metrics", metrics, "--checkpoint-dir", tmp / "rewarmed-checkpoints"
            )
        )
        assert not warm_dir.exists(), "apply wrote into the search's folder"
        redone = json.loads((redo / "warm.json").read_text())
        original = json.loads((away / "warm.json").read_text())
        assert redone["step"] == WARM and redone["val_loss"] == original["val_loss"]
        _same_weights(away / f"batch_{WARM:08d}", Path(redone["checkpoint"]))
        got = _train(metrics)
        n = min(len(got), len(want))  # the trial may have trained past its budget (a shared curve's first run)
        assert got[0]["step"] == WARM + 1 and n >= 3 and _same_losses([r["loss"] for r in got][:n], want[:n], shared)
    finally:
        if not warm_dir.exists():
            away.rename(warm_dir)


# ------------------------------------------------------------------ a warm-up killed part-way
_DIES_AT = """
import json, os, signal, sys
import paci_tune.train.run as run
from paci_tune.tune.warm import ensure

doc, step = json.loads(sys.argv[1]), int(sys.argv[2])
train = run.run_training

def dying(resolved, on_record=None, **kw):
    def record(rec):
        if rec.get("event") == "train" and rec["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up runs, as when a worker is killed
        if on_record is not None:
            on_record(rec)
    return train(resolved, on_record=record, **kw)

run.run_training = dying
ensure(doc, "search.warm_start.dir")
"""


@pytest.mark.slow
def test_a_killed_warm_up_continues_from_its_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8-step warm-up (a checkpoint every 2) SIGKILLed as it trains step 7: the search opened next continues
    it at step 7 from batch 6 and ends where a warm-up trained straight through ends, bit for bit."""
    import paci_tune.train.run as train_run
    from paci_tune.base.files import read_yaml
    from paci_tune.config.tune import load_tune_config
    from paci_tune.tune import warm
    from paci_tune.tune.session import open_search
    from paci_tune.tune.setup import trial_runtime

    steps, folder = 8, (tmp_path / "warm").resolve()
    config = write_quick(tmp_path, warm={"steps": steps, "dir": str(folder)})
    tune = load_tune_config(read_yaml(config))
    doc = warm.warm_up_doc(tune, folder, trial_runtime(tune))
    assert doc["training"]["checkpoint_every"] == 2
    killed = subprocess.run(
        [sys.executable, "-c", _DIES_AT, json.dumps(doc), "7"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cli_env(),
        timeout=300,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (folder / warm.DONE).exists() and (folder / "LATEST").read_text().strip() == "batch_00000006"

    records: list[dict[str, Any]] = []
    real = train_run.run_training

    def recorded(resolved: Any, on_record: Any = None, **kw: Any) -> Any:
        return real(resolved, on_record=lambda r: (records.append(r), on_record and on_record(r)), **kw)

    monkeypatch.setattr(train_run, "run_training", recorded)
    lines: list[str] = []
    session = open_search(str(config), workdir=str(tmp_path / "work"), log=lines.append)
    assert [r["step"] for r in records if r["event"] == "train"] == [7, 8], "did not continue at step 7"
    assert any("continuing at batch_00000006" in ln for ln in lines), lines
    assert session.warm is not None and session.warm.step == 8
    assert Path(session.warm.checkpoint) == folder / "batch_00000008"
    resumed = json.loads((folder / warm.DONE).read_text())

    straight = warm.ensure(warm.warm_up_doc(tune, tmp_path / "straight", trial_runtime(tune)), "test")
    assert resumed["val_loss"] == straight["val_loss"]
    _same_weights(Path(resumed["checkpoint"]), Path(straight["checkpoint"]))
    _, want_val, _ = plain_training(doc)
    assert resumed["val_loss"] == pytest.approx(want_val, abs=1e-5, rel=0)
    for st in session.studies.values():
        assert StudyRecord.read(st).warm_start == {"folder": str(folder), "checkpoint": resumed["checkpoint"]}


# ------------------------------------------------------------------ workers sharing one storage
@pytest.mark.slow
def test_workers_on_one_journal_train_one_warm_up_and_start_every_trial_from_it(tmp_path: Path) -> None:
    config = write_quick(tmp_path, warm={"steps": WARM}, search={"trials": 2, "confirm": {"top": 0}})
    journal = tmp_path / "s.log"
    cmds = [
        search_cmd(
            config,
            tmp_path,
            "--storage",
            f"journal://{journal}",
            "--workdir",
            str(tmp_path / f"w{i}"),
            "--out",
            str(tmp_path / f"best{i}.yaml"),
        )
        for i in range(2)
    ]
    outs = [(out, err) for _, out, err in run_workers(cmds, timeout=500)]
    folder = tmp_path / "model-warm-start"  # beside the journal file
    assert sorted(tmp_path.rglob("warm.json")) == [folder / "warm.json"], "more than one warm-up"
    assert not [p for p in tmp_path.rglob("*warm-start*") if p != folder and folder not in p.parents]
    assert sum(err.count(TRAINING_LINE) for _, err in outs) == 1, "the warm-up was trained twice"
    done = json.loads((folder / "warm.json").read_text())
    trained = [_check_trials_start_from(tmp_path / f"w{i}", done) for i in range(2)]
    # 2 trials per schedule, both workers ran some; flush's two may be one curve, trained once (tune/sharing.py)
    assert min(trained) >= 1 and sum(trained) >= 3, trained
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    for s in ("paci", "1f1b"):
        st = optuna.load_study(study_name=f"model.{s}", storage=storage)
        assert StudyRecord.read(st).warm_start == {"folder": str(folder), "checkpoint": done["checkpoint"]}
    for i in range(2):
        assert (
            yaml.safe_load((tmp_path / f"best{i}.yaml").read_text())["run"]["training"]["init_from"]
            == done["checkpoint"]
        )


@pytest.mark.slow
def test_workers_on_postgresql_with_other_work_folders_train_one_warm_up(tmp_path: Path) -> None:
    """A database server has no file to put the warm-up beside: the first worker records its folder in the
    studies before it trains, and a worker that opens the search meanwhile, from another work folder,
    waits on that folder's lock and starts every trial from the same checkpoint."""
    import os

    from helpers.pg import ENV, server

    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install 'paci-tune[postgres]'")
    srv = None if os.environ.get(ENV) else server()
    if srv is None and not os.environ.get(ENV):
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin (and no PACI_TUNE_POSTGRES_URL)")
    url = os.environ.get(ENV) or srv.url  # type: ignore[union-attr]
    name = f"warm-{os.getpid()}-{tmp_path.name}"
    try:
        config = write_quick(tmp_path, warm={"steps": WARM}, search={"trials": 2, "confirm": {"top": 0}})
        cmds = [
            search_cmd(
                config,
                tmp_path,
                "--storage",
                url,
                "--study-name",
                name,
                "--workdir",
                str(tmp_path / f"w{i}"),
                "--out",
                str(tmp_path / f"best{i}.yaml"),
            )
            for i in range(2)
        ]
        env = cli_env()
        env.pop("OMP_NUM_THREADS", None)
        first = subprocess.Popen(cmds[0], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / "w0" / "warm-start" / ".lock").exists():  # the first worker claimed the folder
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.1)
        second = subprocess.Popen(cmds[1], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=500) for p in (first, second)]
        for p, (_, err) in zip((first, second), outs, strict=True):
            assert p.returncode == 0, err[-3000:]
        folder = tmp_path / "w0" / "warm-start"
        assert sorted(tmp_path.rglob("warm.json")) == [folder / "warm.json"], "more than one warm-up"
        assert sum(err.count(TRAINING_LINE) for _, err in outs) == 1, "the warm-up was trained twice"
        done = json.loads((folder / "warm.json").read_text())
        trained = [_check_trials_start_from(tmp_path / f"w{i}", done) for i in range(2)]
        assert sum(trained) >= 3, trained  # flush's two trials may be one curve, trained once
        for st in studies(url, name).values():
            assert StudyRecord.read(st).warm_start == {"folder": str(folder), "checkpoint": done["checkpoint"]}
    finally:
        if srv is not None:
            srv.remove()


def test_folder_for_finds_the_warm_up_folder(tmp_path: Path) -> None:
    """``dir`` first; else the folder a worker recorded in the studies; else beside a file storage
    (``STUDY-warm-start``); else, with a database server, ``WORKDIR/warm-start``."""
    from paci_tune.base.files import read_yaml
    from paci_tune.config.tune import load_tune_config
    from paci_tune.tune.warm import folder_for

    work = tmp_path / "work"
    tune = load_tune_config(read_yaml(write_quick(tmp_path, warm={"steps": WARM})))
    fresh = {s: optuna.create_study(study_name=s) for s in ("paci", "1f1b")}
    assert (
        folder_for(tune, "run", work, f"sqlite:///{tmp_path}/db/study.db", fresh) == tmp_path / "db" / "run-warm-start"
    )
    assert folder_for(tune, "run", work, f"journal://{tmp_path}/j/s.log", fresh) == tmp_path / "j" / "run-warm-start"
    assert folder_for(tune, "run", work, str(tmp_path / "j" / "s.log"), fresh) == tmp_path / "j" / "run-warm-start"
    for server in ("postgresql://u@db.example/paci", "mysql://u@db.example/paci"):
        assert folder_for(tune, "run", work, server, fresh) == work / "warm-start"

    recorded = {s: optuna.create_study(study_name=s) for s in ("paci", "1f1b")}
    StudyRecord.write_warm_start(recorded["1f1b"], {"folder": "/shared/run-warm-start", "checkpoint": "x"})
    for url in (f"sqlite:///{tmp_path}/other.db", "postgresql://u@db.example/paci"):
        assert folder_for(tune, "run", tmp_path / "elsewhere", url, recorded) == Path("/shared/run-warm-start")

    given = load_tune_config(read_yaml(write_quick(tmp_path / "given", warm={"steps": WARM, "dir": "~/w/../ws"})))
    for st in (fresh, recorded):
        assert folder_for(given, "run", work, f"sqlite:///{tmp_path}/db/study.db", st) == Path.home() / "ws"


# ------------------------------------------------------------------ refusals
BAD_WARM_START: list[tuple[str, dict[str, Any], str, str]] = [
    ("zero-steps", {"steps": 0}, "search.warm_start.steps", "0"),
    ("negative-steps", {"steps": -4}, "search.warm_start.steps", "-4"),
    ("steps-not-a-number", {"steps": "lots"}, "search.warm_start.steps", "lots"),
    ("steps-and-checkpoint", {"steps": 4, "checkpoint": "ckpt"}, "search.warm_start.checkpoint", "ckpt"),
    ("missing-checkpoint", {"checkpoint": "/nonexistent/ckpt"}, "search.warm_start.checkpoint", "/nonexistent/ckpt"),
    ("unknown-key", {"stepz": 4}, "search.warm_start.stepz", "4"),
    ("empty-dir", {"steps": 4, "dir": ""}, "search.warm_start.dir", "''"),
    ("dir-without-steps", {"dir": "shared"}, "search.warm_start.dir", "shared"),
    ("not-a-mapping", 4, "search.warm_start", "4"),  # type: ignore[list-item]
]


def _refused_in_process(folder: Path, args: list[str], key: str, value: str) -> None:
    """``paci-tune ARGS`` in ``folder``: exit 2, one ``error: KEY: got VALUE`` line, no traceback, nothing written."""
    inputs = sorted(p.name for p in folder.iterdir())
    r = invoke_in(folder, args)
    out = r.stdout + r.stderr
    assert r.exit_code == 2, f"{args}: exit {r.exit_code}\n{out[-3000:]}"
    assert "Traceback" not in out and (r.exception is None or isinstance(r.exception, SystemExit)), r.exception
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}: got ") and value in lines[0], out[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == inputs, "a refused command wrote something"


@pytest.mark.parametrize(("case", "warm", "key", "value"), BAD_WARM_START, ids=[c[0] for c in BAD_WARM_START])
def test_bad_warm_start_is_refused_by_search_and_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, warm: Any, key: str, value: str
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a profile measured would land here
    write_quick(tmp_path / "in", warm=warm, relative=True)
    for args in (["search", "model.yaml", "--no-live"], ["train", "model.yaml", "--no-live"]):
        _refused_in_process(tmp_path / "in", args, key, value)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("steps", "refused"), [(4, True), (6, True), (7, False)])
def test_a_warm_up_inside_the_lr_ramp_is_refused(tmp_path: Path, steps: int, refused: bool) -> None:
    """The example ramps its LR over 0.02 x 300 = 6 global batches: a warm-up of 6 or fewer would
    end below the peak every trial starts at, so ``search`` refuses it before any work; 7 passes."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())
    assert doc["training"]["steps"] * doc["lr_schedule"]["warmup_fraction"] == pytest.approx(6)
    doc["search"] = {**doc["search"], "warm_start": {"steps": steps}}
    if refused:
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "model.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        args = ["search", "model.yaml", "--no-live"]
        _refused_in_process(tmp_path / "in", args, "search.warm_start.steps", str(steps))
    else:
        from paci_tune.config.tune import load_tune_config

        assert load_tune_config(doc).search.warm_start.steps == steps


@pytest.mark.slow
def test_bad_warm_start_end_to_end(tmp_path: Path) -> None:
    """As a process: exit 2, one error line, no traceback, no work folder and no best.yaml."""
    config = write_quick(tmp_path, warm={"steps": 0})
    proc = run(search_cmd(config, tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: search.warm_start.steps: got 0;"), proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "best.yaml").exists()


# ------------------------------------------------------------------ training.init_from / --init-from
def _checkpoint(folder: Path, steps: int = 2) -> Path:
    """A checkpoint root (LATEST) of BASE_CONFIG's run after ``steps`` steps, trained in this process."""
    run_in_process(make_config(training={"steps": steps, "checkpoint_every": steps, "checkpoint_dir": str(folder)}))
    return folder


INIT_FROM_CASES: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("relative-key", {"init_from": "ckpts/missing"}, [], "ckpts/missing"),
    ("absolute-key", {"init_from": "/nonexistent/ckpt"}, [], "/nonexistent/ckpt"),
    ("relative-option", {}, ["--init-from", "ckpts/missing"], "ckpts/missing"),
    ("absolute-option", {}, ["--init-from", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    ("not-a-checkpoint", {"init_from": "plain"}, [], "plain"),
    ("empty-key", {"init_from": " "}, [], "' '"),
]


@pytest.mark.parametrize(("case", "training", "args", "value"), INIT_FROM_CASES, ids=[c[0] for c in INIT_FROM_CASES])
def test_train_refuses_an_init_from_that_is_not_a_checkpoint(
    tmp_path: Path, case: str, training: dict[str, Any], args: list[str], value: str
) -> None:
    (tmp_path / "plain").mkdir()  # a folder, but no checkpoint in it
    write_config(tmp_path, make_config(training=training), "c.yaml")
    _refused_in_process(
        tmp_path, ["train", "c.yaml", "--no-live", "--metrics", "m.jsonl", *args], "training.init_from", value
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["key", "option"])
def test_train_refuses_a_missing_init_from_end_to_end(tmp_path: Path, how: str) -> None:
    doc = make_config(training={"init_from": "ckpts/missing"} if how == "key" else {})
    args = ["--init-from", "ckpts/missing"] if how == "option" else []
    metrics = tmp_path / "metrics.jsonl"
    check_error(
        run_cli(write_config(tmp_path, doc), *args, "--metrics", metrics),
        metrics,
        "training.init_from",
        "ckpts/missing",
    )


def test_a_relative_init_from_is_read_from_the_current_folder(tmp_path: Path) -> None:
    """The key's relative path, like ``data.path``, is the current folder's; the run continues at the
    checkpoint's step."""
    _checkpoint(tmp_path / "ckpts")
    write_config(tmp_path, make_config(training={"steps": 4, "init_from": "ckpts"}), "c.yaml")
    r = invoke_in(tmp_path, ["train", "c.yaml", "--no-live", "--metrics", "m.jsonl"])
    assert r.exit_code == 0, r.stderr[-3000:]
    assert [x["step"] for x in _train(tmp_path / "m.jsonl")] == [3, 4]


def test_search_refuses_a_missing_init_from_before_any_trial(tmp_path: Path) -> None:
    """A search whose run starts from a checkpoint that is not there: refused before anything is created,
    not by every trial in turn."""
    write_quick(tmp_path, relative=True, training={"init_from": "ckpts/missing"})
    _refused_in_process(tmp_path, ["search", "model.yaml", "--no-live"], "training.init_from", "ckpts/missing")


def _warm_best(folder: Path, gone: Path) -> Path:
    """A best.yaml of BASE_CONFIG's run warm-started from a 4-step warm-up whose checkpoint ``gone`` is not here."""
    checkpoint = str(gone / "batch_00000004")
    training = {"steps": 4, "eval_every": 4, "checkpoint_dir": str(gone), "checkpoint_every": 1, "keep_checkpoints": 1}
    warm_run = merge(BEST["run"], {"pipeline": {"schedule": "1f1b"}, "training": training})
    doc = copy.deepcopy(BEST)
    doc["run"]["training"]["init_from"] = checkpoint
    doc["warm_start"] = {
        "note": "warm-started",
        "checkpoint": checkpoint,
        "step": 4,
        "source": "warm-up",
        "val_loss": 3.9,
        "run": warm_run,
    }
    path = folder / "best.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_apply_dry_run_says_it_will_train_the_warm_up_first(tmp_path: Path) -> None:
    best = _warm_best(tmp_path, tmp_path / "gone")
    r = invoke_in(tmp_path, ["apply", "best.yaml", "--dry-run"])
    assert r.exit_code == 0, r.stderr[-3000:]
    assert f"first train its 4-step warm-up into {tmp_path / 'best-warm-start'}" in r.stderr.replace("\n", " ")
    written = yaml.safe_load((tmp_path / "best.run.yaml").read_text())
    assert written["training"]["init_from"] == str(tmp_path / "best-warm-start" / "batch_00000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.run.yaml", best.name], "a dry run trains nothing"


def test_apply_refuses_a_missing_init_from_given_instead_of_the_warm_up(tmp_path: Path) -> None:
    """``--init-from`` replaces the search's checkpoint: one that is not there is refused, naming it, rather than
    the search's warm-up trained in its place."""
    _warm_best(tmp_path, tmp_path / "gone")
    _refused_in_process(
        tmp_path, ["apply", "best.yaml", "--dry-run", "--init-from", "typo/ckpt"], "training.init_from", "typo/ckpt"
    )
