"""The checks of a run's model and data that commands other than ``train`` need before they start.

``calibrate`` measures a model at micro-batch sizes of its own choosing, and a search validates
its trials before any runs: both must refuse, as a trial or ``train`` would (:func:`.factory.load_pieces`),
a depth beyond the model's units or a batch the data cannot supply, without building the model.
May import: :mod:`paci_tune.data`, :mod:`paci_tune.model`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.config`, :mod:`paci_tune.errors`, torch. Also the one place a run to be trained here checks
that its model's weights fit this machine (:func:`check_trainable_here`, used by :mod:`.factory`).

A user model (``model.entry``) is checked here on one sample before anything is built for a run
(:func:`check_units`): what a unit may take and return is the pipeline's contract, and a unit that
breaks it would otherwise fail mid-run with an internal error. The contract: unit 0 takes token ids
``(b, T)``; every unit takes the previous unit's output; every unit returns **one tensor** (a stage
cut may fall after any unit, and one tensor is what crosses it); the last returns logits
``(b, T, V)`` with ``V`` at least the data's vocabulary; the logits at a position depend on the
tokens up to it only (causal: probed, :mod:`.unit_probe`); at least one parameter trains. A unit
without parameters, or with frozen ones, is fine: it has nothing to train. A parameter shared by
units on different stages trains under the flush schedules (a copy per stage, gradients summed:
:mod:`.tied`) and is refused under PACI once the cut is known (:func:`check_shared_parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..config.schema import RunConfig
from ..data import TokenSource, load_source
from ..data.limits import check_fits_data
from ..errors import ConfigError
from ..model import LoadedModel, load_model
from ..model.loader import SOURCES, check_fits, model_ties
from ..schedule import OWN_PROGRAM, check_depth, schedule_of
from .tied import tied_across_stages
from .unit_probe import counted, eval_mode, first_leak

ENTRY = "model.entry"


def source_key(spec: Mapping[str, object]) -> str:
    """The key an error line about the model's units names: ``model.entry``, ``model.hf``, ``model.torchtitan``."""
    return "model." + next((k for k in SOURCES if k in spec), "entry")


def check_trainable_here(meta: LoadedModel) -> None:
    """A built-in GPT every stage of which is built on this machine must fit its memory (weights alone)."""
    if meta.gpt is not None:
        check_fits(meta.gpt, list(range(meta.n_units)))


def check_model_and_data(
    cfg: RunConfig,
    microbatch_sizes: Sequence[int] = (),
    key: str = "--microbatch-sizes",
    *,
    built_here: bool = True,
    checked: bool = False,
) -> tuple[TokenSource, LoadedModel]:
    """The data source and the model's shape (no units built), every size checked against them.

    ``built_here=False`` (``simulate``: a plan, possibly of hardware this machine is not) skips the
    check that the model's weights fit this machine. ``checked``: a worker of a run whose launcher
    ran these checks on the same resolved config (its cut pinned): a model built per rank (hf,
    torchtitan) is then not built whole here, so no rank ever holds the whole model.
    """
    source = load_source(cfg.data, cfg.model.get("vocab_size"))
    meta = load_model(cfg.model, source.vocab_size, cfg.training.seed, indices=[])
    per_rank = len(meta.units) < meta.n_units  # built per rank: holds no unit here
    if meta.gpt is None and not (checked and per_rank):
        whole = load_model(cfg.model, source.vocab_size, cfg.training.seed) if per_rank else meta
        key = source_key(cfg.model)
        check_units(whole, source.vocab_size, cfg.model[key.removeprefix("model.")], key)
        meta.flops = whole.flops  # counted on the sample: what the cut balances without a profile
        if whole.verify is not None:
            whole.verify()  # the source's own check (hf, torchtitan: the units chained equal the model)
    if built_here:
        check_trainable_here(meta)
    check_depth(cfg.pipeline.stages, meta.n_units)
    check_optimizer(cfg, meta)
    t = cfg.training
    check_fits_data(source, meta.block_size, t.global_batch, cfg.pipeline.microbatch_size, t.eval_sequences)
    for b in microbatch_sizes:
        try:
            check_fits_data(source, meta.block_size, 1, b, 1)
        except ConfigError as e:
            raise ConfigError(key, b, e.allowed) from None
    return source, meta


