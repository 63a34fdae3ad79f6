"""``paci-tune report`` on a search with finished, pruned, failed and confirmation trials.

The study is built with Optuna's own API in a real SQLite storage, and best.yaml by the tuner's
own :func:`build_best`, so the oracle is known exactly: which trial won, which seeds confirmed it,
why the others stopped. Each picture is checked for content (its series, its labelled axes), the
HTML for every image decoding as a PNG and for the verdict, and the command for exit codes.
A real search's report is checked end to end in ``tests/test_search.py``.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from helpers import REPO
from helpers.cli import cli_env
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from paci_tune.schedule import drift_bound
from paci_tune.sim.profile import Profile
from paci_tune.tune.bestfile import write_best
from paci_tune.tune.record import CONFIRM as CONFIRM_ATTR
from paci_tune.tune.record import CONFIRM_PLAN as PLAN_ATTR
from paci_tune.verdict.best import build_best

DISTS = {"stages": CategoricalDistribution([2, 4]), "microbatch_size": CategoricalDistribution([2, 4, 8])}
BATCH, TARGET, BUDGET = 16, 2.0, 10.0
SEEDS = [1, 2, 3]


def _curve(reach: float | None, end: float) -> list[list[float]]:
    """A validation curve on a 1 s grid that crosses TARGET at ``reach`` (or ends above it)."""
    out = []
    for t in range(1, int(end) + 1):
        out.append([float(t), TARGET + (reach - t) * 0.1 if reach is not None else TARGET + 0.5 / t + 0.1])
    return out


def _attrs(p: int, ttt: float | None, end: float, **extra: Any) -> dict[str, Any]:
    return {
        "time_to_target": ttt,
        "best_val_loss": TARGET - 0.01 if ttt else TARGET + 0.2,
        "curve": _curve(ttt, end),
        "partition": [4 // p] * p,
        "wall_seconds": 1.5,
        "stage_drift": [
            {"max": drift_bound(s, p, BATCH // 4), "mean": 0.5, "bound": drift_bound(s, p, BATCH // 4)}
            for s in range(p)
        ],
        **extra,
    }


def _study(storage: str, schedule: str, confirm: dict[int, float]) -> optuna.Study:
    """Search trials: (P=2,b=4) wins; (P=4,b=4), (P=2,b=8) finish slower; (P=4,b=2) pruned; (P=2,b=2) crashed."""
    st = optuna.create_study(study_name=f"rep.{schedule}", storage=storage, direction="minimize")
    st.set_user_attr("fingerprint", {"space": {"global_batch": BATCH}, "target": TARGET, "budget": ["sim", BUDGET, 10]})
    slow = 1.0 if schedule == "1f1b" else 0.0
    for (p, b), ttt in {(2, 4): 4.0 + slow, (4, 4): 6.0 + slow, (2, 8): 8.0}.items():
        st.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                value=ttt,
                params={"stages": p, "microbatch_size": b},
                distributions=DISTS,
                user_attrs=_attrs(p, ttt, ttt + 1, label=f"{schedule} P={p} b={b}"),
            )
        )
    st.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"stages": 4, "microbatch_size": 2},
            distributions=DISTS,
            intermediate_values={2: 3.0},
            user_attrs=_attrs(4, None, 3, pruned_step=2, pruned_clock=3.0),
        )
    )
    st.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params={"stages": 2, "microbatch_size": 2},
            distributions=DISTS,
            user_attrs={"fail_reason": "crash: boom (exit 1)"},
        )
    )
    st.set_user_attr(PLAN_ATTR, [0])
    for seed, score in confirm.items():
        st.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                value=score,
                params={"stages": 2, "microbatch_size": 4},
                distributions=DISTS,
                user_attrs=_attrs(2, score, score + 1, **{CONFIRM_ATTR: {"of": 0, "seed": seed}}),
            )
        )
    return st


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """best.yaml of the synthetic search, PACI confirmed at 4 s per seed against flush's 6 s."""
    d = tmp_path_factory.mktemp("report")
    storage = f"sqlite:///{d / 'study.db'}"
    studies = {
        "paci": _study(storage, "paci", {1: 4.0, 2: 4.2, 3: 3.8}),
        "1f1b": _study(storage, "1f1b", {1: 6.0, 2: 6.3, 3: 5.7}),
    }
    profile = d / "profile.yaml"
    cost = {"activation_bytes": 100, "saved_bytes": 100}
    unit = {
        "param_bytes": 1000,
        "optimizer_s": 1e-4,
        "microbatch": {b: {"forward_s": 1e-3 * b, "backward_s": 2e-3 * b, **cost} for b in (2, 4, 8)},
    }
    Profile.from_dict({"seq_len": 16, "units": [unit] * 4, "p2p": {"latency_s": 0.0, "bandwidth_Bps": 1e12}}).save(
        profile
    )
    best = build_best(
        studies,
        run_doc_for=lambda p: {"pipeline": {"schedule": p.schedule}, "training": {"profile": str(profile)}},
        base_lr=1e-3,
        fixed_batch=BATCH,
        target={"metric": "val_loss", "value": TARGET},
        budget={"clock": "sim", "seconds": BUDGET, "grid": 10},
        provenance={"study_name": "rep", "storage": storage, "clock": "sim"},
        confirm_seeds=SEEDS,
    )
    write_best(d / "best.yaml", best)
    return d / "best.yaml"


