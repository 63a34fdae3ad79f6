"""Reshardable checkpoints: a checkpoint of one layout starts a run in another (``--init-from``).

Acceptance (issue 26): a flush checkpoint taken at P=4 and loaded at P=2 gives the same run as a
P=2 checkpoint of the same training loaded at P=2; D changes likewise. Emulated runtime, fp32 and bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.configs import BASE_CONFIG, merge


def _train(doc: dict, init_from: str | None = None) -> list[dict]:
    from paci_tune.config import load_run_config
    from paci_tune.train.loop import Trainer
    from paci_tune.train.metrics import RecordSink
    from paci_tune.train.run import resolve_run

    cfg = load_run_config(merge(doc, {"training": {"init_from": init_from}}))
    sink = RecordSink(None, None)
    Trainer(resolve_run(cfg), sink).run()
    return sink.records


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records if r.get("event") == "train"]


def _layout(p: int, d: int, precision: str, ckpt: Path | None = None, steps: int = 4) -> dict:
    pipe = {
        "schedule": "1f1b",
        "stages": p,
        "data_parallel": d,
        "window": 4 // d,
        "precision": precision,
        "partition": "auto",
    }
    training = {"steps": steps}
    if ckpt is not None:
        training |= {"checkpoint_dir": str(ckpt), "checkpoint_every": steps}
    return merge(BASE_CONFIG, {"pipeline": pipe, "training": training})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("src", "dst"), [((4, 1), (2, 1)), ((2, 1), (4, 1)), ((2, 2), (2, 1)), ((1, 1), (2, 2))])
def test_reshard_continues_the_same_run(tmp_path: Path, precision: str, src: tuple, dst: tuple) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _train(_layout(*src, precision, a))
    _train(_layout(*dst, precision, b))  # the same training, checkpointed in the target layout
    from_src = _losses(_train(_layout(*dst, precision, steps=8), init_from=str(a)))
    from_dst = _losses(_train(_layout(*dst, precision, steps=8), init_from=str(b)))
    assert [s for s, _ in from_src] == [5, 6, 7, 8]
    # Exact when the two trainings' states agree bit for bit (P changes); D changes reorder the
    # gradient average's sum, so those agree to 1e-6.
    tol = 1e-6 if src[1] != dst[1] else 0.0
    assert [x for _, x in from_src] == pytest.approx([x for _, x in from_dst], abs=tol, rel=0)
    # Loading the target layout's own checkpoint continues that training exactly (moments, steps, data).
    straight = _losses(_train(_layout(*dst, precision, steps=8)))[4:]
    assert from_dst == straight


def test_refuses_other_model(tmp_path: Path) -> None:
    from paci_tune.errors import ConfigError

    _train(_layout(2, 1, "fp32", tmp_path / "a"))
    other = merge(_layout(2, 1, "fp32", steps=8), {"model": {"d_model": 32}})
    with pytest.raises(ConfigError, match="model"):
        _train(other, init_from=str(tmp_path / "a"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reshard_across_runtimes(tmp_path: Path, precision: str) -> None:
    """An emulated P=4 checkpoint starts a distributed P=2 x D=2 run (the CLI's --init-from), and a
    distributed P=2 x D=2 checkpoint starts an emulated P=4 run: the same losses as the emulated run from
    the emulated checkpoint (1e-6: the replicas' gradient average is reduced in another order)."""
    from tests.helpers.cli import check_ok, read_metrics, run_cli
    from tests.helpers.configs import write_config

    _train(_layout(4, 1, precision, tmp_path / "emu"))
    ref = _losses(_train(_layout(2, 2, precision, steps=8), init_from=str(tmp_path / "emu")))
    doc = merge(_layout(2, 2, precision, tmp_path / "dist", steps=8), {"pipeline": {"runtime": "distributed"}})
    cfg = write_config(tmp_path, doc)
    check_ok(run_cli(cfg, "--init-from", tmp_path / "emu", "--metrics", tmp_path / "m.jsonl", timeout=300))
    got = _losses(read_metrics(tmp_path / "m.jsonl"))
    assert [s for s, _ in got] == [5, 6, 7, 8]
    assert [x for _, x in got] == pytest.approx([x for _, x in ref], abs=1e-6, rel=0)
    back = _losses(_train(_layout(4, 1, precision, steps=12), init_from=str(tmp_path / "dist")))
    assert [s for s, _ in back] == [9, 10, 11, 12]
