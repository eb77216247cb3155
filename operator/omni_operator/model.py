"""The OmniPipeline spec as typed, validated values.

`parse_pipeline` applies the CRD's defaults, then checks every rule the operator relies on,
including those the CRD schema states (the API server may not have validated the object:
an older CRD, or a test server) and those it cannot state (a cycle in the stage graph).
It reports every problem at once, each naming its field and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import crd
from .errors import Problem, SpecError
from .quantities import is_quantity

# Services are named after the pipeline and its stages, and a Service name is a DNS-1035
# label: lower case letters, digits and '-', starting with a letter (no dots).
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
ROLES = ("ar", "generation")
CRITERIA = ("prefill_finished", "special_token", "request_finished")
MAX_CHILD_NAME = 63  # a Service name is a DNS-1123 label
# Engine arguments the stage contract fixes: the runtime sets them, a user value would break it.
RESERVED_ENGINE_ARGS = {
    "host": "the stage listens where the stage contract says (port http 8000)",
    "port": "the stage's HTTP port is fixed at 8000 by the stage contract",
    "model": "the model comes from spec.model",
    "scheduler-cls": "the runtime installs omni_runtime.sched.OmniARScheduler itself",
    "scheduler_cls": "the runtime installs omni_runtime.sched.OmniARScheduler itself",
}
RESERVED_ENV_PREFIXES = ("OMNI_",)
RESERVED_MOUNT_PATHS = ("/tmp", "/dev/shm", "/etc/omni")  # the volumes every stage pod mounts (render.py)
GPU_RESOURCE = "nvidia.com/gpu"
# kvTransfer.ioCpus: "auto" or a Linux CPU list, as the CRD's pattern states it; the ranges'
# order and the id bound are checked here (the schema cannot say them). MAX_CPU_ID is the
# runtime's (omni_runtime/kv/cpu_affinity.py, which the operator image does not carry; a
# test keeps the two equal).
CPU_LIST = re.compile(r"^(auto|[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*)$")
MAX_CPU_LIST_LENGTH = 256
MAX_CPU_ID = 65535


@dataclass(frozen=True)
class KvTransfer:
    send: bool = False
    criteria_type: str = "prefill_finished"
    token_id: int | None = None
    timeout_seconds: int = 30
    #: The KV transport threads' CPUs as a Linux CPU list ("2-3,6"); None: "auto".
    io_cpus: str | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    role: str
    image: str
    replicas: int
    gpus: int
    shm_size: str | int
    kv: KvTransfer
    inputs: tuple[str, ...] = ()
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Model:
    name: str
    path: str | None = None
    revision: str | None = None
    cache_claim: str | None = None
    cache_read_only: bool = False
    cache_mount_path: str = "/models"
    hub_token_secret: str | None = None
    hub_token_key: str = "token"


@dataclass(frozen=True)
class Observability:
    metrics: bool = True
    otlp_endpoint: str | None = None
    stuck_transfer_seconds: int = 120


@dataclass(frozen=True)
class Pipeline:
    name: str
    namespace: str
    uid: str
    generation: int
    image: str
    image_pull_policy: str
    model: Model
    stages: tuple[Stage, ...]
    observability: Observability
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str | None = None

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def downstream_of(self, name: str) -> list[str]:
        """Stages that list `name` in their inputs, in spec order."""
        return [s.name for s in self.stages if name in s.inputs]


def parse_pipeline(body: Mapping[str, Any]) -> Pipeline:
    """Validate an OmniPipeline object and return its typed spec; SpecError names each bad field."""
    meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    raw_spec = body.get("spec")
    if not isinstance(raw_spec, dict):
        raise SpecError([Problem("spec", "is required and must be an object")])
    spec = crd.apply_defaults(crd.openapi_schema()["properties"]["spec"], raw_spec)
    problems: list[Problem] = []
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    if not DNS1035_LABEL.match(name) or len(name) > MAX_CHILD_NAME:
        problems.append(Problem("metadata.name", "must be a DNS-1035 label of at most 63 characters (lower case letters, "
                                "digits and '-', starting with a letter, no dots): it names the stage Services, e.g. qwen-omni"))

    image = spec.get("image")
    if not isinstance(image, str) or not image.strip():
        problems.append(Problem("spec.image", "is required: the stage runtime image, e.g. ghcr.io/org/omni-stage:0.1"))
    pull_policy = spec.get("imagePullPolicy")
    if pull_policy not in ("Always", "IfNotPresent", "Never"):
        problems.append(Problem("spec.imagePullPolicy", "must be one of Always, IfNotPresent, Never"))
    pull_secrets = _pull_secrets(spec.get("imagePullSecrets"), problems)
    service_account = spec.get("serviceAccountName")
    if service_account is not None and not (isinstance(service_account, str) and service_account):
        problems.append(Problem("spec.serviceAccountName", "must be a non-empty string"))
    model = _model(spec.get("model"), problems)
    observability = _observability(spec.get("observability"), problems)
    stages = _stages(name, spec.get("stages"), image if isinstance(image, str) else "", problems)

    if problems:
        raise SpecError(problems)
    return Pipeline(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        image=image,
        image_pull_policy=pull_policy,
        image_pull_secrets=pull_secrets,
        service_account=service_account,
        model=model,
        stages=stages,
        observability=observability,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pull_secrets(raw: Any, problems: list[Problem]) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append(Problem("spec.imagePullSecrets", "must be a list of {name: SECRET}"))
        return ()
    names = []
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]):
            problems.append(Problem(f"spec.imagePullSecrets[{i}].name", "is required: the name of a docker-registry Secret"))
        else:
            names.append(item["name"])
    return tuple(names)


def _model(raw: Any, problems: list[Problem]) -> Model:
    if not isinstance(raw, dict):
        problems.append(Problem("spec.model", "is required: {name: MODEL} (a hub id, or a served name with path)"))
        return Model(name="")
    model_name = raw.get("name")
    if not isinstance(model_name, str) or not model_name.strip():
        problems.append(Problem("spec.model.name", "is required: a hub repository id or the served model name"))
        model_name = ""
    path = raw.get("path")
    if path is not None and not (isinstance(path, str) and path):
        problems.append(Problem("spec.model.path", "must be a non-empty path"))
    cache = raw.get("cache")
    claim, read_only, mount_path = None, False, "/models"
    if cache is not None:
        pvc = cache.get("pvc") if isinstance(cache, dict) else None
        if not (isinstance(pvc, dict) and isinstance(pvc.get("claimName"), str) and pvc["claimName"]):
            problems.append(Problem("spec.model.cache.pvc.claimName", "is required when spec.model.cache is set: the PersistentVolumeClaim holding the model cache"))
        else:
            claim, read_only = pvc["claimName"], bool(pvc.get("readOnly", False))
        mount_path = cache.get("mountPath", "/models") if isinstance(cache, dict) else "/models"
        if not (isinstance(mount_path, str) and mount_path.startswith("/")):
            problems.append(Problem("spec.model.cache.mountPath", "must be an absolute path, e.g. /models"))
            mount_path = "/models"
        elif mount_path.rstrip("/") in RESERVED_MOUNT_PATHS:
            problems.append(Problem("spec.model.cache.mountPath", f"the stage pods already mount {', '.join(RESERVED_MOUNT_PATHS)}; choose another path, e.g. /models"))
    secret = raw.get("hubTokenSecretRef")
    secret_name, secret_key = None, "token"
    if secret is not None:
        if not (isinstance(secret, dict) and isinstance(secret.get("name"), str) and secret["name"]):
            problems.append(Problem("spec.model.hubTokenSecretRef.name", "is required: the Secret holding the hub token"))
        else:
            secret_name, secret_key = secret["name"], str(secret.get("key") or "token")
    return Model(
        name=model_name, path=path, revision=raw.get("revision"),
        cache_claim=claim, cache_read_only=read_only, cache_mount_path=mount_path,
        hub_token_secret=secret_name, hub_token_key=secret_key,
    )


def _observability(raw: Any, problems: list[Problem]) -> Observability:
    raw = raw or {}
    if not isinstance(raw, dict):
        problems.append(Problem("spec.observability", "must be an object"))
        return Observability()
    metrics = raw.get("metrics", True)
    if not isinstance(metrics, bool):
        problems.append(Problem("spec.observability.metrics", "must be true or false"))
    tracing = raw.get("tracing") or {}
    endpoint = tracing.get("otlpEndpoint") if isinstance(tracing, dict) else None
    if endpoint is not None and not (isinstance(endpoint, str) and re.match(r"^https?://[^\s/]+", endpoint)):
        problems.append(Problem("spec.observability.tracing.otlpEndpoint", "must be an http(s) URL, e.g. http://otel-collector:4318"))
    alerts = raw.get("alerts") or {}
    stuck = alerts.get("stuckTransferSeconds", 120) if isinstance(alerts, dict) else 120
    if not (_is_int(stuck) and stuck >= 1):
        problems.append(Problem("spec.observability.alerts.stuckTransferSeconds", "must be an integer of at least 1"))
        stuck = 120
    return Observability(metrics=bool(metrics), otlp_endpoint=endpoint or None, stuck_transfer_seconds=stuck)


def _stages(pipeline: str, raw: Any, default_image: str, problems: list[Problem]) -> tuple[Stage, ...]:
    if not isinstance(raw, list) or not raw:
        problems.append(Problem("spec.stages", "needs at least one stage: [{name: ..., role: ar}]"))
        return ()
    seen: dict[str, int] = {}
    stages: list[Stage] = []
    for i, item in enumerate(raw):
        where = f"spec.stages[{i}]"
        if not isinstance(item, dict):
            problems.append(Problem(where, "must be an object with name and role"))
            continue
        stage = _stage(pipeline, where, item, default_image, problems)
        if stage.name in seen:
            problems.append(Problem(f"{where}.name", f"duplicates spec.stages[{seen[stage.name]}].name {stage.name!r}; stage names must be unique"))
        elif stage.name:
            seen[stage.name] = i
        stages.append(stage)
    names = set(seen)
    for i, stage in enumerate(stages):
        for j, upstream in enumerate(stage.inputs):
            if upstream == stage.name:
                problems.append(Problem(f"spec.stages[{i}].inputs[{j}]", "a stage cannot be its own input"))
            elif upstream not in names:
                problems.append(Problem(f"spec.stages[{i}].inputs[{j}]", f"names no stage: {upstream!r} is not in spec.stages[].name ({', '.join(sorted(names))})"))
        if stage.kv.send and not any(stage.name in s.inputs for s in stages):
            problems.append(Problem(f"spec.stages[{i}].kvTransfer.send", f"is true but no stage lists {stage.name!r} in its inputs; add it to the receiving stage's inputs or set send: false"))
    cycle = find_cycle({s.name: [u for u in s.inputs if u in names and u != s.name] for s in stages if s.name})
    if cycle:
        problems.append(Problem("spec.stages[].inputs", f"the stage graph has a cycle: {' -> '.join(cycle)}; remove one of these inputs"))
    return tuple(stages)


def _stage(pipeline: str, where: str, raw: dict, default_image: str, problems: list[Problem]) -> Stage:
    name = raw.get("name")
    if not isinstance(name, str) or not DNS1035_LABEL.match(name) or len(name) > 50:
        problems.append(Problem(f"{where}.name", "must be a DNS-1035 label of at most 50 characters: lower case letters, digits and '-', starting with a letter and ending with a letter or digit"))
        name = name if isinstance(name, str) else ""
    elif len(pipeline) + 1 + len(name) > MAX_CHILD_NAME:
        problems.append(Problem(f"{where}.name", f"metadata.name + '-' + the stage name ({pipeline}-{name}) is longer than {MAX_CHILD_NAME} characters; it names the stage's Service: shorten one"))
    role = raw.get("role")
    if role not in ROLES:
        problems.append(Problem(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {role!r})"))
    image = raw.get("image") or default_image
    replicas = raw.get("replicas", 1)
    if not (_is_int(replicas) and 1 <= replicas <= 1024):
        problems.append(Problem(f"{where}.replicas", "must be an integer from 1 to 1024"))
        replicas = 1
    gpus = raw.get("gpus", 1)
    if not (_is_int(gpus) and 0 <= gpus <= 64):
        problems.append(Problem(f"{where}.gpus", "must be an integer from 0 to 64 (GPUs per replica; 0 runs on CPU)"))
        gpus = 0
    shm = raw.get("shmSize", "2Gi")
    if not is_quantity(shm):
        problems.append(Problem(f"{where}.shmSize", f"must be a quantity such as 2Gi (got {shm!r})"))
    kv = _kv_transfer(where, raw.get("kvTransfer") or {}, role, problems)
    inputs = raw.get("inputs") or []
    if not (isinstance(inputs, list) and all(isinstance(x, str) for x in inputs)):
        problems.append(Problem(f"{where}.inputs", "must be a list of stage names"))
        inputs = []
    elif len(set(inputs)) != len(inputs):
        problems.append(Problem(f"{where}.inputs", "lists a stage more than once"))
    resources = _resources(where, raw.get("resources") or {}, problems)
    node_selector = raw.get("nodeSelector") or {}
    if not (isinstance(node_selector, dict) and all(isinstance(v, str) for v in node_selector.values())):
        problems.append(Problem(f"{where}.nodeSelector", "must map label names to string values"))
        node_selector = {}
    tolerations = raw.get("tolerations") or []
    if not (isinstance(tolerations, list) and all(isinstance(t, dict) for t in tolerations)):
        problems.append(Problem(f"{where}.tolerations", "must be a list of Kubernetes tolerations"))
        tolerations = []
    engine_args = raw.get("engineArgs") or {}
    if not isinstance(engine_args, dict):
        problems.append(Problem(f"{where}.engineArgs", "must be a map of vLLM engine argument names to values"))
        engine_args = {}
    for key in engine_args:
        reason = RESERVED_ENGINE_ARGS.get(str(key).lstrip("-"))
        if reason:
            problems.append(Problem(f"{where}.engineArgs.{key}", f"cannot be set: {reason}; remove it"))
    env = _env(where, raw.get("env") or [], problems)
    return Stage(
        name=name, role=role if role in ROLES else "ar", image=image, replicas=replicas, gpus=gpus,
        shm_size=shm, kv=kv, inputs=tuple(inputs), resources=resources, node_selector=node_selector,
        tolerations=tuple(tolerations), engine_args=engine_args, env=env,
    )


def _kv_transfer(where: str, raw: Any, role: Any, problems: list[Problem]) -> KvTransfer:
    where = f"{where}.kvTransfer"
    if not isinstance(raw, dict):
        problems.append(Problem(where, "must be an object {send, criteria, timeoutSeconds, ioCpus}"))
        return KvTransfer()
    send = raw.get("send", False)
    if not isinstance(send, bool):
        problems.append(Problem(f"{where}.send", "must be true or false"))
        send = False
    if send and role != "ar":
        problems.append(Problem(f"{where}.send", "is only supported on stages with role 'ar' (the AR scheduler ships the KV cache)"))
    criteria = raw.get("criteria") or {}
    ctype = criteria.get("type", "prefill_finished") if isinstance(criteria, dict) else None
    token_id = criteria.get("tokenId") if isinstance(criteria, dict) else None
    if ctype not in CRITERIA:
        problems.append(Problem(f"{where}.criteria.type", f"must be one of {', '.join(CRITERIA)} (got {ctype!r})"))
        ctype = "prefill_finished"
    if ctype == "special_token":
        if token_id is None:
            problems.append(Problem(f"{where}.criteria.tokenId", "is required when criteria.type is special_token: the sentinel token id"))
        elif not (_is_int(token_id) and token_id >= 0):
            problems.append(Problem(f"{where}.criteria.tokenId", "must be a non-negative integer token id"))
            token_id = None
    elif token_id is not None:
        problems.append(Problem(f"{where}.criteria.tokenId", f"is only allowed when criteria.type is special_token (type is {ctype}); remove it"))
        token_id = None
    timeout = raw.get("timeoutSeconds", 30)
    if not (_is_int(timeout) and 1 <= timeout <= 3600):
        problems.append(Problem(f"{where}.timeoutSeconds", "must be an integer from 1 to 3600"))
        timeout = 30
    io_cpus = _io_cpus(f"{where}.ioCpus", raw.get("ioCpus"), send, problems)
    return KvTransfer(send=send, criteria_type=ctype, token_id=token_id, timeout_seconds=timeout,
                      io_cpus=io_cpus)


def _io_cpus(where: str, value: Any, send: bool, problems: list[Problem]) -> str | None:
    """kvTransfer.ioCpus: its syntax only; whether the pod may use those CPUs is checked in
    the pod at engine start-up. None for "auto" or absent (the rendered config leaves it out,
    so writing "auto" changes nothing, not even the config's hash)."""
    if value is None or value == "auto":
        return None
    fix = 'use "auto" or a Linux CPU list such as "3" or "2-3,6" (no spaces)'
    if not (isinstance(value, str) and len(value) <= MAX_CPU_LIST_LENGTH and CPU_LIST.match(value)):
        problems.append(Problem(where, f"must be a string: {fix}"))
        return None
    for part in value.split(","):
        low, _, high = part.partition("-")
        if high and int(high) < int(low):
            problems.append(Problem(where, f"has a descending range {part!r}; write it low-high, e.g. "
                                           f"{high}-{low}"))
            return None
        if int(high or low) > MAX_CPU_ID:
            problems.append(Problem(where, f"names CPU {int(high or low)}, above {MAX_CPU_ID}; {fix}"))
            return None
    if not send:
        # Refused, not ignored: only a stage that sends runs the KV transport, and a setting
        # that silently does nothing hides a mistake (send left false, the wrong stage).
        problems.append(Problem(where, "is only used by a stage that sends KV; remove it, or set kvTransfer.send: true"))
        return None
    return value


def _resources(where: str, raw: Any, problems: list[Problem]) -> dict[str, dict[str, Any]]:
    if not isinstance(raw, dict):
        problems.append(Problem(f"{where}.resources", "must be {requests: {...}, limits: {...}}"))
        return {}
    out: dict[str, dict[str, Any]] = {}
    for section in ("requests", "limits"):
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            problems.append(Problem(f"{where}.resources.{section}", "must map resource names to quantities"))
            continue
        for key, value in values.items():
            if key == GPU_RESOURCE:
                problems.append(Problem(f"{where}.resources.{section}.{key}", "is set by the operator from spec.stages[].gpus; set gpus instead"))
            elif not is_quantity(value):
                problems.append(Problem(f"{where}.resources.{section}.{key}", f"must be a quantity such as 4, 500m or 16Gi (got {value!r})"))
        out[section] = dict(values)
    extra = set(raw) - {"requests", "limits"}
    if extra:
        problems.append(Problem(f"{where}.resources.{sorted(extra)[0]}", "is not a resources field; use requests and limits"))
    return {k: v for k, v in out.items() if v}


def _env(where: str, raw: Any, problems: list[Problem]) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(raw, list):
        problems.append(Problem(f"{where}.env", "must be a list of {name, value} or {name, valueFrom}"))
        return ()
    out = []
    for i, item in enumerate(raw):
        at = f"{where}.env[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not ENV_NAME.match(item["name"]):
            problems.append(Problem(f"{at}.name", "is required: a valid environment variable name"))
            continue
        if item["name"].startswith(RESERVED_ENV_PREFIXES):
            problems.append(Problem(f"{at}.name", f"{item['name']} uses the OMNI_ prefix the operator sets; choose another name"))
        if "value" in item and "valueFrom" in item:
            problems.append(Problem(at, "set either value or valueFrom, not both"))
        if "value" in item and not isinstance(item["value"], str):
            problems.append(Problem(f"{at}.value", "must be a string (quote numbers)"))
        out.append({k: item[k] for k in ("name", "value", "valueFrom") if k in item})
    return tuple(out)


def find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """A cycle in the inputs graph (node -> its inputs), as [a, b, ..., a]; None when acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {node: WHITE for node in graph}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        path.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == GREY:
                return path[path.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        color[node] = BLACK
        return None

    for node in graph:  # dict order = spec order, so the report is stable
        if color[node] == WHITE:
            found = visit(node)
            if found:
                # Reverse so arrows read in data-flow direction (upstream -> downstream).
                return list(reversed(found))
    return None
