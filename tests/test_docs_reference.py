"""docs/reference.md cannot rot: every table of keys is checked against the code it describes.

Oracle: the code, read independently of the document. For ``model.yaml``'s sections: the schema's
dataclasses (``dataclasses.fields`` walked recursively, nested ones as dotted keys such as
``confirm.top`` in ``search``; their defaults; their annotations, resolved), the model and data
loaders' key constants, builder signatures and what ``load_model`` / ``load_source`` make of a
key left out, and the command-line options as click builds them (what ``overrides_from`` turns
each into). For the files parsed by hand -- search spaces, profiles, ``best.yaml`` -- the parsers'
real behaviour: the known keys an unknown key's error lists, a ``required`` key left out that is
refused with an error naming it, a key left out that gives exactly what its documented default
gives, a value changed that ``apply`` refuses (or does not), and the profile's dataclass defaults.

Tables: a markdown table belongs to the headings above it and is named ``(file, section)``: the
first code span of its ``##`` heading and its ``###`` heading without backticks, e.g.
``("model.yaml", "training")`` or ``("profile.yaml", "units[i]")``. A row's key is the first code
span of its first cell.

Conventions of the ``default`` column, normalised before comparing:

- the first code span of the cell, read as YAML -- ``null`` (or ``None``) is None, ``true`` /
  ``false`` are booleans, ``[0.9, 0.95]`` a list, ``6.0e-4`` a float; ``6e-4`` is a *string* in
  YAML and in the config loader alike, so it fails here as it would in a user's file. A cell with no
  backticks is read as YAML whole. Tuples in the code compare as lists.
- ``required``: the key has no default (the code must refuse it missing);
  ``derived``: computed from other keys when absent (the text says how; checked where it can be).

For the schema's sections and the profile's dataclasses, the ``type`` column is alternatives joined
by `` or `` (``integer``, ``number``, ``string``, ``boolean``, ``null``, ``mapping``, ``list of
integers``, ``list of 2 numbers`` for a pair), compared as a set with the resolved annotation
rendered the same way; and every value of a ``Literal`` annotation must appear, in backticks, in
the row's ``allowed`` cell.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import yaml
from helpers.configs import sim_config
from torch import nn

from paci_tune.cli.options import overrides_from, run_options
from paci_tune.cli.tune import search as search_command
from paci_tune.config.schema import RunConfig
from paci_tune.config.tune import RUN_HARDWARE_KEYS, TUNE_SECTIONS, TuneConfig
from paci_tune.data import sources
from paci_tune.errors import ConfigError
from paci_tune.model import gpt, loader
from paci_tune.sim import profile as prof
from paci_tune.tune import bestfile
from paci_tune.tune.apply import apply_run
from paci_tune.tune.bestfile import RECOMMENDED
from paci_tune.tune.space import load_space

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
MODEL, SPACE, BEST, PROFILE = "model.yaml", "search_spaces/*.yaml", "best.yaml", "profile.yaml"


class _Required:
    """The ``default`` cell ``required``: no default."""

    def __repr__(self) -> str:
        return "required"


class _Derived:
    """The ``default`` cell ``derived ...``: computed from other keys."""

    def __repr__(self) -> str:
        return "derived"


REQUIRED, DERIVED = _Required(), _Derived()
Row = dict[str, str]


# ----------------------------------------------------------------------------- reading the document


def _span(text: str) -> str | None:
    m = re.search(r"`([^`]*)`", text)
    return m.group(1) if m else None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _parse_tables(text: str) -> dict[tuple[str, str], list[Row]]:
    tables: dict[tuple[str, str], list[Row]] = {}
    h2 = h3 = ""
    lines = text.splitlines()
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            h2, h3 = _span(line) or line[3:].strip(), ""
        elif not fenced and line.startswith("### "):
            h3 = line[4:].replace("`", "").strip()
        elif (
            not fenced
            and line.startswith("|")
            and i + 1 < len(lines)
            and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
        ):
            header = _cells(line)
            rows: list[Row] = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                assert len(cells) == len(header), f"{DOC.name}:{i + 1}: {len(cells)} cells, header has {len(header)}"
                rows.append(dict(zip(header, cells, strict=True)))
                i += 1
            assert (h2, h3) not in tables, f"two tables under ## {h2} / ### {h3}"
            tables[(h2, h3)] = rows
            continue
        i += 1
    return tables


TABLES = _parse_tables(DOC.read_text())


def _table(file: str, section: str) -> list[Row]:
    assert (file, section) in TABLES, f"docs/reference.md has no table under ## `{file}` / ### {section}"
    return TABLES[(file, section)]


def _key(row: Row) -> str:
    first = next(iter(row.values()))
    key = _span(first)
    assert key, f"a row without a key in backticks: {row}"
    return key


def _rows(file: str, section: str) -> dict[str, Row]:
    rows = _table(file, section)
    keys = [_key(r) for r in rows]
    assert len(keys) == len(set(keys)), f"{file} / {section}: a key documented twice: {keys}"
    return dict(zip(keys, rows, strict=True))


def _default(cell: str) -> Any:
    """The documented default (module docstring's conventions)."""
    text = cell.strip()
    if text.startswith("required"):
        return REQUIRED
    if text.startswith("derived"):
        return DERIVED
    raw = _span(text) if text.startswith("`") else text
    value = yaml.safe_load(raw or "")
    return None if value == "None" else value


def _norm(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    return value


def _same(documented: Any, actual: Any) -> bool:
    """Equal as YAML values: kinds matter (``1`` is not ``true``, ``"1e-4"`` is not ``1e-4``), but an
    integer equals the same float (the loader reads ``300`` as ``300.0`` for a number key)."""
    a, b = _norm(documented), _norm(actual)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- the code's side


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        (kind,) = {type(a) for a in typing.get_args(tp)}
        return _type_name(kind)
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is tuple:
        args = typing.get_args(tp)
        (name,) = {_type_name(a) for a in args}
        return f"list of {len(args)} {name}s"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "mapping"
    return {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}[tp]


def _type_names(tp: Any) -> set[str]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return set().union(*(_type_names(a) for a in typing.get_args(tp)))
    return {_type_name(tp)}


def _literals(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for a in typing.get_args(tp) for v in _literals(a)]


def _fields(cls: type, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (annotation, default) of a dataclass, nested dataclasses flattened."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_fields(tp, f"{prefix}{f.name}."))  # type: ignore[arg-type]
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        out[prefix + f.name] = (tp, default)
    return out


def _sections() -> dict[str, list[type]]:
    """model.yaml's dataclass sections: the run's (RunConfig) and the tuning ones (TuneConfig); ``hardware``
    is both (its ``memory`` is the run's, the rest the search's), documented as one table."""
    run, tune = typing.get_type_hints(RunConfig), typing.get_type_hints(TuneConfig)
    out = {name: [tp] for name, tp in run.items() if dataclasses.is_dataclass(tp)}
    for name in TUNE_SECTIONS:
        out.setdefault(name, []).append(tune[name])
    return out


def _run_options() -> dict[str, str]:
    """Dotted key -> the ``train``/``apply`` option that sets it, as the CLI builds them."""

    def command(**kwargs: Any) -> None:
        """A bare function decorated like ``paci-tune train``."""

    out: dict[str, str] = {}
    for param in run_options(command).__click_params__:  # type: ignore[attr-defined]
        (key,) = overrides_from({param.name: 1})
        out[key] = param.opts[0]
    return out


def _refused(load: Callable[[Any], Any], spec: Any) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load(spec)
    return e.value


def _known_keys(error: ConfigError) -> set[str]:
    """The keys an unknown key's error lists (``one of: a, b`` / ``a known key: a, b``)."""
    listed = error.allowed.rsplit(": ", 1)[-1]
    return {k.strip() for k in listed.split(",")}


def _check_absent_means_default(
    rows: dict[str, Row], base: dict[str, Any], load: Callable[[Any], Any], where: str
) -> None:
    """Each ``required`` key left out of ``base`` is refused by name; each literal default, written out,
    gives what leaving the key out gives. ``base`` holds every documented key and must load."""
    assert set(base) == set(rows), f"{where}: the test's full example has keys {sorted(base)}, the table {sorted(rows)}"
    load(copy.deepcopy(base))  # every documented key together is accepted
    for key, row in rows.items():
        default = _default(row["default"])
        absent = {k: copy.deepcopy(v) for k, v in base.items() if k != key}
        if default is REQUIRED:
            e = _refused(load, absent)
            assert key in f"{e.key} {e.allowed}", f"{where}.{key} is documented required; leaving it out: {e}"
        elif default is not DERIVED:
            try:
                left_out, written = load(absent), load({**absent, key: copy.deepcopy(default)})
            except ConfigError as e:
                raise AssertionError(f"{where}.{key}: documented default {default!r}, but: {e}") from None
            assert left_out == written, f"{where}.{key}: documented {default!r} is not what leaving it out gives"


# ----------------------------------------------------------------------------- model.yaml: the sections


def test_every_section_of_model_yaml_has_a_table() -> None:
    documented = {section for file, section in TABLES if file == MODEL}
    wanted = set(_sections()) | {"model with preset", "model with entry", "model presets", "data"}
    wanted |= {f"data with source: {kind}" for kind in sources.SOURCE_KEYS}
    assert documented == wanted


@pytest.mark.parametrize("section", sorted(_sections()))
def test_section_keys_defaults_types_and_literals_match_the_schema(section: str) -> None:
    fields = {k: v for cls in _sections()[section] for k, v in _fields(cls).items()}
    rows = _rows(MODEL, section)
    assert sorted(rows) == sorted(fields), f"{section}: documented keys vs the dataclass's fields"
    for key, (tp, default) in fields.items():
        row, where = rows[key], f"{section}.{key}"
        documented = _default(row["default"])
        assert documented is not REQUIRED and documented is not DERIVED, f"{where}: the schema has a default"
        assert _same(documented, default), f"{where}: documented default {documented!r}, the code's {default!r}"
        assert set(row["type"].split(" or ")) == _type_names(tp), f"{where}: type {row['type']!r} vs {tp}"
        for value in _literals(tp):
            assert f"`{value}`" in row["allowed"], f"{where}: allowed value {value!r} is not in {row['allowed']!r}"


def _option(row: Row) -> str:
    return _span(row["option"]) or row["option"]


def _run_default(section: str) -> Any:
    """The default of RunConfig's ``model`` or ``data`` (a whole default RunConfig cannot be built:
    its training section has no budget)."""
    (f,) = [f for f in dataclasses.fields(RunConfig) if f.name == section]
    return f.default_factory()  # type: ignore[misc]


def test_options_column_is_what_the_cli_overrides() -> None:
    documented = {}
    for (file, section), rows in TABLES.items():
        if file == MODEL and section not in TUNE_SECTIONS:
            run_section = section.split(" ")[0]
            documented |= {f"{run_section}.{_key(r)}": _option(r) for r in rows if r.get("option")}
        if file == MODEL and section == "hardware":  # its run keys (hardware.memory) are run options too
            documented |= {f"hardware.{_key(r)}": _option(r) for r in rows if _key(r) in RUN_HARDWARE_KEYS}
    assert documented == _run_options()


def test_search_options_are_options_of_paci_tune_search() -> None:
    flags = {opt for p in search_command.params for opt in p.opts}
    for section in TUNE_SECTIONS:
        for key, row in _rows(MODEL, section).items():
            if row["option"]:
                assert _option(row) in flags, f"{section}.{key}: `paci-tune search` has no {row['option']}"
                assert _option(row) == "--" + key.replace("_", "-"), f"{section}.{key}: option {row['option']}"


def _entry_units() -> list[nn.Module]:
    """A user model for ``model.entry``: two units."""
    return [nn.Embedding(8, 4), nn.Linear(4, 8)]


def test_model_keys_are_the_loaders() -> None:
    assert _run_default("model") == {"preset": _default(_rows(MODEL, "model with preset")["preset"]["default"])}
    preset_rows = _rows(MODEL, "model with preset")
    assert tuple(preset_rows) == loader.PRESET_KEYS
    for name in gpt.PRESETS:
        assert f"`{name}`" in preset_rows["preset"]["allowed"]

    def shape(name: str, vocab: int, extra: dict[str, Any]) -> Any:
        return loader.load_model({"preset": name, **extra}, vocab, 0, indices=[]).gpt

    for key, row in preset_rows.items():
        if key == "preset":
            continue
        absent = {getattr(shape(name, vocab, {}), key) for name in gpt.PRESETS for vocab in (77, 99)}
        documented = _default(row["default"])
        if documented is DERIVED:
            assert len(absent) > 1, f"model.{key}: documented derived, but it is always {absent}"
        else:
            assert absent == {documented}, f"model.{key}: documented {documented!r}, left out it is {absent}"
            assert shape("tiny", 77, {key: documented}) == shape("tiny", 77, {})

    entry = {"entry": f"{__name__}:_entry_units", "kwargs": {}, "block_size": 8}
    _check_absent_means_default(
        _rows(MODEL, "model with entry"), entry, lambda spec: loader.load_model(spec, 8, 0).n_units, "model"
    )
    assert tuple(_rows(MODEL, "model with entry")) == loader.ENTRY_KEYS


def test_presets_table_is_the_presets() -> None:
    documented = {
        _key(r): [int(r[c]) for c in ("n_layer", "n_head", "d_model", "block_size", "units")]
        for r in _table(MODEL, "model presets")
    }
    actual = {name: [c.n_layer, c.n_head, c.d_model, c.block_size, gpt.num_units(c)] for name, c in gpt.PRESETS.items()}
    assert documented == actual


def test_data_keys_and_defaults_are_the_sources() -> None:
    row, draw = _table(MODEL, "data")
    assert _key(row) == "source" and _run_default("data") == {"source": _default(row["default"])}
    for kind in sources.SOURCE_KEYS:
        assert f"`{kind}`" in row["allowed"]
    from paci_tune.data.stream import DRAWS, MicroBatchStream

    assert _key(draw) == "draw" and all(f"`{d}`" in draw["allowed"] for d in DRAWS)
    params = inspect.signature(MicroBatchStream).parameters
    assert _default(draw["default"]) == params["draw"].default
    builders = {"stdlib": sources.stdlib_corpus, "synthetic": sources.synthetic_source}  # pure: kwargs as given
    for kind, build in builders.items():
        rows = _rows(MODEL, f"data with source: {kind}")
        assert tuple(rows) == sources.SOURCE_KEYS[kind]
        params = inspect.signature(build).parameters
        for key, r in rows.items():
            empty = params[key].default is inspect.Parameter.empty
            assert _same(_default(r["default"]), REQUIRED if empty else params[key].default), f"data.{key} ({kind})"


def test_text_and_bin_sources_by_behaviour(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    folder = tmp_path / "bin"
    folder.mkdir()
    for split in ("train", "val"):
        np.arange(300, dtype=np.uint16).tofile(folder / f"{split}.bin")

    def load(kind: str) -> Callable[[Any], Any]:
        def run(spec: dict[str, Any]) -> Any:
            s = sources.load_source({"source": kind, **spec}, None)
            return s.vocab_size, len(s.train), len(s.val)

        return run

    for kind, base in (
        ("text", {"path": str(text), "val_fraction": 0.3}),
        ("bin", {"path": str(folder), "vocab_size": 1000, "dtype": "uint16"}),
    ):
        rows = _rows(MODEL, f"data with source: {kind}")
        assert tuple(rows) == sources.SOURCE_KEYS[kind]
        _check_absent_means_default(rows, base, load(kind), f"data ({kind})")


# ----------------------------------------------------------------------------- search spaces


def _space_loader(tmp_path: Path) -> Callable[[Any], Any]:
    def load(doc: Any) -> Any:
        path = tmp_path / "space.yaml"
        path.write_text(yaml.safe_dump(doc))
        return load_space(str(path), global_batch=8, n_units=8, max_stages=None).describe()

    return load


SPACE_BASE = {
    "description": "a space",
    "schedules": ["paci"],
    "global_batch": "fixed",
    "stages": [1, 2],
    "microbatch_size": [2, 4],
    "lr_scale": [0.5, 1.0],
    "backward_weights": ["forward", "current"],
    "chunks": [2, 3],
    "optimizer": {"name": ["adamw", "nadam"], "betas": [[0.9, 0.95]]},
    "staleness": {"predict_weights": [False, True]},
}


def test_space_keys_are_the_parsers(tmp_path: Path) -> None:
    load = _space_loader(tmp_path)
    rows = _rows(SPACE, "top level")
    assert set(rows) == _known_keys(_refused(load, {**SPACE_BASE, "no_such_key": 1}))
    assert _default(rows["window"]["default"]) is DERIVED
    _check_absent_means_default({k: r for k, r in rows.items() if k != "window"}, SPACE_BASE, load, "space")
    # window: derived with a fixed global batch (checked above: the base has none), required with a free one
    free = {**SPACE_BASE, "global_batch": "free", "window": [1, 2]}
    load(free)
    assert _refused(load, {k: v for k, v in free.items() if k != "window"}).key == "space.window"


def test_range_keys_are_the_parsers(tmp_path: Path) -> None:
    load = _space_loader(tmp_path)
    ints = {"low": 1, "high": 4, "step": 1, "log": False}
    _check_absent_means_default(
        _rows(SPACE, "integer ranges"), ints, lambda r: load({**SPACE_BASE, "stages": r})["stages"], "space.stages"
    )
    assert _refused(load, {**SPACE_BASE, "stages": {**ints, "no_such_key": 1}}).key == "space.stages"
    lr = {"low": 0.5, "high": 2.0, "log": True}

    def lr_range(r: Any) -> Any:
        return load({**SPACE_BASE, "lr_scale": r})["lr_scale"]

    _check_absent_means_default(_rows(SPACE, "lr_scale range"), lr, lr_range, "space.lr_scale")
    assert _refused(load, {**SPACE_BASE, "lr_scale": {**lr, "no_such_key": 1}}).key == "space.lr_scale"


# ----------------------------------------------------------------------------- best.yaml

RUN = sim_config(
    data={"vocab_size": 32, "n_train": 20_000, "n_val": 2_000},
    training={"eval_sequences": 4},
    optimizer={"lr": 6.0e-4},
    pipeline={"schedule": "paci", "window": 2},
)
RECOMMENDED_FOR_RUN = {
    "schedule": "paci",
    "stages": 2,
    "data_parallel": 1,
    "devices": 2,
    "window": 2,
    "microbatch_size": 4,
    "partition": [2, 2],
    "global_batch": 8,
    "lr": 6.0e-4,
    "lr_scale": 1.0,
    "backward_weights": "forward",
    "optimizer": {
        "name": "adamw",
        "lr": 6.0e-4,
        "betas": [0.9, 0.95],
        "eps": 1.0e-8,
        "weight_decay": 0.1,
        "grad_clip": None,
    },
}


def _best_file(tmp_path: Path, **changes: Any) -> Path:
    doc = {
        "recommended": dict(RECOMMENDED_FOR_RUN),
        "evidence": dict.fromkeys(bestfile.EVIDENCE_KEYS),
        "target": {"metric": "val_loss", "value": 3.0},
        "budget": {"clock": "sim", "seconds": 5, "grid": 4},
        "run": copy.deepcopy(RUN),
    }
    for section, values in changes.items():
        doc[section].update(values)
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _other(value: Any) -> Any:
    """A value of the same kind that differs (a schedule, an integer, a number, a cut of the same units)."""
    if isinstance(value, str):
        return "1f1b" if value != "1f1b" else "paci"
    if isinstance(value, list):
        return [*value[:-2], value[-2] + 1, value[-1] - 1]
    if isinstance(value, dict):
        return {**value, "name": "sgd"}
    return value * 2 if isinstance(value, float) else value + 1


def test_best_yaml_keys_are_the_readers() -> None:
    assert set(_rows(BEST, "top level")) == set(bestfile.TOP)
    assert tuple(_rows(BEST, "recommended")) == RECOMMENDED
    assert tuple(_rows(BEST, "evidence")) == bestfile.EVIDENCE_KEYS


def test_recommended_keys_apply_compares_with_run(tmp_path: Path) -> None:
    assert tuple(RECOMMENDED_FOR_RUN) == RECOMMENDED, "the test's recommendation needs the new key"
    bestfile.read_best(_best_file(tmp_path))
    for key, row in _rows(BEST, "recommended").items():
        changed = _best_file(tmp_path, recommended={key: _other(RECOMMENDED_FOR_RUN[key])})
        if row["apply"].startswith("must equal"):
            assert _refused(bestfile.read_best, changed).key == f"best.yaml.recommended.{key}"
        else:
            bestfile.read_best(changed)  # not compared with the run


def test_evidence_keys_apply_checks_and_reads(tmp_path: Path) -> None:
    rows = _rows(BEST, "evidence")
    for key, row in rows.items():
        bad = _best_file(tmp_path, evidence={key: {"not": "a figure"}})
        if row["apply"].startswith("checked"):
            assert _refused(bestfile.read_best, bad).key == f"best.yaml.evidence.{key}"
        else:
            assert row["apply"] == "not read", f"evidence.{key}"
            bestfile.read_best(bad)
    assert {k for k, r in rows.items() if "read" in r["apply"] and r["apply"] != "not read"} == {"steps"}
    for steps in (7, 9):
        assert apply_run(_best_file(tmp_path, evidence={"steps": steps}), {}).training.checkpoint_every == steps


# ----------------------------------------------------------------------------- profile.yaml

COST = {
    "forward_s": 0.001,
    "backward_s": 0.002,
    "activation_bytes": 64,
    "saved_bytes": 128,
    "backward_input_s": 0.0012,
    "backward_weight_s": 0.001,
    "transient_bytes": 256,
    "eval_bytes": 96,
    "split_bytes": 32,
}
LINK = {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e9, "backend": "hand"}
UNIT = {
    "name": "embed",
    "param_bytes": 1024,
    "trainable_bytes": 512,
    "optimizer_s": 0.0001,
    "copy_s": 0.00001,
    "microbatch": {4: COST},
    "optimizer_steps": {"muon": 0.0003},
    "step_bytes": 1024,
}
PROFILE_BASE = {
    "format": "paci-tune-profile/1",
    "machine": {"node": "h"},
    "device": "cpu",
    "torch": "2.0",
    "dtype": "bf16",
    "date": "2026-01-01",
    "threads": 2,
    "seq_len": 16,
    "units": [UNIT],
    "p2p": LINK,
    "allreduce": LINK,
    "tied": [],
    "optimizer": "adamw",
    "optimizer_note": "timed alone",
}
PROFILE_TABLES: dict[str, tuple[type, ...]] = {
    "top level": (prof.Profile,),
    "units[i]": (prof.UnitProfile,),
    "units[i].microbatch[b]": (prof.UnitCost,),
    "p2p": (prof.P2PCost,),
    "allreduce": (prof.AllReduceCost,),
}
RENAMED = {"torch_version": "torch", "allreduce_cost": "allreduce", "costs": "microbatch"}
"""Dataclass fields that a profile's YAML spells otherwise (``Profile.to_dict`` / ``from_dict``)."""


def _load_profile(doc: Any) -> dict[str, Any]:
    return prof.Profile.from_dict(doc).to_dict()


def _placed(table: str, value: dict[str, Any]) -> dict[str, Any]:
    """A whole profile with ``value`` as the mapping ``table`` describes."""
    doc = copy.deepcopy(PROFILE_BASE)
    if table == "top level":
        return value
    if table == "units[i]":
        doc["units"] = [value]
    elif table == "units[i].microbatch[b]":
        doc["units"] = [{**UNIT, "microbatch": {4: value}}]
    else:
        doc[table] = value
    return doc


@pytest.mark.parametrize("table", list(PROFILE_TABLES))
def test_profile_keys_and_defaults_are_the_parsers(table: str) -> None:
    rows = _rows(PROFILE, table)
    base = {"top level": PROFILE_BASE, "units[i]": UNIT, "units[i].microbatch[b]": COST}.get(table, LINK)
    e = _refused(_load_profile, _placed(table, {**base, "no_such_key": 1}))
    assert set(rows) == _known_keys(e), f"profile {table}: documented keys vs what the parser accepts"
    _check_absent_means_default(rows, base, lambda v: _load_profile(_placed(table, v)), f"profile {table}")


@pytest.mark.parametrize("table", list(PROFILE_TABLES))
def test_profile_dataclass_fields_are_documented_with_their_defaults(table: str) -> None:
    rows = _rows(PROFILE, table)
    for cls in PROFILE_TABLES[table]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = RENAMED.get(f.name, f.name)
            assert key in rows, f"profile {table}: {cls.__name__}.{f.name} is not documented"
            documented_type = set(rows[key]["type"].split(" or "))
            assert documented_type == _type_names(hints[f.name]), f"{cls.__name__}.{f.name}: {rows[key]['type']!r}"
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                continue  # no default in the dataclass: the parser's behaviour decides (the test above)
            documented = _default(rows[key]["default"])
            assert _same(documented, default), f"{cls.__name__}.{f.name}: documented {documented!r}, code {default!r}"
