"""The pipeline runtimes: stages, the emulated and distributed runtimes, transports, planning a run.

Runtimes execute the per-stage action lists of :mod:`paci_tune.schedule`; the planning module
cuts and memory-checks a run with the simulator's models (:mod:`paci_tune.sim`). May import:
:mod:`paci_tune.schedule`, :mod:`paci_tune.sim`, :mod:`paci_tune.model`, :mod:`paci_tune.data`,
:mod:`paci_tune.config`, :mod:`paci_tune.errors`, torch.
"""
