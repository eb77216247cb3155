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


MULTI_CONNECTOR = "MultiConnector"
_ROLES = ("kv_producer", "kv_consumer", "kv_both")


class ConnectorConfigError(ValueError):
    """A user's ``kv_transfer_config`` that cannot be composed with the omni connector."""


def composed_kv_transfer_config(omni: Mapping[str, Any], other: Mapping[str, Any]
                                ) -> dict[str, Any]:
    """vLLM's ``MultiConnector`` over ``other`` (a user's connector, or a MultiConnector's
    children) and the omni connector ``omni`` (last: loads come from the first child that has
    tokens to load, and ours loads nothing). Children keep their own roles; the composition
    is a ``kv_producer`` only when every child is one, else ``kv_both``.

    The omni scheduler finds its connector among the MultiConnector's children, and keeps a
    finished request's blocks for its transfer by pinning them rather than through vLLM's
    delayed free, which the other children may use (docs/connector.md)."""
    if not isinstance(other, Mapping):
        raise ConnectorConfigError(
            f"kv_transfer_config must be a mapping, got {type(other).__name__}")
    other = dict(other)
    if other.get("kv_connector") == MULTI_CONNECTOR:
        extra = dict(other.get("kv_connector_extra_config") or {})
        children = extra.get("connectors")
        if not isinstance(children, list) or not children:
            raise ConnectorConfigError(
                "a MultiConnector's kv_connector_extra_config.connectors must be a non-empty "
                "list of connector configs")
        top = {k: v for k, v in other.items()
               if k not in ("kv_connector", "kv_role", "kv_connector_extra_config")}
    else:
        extra, children, top = {}, [other], {}
    resolved = []
    for i, child in enumerate(children):
        if not isinstance(child, Mapping) or not (
                isinstance(child.get("kv_connector"), str) and child["kv_connector"]):
            raise ConnectorConfigError(
                f"connector {i} of kv_transfer_config must be a mapping naming kv_connector")
        if child["kv_connector"] in (CONNECTOR_NAME, MULTI_CONNECTOR):
            raise ConnectorConfigError(
                f"kv_transfer_config names {child['kv_connector']}: the omni KV connector is "
                "added by the stage (from kvTransfer and the pipeline graph; its transport "
                "CPUs from kvTransfer.ioCpus); name only your own connector(s)")
        child = dict(child)
        if "engine_id" in child:
            # MultiConnector passes the engine id to every child itself (a child's own
            # engine_id would be given twice).
            engine_id = child.pop("engine_id")
            if top.setdefault("engine_id", engine_id) != engine_id:
                raise ConnectorConfigError("the composed connectors name different engine_ids")
        if child.get("kv_role") not in _ROLES:
            raise ConnectorConfigError(
                f"connector {i} ({child['kv_connector']}) of kv_transfer_config needs a "
                f"kv_role, one of {', '.join(_ROLES)}")
        resolved.append(child)
    producer_only = all(c["kv_role"] == "kv_producer" for c in resolved)
    extra["connectors"] = [*resolved, dict(omni)]
    return {**top, "kv_connector": MULTI_CONNECTOR,
            "kv_role": "kv_producer" if producer_only else "kv_both",
            "kv_connector_extra_config": extra}
