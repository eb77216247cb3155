"""The stage config: the file the operator renders into the stage's ConfigMap (keys in
docs/operator.md; ``omni-pipeline up`` writes the same file for local runs), parsed and
checked here so that both kinds of stage (:mod:`omni_runtime.stages.ar`,
:mod:`omni_runtime.stages.receiver`) and the entry point (:mod:`omni_runtime.stages.main`)
share one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_contract.edges import (MAX_DEADLINE_SECONDS, Edge, EdgeError, StreamSettings, parse_input, parse_inputs,
                                 stream_config)
from omni_contract.engine_args import engine_args_problems
from omni_contract.ports import HTTP_PORT as DEFAULT_HTTP_PORT
from omni_contract.ports import KV_PORT as DEFAULT_KV_PORT
from omni_runtime.kv.cpu_affinity import CPUListError, requested_cpus
from omni_runtime.transfers.config import OmniKVConfigError, parse_omni_kv_config

DEFAULT_GRACE_SECONDS = 30.0


class StageConfigError(ValueError):
    """A bad stage config; the message names the key."""


@dataclass(frozen=True)
class Downstream:
    stage: str
    endpoint: str  # host:port of the stage's KV receiver
    #: The edge's stream settings when it is streamed (both ends' configs carry them,
    #: omni_contract/edges.py); None: whole hand-offs.
    stream: StreamSettings | None = None

    @property
    def zmq_address(self) -> str:
        return self.endpoint if "://" in self.endpoint else f"tcp://{self.endpoint}"


@dataclass(frozen=True)
class StageConfig:
    pipeline: str
    stage: str
    role: str
    model: str  # what vLLM loads: a path, else the name
    model_name: str  # what clients ask for (served model name)
    model_dir: str | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    kv_send: bool = False
    kv_criteria: Mapping[str, Any] | None = None
    kv_timeout_seconds: float | None = None
    #: The KV transport threads' CPUs (the connector's ``io_cpus``): a Linux CPU list
    #: ("2-3,6") or CPU ids, syntax checked; None: "auto". Whether the pod may use them is
    #: checked where they are used, at engine start-up (omni_runtime/kv/cpu_affinity.py).
    kv_io_cpus: str | tuple[int, ...] | None = None
    downstream: tuple[Downstream, ...] = ()
    #: The upstream stages (the stage config's ``inputs``): the bounded ``from_stage`` values
    #: of a receiving stage's metrics (ReceiverMetrics(from_stages=...)).
    inputs: tuple[str, ...] = ()
    #: The same inputs as edges: each fed whole or streamed, with the stream's settings.
    input_edges: tuple[Edge, ...] = ()
    http_port: int = DEFAULT_HTTP_PORT
    kv_port: int = DEFAULT_KV_PORT
    #: The pipeline revision (the operator's hash of what the stages must agree on): an AR
    #: stage names it in its KV hello, a receiving stage refuses senders of another one.
    #: None when the config has none (a hand-written one): nothing is checked.
    revision: str | None = None
    #: AR stages only (vLLM's --otlp-traces-endpoint); a receiving stage's span exports
    #: follow the standard OTEL_* variables the operator sets.
    otlp_endpoint: str | None = None
    #: An AR stage with inputs (a downstream vLLM stage, stage_input.py): the input hook's
    #: import path (None: every upstream token), the requests' sampling parameters, how
    #: many requests from hand-offs may be in flight, whether an upstream's KV may be
    #: loaded as a prefix (``input`` in the stage config).
    input_hook: str | None = None
    input_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    input_max_inputs: int | None = None
    input_load_kv: bool = True
    #: The pipeline's endpoint (``role: endpoint``): the ``endpoint`` mapping, checked by
    #: omni_runtime.pipeline.endpoint.parse_endpoint_config.
    endpoint: Mapping[str, Any] | None = None

    @property
    def is_ar(self) -> bool:
        return self.role == "ar"

    @property
    def is_endpoint(self) -> bool:
        return self.role == "endpoint"

    @property
    def takes_hand_offs(self) -> bool:
        """A vLLM stage whose requests come from its upstream stages' hand-offs."""
        return self.is_ar and bool(self.inputs)

    def omni_kv_config(self) -> dict[str, Any]:
        """The scheduler's ``omni_kv_config`` (the CRD's camelCase mapped to its keys)."""
        cfg: dict[str, Any] = {"need_send_cache": self.kv_send, "stage_name": self.stage}
        # request_finished is the CRD's name for "no early trigger": the scheduler's default.
        if self.kv_criteria and self.kv_criteria.get("type") != "request_finished":
            criteria = {"type": self.kv_criteria.get("type")}
            token_id = self.kv_criteria.get("tokenId", self.kv_criteria.get("token_id"))
            if token_id is not None:
                criteria["token_id"] = token_id
            cfg["kv_transfer_criteria"] = criteria
        if self.kv_timeout_seconds is not None:
            cfg["timeout_seconds"] = self.kv_timeout_seconds
        streams = {d.stage: stream_config(d.stream) for d in self.downstream
                   if d.stream is not None}
        if streams:
            cfg["streams"] = streams
        return cfg


