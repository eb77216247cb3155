"""omni_runtime: the stage runtime of omni-pipeline, one package per concern:

* :mod:`omni_runtime.transfers`: the transfer ledger and ``omni_kv_config`` (no vLLM);
* :mod:`omni_runtime.sched`: ``OmniARScheduler``, vLLM's v1 scheduler extended for omni;
* :mod:`omni_runtime.observability`: metrics and tracing of transfers;
* :mod:`omni_runtime.kv`: the KV data path (extraction, block layout, network transport);
* :mod:`omni_runtime.stages`: ``omni-stage``, the AR and receiving stage processes;
* :mod:`omni_runtime.devtools`: development helpers, never imported by the rest.

Nothing here imports the operator.
"""

__version__ = "0.1.0"