def test_the_evidence_is_the_storage_and_best_yaml(searched: Path) -> None:
    from paci_tune.report import gather

    ev = gather(searched, None, None)
    for s in ("paci", "1f1b"):
        w = ev.winner(s)
        assert w is not None and (w.number, w.point.stages, w.point.microbatch_size, w.point.window) == (0, 2, 4, 4)
        assert [c.seed for c in ev.confirmations(s, 0)] == SEEDS
        assert ev.reasons(s) == {"pruned at step 2": 1, "failed: crash": 1}
    assert ev.best.verdict == "paci" and ev.target == TARGET and ev.budget == BUDGET


def test_each_picture_has_its_content(searched: Path) -> None:
    from paci_tune.report import figures, gather, verdict

    ev = gather(searched, None, None)
    curves = figures.draw_curves(ev)
    for ax in curves.axes:
        # 3 finished + 1 pruned search trials + 3 seeds, the pruned one's end cross, the target line
        assert len(ax.lines) == 3 + 1 + 3 + 1 + 1
        assert sum(line.get_linewidth() == 3 for line in ax.lines) == 1 + 3  # the winner and its seeds
        assert ax.get_xlabel() == "sim clock (s)"
    assert curves.axes[0].get_ylabel() == "validation loss"

    heat = figures.draw_heatmap(ev)
    grids = [ax for ax in heat.axes if ax.images]
    assert len(grids) == 2 and all(
        ax.get_ylabel() == "pipeline depth P" and "window" in ax.get_xlabel() for ax in grids
    )
    cells = grids[0].images[0].get_array()
    assert cells.shape == (2, 3)  # P in {2, 4} x a in {2, 4, 8}
    assert float(cells[0, 1]) == 4.0  # P=2, a=4 (b=4): the winner's score; P=4 b=2 was pruned: blank
    assert [t.get_text() for t in grids[0].texts].count("4") == 1

    mb = figures.draw_microbatch(ev)
    ax = mb.axes[0]
    assert len(ax.collections) == 4 and ax.get_xlabel().startswith("micro-batch size")

    fig, imp = figures.draw_importances(ev)
    assert fig is not None and set(imp["paci"]) == {"stages", "microbatch_size"}
    assert sum(imp["paci"].values()) == pytest.approx(1.0)

    drift = verdict.draw_drift(ev)
    assert drift is not None
    rows = verdict.drift_rows(ev)
    assert [r["bound"] for r in rows] == [drift_bound(s, 2, 4) for s in range(2)]
    assert all(r["simulated"] is not None and r["simulated"] <= r["bound"] for r in rows)

    sp = verdict.draw_speedup(ev)
    assert sp is not None and sp.axes[0].get_xlabel().startswith("PACI speedup")
    ratios = {1: 6.0 / 4.0, 2: 6.3 / 4.2, 3: 5.7 / 3.8}  # flush's confirmed scores over PACI's, seed by seed
    assert ev.best.verdict_record.ratios == pytest.approx(ratios)
    assert sorted(sp.axes[0].collections[0].get_offsets()[:, 0]) == pytest.approx(sorted(ratios.values()))