def check_optimizer(cfg: RunConfig, meta: LoadedModel) -> None:
    """Muon needs a matrix to step: a 2-D trainable parameter in a unit between the model's first and last.

    Refused rather than run as AdamW: a run that says ``muon`` and trains with AdamW alone would
    report the wrong optimizer's numbers under Muon's name.
    """
    if cfg.optimizer.name == "muon" and not any(meta.matrices[1:-1]):
        raise ConfigError(
            "optimizer.name",
            "muon",
            "an optimizer other than muon for this model: no unit between its "
            "first and last has a 2-D trainable parameter, and Muon steps only those (the first "
            "and last units' parameters go to AdamW)",
        )


def _described(out: object) -> str:
    """What a unit returned, for an error line: its type, and for a tuple or dict what is inside."""
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
    if isinstance(out, dict):
        return f"a dict with keys {list(out)[:6]}"
    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


def _first_line(exc: Exception) -> str:
    """An exception's message as one line (an error line is one line)."""
    return next(iter(str(exc).splitlines()), "")


def _wrap_hint(out: object) -> str:
    """How to make a unit that returned ``out`` return one tensor: a wrapper module's forward."""
    if isinstance(out, dict) and out:
        pick = f"[{next(iter(out))!r}]"
    elif isinstance(out, tuple | list):
        pick = "[0]"
    else:
        pick = ""
    return (
        f"wrap it in a module whose forward returns one tensor, the hidden state: "
        f"`def forward(self, h): return self.inner(h){pick}`"
    )


@torch.no_grad()
def check_units(meta: LoadedModel, vocab_size: int, entry: object, key: str = ENTRY) -> None:
    """Run a user model's units once, chained, on token ids ``(1, T)``; refuse any that break the contract.

    The contract is the module docstring's. Everything is refused as ``key`` (``model.entry``,
    ``model.hf``, ...) naming the unit, what it returned and what to do about it. Runs without
    autograd, so a model that only misbehaves in training (a test's crash on the k-th training
    forward) is not tripped here, and in eval mode (modes restored after). Then the causality probe
    (:mod:`.unit_probe`): a model whose logits see later tokens is refused. A model with no cost of
    its own (``meta.flops is None``) gets its units' forward FLOPs per token, counted on this
    sample: what the cut balances without a profile.
    """
    n, t = meta.n_units, meta.block_size
    if not any(meta.trainable):
        raise ConfigError(key, entry, "a model with a parameter to train (every parameter has requires_grad=False)")
    units = [meta.units[i] for i in range(n)]
    with eval_mode(units):
        flops = _run_chain(units, vocab_size, t, entry, key)
        _check_causal(units, vocab_size, t, entry, key)
    if meta.flops is None:
        meta.flops = [f / t for f in flops]


def _run_chain(units: Sequence[torch.nn.Module], vocab_size: int, t: int, entry: object, key: str) -> list[float]:
    """The contract's run on token ids of zeros; each unit's forward FLOPs on it."""
    n, flops = len(units), []
    h: object = torch.zeros((1, t), dtype=torch.long)
    for i in range(n):
        unit = units[i]
        name = type(unit).__name__
        try:
            h, f = counted(unit, h)
            flops.append(f)
        except Exception as exc:  # the user's model on a sample of its contract's input: say which unit
            why = f"unit {i} ({name}) raised {type(exc).__name__}: {_first_line(exc)}"
            raise ConfigError(
                key, entry, f"units that run on token ids of shape (1, {t}) and on each other's output: {why}"
            ) from None
        if not isinstance(h, torch.Tensor):
            raise ConfigError(
                key,
                entry,
                f"units that each return one tensor (a stage cut may fall after any "
                f"unit): unit {i} ({name}) returns {_described(h)}; {_wrap_hint(h)}",
            )
    assert isinstance(h, torch.Tensor)
    if not h.is_floating_point() or h.dim() != 3 or tuple(h.shape[:2]) != (1, t) or h.shape[-1] < vocab_size:
        raise ConfigError(
            key,
            entry,
            f"a last unit returning logits (b, T, V) with V >= the data's vocabulary "
            f"{vocab_size}: unit {n - 1} ({type(units[n - 1]).__name__}) returns {_described(h)} "
            f"for token ids of shape (1, {t})",
        )
    return flops


