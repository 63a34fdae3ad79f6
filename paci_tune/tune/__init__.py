"""The tuner: search spaces, the Optuna study, trial runners, the objective and ``best.yaml``."""
