"""The KV data path: how a handed-off transfer's blocks become bytes at the next stage.

* :mod:`.layout`: the engine's paged KV cache, as block layout and gather;
* :mod:`.connector`: the vLLM-facing KV connector (``KVConnectorBase_V1``), loaded with
  ``--kv-transfer-config`` (:mod:`.connector_config` builds it without importing vLLM);
* :mod:`.transport`: the transport: NIXL reads of the AR's registered KV cache, their
  control messages (the sender, the receiver, the inbox, the protocol), which imports
  nothing else of omni_runtime;
* :mod:`.load`, :mod:`.scheduler_side`, :mod:`.worker_side`: a downstream stage's loading of
  an arriving KV prefix, and the connector's two halves.

Importing this package imports neither vLLM nor torch: a receiving stage imports the
transport alone.
"""
