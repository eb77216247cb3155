"""The transfer bookkeeping: every KV transfer's state machine and deadlines (:mod:`.ledger`)
and the ``omni_kv_config`` that says when a request's KV is sent and how long it may take
(:mod:`.config`). Imports no vLLM, so it is small, fast and testable alone."""
