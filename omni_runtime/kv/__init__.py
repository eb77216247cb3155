"""The KV data path: how a handed-off transfer's blocks become bytes at the next stage.

* :mod:`.layout`: the engine's paged KV cache, as block layout and gather;
* :mod:`.connector`: the vLLM-facing KV connector (``KVConnectorBase_V1``), loaded with
  ``--kv-transfer-config`` (:mod:`.connector_config` builds it without importing vLLM);
* :mod:`.transport`: the network transport (ZeroMQ sender, receiver, inbox, wire format),
  which imports nothing else of omni_runtime.

Importing this package imports neither vLLM nor torch: a receiving stage imports the
transport alone.
"""
