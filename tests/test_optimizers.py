"""Optimizers that tolerate staleness (NAdam, Muon) and PACI's per-stage staleness controls.

Oracles, none of them the code under test:

- plain gradient accumulation in one process on the torch optimizer(s) the config names, built by
  hand from the documented rules (:func:`helpers.oracles.plain_training`, :func:`~helpers.oracles.oracle_optimizers`);
- the from-scratch PACI of :mod:`helpers.paci_oracle`, which also builds the predicted weights
  ``W + tau (W - W_before)`` by hand after each step;
- the formulas themselves (stage momentum, PipeMare's LR), read back from each stage's torch optimizer;
- the other runtime (emulated against distributed, in bf16), and the uninterrupted run (checkpoints).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import check_ok, invoke_in, read_metrics, run_cli, run_in_process, train_losses
from helpers.configs import make_config, write_config
from helpers.oracles import CONSTANT_LR, plain_training
from helpers.paci_oracle import oracle_losses

from paci_tune.config import derive_run
from paci_tune.errors import ConfigError

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"name": "adamw"},
    "sgd": {"name": "sgd", "momentum": 0.9},
    "nadam": {"name": "nadam", "betas": [0.99, 0.999], "momentum_decay": 0.004},
    "muon": {"name": "muon"},
}
# 8 units (embedding, 6 blocks, head): P = 4 is two units per stage.
MODEL = {"preset": "tiny", "n_layer": 6, "d_model": 32, "n_head": 2, "block_size": 16}


def doc_for(name: str, schedule: str = "1f1b", stages: int = 1, window: int = 4, **pipeline: Any) -> dict[str, Any]:
    return make_config(
        model=MODEL,
        training={"steps": 6, "global_batch": 8, "eval_every": 1000, "eval_sequences": 4},
        optimizer={**OPTIMIZERS[name], "lr": 3e-3},
        lr_schedule=CONSTANT_LR,
        pipeline={"schedule": schedule, "stages": stages, "window": window, **pipeline},
    )


def with_partition(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its 8 units cut evenly, as the from-scratch oracle needs it written out."""
    p = doc["pipeline"]["stages"]
    doc["pipeline"]["partition"] = [8 // p + (1 if s < 8 % p else 0) for s in range(p)]
    return doc


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_trains_plain_torch_numbers_at_every_flush_layout(name: str) -> None:
    """P = 1 is a plain torch loop on the same optimizer(s) and groups; flush at P = 2, 4, GPipe, D = 2 and
    PACI with one micro-batch in flight (a flush by another name) are the same numbers."""
    want, _, _ = plain_training(doc_for(name))
    assert train_losses(run_in_process(doc_for(name))) == pytest.approx(want, abs=1e-6, rel=0)
    for doc in (
        doc_for(name, stages=2),
        doc_for(name, stages=4),
        doc_for(name, "gpipe", stages=2),
        doc_for(name, "paci", stages=4, inflight=1),
    ):
        assert train_losses(run_in_process(doc)) == pytest.approx(want, abs=1e-6, rel=0), doc["pipeline"]
    # D = 2 averages two halves of the batch: a sum in another order (~1e-7)
    dp = train_losses(run_in_process(doc_for(name, stages=2, window=2, data_parallel=2)))
    assert dp == pytest.approx(want, abs=1e-5, rel=0)
    assert want[-1] < want[0], "the run must learn"


def test_the_optimizers_are_different_algorithms() -> None:
    """The control: NAdam and Muon do not train AdamW's numbers (so the equalities above can fail)."""
    runs = {n: plain_training(doc_for(n))[0] for n in ("adamw", "nadam", "muon")}
    assert max(abs(a - b) for a, b in zip(runs["adamw"], runs["nadam"], strict=True)) > 1e-3
    assert max(abs(a - b) for a, b in zip(runs["adamw"], runs["muon"], strict=True)) > 1e-3


@pytest.mark.parametrize("name", ["nadam", "muon"])
def test_paci_on_each_optimizer_equals_the_from_scratch_paci(name: str) -> None:
    doc = with_partition(doc_for(name, "paci", stages=4, window=2))
    assert train_losses(run_in_process(doc)) == pytest.approx(oracle_losses(doc), abs=1e-6, rel=0)


@pytest.mark.parametrize(("name", "stages", "window", "d"), [("adamw", 4, 2, 1), ("muon", 3, 1, 1), ("nadam", 4, 1, 2)])
def test_weight_prediction_equals_weights_extrapolated_by_hand(name: str, stages: int, window: int, d: int) -> None:
    """a < P - 1: stages predict up to tau = 2 (P=3 a=1) or 3 (P=4 a=1) steps ahead; D = 2 replicas too."""
    doc = with_partition(doc_for(name, "paci", stages=stages, window=window, predict_weights=True, data_parallel=d))
    doc["training"]["global_batch"] = 2 * window * d
    got = train_losses(run_in_process(doc))
    assert got == pytest.approx(oracle_losses(doc), abs=1e-6, rel=0)
    plain = dict(doc, pipeline={**doc["pipeline"], "predict_weights": False})
    assert max(abs(a - b) for a, b in zip(got, oracle_losses(plain), strict=True)) > 1e-5, "prediction changed nothing"


def test_an_evaluation_under_prediction_scores_the_trained_weights_not_the_extrapolated_ones() -> None:
    from paci_tune.config import OptimizerConfig
    from paci_tune.pipeline.stage import Stage

    torch.manual_seed(0)
    unit = torch.nn.Linear(4, 4)
    st = Stage(
        0, 3, [unit], window=1, optimizer=OptimizerConfig(lr=0.1), lr_at=None, device=torch.device("cpu"), predict=2
    )
    x = torch.randn(2, 4)
    for mb in range(3):
        st.forward(mb, x)
        st.backward(mb, torch.ones(2, 4))
        st.step()
    trained = {f"0.{n}": m for (n, _), m in zip(unit.named_parameters(), st.optim.masters, strict=True)}
    want = torch.func.functional_call(st.module, trained, (x,))
    assert torch.equal(st.evaluate(x), want)
    assert not torch.allclose(st.module(x), want), "the parameters hold the extrapolated weights"


@pytest.mark.parametrize("name", ["adamw", "nadam", "muon", "sgd"])
def test_stage_momentum_gives_each_stage_the_formula(name: str) -> None:
    from paci_tune.train.loop import Trainer
    from paci_tune.train.metrics import RecordSink
    from paci_tune.train.run import resolve_run

    p, a, top = 4, 1, 0.995
    doc = doc_for(name, "paci", stages=p, window=a, stage_momentum=top)
    runtime = Trainer(resolve_run(derive_run(doc)), RecordSink()).runtime
    beta1 = {"sgd": 0.9, "muon": 0.95}.get(name, OPTIMIZERS[name].get("betas", [0.9])[0])
    for s, stage in enumerate(runtime.first_replica):
        tau = math.ceil((p - s - 1) / a)
        want = beta1 + tau * (top - beta1) / p
        for g in stage.optim.optimizer.param_groups:
            got = g["momentum"] if "momentum" in g else g["betas"][0]
            if "betas" in g and "momentum" not in g and name == "muon":  # Muon's AdamW part: its betas[0]
                want_g = 0.9 + tau * (top - 0.9) / p
                assert got == pytest.approx(want_g), (s, g.keys())
            else:
                assert got == pytest.approx(want), (s, name)


def test_pipemare_lr_gives_each_stage_the_formula() -> None:
    from paci_tune.train.loop import Trainer
    from paci_tune.train.metrics import RecordSink
    from paci_tune.train.run import resolve_run

    p, a, horizon, steps = 4, 1, 0.5, 6
    doc = doc_for("adamw", "paci", stages=p, window=a, stale_lr=horizon)
    stages = Trainer(resolve_run(derive_run(doc)), RecordSink()).runtime.first_replica
    for s, stage in enumerate(stages):
        tau = math.ceil((p - s - 1) / a)
        for k in range(steps):
            factor = tau ** -(1 - min(((k + 1) / steps) / horizon, 1.0)) if tau > 1 else 1.0
            assert stage.lr_at(k) == pytest.approx(3e-3 * factor), (s, k)
    got = train_losses(run_in_process(doc))
    assert got != train_losses(run_in_process(doc_for("adamw", "paci", stages=p, window=a)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nadam", "muon"])
def test_bf16_distributed_equals_emulated(tmp_path: Path, name: str) -> None:
    from helpers.bf16 import torch_threads

    from paci_tune.base.processes import threads_per_process

    doc = doc_for(name, "paci", stages=2, window=4, precision="bf16", predict_weights=True, stage_momentum=0.995)
    doc["training"]["eval_every"] = 3
    with torch_threads(threads_per_process(2)):
        emulated = run_in_process(doc)
    metrics = tmp_path / "m.jsonl"
    check_ok(run_cli(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics))
    got = read_metrics(metrics)
    assert train_losses(got) == pytest.approx(train_losses(emulated), abs=1e-5, rel=0)
    evals = [[r["val_loss"] for r in recs if r["event"] == "eval"] for recs in (got, emulated)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-5, rel=0)


@pytest.mark.parametrize("name", ["nadam", "muon"])
def test_checkpoints_with_each_optimizers_state_reshard_and_continue_the_run(tmp_path: Path, name: str) -> None:
    """Flush P=2 x D=2 for 3 steps, checkpointed; then P=4 x D=1 from it for 3 more: plain training's 6 steps.
    And PACI resumed from its own checkpoint (with weight prediction) gives its uninterrupted run."""
    want, _, _ = plain_training(doc_for(name))
    first = doc_for(name, stages=2, window=2, data_parallel=2)
    first["training"].update(steps=3, checkpoint_every=3, checkpoint_dir=str(tmp_path / "a"))
    head = train_losses(run_in_process(first))
    second = doc_for(name, stages=4)
    second["training"]["init_from"] = str(tmp_path / "a")
    tail = [r["loss"] for r in run_in_process(second) if r.get("event") == "train"]
    assert head + tail == pytest.approx(want, abs=1e-5, rel=0)  # D = 2: see above

    paci = doc_for(name, "paci", stages=2, window=2, predict_weights=True)
    paci["training"].update(checkpoint_every=3, checkpoint_dir=str(tmp_path / "p"), keep_checkpoints=2)
    whole = train_losses(run_in_process(paci))
    (tmp_path / "p" / "LATEST").write_text("batch_00000003\n")  # as if killed after the first checkpoint
    resumed = train_losses(run_in_process(paci, resume=True))
    assert resumed == pytest.approx(whole, abs=1e-6, rel=0)


def test_a_checkpoint_of_another_optimizer_moves_its_weights_and_starts_fresh_moments(tmp_path: Path) -> None:
    first = doc_for("adamw", stages=2)
    first["training"].update(steps=3, checkpoint_every=3, checkpoint_dir=str(tmp_path / "a"))
    run_in_process(first)
    second = doc_for("nadam", stages=2)
    second["training"]["init_from"] = str(tmp_path / "a")
    records = run_in_process(second)
    start = next(r for r in records if r["event"] == "start")
    assert start["init_optimizer"] == "fresh: the checkpoint's adamw state is not nadam's"
    assert [r["step"] for r in records if r.get("event") == "train"] == [4, 5, 6]


BAD = [
    ({"optimizer": {"name": "nadam", "betas": [0.9, 1.0]}}, "optimizer.betas[1]"),
    ({"optimizer": {"name": "nadam", "momentum_decay": 0}}, "optimizer.momentum_decay"),
    ({"optimizer": {"name": "muon", "momentum": 1.0}}, "optimizer.momentum"),
    ({"optimizer": {"name": "muon", "ns_steps": 0}}, "optimizer.ns_steps"),
    ({"pipeline": {"schedule": "1f1b", "stage_momentum": 0.99}}, "pipeline.stage_momentum"),
    ({"pipeline": {"schedule": "zb-h1", "predict_weights": True}}, "pipeline.predict_weights"),
    ({"pipeline": {"schedule": "gpipe", "stale_lr": 0.5}}, "pipeline.stale_lr"),
    ({"pipeline": {"stage_momentum": 0.5}}, "pipeline.stage_momentum"),  # below AdamW's beta1: it would lower it
    ({"pipeline": {"stale_lr": 1.5}}, "pipeline.stale_lr"),
    (
        {
            "optimizer": {"name": "muon"},
            "model": {
                "entry": "helpers.guide_models:build",
                "block_size": 32,
                "kwargs": {"n_layer": 0, "vocab_size": 64, "block_size": 32},
            },
        },
        "optimizer.name",
    ),
]


@pytest.mark.parametrize(("change", "key"), BAD, ids=[k for _, k in BAD])
def test_bad_values_exit_2_naming_the_key(tmp_path: Path, change: dict[str, Any], key: str) -> None:
    doc = make_config(**{k: v for k, v in change.items() if k != "model"})
    if "model" in change:
        doc["model"] = change["model"]
    result = invoke_in(tmp_path, ["train", str(write_config(tmp_path, doc)), "--no-live"])
    assert result.exit_code == 2, result.output
    assert f"error: {key}: got " in result.output and "Traceback" not in result.output, result.output


def test_a_profile_is_charged_its_own_optimizers_step() -> None:
    """The rst/sim clocks read the run's optimizer's step; a profile that did not time it is refused."""
    from helpers.profiles import reference_profile

    from paci_tune.sim.profile import Profile

    base = Profile.from_dict(reference_profile(3, 16))
    assert base.optimizer == "adamw" and base.timed_optimizers() == ["adamw"]
    with pytest.raises(ConfigError, match="timed the muon step"):
        base.for_optimizer("muon", "budget.profile")
    doc = base.to_dict()
    for i, u in enumerate(doc["units"]):
        u["optimizer_steps"] = {"muon": 3.0 * (i + 1)}
    both = Profile.from_dict(doc)
    muon = both.for_optimizer("muon")
    assert [u.optimizer_s for u in muon.units] == [3.0 * (i + 1) for i in range(len(doc["units"]))]
    assert muon.for_optimizer("adamw").units == both.units


def test_calibrate_times_every_optimizer_a_search_names() -> None:
    """Each unit gets a step time per optimizer asked for (0 for one with nothing to train); the pattern's own
    optimizer is the profile's ``optimizer`` and is not repeated; the note says how the others were timed."""
    from paci_tune.calibrate.measure import other_optimizer_steps
    from paci_tune.config import OptimizerConfig

    units = [
        torch.nn.Embedding(16, 8),
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 16),
    ]
    timed = OptimizerConfig(name="adamw")
    wanted = [
        OptimizerConfig(name="muon"),
        OptimizerConfig(name="nadam"),
        timed,
        OptimizerConfig(name="muon", ns_steps=3),
    ]
    steps, note = other_optimizer_steps(
        timed, wanted, units, [1e-3, 1e-3, 0.0, 1e-3], device=torch.device("cpu"), repeats=2, warmup=1
    )
    assert [sorted(s) for s in steps] == [["muon", "muon ns_steps=3", "nadam"]] * 4
    assert all(v > 0 for i in (0, 1, 3) for v in steps[i].values()) and set(steps[2].values()) == {0.0}
    assert note is not None and "adamw" in note and "muon" in note
    assert other_optimizer_steps(
        timed, [timed], units, [1e-3] * 4, device=torch.device("cpu"), repeats=1, warmup=0
    ) == ([{}, {}, {}, {}], None)


def test_extend_times_on_the_profiles_threads_and_scales_by_its_own_step(monkeypatch: pytest.MonkeyPatch):
    """``calibrate --extend`` times each optimizer on the profile's threads per stage (a ratio taken on
    other threads would not carry over: Muon's small products suffer oversubscription, AdamW's
    element-wise step hardly), restores the caller's, and charges the profile's own step x the ratio."""
    import paci_tune.calibrate.measure as measure
    from paci_tune.calibrate import with_optimizers
    from paci_tune.config import load_config
    from paci_tune.sim.profile import Profile

    config = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt.yaml"
    cfg = load_config(config)
    profile = Profile.load(Path(measure.__file__).parents[1] / "base/share/profiles/tiny-gpt.yaml", key="x")
    seen: list[int] = []

    def fixed(unit: Any, *, optimizer: Any = None, **_: Any) -> float:
        seen.append(torch.get_num_threads())
        return 2e-3 if optimizer.name == "nadam" else 1e-3  # NAdam alone 2x AdamW alone

    monkeypatch.setattr(measure, "measure_optimizer", fixed)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = with_optimizers(profile, cfg, [derive_run(cfg.to_doc(), {"optimizer.name": "nadam"}).optimizer])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {profile.threads}
    for old, new in zip(profile.units, out.units, strict=True):
        assert new.optimizer_steps["nadam"] == pytest.approx(2 * old.optimizer_s)
