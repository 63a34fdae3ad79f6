"""No rank of a launched run builds a per-rank model (hf) whole: the launcher checks it, the workers do not.

The whole-model checks (the units' contract, causality, the split equal to the model) build every unit,
which is what per-rank building exists to avoid on each of P x D workers. The launcher runs them on
the resolved config and starts its workers with ``--checked``. Oracle: which units ``load_model`` is
asked for, recorded in the check itself; and the worker command the launcher really builds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import BLOCK, hf_doc

from paci_tune.config import load_config
from paci_tune.pipeline import checks

pytest.importorskip("transformers")


def _asked(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every ``indices`` the checks ask ``load_model`` for (None: the whole model)."""
    asked: list[object] = []
    real = checks.load_model

    def recording(spec, vocab_size, seed, indices=None, **kw):  # type: ignore[no-untyped-def]
        asked.append(None if indices is None else list(indices))
        return real(spec, vocab_size, seed, indices, **kw)

    monkeypatch.setattr(checks, "load_model", recording)
    return asked


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    import yaml

    doc = hf_doc({"hf": "tiny-llama", "block_size": BLOCK}, stages=2)
    doc["pipeline"]["partition"] = [2, 2]  # a launched worker's config has its cut pinned
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(str(path))


def test_the_launcher_checks_the_whole_model_and_a_checked_worker_builds_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    asked = _asked(monkeypatch)
    _, meta = checks.check_model_and_data(cfg)
    assert None in asked, "the launcher's check builds the whole model once"
    assert meta.flops is not None and len(meta.flops) == meta.n_units  # counted on the sample, for the cut
    asked.clear()
    _, worker_meta = checks.check_model_and_data(cfg, checked=True)
    assert asked == [[]], f"a checked worker asked for {asked}: it built units it does not own"
    assert worker_meta.units == {}


def test_the_launcher_starts_its_workers_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from paci_tune.train import launch

    commands: list[list[str]] = []

    class Stop(Exception):
        pass

    def capture(config_path: Path, n_procs: int, extra: list[str]) -> list[str]:
        commands.append(extra)
        raise Stop

    monkeypatch.setattr(launch, "worker_command", capture)
    with pytest.raises(Stop):
        launch.run_distributed(_config(tmp_path), tmp_path / "work", lambda _: None)
    assert "--checked" in commands[0]