@pytest.mark.slow
def test_report_command_writes_a_page_that_holds_everything(searched: Path, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    proc = subprocess.run(
        [sys.executable, "-m", "paci_tune.cli", "report", str(searched), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Verdict: paci -- PACI wins" in proc.stderr and "crash x1" in proc.stderr
    page = (out / "index.html").read_text()
    assert "Verdict: paci -- PACI wins" in page and "http://" not in page and "https://" not in page
    images = re.findall(r'<img id="(\w+)"[^>]+src="data:image/png;base64,([^"]+)"', page)
    assert {k for k, _ in images} == {"curves", "heatmap", "microbatch", "importances", "timelines", "drift", "speedup"}
    for key, data in images:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == (out / f"{key}.png").read_bytes()


def test_report_from_the_storage_alone_and_bad_input(searched: Path, tmp_path: Path) -> None:
    """In process (click's runner): the same command without best.yaml, and a study that is not there."""
    from click.testing import CliRunner

    from paci_tune.cli.app import main

    storage = f"sqlite:///{searched.parent / 'study.db'}"
    args = ["report", "--storage", storage, "--out", str(tmp_path / "r")]
    ok = CliRunner().invoke(main, [*args, "--study-name", "rep"])
    assert ok.exit_code == 0, ok.output
    assert "No recommendation yet" in (tmp_path / "r" / "index.html").read_text()
    bad = CliRunner().invoke(main, [*args, "--study-name", "nope"])
    assert bad.exit_code == 2 and "--study-name" in bad.output and "rep" in bad.output
    assert bad.exception is None or isinstance(bad.exception, SystemExit)
    assert CliRunner().invoke(main, ["report", "--out", str(tmp_path / "x")]).exit_code == 2  # nothing to report on


def _browser() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
@pytest.mark.skipif(_browser() is None, reason="no headless browser (chromium) on this machine")
def test_a_real_browser_loads_every_image_and_the_verdict(searched: Path, tmp_path: Path) -> None:
    """Chromium, headless, opens the page from disk; a copy of it with one inline script appended
    reports what the browser itself decoded: every image complete with a non-zero natural size."""
    from click.testing import CliRunner

    from paci_tune.cli.app import main

    out = tmp_path / "rep"
    assert CliRunner().invoke(main, ["report", str(searched), "--out", str(out)]).exit_code == 0
    probe = (
        "<script>window.addEventListener('load', () => { const im = [...document.images];"
        " const ok = im.filter(i => i.complete && i.naturalWidth > 0).length;"
        " const v = document.getElementById('verdict').textContent;"
        " document.body.insertAdjacentHTML('beforeend', `<pre id=probe>${ok}/${im.length}|${v}</pre>`); });"
        "</script>"
    )
    page = (out / "index.html").read_text()
    harness = out / "probe.html"
    harness.write_text(page.replace("</body>", probe + "</body>"))
    proc = subprocess.run(
        [
            _browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=10000",
            "--dump-dom",
            harness.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    found = re.search(r'<pre id="probe">(\d+)/(\d+)\|([^<]*)</pre>', proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    ok, total, verdict = int(found[1]), int(found[2]), found[3]
    assert total == 7 and ok == total
    assert verdict.startswith("Verdict: paci -- PACI wins")
