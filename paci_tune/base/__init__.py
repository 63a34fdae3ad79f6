"""Ground floor: file and process helpers every layer may use.

Nothing here knows about pipelines, models or tuning, and nothing here imports torch, so the
light layers (schedules, the simulator, the config) can stand on it. May import: the standard
library, PyYAML and :mod:`paci_tune.errors` only.
"""