def _get(mapping: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...):
    if key not in mapping or mapping[key] is None:
        if default is ...:
            raise StageConfigError(f"{where}{key} is required")
        return default
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise StageConfigError(f"{where}{key} must be a {names}, got {value!r}")
    return value


def _optional_str(mapping: Mapping[str, Any], key: str, where: str) -> str | None:
    value = mapping.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise StageConfigError(f"{where}{key} must be a string, got {value!r}")
    return value


def _port(ports: Mapping[str, Any], key: str, default: int) -> int:
    port = _get(ports, key, int, "ports.", default)
    if not 1 <= port <= 65535:
        raise StageConfigError(f"ports.{key} must be a port number from 1 to 65535, got {port}")
    return port


def parse_stage_config(raw: Any) -> StageConfig:
    """The stage config, checked; StageConfigError naming the key for anything the stage
    cannot run with (never another exception, whatever ``raw`` holds)."""
    if not isinstance(raw, Mapping):
        raise StageConfigError("the stage config must be a mapping")
    model = _get(raw, "model", Mapping, "")
    name = _optional_str(model, "name", "model.")
    path = _optional_str(model, "path", "model.")
    model_ref = path or name
    if not model_ref:
        raise StageConfigError("model.name or model.path is required")
    kv = _get(raw, "kvTransfer", Mapping, "", {})
    ports = _get(raw, "ports", Mapping, "", {})
    obs = _get(raw, "observability", Mapping, "", {})
    tracing = _get(obs, "tracing", Mapping, "observability.", {})
    downstream = []
    for i, entry in enumerate(_get(raw, "downstream", list, "", [])):
        where = f"downstream[{i}]."
        if not isinstance(entry, Mapping):
            raise StageConfigError(f"downstream[{i}] must be a mapping")
        edge = _edge({k: v for k, v in entry.items() if k != "endpoint"}, f"downstream[{i}]")
        downstream.append(Downstream(edge.stage, _get(entry, "endpoint", str, where),
                                     edge.stream if edge.streamed else None))
    timeout = kv.get("timeoutSeconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise StageConfigError(f"kvTransfer.timeoutSeconds must be a number, got {timeout!r}")
    if timeout is not None and not 0 < timeout <= MAX_DEADLINE_SECONDS:
        raise StageConfigError(f"kvTransfer.timeoutSeconds must be a positive number of seconds, at most "
                               f"{MAX_DEADLINE_SECONDS:g} (the KV wire's bound of a deadline), got {timeout!r}")
    criteria = kv.get("criteria")
    if criteria is not None and not isinstance(criteria, Mapping):
        raise StageConfigError("kvTransfer.criteria must be a mapping with a type")
    kv_send = bool(_get(kv, "send", bool, "kvTransfer.", False))
    engine_args = dict(_get(raw, "engineArgs", Mapping, "", {}))
    # The stage contract (omni_contract), checked with the very code the operator and
    # `omni-pipeline validate` check a pipeline with: what they accept, the stage runs.
    for problem in engine_args_problems(engine_args, sends_kv=kv_send):
        raise StageConfigError(str(problem))
    try:
        edges = parse_inputs(raw.get("inputs"))
    except EdgeError as exc:
        raise StageConfigError(str(exc)) from None
    inputs = [edge.stage for edge in edges]
    stage_input = _get(raw, "input", Mapping, "", {})
    unknown = set(stage_input) - {"hook", "samplingParams", "maxInputs", "loadKV"}
    if unknown:
        raise StageConfigError(f"input.{sorted(unknown)[0]} is not a key of input (hook, "
                               "samplingParams, maxInputs, loadKV)")
    max_inputs = _get(stage_input, "maxInputs", int, "input.", None)
    if max_inputs is not None and max_inputs < 1:
        raise StageConfigError(f"input.maxInputs must be at least 1, got {max_inputs}")
    role = _get(raw, "role", str, "")
    if stage_input and not (role == "ar" and inputs):
        raise StageConfigError("input is set, but only an ar stage with inputs makes requests "
                               "from hand-offs: remove input, or give the stage inputs")
    endpoint = _get(raw, "endpoint", Mapping, "", None)
    if (endpoint is not None) != (role == "endpoint"):
        raise StageConfigError("endpoint goes with role: endpoint (the pipeline's endpoint's "
                               "config), and role: endpoint needs it")
    config = StageConfig(
        pipeline=_get(raw, "pipeline", str, ""),
        stage=_get(raw, "stage", str, ""),
        role=role,
        model=model_ref,
        model_name=name or model_ref,
        model_dir=_optional_str(model, "cacheDir", "model."),
        engine_args=engine_args,
        kv_send=kv_send,
        kv_criteria=dict(criteria) if criteria else None,
        kv_timeout_seconds=float(timeout) if timeout is not None else None,
        kv_io_cpus=_io_cpus(kv.get("ioCpus"), kv_send),
        downstream=tuple(downstream),
        inputs=tuple(inputs),
        input_edges=edges,
        http_port=_port(ports, "http", DEFAULT_HTTP_PORT),
        kv_port=_port(ports, "kv", DEFAULT_KV_PORT),
        otlp_endpoint=_optional_str(tracing, "otlpEndpoint", "observability.tracing."),
        revision=_optional_str(raw, "revision", ""),
        input_hook=_optional_str(stage_input, "hook", "input."),
        input_sampling_params=dict(_get(stage_input, "samplingParams", Mapping, "input.", {})),
        input_max_inputs=max_inputs,
        input_load_kv=_get(stage_input, "loadKV", bool, "input.", True),
        endpoint=dict(endpoint) if endpoint is not None else None,
    )
    if config.is_ar:
        # Fail here, naming the stage config's keys, rather than deep in vLLM's start-up.
        try:
            parse_omni_kv_config(config.omni_kv_config())
        except OmniKVConfigError as exc:
            raise StageConfigError(_as_stage_keys(str(exc))) from None
    return config


def _edge(raw: Mapping[str, Any], where: str) -> Edge:
    try:
        return parse_input(dict(raw), where)
    except EdgeError as exc:
        raise StageConfigError(str(exc)) from None


def _io_cpus(value: Any, send: bool) -> str | tuple[int, ...] | None:
    """``kvTransfer.ioCpus``, its syntax checked with the transport's own parser (so the
    stage refuses exactly what the connector would refuse at start-up, but before vLLM
    loads a model); None for "auto" or absent."""
    try:
        cpus = requested_cpus(value, field="kvTransfer.ioCpus")
    except CPUListError as exc:
        raise StageConfigError(str(exc)) from None
    if cpus is None:
        return None
    if not send:
        # Refused rather than ignored: only a sending stage runs the KV transport, so the
        # setting would silently do nothing, and a user who wrote it expects it to act
        # (on a receiving stage, or with send left false by mistake).
        raise StageConfigError(
            "kvTransfer.ioCpus is set but kvTransfer.send is false: only a stage that sends "
            "KV runs the transport's threads; remove ioCpus, or set kvTransfer.send: true")
    return value.strip() if isinstance(value, str) else tuple(value)


def _as_stage_keys(message: str) -> str:
    """An omni_kv_config error in the stage config's own words."""
    for ours, theirs in (
        ("omni_kv_config.kv_transfer_criteria.token_id", "kvTransfer.criteria.tokenId"),
        ("omni_kv_config.kv_transfer_criteria", "kvTransfer.criteria"),
        ("omni_kv_config.timeout_seconds", "kvTransfer.timeoutSeconds"),
        ("omni_kv_config.need_send_cache", "kvTransfer.send"),
        ("omni_kv_config.streams.", "the stream to "),
    ):
        message = message.replace(ours, theirs)
    return message


def load_stage_config(path: str | Path) -> StageConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise StageConfigError(f"cannot read the stage config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise StageConfigError(f"{path} is not UTF-8 text") from None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # ValueError: an integer of over 4,300 digits
        raise StageConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    try:
        return parse_stage_config(raw)
    except StageConfigError as exc:
        raise StageConfigError(f"{path}: {exc}") from None
