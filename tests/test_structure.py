"""The package's shape, read from its own source: layers, cycles, module sizes, one copy of each mechanism.

Oracle: the code's import statements (function-level ones included), parsed with ``ast`` -- not
what any module says about itself. The layer table below is the design; a change that needs to
break it should change the table here, in review, not slip past it.

What a module says about itself is checked against the same oracle. Every module but the package
root and ``__main__.py`` files has a ``May import:`` sentence in its docstring (from those words
to the first full stop that ends a sentence). Its ``:mod:`` references to ``paci_tune.<node>...``
name nodes, and the set they name, less the module's own node, must be *exactly* the set of other
nodes the module imports: a stale or a missing name fails, so the line cannot rot. A package's
``__init__.py`` speaks for the whole package: its set is every other node any of the package's
modules imports. Relative references (``:mod:`.stage```), prose and third-party names (torch,
click, ...) are documentation and are not checked.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "paci_tune"

# Bottom to top. A node (subpackage or top-level module) may import its own layer's node and any
# node of a lower layer; nodes sharing a layer are independent of each other, except as listed.
LAYERS: list[set[str]] = [
    {"errors"},
    {"base"},
    {"schedule"},  # the schedule registry: what config validation, the spaces and every layer above read
    {"config"},
    {"model", "data"},
    {"sim"},
    {"pipeline"},
    {"calibrate"},
    {"train"},
    {"tune"},
    {"verdict"},  # best.yaml from a search's studies; above the search loop (which it reads), below the report
    {"report"},
    {"cli", "worker", "pipelining", "__main__"},  # entry points
]
SAME_LAYER = {("worker", "cli"), ("__main__", "cli")}  # the worker takes `paci-tune train`'s options
TORCH_FREE = ("base", "config", "schedule", "sim", "errors")
MAX_LINES = 450


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> set[str]:
    """Dotted names of every module imported anywhere in ``path`` (relative imports resolved)."""
    parts = _module_parts(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                if node.module:
                    out.add(".".join([*base, node.module]))
                else:
                    out.update(".".join([*base, a.name]) for a in node.names)
            elif node.module:
                out.add(node.module)
    return out


def _node(dotted: str) -> str | None:
    """The subpackage or top-level module ``dotted`` belongs to; None outside the package.

    The root's own attributes are not a node: only ``__version__`` may be taken from it (the root
    imports nothing when it loads; its public names load lazily).
    """
    parts = dotted.split(".")
    if parts[0] != "paci_tune" or len(parts) < 2:
        return None
    if not (PKG / parts[1]).is_dir() and not (PKG / f"{parts[1]}.py").is_file():
        assert dotted == "paci_tune.__version__", f"{dotted}: only __version__ may be imported from the root"
        return None
    return parts[1]


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        parts = _module_parts(f)
        if len(parts) < 2:
            continue  # the package root: exports only (checked below)
        src = parts[1]
        for target in _imports(f):
            dst = _node(target)
            if dst is not None and dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


MAY_IMPORT = re.compile(r"may import:\s(.*?)(?:\.(?:\s|$)|$)", re.IGNORECASE)


def _may_import(doc: str) -> set[str] | None:
    """The nodes a docstring's ``May import:`` sentence names (None: it has none)."""
    m = MAY_IMPORT.search(" ".join(doc.split()))
    return None if m is None else set(re.findall(r":mod:`~?paci_tune\.(\w+)", m.group(1)))


def _layer_of(node: str) -> int:
    for i, layer in enumerate(LAYERS):
        if node in layer:
            return i
    raise AssertionError(f"{node} is in no layer of the table: add it")


def test_every_node_is_in_the_layer_table() -> None:
    nodes = {p.stem if p.is_file() else p.name for p in PKG.iterdir() if p.suffix == ".py" or p.is_dir()}
    nodes -= {"__pycache__"}
    nodes.discard("__init__")
    for node in nodes:
        _layer_of(node)
    assert all((PKG / d / "__init__.py").exists() for d in nodes if (PKG / d).is_dir()), "a folder without __init__.py"


