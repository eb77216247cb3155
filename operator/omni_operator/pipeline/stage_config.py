"""The stage config file that `omni-stage --config /etc/omni/stage.yaml` reads.

A pure function of the pipeline and the stage name. The operator puts it in the stage's
ConfigMap; docs/operator.md documents every key, since the runtime is written against it.
It never holds secrets: the hub token reaches the pod as a secretKeyRef environment variable.
"""
from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Callable

import yaml

from . import naming
from .model import Pipeline

CONFIG_API_VERSION = "omnipipeline.dev/v1alpha1"
CONFIG_KIND = "StageConfig"


def render_stage_config(
    pipeline: Pipeline,
    stage_name: str,
    endpoint_for: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The stage config as a dict.

    `endpoint_for(stage)` gives the host:port of a stage's KV receiver; by default the KV
    Service of the stage's revision in the pipeline's namespace, so that a sender only ever
    reaches receivers of its own revision (a local runner passes 127.0.0.1 addresses).
    """
    if endpoint_for is None:
        def endpoint_for(name: str) -> str:
            return naming.kv_endpoint(pipeline.name, name, pipeline.namespace, pipeline.revision)
    stage = pipeline.stage(stage_name)
    model: dict[str, Any] = {"name": pipeline.model.name}
    if pipeline.model.path:
        model["path"] = pipeline.model.path
    if pipeline.model.revision:
        model["revision"] = pipeline.model.revision
    if pipeline.model.cache_claim:
        model["cacheDir"] = pipeline.model.cache_mount_path
    criteria: dict[str, Any] = {"type": stage.kv.criteria_type}
    if stage.kv.token_id is not None:
        criteria["tokenId"] = stage.kv.token_id
    kv: dict[str, Any] = {
        "send": stage.kv.send,
        "criteria": criteria,
        "timeoutSeconds": stage.kv.timeout_seconds,
    }
    if stage.kv.io_cpus is not None:
        # Only when set: a pipeline without it keeps its config hash (and its pods) as before.
        kv["ioCpus"] = stage.kv.io_cpus
    extra: dict[str, Any] = {}
    if stage.input is not None:
        made = {"samplingParams": dict(stage.input.sampling_params), "loadKV": stage.input.load_kv}
        if stage.input.hook:
            made["hook"] = stage.input.hook
        if stage.input.max_inputs is not None:
            made["maxInputs"] = stage.input.max_inputs
        extra["input"] = made
    return {**extra,
        "apiVersion": CONFIG_API_VERSION,
        "kind": CONFIG_KIND,
        "pipeline": pipeline.name,
        "namespace": pipeline.namespace,
        "revision": pipeline.revision,
        "stage": stage.name,
        "role": stage.role,
        "model": model,
        "engineArgs": dict(stage.engine_args),
        "kvTransfer": kv,
        # Each edge as the contract writes it (omni_contract.edges): a whole one as the
        # upstream's name alone, so a pipeline without streams renders as it always did.
        "inputs": [edge.to_config() for edge in stage.edges],
        "downstream": [
            _downstream(pipeline, stage.name, name, endpoint_for(name)) for name in pipeline.downstream_of(stage.name)
        ],
        "ports": {"http": naming.HTTP_PORT, "kv": naming.KV_PORT},
        "observability": {
            "metrics": pipeline.observability.metrics,
            "tracing": {"otlpEndpoint": pipeline.observability.otlp_endpoint},
            "alerts": {"stuckTransferSeconds": pipeline.observability.stuck_transfer_seconds},
        },
    }


def _downstream(pipeline: Pipeline, producer: str, consumer: str, endpoint: str) -> dict[str, Any]:
    """The producer's end of the edge to ``consumer``: its stage and KV endpoint and, for a
    streamed edge, the same ``mode`` and ``stream`` as the consumer's ``inputs`` entry (one
    ``Edge.to_config()``, so the two ends cannot disagree)."""
    entry: dict[str, Any] = {"stage": consumer, "endpoint": endpoint}
    edge = pipeline.stage(consumer).edge_from(producer).to_config()
    if isinstance(edge, dict):
        entry.update({k: v for k, v in edge.items() if k != "stage"})
    return entry


def render_endpoint_config(pipeline: Pipeline, entry_url: str, advertise: str,
                           http_port: int = naming.ENDPOINT_PORT) -> dict[str, Any] | None:
    """The pipeline's endpoint's config (``omni-stage --config``, role ``endpoint``), or None
    for a pipeline of another shape than one entry stage and one last stage. ``entry_url``:
    the entry stage's API as the endpoint reaches it; ``advertise``: the endpoint replica's
    own URL as the stages reach it (``${POD_IP}`` is the pod's address, from its
    environment)."""
    shape = pipeline.endpoint_stages
    if shape is None:
        return None
    entry, last = shape
    edges = [_endpoint_edge(pipeline, s.name, d, s.kv.timeout_seconds)
             for s in pipeline.stages for d in pipeline.downstream_of(s.name)]
    return {
        "apiVersion": CONFIG_API_VERSION,
        "kind": CONFIG_KIND,
        "pipeline": pipeline.name,
        "namespace": pipeline.namespace,
        "revision": pipeline.revision,
        "stage": "endpoint",
        "role": "endpoint",
        "model": {"name": pipeline.model.name},
        "ports": {"http": http_port},
        "endpoint": {
            "entry": {"stage": entry.name, "url": entry_url},
            "sink": last.name,
            "advertise": advertise,
            "edges": edges,
        },
    }


def _endpoint_edge(pipeline: Pipeline, producer: str, consumer: str, timeout: int) -> dict[str, Any]:
    """An edge as the endpoint's config lists it: a streamed one also says so, with its
    settings (its deadlines), as both ends' stage configs do."""
    out: dict[str, Any] = {"from": producer, "to": consumer, "timeoutSeconds": timeout}
    edge = pipeline.stage(consumer).edge_from(producer).to_config()
    if isinstance(edge, dict):
        out.update({k: v for k, v in edge.items() if k != "stage"})
    return out


def dump_stage_config(config: dict[str, Any]) -> str:
    """Deterministic YAML (sorted keys), so the same config always hashes the same.

    The text is `yaml.safe_dump(config, sort_keys=True, default_flow_style=False)`, built a
    top-level key at a time: in block style each key's entry starts at column 0 and does not
    depend on the others, so the document is their concatenation. Most entries (the model,
    engine arguments, ports, observability) are the same in every pipeline and every render,
    and PyYAML is slow (about 1 ms a config), so each entry is dumped once per value."""
    return "".join(_entry(key, json.dumps(config[key], sort_keys=True)) for key in sorted(config))


@functools.lru_cache(maxsize=4096)
def _entry(key: str, value_json: str) -> str:
    """One top-level entry, a pure function of its key and its value (a stage config is JSON
    data: the value is the one its JSON gives back)."""
    return yaml.safe_dump({key: json.loads(value_json)}, sort_keys=True, default_flow_style=False)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
