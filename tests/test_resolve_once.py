"""A run is resolved once per process: by ``train``, by ``apply`` and by a search trial's process.

Oracle: counters wrapped around the functions that resolve and load (``resolve_run``, the pipeline's
``resolve_pieces`` and the data's ``load_source``), patched into every loaded module that holds
them, so a second call from anywhere in the process is counted -- not what the code says it did.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.configs import BASE_CONFIG, make_config, write_best_for


def _count_calls(monkeypatch: pytest.MonkeyPatch, *funcs: Callable[..., Any]) -> Counter[str]:
    """Wrap each function wherever a paci_tune module holds it; the counter says how often each ran."""
    calls: Counter[str] = Counter()
    for func in funcs:

        def counted(*a: Any, _f: Callable[..., Any] = func, **k: Any) -> Any:
            calls[_f.__name__] += 1
            return _f(*a, **k)

        for name, module in list(sys.modules.items()):
            if name.startswith("paci_tune") and module is not None:
                for attr, value in list(vars(module).items()):
                    if value is func:
                        monkeypatch.setattr(module, attr, counted)
    return calls


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    import paci_tune.cli.app
    import paci_tune.tune.apply
    import paci_tune.tune.child

    return _count_calls(
        monkeypatch,
        paci_tune.train.run.resolve_run,
        paci_tune.pipeline.factory.resolve_pieces,
        paci_tune.data.load_source,
    )


ONCE = {"resolve_run": 1, "resolve_pieces": 1, "load_source": 1}
APPLY = {**ONCE, "load_source": 2}
"""``apply`` reads its data twice: once to check best.yaml's run as the search recorded it (an error
names the best.yaml key), once when it resolves that run with the user's overrides."""


def _invoke(folder: Path, args: list[str]) -> Any:
    from paci_tune.cli.app import main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        return CliRunner().invoke(main, args, catch_exceptions=False)


def test_train_resolves_once(tmp_path: Path, calls: Counter[str]) -> None:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(make_config(training={"steps": 2})))
    r = _invoke(tmp_path, ["train", "run.yaml", "--no-live"])
    assert r.exit_code == 0, r.output
    assert dict(calls) == ONCE


def test_apply_resolves_once(tmp_path: Path, calls: Counter[str]) -> None:
    run = make_config(training={"steps": 2})
    write_best_for(tmp_path, run)
    r = _invoke(tmp_path, ["apply", "best.yaml", "--no-live", "--clock", "wall"])
    assert r.exit_code == 0, r.output
    assert dict(calls) == APPLY
    calls.clear()
    r = _invoke(tmp_path, ["apply", "best.yaml", "--dry-run", "--clock", "wall"])
    assert r.exit_code == 0, r.output
    assert dict(calls) == APPLY


def test_a_trial_process_resolves_once(tmp_path: Path, calls: Counter[str]) -> None:
    from paci_tune.tune.child import main

    trial = tmp_path / "trial.yaml"
    trial.write_text(yaml.safe_dump({**BASE_CONFIG, "training": {**BASE_CONFIG["training"], "steps": 2}}))
    assert main(str(trial), str(tmp_path / "events.jsonl"), str(tmp_path / "metrics.jsonl")) == 0
    assert dict(calls) == ONCE
    assert (tmp_path / "metrics.jsonl").read_text().count('"event": "summary"') == 1
