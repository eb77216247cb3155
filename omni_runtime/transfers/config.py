"""``omni_kv_config``: the AR stage's KV-transfer settings, parsed and validated once.

On plain vLLM the native place for a plugin's settings is ``VllmConfig.additional_config``:

    --additional-config '{"omni_kv_config": {"need_send_cache": true,
        "kv_transfer_criteria": {"type": "special_token", "token_id": 151667},
        "timeout_seconds": 30, "telemetry_interval_seconds": 0.1}}'

vllm-omni keeps the same mapping on its model config as ``omni_kv_config``; both are read.
This module imports no vLLM, so the operator-side tooling and the tests can use it alone.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_contract.edges import MAX_DEADLINE_SECONDS, EdgeError, StreamSettings, parse_stream
from omni_runtime.transfers.ledger import DEFAULT_TIMEOUT_SECONDS, Trigger

#: How often, at most, the transfer metrics and spans are written while transfers are in
#: flight (the ledger's report interval): a tenth of a second is far below any scrape or
#: alert interval, and spares the step a write per changed value and a span per transfer.
DEFAULT_TELEMETRY_INTERVAL_SECONDS = 0.1
#: Above this the figures would lag a scrape (Prometheus' shortest usual interval is 5 s).
MAX_TELEMETRY_INTERVAL_SECONDS = 5.0

logger = logging.getLogger(__name__)

CONFIG_KEY = "omni_kv_config"
#: Environment variable naming the stage (set by ``omni-stage`` and the operator).
STAGE_ENV = "OMNI_STAGE_NAME"
DEFAULT_STAGE = "ar"

_KNOWN_KEYS = frozenset({"need_send_cache", "kv_transfer_criteria", "timeout_seconds",
                         "stage_name", "telemetry_interval_seconds", "streams"})
#: Keys vllm-omni's stage configs carry that concern other parts of its runtime.
_FOREIGN_KEYS = frozenset({"need_recv_cache", "omni_from_stage", "omni_to_stage"})
_CRITERIA_TYPES = (Trigger.PREFILL_FINISHED.value, Trigger.SPECIAL_TOKEN.value)


class OmniKVConfigError(ValueError):
    """A bad ``omni_kv_config``; the message names the key and the fix."""


@dataclass(frozen=True, slots=True)
class OmniKVConfig:
    need_send_cache: bool = False
    #: None: transfer when the request finishes. Otherwise the in-flight trigger.
    criteria: Trigger | None = None
    token_id: int | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    stage_name: str = DEFAULT_STAGE
    #: See DEFAULT_TELEMETRY_INTERVAL_SECONDS; 0: at every scheduler step.
    telemetry_interval_seconds: float = DEFAULT_TELEMETRY_INTERVAL_SECONDS
    #: The streamed edges this stage produces (consumer stage -> its stream settings,
    #: omni_contract/edges.py): their requests' output goes there chunk by chunk, not whole.
    streams: Mapping[str, StreamSettings] = field(default_factory=dict)


def parse_omni_kv_config(raw: Any, *, vocab_size: int | None = None) -> OmniKVConfig:
    """Validate a raw ``omni_kv_config`` mapping (None means "transfers off")."""
    stage_default = os.environ.get(STAGE_ENV) or DEFAULT_STAGE
    if raw is None:
        return OmniKVConfig(stage_name=stage_default)
    if not isinstance(raw, Mapping):
        raise OmniKVConfigError(
            f"{CONFIG_KEY} must be a mapping, got {type(raw).__name__}; "
            f'pass e.g. {{"need_send_cache": true}}'
        )
    # An explicit null means "the default" (vllm-omni's config objects carry None for unset).
    raw = {k: v for k, v in raw.items() if v is not None}
    unknown = set(raw) - _KNOWN_KEYS - _FOREIGN_KEYS
    if unknown:
        raise OmniKVConfigError(
            f"{CONFIG_KEY}: unknown key(s) {sorted(unknown)}; known keys are "
            f"{sorted(_KNOWN_KEYS)}"
        )

    need_send = raw.get("need_send_cache", False)
    if not isinstance(need_send, bool):
        raise OmniKVConfigError(
            f"{CONFIG_KEY}.need_send_cache must be true or false, got {need_send!r}"
        )

    criteria, token_id = _parse_criteria(raw.get("kv_transfer_criteria"), vocab_size)

    timeout = raw.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise OmniKVConfigError(
            f"{CONFIG_KEY}.timeout_seconds must be a number of seconds, got {timeout!r}"
        )
    if not math.isfinite(timeout) or not 0 < timeout <= MAX_DEADLINE_SECONDS:
        raise OmniKVConfigError(
            f"{CONFIG_KEY}.timeout_seconds must be a positive number of seconds, at most "
            f"{MAX_DEADLINE_SECONDS:g} (a transfer's deadline travels on the KV wire, which "
            f"bounds it so), got {timeout!r}; it bounds how long a transfer may hold KV blocks "
            f"(default {DEFAULT_TIMEOUT_SECONDS:g})"
        )

    interval = raw.get("telemetry_interval_seconds", DEFAULT_TELEMETRY_INTERVAL_SECONDS)
    if (isinstance(interval, bool) or not isinstance(interval, (int, float))
            or not 0 <= interval <= MAX_TELEMETRY_INTERVAL_SECONDS):
        raise OmniKVConfigError(
            f"{CONFIG_KEY}.telemetry_interval_seconds must be a number of seconds from 0 to "
            f"{MAX_TELEMETRY_INTERVAL_SECONDS:g}, got {interval!r}; it is how often, at most, "
            f"the transfer metrics and spans are written while transfers are in flight "
            f"(default {DEFAULT_TELEMETRY_INTERVAL_SECONDS:g}; 0: at every step)"
        )

    stage = raw.get("stage_name", stage_default)
    if not isinstance(stage, str) or not stage:
        raise OmniKVConfigError(f"{CONFIG_KEY}.stage_name must be a non-empty string")

    if criteria is not None and not need_send:
        logger.warning(
            "%s.kv_transfer_criteria is set but need_send_cache is false: no KV transfers "
            "will be made",
            CONFIG_KEY,
        )
    return OmniKVConfig(need_send, criteria, token_id, float(timeout), stage, float(interval),
                        _parse_streams(raw.get("streams")))


def _parse_streams(raw: Any) -> dict[str, StreamSettings]:
    key = f"{CONFIG_KEY}.streams"
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and k for k in raw):
        raise OmniKVConfigError(f"{key} must map stage names to stream settings")
    try:
        return {stage: parse_stream(settings, f"{key}.{stage}")
                for stage, settings in raw.items()}
    except EdgeError as exc:
        raise OmniKVConfigError(str(exc)) from None


def _parse_criteria(raw: Any, vocab_size: int | None) -> tuple[Trigger | None, int | None]:
    key = f"{CONFIG_KEY}.kv_transfer_criteria"
    if raw is None:
        return None, None
    if not isinstance(raw, Mapping):
        raise OmniKVConfigError(f"{key} must be a mapping with a 'type', got {raw!r}")
    kind = raw.get("type")
    if kind not in _CRITERIA_TYPES:
        raise OmniKVConfigError(
            f"{key}.type must be one of {list(_CRITERIA_TYPES)}, got {kind!r}"
        )
    extra = set(raw) - {"type", "token_id"}
    if extra:
        raise OmniKVConfigError(f"{key}: unknown key(s) {sorted(extra)}")
    token_id = raw.get("token_id")
    if kind == Trigger.PREFILL_FINISHED.value:
        if token_id is not None:
            raise OmniKVConfigError(
                f"{key}.token_id is only meaningful with type special_token; remove it"
            )
        return Trigger.PREFILL_FINISHED, None
    if token_id is None:
        raise OmniKVConfigError(
            f"{key}.token_id is required when type is special_token: set it to the "
            "sentinel token's id"
        )
    if isinstance(token_id, bool) or not isinstance(token_id, int):
        raise OmniKVConfigError(f"{key}.token_id must be an integer, got {token_id!r}")
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
        raise OmniKVConfigError(
            f"{key}.token_id {token_id} is outside the model's vocabulary ({bound})"
        )
    return Trigger.SPECIAL_TOKEN, token_id


def raw_omni_kv_config(vllm_config: Any) -> Any:
    """The raw mapping from a VllmConfig: ``additional_config`` first, then vllm-omni's
    ``model_config.omni_kv_config``."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(additional, Mapping) and CONFIG_KEY in additional:
        return additional[CONFIG_KEY]
    model_config = getattr(vllm_config, "model_config", None)
    raw = getattr(model_config, CONFIG_KEY, None)
    if raw is not None and not isinstance(raw, Mapping):
        # vllm-omni may hold it as an object with attributes.
        raw = {k: getattr(raw, k) for k in _KNOWN_KEYS if hasattr(raw, k)}
    return raw
