"""The verdict: a finished search's studies turned into ``best.yaml`` -- one comparison of PACI's best
pipelined point with the strongest synchronous point (the statistics live in the tune layer's
:mod:`paci_tune.tune.comparison`, which the confirmation's rounds read too), the recommendation that
follows it, the transfer check's rank correlation, the picture.

It reads the search's trials through the tune layer's record (:mod:`paci_tune.tune.record`) and writes
``best.yaml`` through its schema (:mod:`paci_tune.tune.bestfile`); the search loop, which plans and queues
the confirmation and transfer runs (:mod:`paci_tune.tune.extra`), knows nothing of this layer. May import:
optuna, numpy, scipy and torch (their versions), matplotlib, :mod:`paci_tune.tune`, :mod:`paci_tune.config`,
:mod:`paci_tune.schedule`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""
