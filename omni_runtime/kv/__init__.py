"""The KV data path: how a handed-off transfer's blocks become bytes at the next stage.

* :mod:`.layout`: the engine's paged KV cache, as block layout and gather;
* :mod:`.worker`: the KV extraction worker (``--worker-cls omni_runtime.kv.worker.OmniCPUWorker``);
  the vLLM-facing KV connector (``KVConnectorBase_V1``) takes its place here;
* :mod:`.transport`: the network transport (ZeroMQ sender, receiver, inbox, wire format),
  which imports nothing else of omni_runtime.

Importing this package imports neither vLLM nor torch: a receiving stage imports the
transport alone.
"""
