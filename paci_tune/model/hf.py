"""``model: {hf: ...}``: a Hugging Face transformers causal LM as pipeline units.

The spec: ``hf`` is a shipped tiny config's name (``paci_tune/base/share/hf/*.json``), a mapping of
config fields with ``model_type``, or a local folder with ``config.json`` (and, if present,
``model.safetensors`` or its sharded index); ``untie`` (default false) gives every parameter shared by
several units a copy per unit (:mod:`.untie`); ``block_size`` (default: the config's
``max_position_embeddings``, capped at :data:`MAX_DEFAULT_BLOCK`).

Nothing the tool is handed may run code: a config is read as JSON and built with transformers' own
classes for its ``model_type`` (never ``trust_remote_code``, ``auto_map`` ignored), weights only from
safetensors (a folder with pickled ``.bin`` weights alone is refused), and no network (offline mode).

The vocabulary: a shipped or mapping config without ``vocab_size`` takes the data's vocabulary (a
tiny model for the data at hand); one that sets it, or a folder's, must cover the data's vocabulary
(refused otherwise: token ids beyond the embedding cannot be looked up).

Like a preset, a rank builds only its own units (:mod:`.hf_build`: a skeleton on the meta device, the
wanted units materialised, each parameter initialised by a seed of its own module, so the weights do
not depend on the depth). Callers see a preset-like :class:`LoadedModel` (only ``indices``' units)
whose ``ties`` say which parameters units share and whose ``verify`` is the check
:mod:`paci_tune.pipeline.checks` runs before any run (:mod:`.hf_verify`). May import: torch,
transformers, safetensors, the model layer's modules, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .loader import LoadedModel, _check_indices, _check_keys

KEY = "model.hf"
HF_KEYS = ("hf", "untie", "block_size")
MAX_DEFAULT_BLOCK = 1024
"""The default sequence length when the spec gives none: the config's longest, at most this."""
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_ALLOWED = (
    "the name of a shipped tiny config ({names}), a mapping of config fields with 'model_type', or a "
    "local folder with config.json (and model.safetensors weights, if any)"
)


def shipped_configs() -> dict[str, Path]:
    """The tiny configs that ship with the package, by name."""
    folder = Path(str(resources.files("paci_tune.base") / "share" / "hf"))
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def _allowed() -> str:
    return _ALLOWED.format(names=", ".join(shipped_configs()))


def read_spec(value: object) -> tuple[dict[str, Any], Path | None]:
    """The config fields ``value`` names and the folder its weights are in (None: random init)."""
    if isinstance(value, Mapping):
        if not isinstance(value.get("model_type"), str) or not all(isinstance(k, str) for k in value):
            raise ConfigError(KEY, dict(value), _allowed() + " (the mapping has no string 'model_type')")
        return dict(value), None
    if not isinstance(value, str) or not value:
        raise ConfigError(KEY, value, _allowed())
    shipped = shipped_configs()
    if value in shipped and not Path(value).exists():
        return json.loads(shipped[value].read_text()), None
    folder = Path(value).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(KEY, value, _allowed())
    try:
        fields = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, value, f"{_allowed()} (its config.json is unreadable: {exc})") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ConfigError(KEY, value, f"{_allowed()} (its config.json has no 'model_type')")
    has_weights = (folder / WEIGHTS).is_file() or (folder / INDEX).is_file()
    if not has_weights and any(folder.glob("*.bin")):
        raise ConfigError(
            KEY, value, "a folder with safetensors weights (model.safetensors): pickled .bin weights are never loaded"
        )
    return fields, folder if has_weights else None


def make_config(fields: Mapping[str, Any], vocab_size: int, where: object) -> Any:
    """A transformers config of the built-in class for ``model_type`` (no remote code), vocabulary checked."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if k not in ("auto_map", "architectures", "transformers_version")}
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", vocab_size)
    if isinstance(fields["vocab_size"], int) and fields["vocab_size"] < vocab_size:
        raise ConfigError(
            f"{KEY} vocab_size",
            fields["vocab_size"],
            f"at least the data's vocabulary {vocab_size} (a token id beyond the embedding cannot be looked up)",
        )
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        first = next(iter(str(exc).splitlines()), "")
        raise ConfigError(KEY, where, f"{_allowed()} (transformers refused it: {first})") from None
    config.use_cache = False
    return config


def block_size_of(spec: Mapping[str, Any], config: Any) -> int:
    """``model.block_size``, or the config's longest sequence capped at :data:`MAX_DEFAULT_BLOCK`."""
    longest = getattr(config, "max_position_embeddings", None)
    given = spec.get("block_size")
    if given is None:
        if not isinstance(longest, int) or longest <= 0:
            raise ConfigError(
                "model.block_size", None, "a positive integer (the config gives no max_position_embeddings)"
            )
        return min(longest, MAX_DEFAULT_BLOCK)
    if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
        raise ConfigError("model.block_size", given, "a positive integer")
    if isinstance(longest, int) and given > longest:
        raise ConfigError("model.block_size", given, f"at most the config's max_position_embeddings {longest}")
    return given


def untie_flag(spec: Mapping[str, Any]) -> bool:
    """``model.untie``: a boolean, false unless given."""
    value = spec.get("untie", False)
    if not isinstance(value, bool):
        raise ConfigError("model.untie", value, "true or false")
    return value


def load_hf(spec: Mapping[str, Any], vocab_size: int, seed: int, indices: Iterable[int] | None) -> LoadedModel:
    """The units ``indices`` (default all) of the transformers model ``spec`` names (module docstring)."""
    from .hf_build import build

    _check_keys(spec, HF_KEYS)
    untie = untie_flag(spec)
    fields, folder = read_spec(spec["hf"])
    config = make_config(fields, vocab_size, spec["hf"])
    block = block_size_of(spec, config)
    built, model = build(config, seed, None if indices is None else list(indices), folder, untie, block, spec["hf"])
    _check_indices(indices, built.n_units)

    def verify() -> None:
        from .hf_verify import check_split, verify_split

        if indices is None:  # the whole model is built here: check it as it is, not a second copy
            check_split(model, [built.units[i] for i in range(built.n_units)], vocab_size, block, spec["hf"])
            model.train()
        else:
            verify_split(config, seed, folder, untie, block, vocab_size, spec["hf"])

    built.verify = verify
    return built
