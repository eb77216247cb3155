"""omni_runtime: the stage runtime of omni-pipeline (scheduler, transfer ledger, metrics,
tracing, KV extraction worker and connector). Nothing here imports the operator."""

__version__ = "0.1.0"
