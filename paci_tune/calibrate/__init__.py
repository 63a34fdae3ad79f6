"""Measuring a cost profile (:mod:`paci_tune.sim.profile`) of a config's model on this machine.

A profile exists to predict a *pipeline*, so compute is timed under the conditions a pipeline
stage runs in rather than one unit at a time in a tight loop on an idle machine. Timed that way,
the simulator came out 16-22% fast against the distributed runtime at P=2 on a 2-core CPU, for
two reasons of about equal weight: (1) *composition* -- in a stage the units run chained, with
several micro-batches in flight, so a unit finds its input, its saved activations and its weights
out of cache, where a unit timed alone on the same input finds them hot; (2) *concurrency* --
every core runs a stage process at once, sharing caches and memory bandwidth, where calibration
ran alone. What is measured, and how:

- **Compute, in a stage pattern.** The whole model runs as one stage runs its units: chained in
  order (one forward through all of them, one backward call over the chain), 1F1B with
  ``inflight`` micro-batches in flight (2 for a pipeline of 2+ stages, as the first stage's
  steady state has; 1 for a single stage), every micro-batch with its own data, the last unit's
  forward including the cross-entropy loss scaled by 1/window as the real last stage computes
  it, and an optimizer step after every ``window`` backwards. Per-unit times -- the partitioner
  needs them, not just a total -- come from timestamps between the units' forwards, and in the
  backward from hooks on the tensors at the unit boundaries: the gradient of unit ``i``'s output
  is complete exactly when unit ``i+1``'s backward is done. Attributing the chain's own time this
  way keeps the per-unit costs summing to what a stage of those units takes, with no fudge
  factor, and works for any partition the partitioner may pick.
- **The backward's two halves** (``backward_input_s``, ``backward_weight_s``), in the same pattern:
  what a zero-bubble schedule runs apart -- ``B``, the input gradient (``torch.autograd.grad`` with
  respect to the unit's input only, keeping the graph), and ``W``, the weight gradient (then with
  respect to the unit's trainable parameters, from the gradients ``B`` left at the layers that use
  them), as torch.distributed.pipelining splits a stage's backward (:mod:`.split`). Micro-batches
  with whole and with split backwards alternate, so both are timed on the same machine state;
  ``backward_s`` stays the whole backward, what the other schedules run. ``B + W`` exceeds it by
  what splitting costs (a walk of the unit's autograd graph, a second autograd pass per parameter
  group): 1.1-1.35x per block of the tiny GPT on a 2-core CPU, more for units of a few hundred
  microseconds, where the fixed cost dominates. A half with nothing to run is 0: ``W`` of a
  frozen or parameter-free unit, ``B`` of the first unit whose input needs no gradient.
- **Optimizer step**, in the same pattern: the config's optimizer built as a stage builds it
  (weight-decay groups, stepping through parameter *aliases* so in-flight micro-batches keep
  working), one per unit, stepped in unit order with timestamps between, on the real gradients
  of the window -- whose optimizer state and gradients are then as cold as in the pipeline (an
  AdamW step over a stage took 3.1 ms in the pipeline against 0.76 ms per block timed alone).
  The step is the stage's own (:class:`~paci_tune.pipeline.optim.AliasedOptimizer`), clipping
  included when the config clips.
- **Weight copy** (``copy_s``): one clone of each unit's parameter storages in the compute dtype,
  what a PACI stage with ``pipeline.backward_weights: forward`` does at a step that keeps a weight
  version (:mod:`paci_tune.pipeline.versions`); timed alone in this process with the stage's
  threads (median of the repeats), so hot-cached and a little optimistic.
- **Concurrency (CPU).** The measurement runs in ``processes = min(stages, cpu_count // threads)``
  processes at once (the stage processes the distributed runtime would run here at once), each
  with ``threads`` threads and the environment the distributed launcher gives its workers. They
  start the timed phase together at a barrier and keep running the pattern, untimed, until the
  last of them is done, so no timed pass runs on a quieter machine than a stage does. The
  samples of all processes are pooled. The processes are plain ``python -c`` children talking
  over pipes: each step has a timeout, and every child is killed on any exit path (and dies
  with this process, via the parent-death signal, if it is killed). On CUDA the stages run on
  different devices, so there is no contention to reproduce: one in-process measurement.
- **Repeats**: per micro-batch size, ``warmup`` untimed global batches (allocator growth, lazy
  initialisation, optimizer state), then ``repeats`` timed ones (``repeats * window`` samples of
  each forward and backward); a cost is the median of its samples, not the mean, so that a
  one-off stall of the machine while calibrating does not stay in a profile used long after.
- **Identical units pool their samples** into one cost. Units with the same class, structure and
  input shape (the blocks of a GPT) cost the same; separate costs would only differ by noise,
  which the partitioner would then "balance" as if it were real.
- **Bytes** per unit and micro-batch size: the output activation's bytes, and the bytes autograd
  saves for the backward, from :func:`torch.autograd.graph.saved_tensors_hooks`, summing distinct
  storages and counting parameter storages as zero (saving a weight keeps no copy alive).
  Parameter bytes per unit (4 per parameter in either precision: :mod:`paci_tune.sim.profile`).
- **Precision**: ``bf16`` measures the stage's own scheme -- bf16 parameters, activations and
  saved tensors, fp32 masters stepped by the stage's optimizer and written back in place -- never
  autocast, whose weight casts would be timed and counted as saved bytes per micro-batch.
- **Threads**: on a CPU a stage shares the machine with the other stages, so it is timed with
  the threads one stage process gets (``cpu_count // stages``, at least 1).
- **Point to point** (:mod:`.p2p`): two gloo processes on loopback ping-pong
  tensors of a few sizes; the
  fastest one-way time of each size is fitted to ``latency + bytes / bandwidth``. This is the
  transport the distributed runtime uses on a CPU; for a real interconnect, measure there or
  edit ``p2p`` by hand.
- **Gradient all-reduce** (:mod:`.allreduce`): two gloo processes on loopback all-reduce tensors
  of a few sizes; the fastest time of each is fitted to the ring model (one step: ``latency +
  bytes / bandwidth``), what a stage's data-parallel group pays at each optimizer step. Written by
  hand for NVLink or InfiniBand. A calibration measures both links from one pair of processes
  (:mod:`.links`): their start-up, not the transfers, is most of the time.

Not modelled, so simulated step times still run 5-10% under measured ones on a 2-core CPU:

- the pipeline's own jitter. A stage idles whenever a neighbour's pass runs long, and 1F1B with
  ``P - s`` in flight has no slack to absorb that: about 7% of the step, which a deterministic
  simulator cannot predict;
- the transport's CPU: gloo's threads take ~3% of a core per stage, stolen from compute when
  every core computes (the ``p2p`` cost is a delay on the link, measured on idle cores);
- the runtime's start-up: the first micro-batches of a run (fresh memory for the micro-batches
  in flight, the optimizer's first state) take several times longer, a one-off ~0.1 s;
- position: a per-unit profile cannot tell stages apart, and the last stage, with one
  micro-batch in flight, runs its units a few percent faster than the pattern's two.

Modules: :mod:`.pattern` (the stage pattern), :mod:`.split` (a backward in two halves),
:mod:`.corun` (co-running processes), :mod:`.units`
(one unit alone: bytes, and the isolated timing kept for quick checks and as the fallback when the
whole model with its micro-batches in flight does not fit on a GPU), :mod:`.p2p` (transfers),
:mod:`.allreduce` (the data-parallel gradient all-reduce), :mod:`.links` (both in one launch),
:mod:`.measure` (a whole config) and :mod:`.cache` (measure once, read back). The package stands
above :mod:`paci_tune.pipeline`, whose stage step it reuses. May import:
:mod:`paci_tune.pipeline`, :mod:`paci_tune.sim`, :mod:`paci_tune.model`, :mod:`paci_tune.data`,
:mod:`paci_tune.schedule` (:mod:`.predict`), :mod:`paci_tune.config`, :mod:`paci_tune.base`,
:mod:`paci_tune.errors`, torch.
"""

from .allreduce import fit_allreduce, measure_allreduce
from .cache import cache_dir, cache_key, measured_profile
from .corun import co_run_pattern
from .links import measure_links
from .measure import (
    calibrate,
    default_inflight,
    default_processes,
    default_threads,
    parse_sizes,
    resolve_target,
    with_optimizers,
)
from .p2p import fit_p2p, measure_p2p
from .pattern import PatternSamples, StagePattern
from .units import measure_copy, measure_optimizer, measure_unit, measure_units

__all__ = [
    "PatternSamples",
    "StagePattern",
    "cache_dir",
    "cache_key",
    "calibrate",
    "co_run_pattern",
    "default_inflight",
    "default_processes",
    "default_threads",
    "fit_allreduce",
    "fit_p2p",
    "measure_allreduce",
    "measure_copy",
    "measure_links",
    "measure_optimizer",
    "measure_p2p",
    "measure_unit",
    "measure_units",
    "measured_profile",
    "parse_sizes",
    "resolve_target",
    "with_optimizers",
]
