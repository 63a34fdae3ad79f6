"""The tuner: search spaces, the Optuna study, trial runners, the objective and ``best.yaml``.

May import: optuna, :mod:`paci_tune.train`, :mod:`paci_tune.calibrate`, :mod:`paci_tune.pipeline`,
:mod:`paci_tune.sim`, :mod:`paci_tune.model`, :mod:`paci_tune.data`, :mod:`paci_tune.schedule`,
:mod:`paci_tune.config`, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""
