"""Training passes run in train mode (dropout on), validations in eval mode (dropout off), on every runtime.

The oracle is plain PyTorch: the same model under ``eval()`` scores the validation set deterministically,
and a training pass with dropout 0.5 cannot match it. The runs train at learning rate 1e-30 with no weight
decay (no weight changes in fp32), so every evaluation scores the initial weights and must equal the oracle exactly.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO
from helpers.cli import check_ok, cli_command, cli_env, read_metrics, run_in_process, train_losses
from helpers.configs import make_config, write_config
from helpers.guide_models import PYTHONPATH
from torch import nn

from paci_tune.config import OptimizerConfig
from paci_tune.data import MicroBatchStream, ValidationSet, load_source
from paci_tune.model import load_model
from paci_tune.pipeline.stage import Stage

MODEL = {"entry": "helpers.probe_models:build_dropout", "block_size": 32}


def _doc(schedule: str) -> dict[str, Any]:
    doc = make_config(
        training={"steps": 2, "eval_every": 1, "eval_sequences": 4},
        optimizer={"lr": 1e-30, "weight_decay": 0.0},
        pipeline={"schedule": schedule, "stages": 2, "window": 4, "partition": [2, 2]},
    )
    doc["model"] = dict(MODEL)
    return doc


def _oracle(doc: dict[str, Any]) -> tuple[float, list[float]]:
    """Plain PyTorch in eval mode: the validation loss, and each step's train batches' mean loss."""
    t = doc["training"]
    source = load_source(doc["data"], None)
    loaded = load_model(doc["model"], source.vocab_size, t["seed"])
    net = nn.Sequential(*(loaded.units[i] for i in range(loaded.n_units))).eval()
    val = ValidationSet(source.val, loaded.block_size, t["eval_sequences"], 32)
    a = doc["pipeline"]["window"]
    stream = MicroBatchStream(source.train, loaded.block_size, t["global_batch"] // a, t["seed"])
    with torch.no_grad():
        val_loss = val.mean_loss([float(F.cross_entropy(net(x).flatten(0, -2), y.flatten())) for x, y in val])
        steps = []
        for k in range(t["steps"]):
            batches = [stream.get(j) for j in range(k * a, k * a + a)]
            steps.append(sum(float(F.cross_entropy(net(x).flatten(0, -2), y.flatten())) for x, y in batches) / a)
    return val_loss, steps


def _check(records: list[dict[str, Any]], doc: dict[str, Any]) -> None:
    want_val, eval_mode_train = _oracle(doc)
    evals = [r["val_loss"] for r in records if r.get("event") == "eval"]
    assert evals and evals == pytest.approx([want_val] * len(evals), abs=1e-6, rel=0)
    got_train = train_losses(
        records
    )  # dropout 0.5 on: not the eval-mode loss of the same batches (fp32 agrees to 1e-6)
    assert all(abs(g - w) > 1e-4 for g, w in zip(got_train, eval_mode_train, strict=True)), (got_train, eval_mode_train)


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_emulated_validation_is_eval_mode_and_training_applies_dropout(schedule: str) -> None:
    doc = _doc(schedule)
    _check(run_in_process(copy.deepcopy(doc)), doc)


def test_a_stage_scores_in_eval_mode_and_trains_in_train_mode_after() -> None:
    units = load_model(MODEL, 64, 0).units
    stage = Stage(
        0,
        1,
        [units[i] for i in range(4)],
        window=1,
        optimizer=OptimizerConfig(lr=1e-30),
        lr_at=None,
        device=torch.device("cpu"),
    )
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    scored = [float(stage.evaluate(x, y)) for _ in range(2)]
    assert scored[0] == scored[1]  # no dropout: deterministic
    assert stage.module.training and all(m.training for m in stage.module.modules())
    trained = [float(stage.forward(mb, x, y)) for mb in range(2)]
    assert trained[0] != trained[1] and scored[0] not in trained  # dropout on in the training passes


@pytest.mark.slow
def test_distributed_validation_is_eval_mode_and_training_applies_dropout(tmp_path: Path) -> None:
    doc = _doc("paci")
    metrics = tmp_path / "m.jsonl"
    cmd = cli_command(write_config(tmp_path, doc), "--runtime", "distributed", "--metrics", metrics)
    env = {**cli_env(), "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False)
    check_ok(proc)
    _check(read_metrics(metrics), doc)
