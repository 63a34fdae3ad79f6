"""A model whose logits see later tokens is refused before anything runs (pipeline.checks' causality probe).

A next-token model that attends both ways (eager attention handed no causal mask) trains to a loss that
is a lie. The oracle is the model's definition: the probe must name the unit that attends both ways and
let the honest models (the guide's causal model, the built-in GPT) through.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import check_error, cli_command, cli_env
from helpers.configs import make_config, write_config
from helpers.guide_models import PYTHONPATH, SMALL

from paci_tune.errors import ConfigError
from paci_tune.model import load_model
from paci_tune.pipeline.checks import check_units

NONCAUSAL = "helpers.probe_models:build_noncausal"


def _entry(name: str, **kwargs: int) -> dict:
    return {"entry": name, "kwargs": {**SMALL, **kwargs}, "block_size": SMALL["block_size"]}


@pytest.mark.parametrize("leaky", [1, 3])
def test_a_block_attending_both_ways_is_refused_naming_it(leaky: int) -> None:
    meta = load_model(_entry(NONCAUSAL, leaky=leaky), 64, 0)
    with pytest.raises(ConfigError) as err:
        check_units(meta, 64, NONCAUSAL)
    line = str(err.value)
    assert err.value.key == "model.entry"
    assert f"unit {leaky} (Bidirectional)'s output at position 0 moved by" in line, line
    assert "is_causal=True" in line and "causal mask" in line, line


def test_honest_models_pass_and_keep_their_modes() -> None:
    """The guide's causal model and every unit of the built-in GPT pass; the check leaves modes as they were."""
    guide = load_model(_entry("helpers.guide_models:build"), 64, 0)
    guide.units[1].train(False)  # a mode of the user's own: the check must give it back
    check_units(guide, 64, "helpers.guide_models:build")
    assert [u.training for _, u in sorted(guide.units.items())] == [True, False, True, True, True, True]
    spec = {"preset": "tiny", "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 16}
    gpt = load_model(spec, 64, 0)
    check_units(gpt, 64, "preset")


def test_the_probe_leaves_the_callers_rng_alone() -> None:
    meta = load_model(_entry("helpers.guide_models:build"), 64, 0)
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    check_units(meta, 64, "helpers.guide_models:build")
    assert torch.equal(torch.rand(3), want)


@pytest.mark.slow
def test_the_cli_refuses_a_noncausal_entry_model_with_exit_2(tmp_path: Path) -> None:
    import subprocess

    from helpers import REPO

    doc = make_config(training={"steps": 2})
    doc["model"] = _entry(NONCAUSAL)
    metrics = tmp_path / "metrics.jsonl"
    env = {**cli_env(), "PYTHONPATH": PYTHONPATH}
    cmd = cli_command(write_config(tmp_path, doc), "--metrics", metrics)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env, check=False)
    check_error(proc, metrics, "model.entry", NONCAUSAL)
    assert "unit 2 (Bidirectional)" in proc.stderr, proc.stderr
