"""How vLLM loads the omni KV connector (``--kv-transfer-config``), without importing vLLM:
``omni-stage``'s supervisor and the operator build the flag from this."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONNECTOR_NAME = "OmniKVConnector"
CONNECTOR_MODULE = "omni_runtime.kv.connector"


def kv_transfer_config(endpoints: Mapping[str, str], pipeline: str = "",
                       io_cpus: str | list[int] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` mapping that loads the omni KV connector, shipping to
    ``endpoints`` ({downstream stage: ZeroMQ address}); ``io_cpus``: the transport threads'
    CPUs (omni_runtime/kv/cpu_affinity.py; absent: "auto")."""
    extra: dict[str, Any] = {"endpoints": dict(endpoints), "pipeline": pipeline}
    if io_cpus is not None:
        extra["io_cpus"] = io_cpus
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
