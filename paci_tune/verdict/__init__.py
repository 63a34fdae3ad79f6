"""The verdict: a finished search's studies turned into ``best.yaml`` -- the confirmation's statistics, the
transfer check's rank correlation, the recommendation against the tuned flush baseline, the picture.

It reads the search's trials through the tune layer's record (:mod:`paci_tune.tune.record`) and writes
``best.yaml`` through its schema (:mod:`paci_tune.tune.bestfile`); the search loop, which plans and queues
the confirmation and transfer runs (:mod:`paci_tune.tune.extra`), knows nothing of this layer. May import:
optuna, numpy, torch (its version), matplotlib, :mod:`paci_tune.tune`, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""
