"""How vLLM loads the omni KV connector (``--kv-transfer-config``), without importing vLLM:
``omni-stage``'s supervisor builds the flag from this.

Which user ``kv_transfer_config`` can be composed with ours, and the composition itself
(``composed_kv_transfer_config``), are part of the stage contract (``omni_contract``), which
the operator checks a pipeline with too; they are re-exported here."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_contract.kv_transfer import (
    CONNECTOR_NAME,
    MULTI_CONNECTOR,
    ConnectorConfigError,
    composed_kv_transfer_config,
)

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "MULTI_CONNECTOR", "ConnectorConfigError",
           "ConnectorSettings", "composed_kv_transfer_config", "connector_settings",
           "kv_transfer_config"]

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


#: Where a connector setting is given, for the errors that name it.
EXTRA = "kv_transfer_config.kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` as the connector reads it, every key checked once, at
    the engine's start (a bad value named there, not a thread that dies at the first
    transfer): ``endpoints`` {downstream stage: ``tcp://host:port``}; ``to_stages`` the
    stages the metrics' ``to_stage`` label takes (default: the endpoints'); ``pipeline`` and
    ``revision`` what its hello names; ``io_cpus`` as given (kv/cpu_affinity.py reads it);
    ``loads``, ``host_huge_pages`` (kv/load.py, kv/huge_pages.py)."""

    endpoints: dict[str, str] = field(default_factory=dict)
    to_stages: tuple[str, ...] = ()
    pipeline: str = ""
    revision: str = ""
    io_cpus: Any = None
    loads: bool = False
    host_huge_pages: bool = True


_KEYS = ("endpoints", "to_stages", "pipeline", "revision", "io_cpus", "loads", "host_huge_pages")


def connector_settings(extra: Any, also: tuple[str, ...] | None = ()) -> ConnectorSettings:
    """The settings of a ``kv_connector_extra_config``; ConnectorConfigError naming the key,
    what was given and the fix. ``also``: the keys a subclass of the connector reads besides
    these (``OmniKVConnector.extra_config_keys``); None: other keys are not looked at (where
    the connector has refused them already)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConnectorConfigError(f"{EXTRA} must be a mapping, got {type(extra).__name__}")
    unknown = [] if also is None else [str(k) for k in extra if k not in _KEYS and k not in also]
    if unknown:
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, _KEYS, 1))
                 else repr(k) for k in unknown]
        raise ConnectorConfigError(f"{EXTRA} has unknown key(s) {', '.join(hints)}: the omni KV "
                                   f"connector reads {', '.join(_KEYS)}")
    endpoints = extra.get("endpoints") or {}
    if not isinstance(endpoints, Mapping):
        raise ConnectorConfigError(f"{EXTRA}.endpoints must be a mapping of downstream stage to "
                                   f"address ({{\"talker\": \"tcp://talker-kv:9600\"}}), got "
                                   f"{type(endpoints).__name__} {endpoints!r}")
    to_stages = extra.get("to_stages")
    if to_stages is None:
        to_stages = list(endpoints)
    elif not isinstance(to_stages, (list, tuple)) or not all(isinstance(s, str) and s for s in to_stages):
        raise ConnectorConfigError(f"{EXTRA}.to_stages must be a list of stage names, got {to_stages!r}")
    return ConnectorSettings(
        endpoints={_stage_name(stage): kv_address(address, f"{EXTRA}.endpoints.{stage}")
                   for stage, address in endpoints.items()},
        to_stages=tuple(dict.fromkeys(str(s) for s in to_stages)),
        pipeline=_text(extra, "pipeline"), revision=_text(extra, "revision"),
        io_cpus=extra.get("io_cpus"), loads=_flag(extra, "loads", False),
        host_huge_pages=_flag(extra, "host_huge_pages", True))


def kv_address(address: Any, where: str) -> str:
    """``address`` (``tcp://host:port`` or ``host:port``: the transport's grammar,
    ``split_address``) as ``tcp://host:port``; ConnectorConfigError naming ``where`` for
    anything else."""
    from omni_runtime.kv.transport.sender import split_address

    if isinstance(address, str):
        try:
            split_address(address)
        except ValueError:
            pass
        else:
            return address if "://" in address else f"tcp://{address}"
    raise ConnectorConfigError(f"{where} must be a receiving stage's KV address, tcp://HOST:PORT "
                               f"or HOST:PORT (e.g. tcp://talker-kv:9600), got {address!r}")


def _stage_name(stage: Any) -> str:
    if not isinstance(stage, str) or not stage:
        raise ConnectorConfigError(f"{EXTRA}.endpoints must be keyed by stage names, got {stage!r}")
    return stage


def _text(extra: Mapping[str, Any], key: str) -> str:
    value = extra.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{EXTRA}.{key} must be a string, got {value!r}")
    return value


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{EXTRA}.{key} must be true or false, got {value!r}")
    return value