def test_no_layer_imports_a_layer_above_it_or_a_peer() -> None:
    bad = []
    for src, dsts in _graph().items():
        for dst in dsts:
            ls, ld = _layer_of(src), _layer_of(dst)
            if ld > ls or (ld == ls and (src, dst) not in SAME_LAYER):
                bad.append(f"{src} (layer {ls}) imports {dst} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle() -> None:
    edges = _graph()
    state: dict[str, int] = {}

    def visit(v: str, path: list[str]) -> None:
        state[v] = 1
        for w in edges.get(v, ()):
            assert state.get(w) != 1, f"import cycle: {' -> '.join([*path, v, w])}"
            if w not in state:
                visit(w, [*path, v])
        state[v] = 2

    for v in list(edges):
        if v not in state:
            visit(v, [])


def test_no_module_is_too_long_and_each_says_its_job_and_what_it_may_import() -> None:
    for f in PKG.rglob("*.py"):
        text = f.read_text()
        assert len(text.splitlines()) <= MAX_LINES, f"{f.relative_to(PKG)}: over {MAX_LINES} lines"
        doc = ast.get_docstring(ast.parse(text))
        assert doc, f"{f.relative_to(PKG)} has no module docstring"
        if f.name not in ("__main__.py",) and f != PKG / "__init__.py":
            assert _may_import(doc) is not None, f"{f.relative_to(PKG)}: the docstring has no 'May import:' sentence"


def test_each_may_import_line_names_exactly_the_nodes_imported() -> None:
    """The semantics are the module docstring's: exact sets, a package's ``__init__`` for the package."""
    edges = _graph()
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        parts = _module_parts(f)
        if len(parts) < 2 or f.name == "__main__.py":
            continue
        own = parts[1]
        said = _may_import(ast.get_docstring(ast.parse(f.read_text())) or "")
        if said is None:
            continue  # the test above says so
        if f.name == "__init__.py" and (PKG / own).is_dir() and len(parts) == 2:
            done = edges.get(own, set())
        else:
            done = {n for n in map(_node, _imports(f)) if n is not None and n != own}
        said.discard(own)
        if said != done:
            bad.append(
                f"{f.relative_to(PKG)}: names but does not import {sorted(said - done)}, "
                f"imports but does not name {sorted(done - said)}"
            )
    assert not bad, "'May import:' lines vs the imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("needle", "home"),
    [
        ("alias.grad = p.grad", "pipeline/optim.py"),  # the aliased optimizer step
        ("cross_entropy", "model/loss.py"),  # the last stage's loss
        ("start_new_session", "base/processes.py"),  # the process-group harness
        ("killpg", "base/processes.py"),
        ("PR_SET_PDEATHSIG", "base/processes.py"),
        ("GLIBC_TUNABLES", "base/processes.py"),  # a compute child's environment
        ("os.replace", "base/files.py"),  # atomic writes
        ("yaml.safe_load", "base/files.py"),  # reading YAML
    ],
)
def test_one_copy_of_each_mechanism(needle: str, home: str) -> None:
    where = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if needle in f.read_text())
    assert where == [home], f"{needle!r} appears in {where}, expected only {home}"


def test_only_the_trial_record_touches_optuna_user_attributes() -> None:
    """What a search stores has one schema (``tune/record.py``): no other module reads or writes user attributes."""
    home = PKG / "tune" / "record.py"
    where = sorted(
        f"{f.relative_to(PKG)}:{i}"
        for f in PKG.rglob("*.py")
        if f != home
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if "user_attr" in line
    )
    assert not where, f"Optuna user attributes touched outside tune/record.py: {', '.join(where)}"
    assert "set_user_attr" in home.read_text() and "user_attrs" in home.read_text()


