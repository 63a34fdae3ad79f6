"""paci-tune: auto-tune and run PACI asynchronous pipeline-parallel training."""

__version__ = "0.1.0"
