"""A user's ``kv-transfer-config`` composed with the omni KV connector (vLLM's
``MultiConnector``), and which such configs can be composed.

The stage builds the composition (``omni-stage``, when its ``kvTransfer.send`` is true); the
operator and ``omni-pipeline validate`` check with :func:`user_connectors` that it can be
built, so a pipeline they accept never stops its AR stage at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The omni KV connector's class name, as vLLM's ``kv_connector`` names it.
CONNECTOR_NAME = "OmniKVConnector"
MULTI_CONNECTOR = "MultiConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")


class ConnectorConfigError(ValueError):
    """A user's ``kv_transfer_config`` that cannot be composed with the omni connector."""


def role_problem(connector: Mapping[str, Any]) -> str | None:
    """What is wrong with a connector config's kv_role (vLLM's KVTransferConfig takes one of
    :data:`ROLES`); None when nothing is."""
    if connector.get("kv_role") in ROLES:
        return None
    given = f"has kv_role {connector['kv_role']!r}, not" if "kv_role" in connector else "needs a kv_role,"
    return f"{given} one of {', '.join(ROLES)}"


def user_connectors(other: Any) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The parts of a user's connector config the composition is made of: (the top-level
    keys kept, the MultiConnector's extra config, the user's connectors); ConnectorConfigError
    naming what cannot be composed."""
    if not isinstance(other, Mapping):
        raise ConnectorConfigError(
            f"kv_transfer_config must be a mapping, got {type(other).__name__}")
    other = dict(other)
    if other.get("kv_connector") == MULTI_CONNECTOR:
        extra = other.get("kv_connector_extra_config")
        extra = dict(extra) if isinstance(extra, Mapping) else {}
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
        role = role_problem(child)
        if role is not None:
            raise ConnectorConfigError(f"connector {i} ({child['kv_connector']}) of kv_transfer_config {role}")
        resolved.append(child)
    return top, extra, resolved


def composed_kv_transfer_config(omni: Mapping[str, Any], other: Mapping[str, Any]
                                ) -> dict[str, Any]:
    """vLLM's ``MultiConnector`` over ``other`` (a user's connector, or a MultiConnector's
    children) and the omni connector ``omni`` (last: loads come from the first child that has
    tokens to load, and ours loads nothing). Children keep their own roles; the composition
    is a ``kv_producer`` only when every child is one, else ``kv_both``.

    The omni scheduler finds its connector among the MultiConnector's children, and keeps a
    finished request's blocks for its transfer by pinning them rather than through vLLM's
    delayed free, which the other children may use (docs/connector.md)."""
    top, extra, resolved = user_connectors(other)
    producer_only = all(c["kv_role"] == "kv_producer" for c in resolved)
    extra["connectors"] = [*resolved, dict(omni)]
    return {**top, "kv_connector": MULTI_CONNECTOR,
            "kv_role": "kv_producer" if producer_only else "kv_both",
            "kv_connector_extra_config": extra}