def _check_causal(units: Sequence[torch.nn.Module], vocab_size: int, t: int, entry: object, key: str) -> None:
    """Refuse a model whose outputs at earlier positions move when only the last token changes."""

    def refuse_error(i: int, exc: Exception) -> None:
        why = f"unit {i} ({type(units[i]).__name__}) raised {type(exc).__name__}: {_first_line(exc)}"
        raise ConfigError(
            key, entry, f"units that run on random token ids in [0, {vocab_size}) of shape (1, {t}): {why}"
        ) from None

    leak = first_leak(units, vocab_size, t, refuse_error)
    if leak is None:
        return
    name = type(units[leak.unit]).__name__
    raise ConfigError(
        key,
        entry,
        f"a causal model (position i's logits may depend on tokens 0..i only): unit {leak.unit} ({name})'s "
        f"output at position {leak.position} moved by {leak.change:.3g} (its largest magnitude {leak.scale:.3g}) "
        f"when only the last token, at position {t - 1}, changed, so the model sees the future; give its "
        "attention a causal mask (scaled_dot_product_attention(..., is_causal=True), or a lower-triangular "
        "mask; a transformers model: attn_implementation='sdpa', or an attention_mask that is causal)",
    )


def check_shared_parameters(meta: LoadedModel, sizes: Sequence[int], schedule: str, chunked: bool = False) -> None:
    """Refuse PACI for a cut that puts units sharing a trainable parameter (tied weights) on different stages.

    Under a flush schedule each holder keeps a copy and the holders sum its gradient before their
    common step (:mod:`.tied`): plain training's numbers. PACI's stages step at their own cadence,
    with no synchronisation: each copy would step on its own holder's gradient at its own time and
    the copies would diverge, and summing their gradients needs a synchronisation PACI does not
    have. So PACI refuses it up front, naming the parameter, the stages and what to do instead. A
    frozen shared parameter never changes, so its copies stay equal under every schedule.

    ``chunked``: a multi-chunk schedule run for real (interleaved 1F1B, ZB-V, DualPipeV), ``sizes`` its
    ``v * P`` pieces, several to a rank. The holders' sum is one all-reduce per rank, so a trainable
    parameter split across pieces is refused too (the emulated runtime, training 1F1B's numbers on
    one piece a stage, sums it). The schedules offered instead under PACI are the registry's
    synchronous ones paci-tune's own runtimes run.
    """
    if chunked:
        for t in tied_across_stages(meta, sizes):
            if t.trainable:
                raise ConfigError(
                    "pipeline.runtime",
                    "distributed",
                    f"emulated for schedule {schedule} with this cut {list(sizes)}: {t.label} are one trainable "
                    f"parameter held by pieces {', '.join(map(str, t.stages))}, and the distributed runtime sums "
                    "a tied parameter over one stage per rank; or a pipeline.partition keeping those units in one "
                    "piece, or untie the parameter",
                )
    if schedule_of(schedule).synchronous:
        return
    flush = " or ".join(n for n in OWN_PROGRAM if schedule_of(n).synchronous)
    for t in tied_across_stages(meta, sizes):
        if t.trainable:
            raise ConfigError(
                "pipeline.schedule",
                schedule,
                f"{flush} for this cut {list(sizes)}: {t.label} are one trainable parameter held by stages "
                f"{', '.join(map(str, t.stages))}; PACI's stages step at their own cadence with no synchronisation, "
                "so the stages' copies would diverge (summing their gradients needs the synchronised step of a "
                f"flush schedule); or model.untie: true for PACI ({_untie_cost(meta)}), or a "
                "pipeline.partition keeping those units on one stage",
            )


def _untie_cost(meta: LoadedModel) -> str:
    """What ``model.untie: true`` would add: a copy of every shared parameter for each holder after the first."""
    extra = sum(t.numel * (len(set(t.units)) - 1) for t in model_ties(meta))
    return f"a copy per unit: +{extra:,} parameters, a different model that every schedule trains"
