"""How vLLM loads the omni KV connector (``--kv-transfer-config``), without importing vLLM:
``omni-stage``'s supervisor builds the flag from this.

Which user ``kv_transfer_config`` can be composed with ours, and the composition itself
(``composed_kv_transfer_config``), are part of the stage contract (``omni_contract``), which
the operator checks a pipeline with too; they are re-exported here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_contract.kv_transfer import (
    CONNECTOR_NAME,
    MULTI_CONNECTOR,
    ConnectorConfigError,
    composed_kv_transfer_config,
)

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "MULTI_CONNECTOR", "ConnectorConfigError",
           "composed_kv_transfer_config", "kv_transfer_config"]

CONNECTOR_MODULE = "omni_runtime.kv.connector"


def kv_transfer_config(endpoints: Mapping[str, str], pipeline: str = "",
                       io_cpus: str | list[int] | None = None,
                       revision: str | None = None, *, loads: bool = False) -> dict[str, Any]:
    """The ``--kv-transfer-config`` mapping that loads the omni KV connector, shipping to
    ``endpoints`` ({downstream stage: ZeroMQ address}); ``io_cpus``: the transport threads'
    CPUs (omni_runtime/kv/cpu_affinity.py; absent: "auto"); ``revision``: the pipeline
    revision its hello names (protocol.Compat; receivers of another revision refuse it);
    ``loads``: it also loads the KV prefixes of the requests a downstream stage makes from
    its hand-offs (kv/load.py), recomputing what fails to load."""
    extra: dict[str, Any] = {"endpoints": dict(endpoints), "pipeline": pipeline}
    if io_cpus is not None:
        extra["io_cpus"] = io_cpus
    if revision:
        extra["revision"] = revision
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    if loads:
        extra["loads"] = True
        config["kv_role"] = "kv_both" if endpoints else "kv_consumer"
        config["kv_load_failure_policy"] = "recompute"
    return config
