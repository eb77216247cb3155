"""Prometheus metrics and OpenTelemetry spans of KV transfers: the ledger's observers
(:mod:`.metrics`, :mod:`.tracing`, built by :mod:`.observers`), the receiving stage's metrics
(:mod:`.receiver_metrics`) and the multiprocess set-up that shows them on /metrics
(:mod:`.multiproc`). Importing this package imports no metrics or tracing library."""