@pytest.mark.slow
def test_torch_free_layers_import_without_torch() -> None:
    """The schedule layer, the simulator, the config and the ground floor never load torch."""
    mods = ", ".join(f"paci_tune.{m}" for m in TORCH_FREE)
    code = (
        f"import sys, {mods}\n"
        "import paci_tune.sim.profile, paci_tune.sim.simulator, paci_tune.sim.partitioner, paci_tune.base.processes\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_public_api() -> None:
    """The package root exports its public API lazily, and ``python -m paci_tune`` is the CLI."""
    import paci_tune

    assert "SchedulePACI" in paci_tune.__all__
    from paci_tune import SchedulePACI
    from paci_tune.pipelining import SchedulePACI as direct

    assert SchedulePACI is direct
    for name in paci_tune.__all__:
        assert getattr(paci_tune, name) is not None, name
    with pytest.raises(AttributeError):
        paci_tune.no_such_name  # noqa: B018
    proc = subprocess.run([sys.executable, "-m", "paci_tune", "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "search" in proc.stdout and "apply" in proc.stdout


def test_a_run_config_is_frozen_and_valid_once_built() -> None:
    """Derived, never mutated: changing a checked config raises, and deriving one checks it again."""
    import dataclasses

    from paci_tune.config import derive_run
    from paci_tune.errors import ConfigError

    doc = {"training": {"global_batch": 8, "steps": 2}, "pipeline": {"microbatch_size": 2}}
    cfg = derive_run(doc)
    assert (cfg.pipeline.window, cfg.pipeline.microbatch_size) == (4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pipeline.window = 8  # type: ignore[misc]
    assert derive_run(doc, {"pipeline.window": 2}).pipeline.microbatch_size == 4  # the pair is re-derived
    assert derive_run(doc, {"training.seconds": 5.0}).training.steps is None  # one budget replaces the other
    with pytest.raises(ConfigError, match=r"pipeline\.microbatch_size"):
        dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, window=2))  # 2 * 2 != 8


REGISTRY_MODULE = PKG / "schedule" / "registry.py"


def _schedule_name_tests(path: Path, names: set[str]) -> list[str]:
    """Where ``path`` tests a value against a schedule's name, or lists two or more schedule names:
    ``x == "paci"``, ``s in ("zb-h1", "interleaved")``, ``{"1f1b": ..., "zb-h1": ...}``."""

    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def names_in(node: ast.AST) -> int:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return sum(is_name(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return sum(k is not None and is_name(k) for k in node.keys)
        return 0

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_name(x) or names_in(x) for x in operands):
                out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: compares with a schedule's name")
        elif isinstance(node, ast.match_case) and any(is_name(x) for x in ast.walk(node.pattern)):
            out.append(f"{path.relative_to(PKG.parent)}:{node.pattern.lineno}: matches a schedule's name")
        elif names_in(node) >= 2:
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: lists schedules by name")
    return out


def test_no_schedule_name_is_compared_outside_the_registry() -> None:
    """What a schedule is lives in one value per schedule (``paci_tune/schedule/registry.py``); every other
    module reads that value's attributes, so a new schedule is taught to the registry alone."""
    from paci_tune.schedule import NAMES

    found = [
        f
        for path in sorted(PKG.rglob("*.py"))
        if path != REGISTRY_MODULE
        for f in _schedule_name_tests(path, set(NAMES))
    ]
    assert not found, "\n".join(found)


def test_the_name_test_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The oracle above can fail: each form it forbids, written in a module of the package's shape."""
    bad = PKG / "_probe_names.py"
    try:
        bad.write_text('x = 1\nif x == "paci": pass\nif x in ("1f1b", "y"): pass\nT = {"zb-h1": 1, "gpipe": 2}\n')
        assert len(_schedule_name_tests(bad, {"paci", "1f1b", "zb-h1", "gpipe"})) == 3
    finally:
        bad.unlink()


def test_the_config_accepts_exactly_the_registry_schedules() -> None:
    import typing

    from paci_tune.config.schema import ScheduleName
    from paci_tune.schedule import NAMES

    assert typing.get_args(ScheduleName) == NAMES
