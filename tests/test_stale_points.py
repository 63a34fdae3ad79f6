"""PACI skips the points too stale to win (``search.paci_max_drift``): documented, off by default.

Oracle: the drift bound worked by hand, ceil((P-1)/a), for each (P, a) of a fixed-batch space;
the search session's own storage (which points each study was started from) and its log lines.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from helpers.searches import SEARCH_DOC

from paci_tune.config.tune import PACI_MAX_DRIFT, load_tune_config
from paci_tune.errors import ConfigError
from paci_tune.tune.narrow import skip_stale
from paci_tune.tune.space import TrialParams, load_space

# g = 32, no budget (D = 1): b in {1, 4, 16} gives a = 32, 8, 2. Bounds ceil((P-1)/a):
#   P=2: 1 1 1;  P=4: 1 1 2;  P=8: 1 1 4;  P=16 -- beyond the model; P=8 a=2 is the only one above 3.
SPACE = {"schedules": ["paci", "1f1b"], "stages": [2, 4, 8], "microbatch_size": [1, 4, 16]}


def _space(tmp: Path, doc: dict, **kw) -> object:
    path = tmp / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_space(str(path), global_batch=32, n_units=10, max_stages=None, **kw)


def test_paci_skips_exactly_the_points_above_the_bound_and_flush_keeps_them(tmp_path: Path) -> None:
    full = _space(tmp_path, SPACE)
    space = skip_stale(full, 3)
    by_hand = {(p, 32 // b, b) for p in (2, 4, 8) for b in (1, 4, 16) if math.ceil((p - 1) / (32 // b)) > 3}
    assert by_hand == {(8, 2, 16)}
    paci = {(q.stages, q.window, q.microbatch_size) for q in space.grid("paci")}
    flush = {(q.stages, q.window, q.microbatch_size) for q in space.grid("1f1b")}
    assert flush == set(full.points) and paci == set(full.points) - by_hand
    why = space.why_not(TrialParams("paci", 8, 2, 16))
    assert why is not None and "search.paci_max_drift = 3" in why and "= 4" in why
    assert space.why_not(TrialParams("1f1b", 8, 2, 16)) is None
    assert any(d.startswith("paci P=8 D=1 a=2 b=16: drift bound") for d in space.dropped)
    # The bound changes what a resumed study must match (the search's fingerprint).
    assert space.describe()["paci_max_drift"] == 3 and "paci_max_drift" not in full.describe()


def test_null_keeps_every_point_and_a_bound_below_every_point_is_refused(tmp_path: Path) -> None:
    full = _space(tmp_path, SPACE)
    assert skip_stale(full, None) == full
    assert len(skip_stale(full, 7).grid("paci")) == len(full.grid("paci"))
    only_p8 = _space(tmp_path, {**SPACE, "stages": [8], "microbatch_size": [16]})  # a = 2: bound 4
    with pytest.raises(ConfigError) as e:
        skip_stale(only_p8, 3)
    assert e.value.key == "search.paci_max_drift" and "at least 4" in e.value.allowed
    flush_only = _space(tmp_path, {**SPACE, "schedules": ["1f1b"], "stages": [8], "microbatch_size": [16]})
    assert skip_stale(flush_only, 1) == flush_only  # nothing of PACI's to skip


def test_the_setting_is_validated_and_off_by_default() -> None:
    doc = {k: dict(v) for k, v in SEARCH_DOC.items()}
    assert load_tune_config(doc).search.paci_max_drift is PACI_MAX_DRIFT is None
    assert load_tune_config({**doc, "search": {**doc["search"], "paci_max_drift": 3}}).search.paci_max_drift == 3
    for bad in (0, -1, 10**12, "lots", 2.5):
        with pytest.raises(ConfigError) as e:
            load_tune_config({**doc, "search": {**doc["search"], "paci_max_drift": bad}})
        assert e.value.key == "search.paci_max_drift"


@pytest.mark.parametrize("bound", [3, None])
def test_a_search_logs_the_skipped_points_and_does_not_start_paci_on_one(tmp_path: Path, bound: int | None) -> None:
    """The session binds the space with the config's bound: the user's own point (P=8 a=2) starts
    the flush study but, when stale, not PACI's; ``null`` starts both."""
    from paci_tune.tune.session import open_search

    doc = {k: dict(v) for k, v in SEARCH_DOC.items()}
    doc["model"] = {**doc["model"], "n_layer": 8}
    doc["training"] = {**doc["training"], "global_batch": 32}
    doc["pipeline"] = {**doc["pipeline"], "stages": 8, "window": 2}
    doc["hardware"] = {"devices": 8}
    cost = {"forward_s": 0.002, "backward_s": 0.004, "activation_bytes": 65536, "saved_bytes": 262144}
    profile = {
        "seq_len": 32,
        "p2p": {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e10},
        "units": [
            {"name": f"u{i}", "param_bytes": 1 << 16, "optimizer_s": 0.001, "microbatch": {4: cost, 16: cost}}
            for i in range(10)
        ],
    }
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile))  # hand-written: nothing is measured
    doc["budget"] = {"clock": "sim", "seconds": 0.3, "grid": 3, "profile": str(tmp_path / "profile.yaml")}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({**SPACE, "stages": [8], "microbatch_size": [4, 16]}))
    doc["search"] = {**doc["search"], "space": str(tmp_path / "space.yaml"), "paci_max_drift": bound}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(doc))
    lines: list[str] = []
    session = open_search(tmp_path / "model.yaml", workdir=tmp_path / "work", log=lines.append)
    skipped = [ln for ln in lines if "paci P=8 D=1 a=2 b=16: drift bound" in ln]
    queued = {
        s: [t.system_attrs.get("fixed_params") for t in st.get_trials(deepcopy=False)]
        for s, st in session.studies.items()
    }
    assert queued["1f1b"] == [{"stages": 8, "microbatch_size": 16}]
    if bound is None:
        assert not skipped and queued["paci"] == queued["1f1b"]
    else:
        assert len(skipped) == 1 and "search.paci_max_drift = 3" in skipped[0] and queued["paci"] == []
