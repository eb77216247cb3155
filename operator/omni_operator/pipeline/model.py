"""The OmniPipeline spec as typed values, and the rules no schema can state.

`pipeline_view` is a typed view of a body that the CRD's schema and CEL rules have accepted
(`validation.py`, through `admission.admit`), as the API server holds it (nulls pruned,
defaults applied once: `crd.server_view`); it checks nothing the schema states. What a
schema cannot state is `graph_problems`: a cycle in the stage graph, a sending stage that no
stage receives from, the order and bound of an `ioCpus` CPU list, and the stage contract's
rules for `engineArgs` (`omni_contract.engine_args`, the very check `omni-stage` runs), and
a streamed edge's cadence against the ``max-model-len`` of the engines at its ends.

An edge (``omni_contract.edges``) is stated once, on its consumer: ``inputs`` names the
upstream stages, ``streams`` says which of them are streamed and with what settings (the
CRD's form: a structural schema cannot let one list hold both a string and a mapping). The
typed view turns them into the contract's ``Edge``s, which the stage configs of both ends
are rendered from, so the two ends cannot disagree about an edge.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from omni_contract import vllm_args
from omni_contract.edges import STREAM, Edge, EdgeError, parse_stream
from omni_contract.engine_args import engine_arg_value, engine_args_problems, engine_args_warnings
from omni_contract.cpu_list import parse_cpu_list
from omni_contract.kv_wire import KV_WIRE_VERSION

from . import crd, naming
from .errors import Problem
from .quantities import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class KvTransfer:
    send: bool = False
    criteria_type: str = "prefill_finished"
    token_id: int | None = None
    timeout_seconds: int = 30
    #: The KV transport threads' CPUs as a Linux CPU list ("2-3,6"); None: "auto".
    io_cpus: str | None = None


@dataclass(frozen=True)
class Rollout:
    """How a new revision replaces the old one for a stage (pods above and below its target)."""
    max_surge: int
    max_unavailable: int


@dataclass(frozen=True)
class Metric:
    """One autoscaling signal and its target (per replica; an age for the age signal)."""
    signal: str
    target: float


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metrics: tuple[Metric, ...]

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class StageInput:
    """How an ar stage with inputs makes a request of each hand-off (the runtime's
    stages/inputs.py): the input hook's import path (None: every upstream token), the
    requests' sampling parameters, how many may be in flight, whether an upstream's KV may
    be loaded as a prefix."""
    hook: str | None = None
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    max_inputs: int | None = None
    load_kv: bool = True


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
    rollout: Rollout = Rollout(0, 1)
    autoscaling: Autoscaling | None = None
    #: An ar stage with inputs: how it makes requests of hand-offs (the CRD's ``input``).
    input: StageInput | None = None
    #: The inputs fed as streams (the CRD's ``streams``), as the contract's edges, in the
    #: order the spec lists them; an input not here is fed whole.
    streams: tuple[Edge, ...] = ()

    @property
    def edges(self) -> tuple[Edge, ...]:
        """Every input as the contract's edge, in ``inputs`` order: streamed or whole."""
        streamed = {edge.stage: edge for edge in self.streams}
        return tuple(streamed.get(name) or Edge(name) for name in self.inputs)

    def edge_from(self, upstream: str) -> Edge:
        """The edge from ``upstream`` (one of this stage's inputs) into this stage."""
        for edge in self.streams:
            if edge.stage == upstream:
                return edge
        return Edge(upstream)


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
    #: A stream waiting (for a chunk, an ack or a credit) longer than this is stalled: the
    #: operator's TransfersHealthy says StreamStalled. The operator's alone (not the stages').
    stalled_stream_seconds: int = 60
    #: The Prometheus that KEDA's triggers query (the autoscaling signals).
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"


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
    #: The hash of everything the stages must agree on (`revision_of`).
    revision: str = ""
    #: The vLLM version the stages' images run, as the pipeline's annotation states it (a
    #: stage image's tag may name its own: `stage_vllm_version`); not part of the revision.
    vllm_version: str | None = None

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def downstream_of(self, name: str) -> list[str]:
        """Stages that list `name` in their inputs, in spec order."""
        return [s.name for s in self.stages if name in s.inputs]

    def streamed_edges(self) -> list[tuple[str, str, Edge]]:
        """(producer, consumer, edge) of every streamed edge, in spec order."""
        return [(edge.stage, s.name, edge) for s in self.stages for edge in s.streams]

    @property
    def endpoint_stages(self) -> tuple[Stage, Stage] | None:
        """(entry, last) of a pipeline that has one endpoint: the one stage without inputs,
        an ar stage (the client's requests enter there), and the one stage no other takes
        from (its output is the answer); None for other shapes (several of either)."""
        sources = [s for s in self.stages if not s.inputs]
        sinks = [s for s in self.stages if not self.downstream_of(s.name)]
        if len(sources) != 1 or len(sinks) != 1 or sources[0].role != "ar":
            return None
        return sources[0], sinks[0]


def parse_pipeline(body: Mapping[str, Any]) -> Pipeline:
    """The typed view of an OmniPipeline body that `admission.admit` accepts (the body as
    written: the server's view is made here). Checks nothing: use `admission.admit`, which
    returns this view of what it checked, to check a body."""
    return pipeline_view(crd.server_view(crd.openapi_schema(), dict(body)))


def pipeline_view(body: Mapping[str, Any]) -> Pipeline:
    """The typed view of an admitted body in the API server's view (`crd.server_view`)."""
    meta = body["metadata"]
    spec = body["spec"]
    model = spec["model"]
    cache = model.get("cache")
    token = model.get("hubTokenSecretRef")
    observability = spec["observability"]
    pipeline = Pipeline(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        image=spec["image"],
        image_pull_policy=spec["imagePullPolicy"],
        image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or []),
        service_account=spec.get("serviceAccountName"),
        vllm_version=(meta.get("annotations") or {}).get(naming.VLLM_VERSION_ANNOTATION),
        model=Model(
            name=model["name"], path=model.get("path") or None, revision=model.get("revision") or None,
            cache_claim=cache["pvc"]["claimName"] if cache else None,
            cache_read_only=bool(cache["pvc"]["readOnly"]) if cache else False,
            cache_mount_path=cache["mountPath"] if cache else "/models",
            hub_token_secret=token["name"] if token else None,
            hub_token_key=token["key"] if token else "token",
        ),
        stages=tuple(_stage(raw, spec["image"]) for raw in spec["stages"]),
        observability=Observability(
            metrics=observability["metrics"],
            otlp_endpoint=(observability.get("tracing") or {}).get("otlpEndpoint") or None,
            stuck_transfer_seconds=observability["alerts"]["stuckTransferSeconds"],
            stalled_stream_seconds=observability["alerts"]["stalledStreamSeconds"],
            **({"prometheus_url": observability["prometheusUrl"]} if observability.get("prometheusUrl") else {}),
        ),
    )
    return dataclasses.replace(pipeline, revision=revision_of(pipeline))


#: A revision is this many hex digits of the hash (a label value and a name suffix).
REVISION_CHARS = 10
#: Stage fields that do not make a revision: how many pods, and how they are replaced.
_NOT_IN_REVISION = ("replicas", "autoscaling", "rollout")


def revision_of(pipeline: "Pipeline") -> str:
    """The pipeline's revision: a hash of everything its stages must agree on, from the typed
    view that every rendered pod comes from (so two specs that render the same pods have the
    same revision, whatever defaults they spell out): the images, the model, every stage's
    template (all of it but replicas, autoscaling and rollout), the observability the stages
    are configured with, and the KV payload format version (omni_contract.kv_wire, the
    runtime protocol's WIRE_VERSION). A new revision gets workloads of its own."""
    view = dataclasses.asdict(pipeline)
    for key in ("name", "namespace", "uid", "generation", "revision", "vllm_version"):
        view.pop(key)
    view["observability"].pop("prometheus_url")
    view["observability"].pop("stalled_stream_seconds")  # the operator's threshold: no stage reads it
    for stage in view["stages"]:
        for key in _NOT_IN_REVISION:
            stage.pop(key)
        if not stage["streams"]:
            # A pipeline without streamed edges keeps the revision it had before they existed
            # (its pods are not rolled by an operator upgrade).
            stage.pop("streams")
    view["kv_wire_version"] = KV_WIRE_VERSION
    text = json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_CHARS]


def _quantity_float(value: Any) -> float:
    """A target as KEDA and the HPA's metrics read it, a float64 (inf beyond its range:
    `graph_problems` refuses it)."""
    return float(parse_quantity(value))


def _stage(raw: Mapping[str, Any], default_image: str) -> Stage:
    kv = raw["kvTransfer"]
    criteria = kv["criteria"]
    io_cpus = kv.get("ioCpus")
    resources = raw.get("resources") or {}
    return Stage(
        name=raw["name"], role=raw["role"], image=raw.get("image") or default_image,
        replicas=raw["replicas"], gpus=raw["gpus"], shm_size=raw["shmSize"],
        kv=KvTransfer(send=kv["send"], criteria_type=criteria["type"], token_id=criteria.get("tokenId"),
                      timeout_seconds=kv["timeoutSeconds"], io_cpus=None if io_cpus in (None, "auto") else io_cpus),
        inputs=tuple(raw.get("inputs") or ()),
        resources={k: dict(v) for k, v in resources.items() if v},
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        engine_args=dict(raw.get("engineArgs") or {}),
        env=tuple(raw.get("env") or ()),
        rollout=_rollout(raw.get("rollout") or {}, raw["gpus"]),
        autoscaling=_autoscaling(raw.get("autoscaling")),
        input=_input(raw.get("input")),
        streams=tuple(Edge(entry["stage"], STREAM, parse_stream(_stream_settings(entry), "streams"))
                      for entry in raw.get("streams") or ()),
    )


def _stream_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``streams[]`` entry's settings, as the contract's ``stream`` mapping keys them."""
    return {k: v for k, v in entry.items() if k != "stage"}


def stream_problems(view: Mapping[str, Any]) -> list[Problem]:
    """The streamed edges' settings of a body in the server's view, checked by the contract
    (``omni_contract.edges.parse_stream``: what the CRD's bounds leave, such as a
    ``firstChunkSeconds`` above a ``streamSeconds`` left at its default), each naming its key.
    Run before `pipeline_view`, which takes them as checked."""
    problems: list[Problem] = []
    for i, stage in enumerate(view.get("spec", {}).get("stages") or ()):
        for j, entry in enumerate(stage.get("streams") or ()):
            where = f"spec.stages[{i}].streams[{j}]"
            try:
                parse_stream(_stream_settings(entry), where)
            except EdgeError as exc:
                field, _, message = str(exc).partition(" ")
                problems.append(Problem(field.rstrip(":"), message))
    return problems


def _input(raw: Mapping[str, Any] | None) -> StageInput | None:
    if raw is None:
        return None
    return StageInput(hook=raw.get("hook") or None,
                      sampling_params=dict(raw.get("samplingParams") or {}),
                      max_inputs=raw.get("maxInputs"), load_kv=bool(raw.get("loadKV", True)))


def _rollout(raw: Mapping[str, Any], gpus: int) -> Rollout:
    # GPUs are scarce: by default a GPU stage is replaced in place (no spare GPU needed), a
    # CPU stage surges one pod and never goes below its count (the Deployment defaults before).
    surge, unavailable = (0, 1) if gpus > 0 else (1, 0)
    return Rollout(int(raw.get("maxSurge", surge)), int(raw.get("maxUnavailable", unavailable)))


def _autoscaling(raw: Mapping[str, Any] | None) -> Autoscaling | None:
    if not raw:
        return None
    return Autoscaling(int(raw["minReplicas"]), int(raw["maxReplicas"]),
                       tuple(Metric(m["signal"], _quantity_float(m["target"])) for m in raw["metrics"]))


def graph_problems(pipeline: Pipeline) -> list[Problem]:
    """What no schema can state, each naming its field and the fix."""
    return graph_report(pipeline)[0]


def graph_report(pipeline: Pipeline) -> tuple[list[Problem], list[Problem]]:
    """(graph_problems, warnings): what the stages would run with but the user should know
    (the stage contract's engineArgs warnings: a vLLM the contract's table does not describe,
    an abbreviated flag, ...)."""
    problems: list[Problem] = []
    warnings: list[Problem] = []
    if pipeline.vllm_version is not None and not vllm_args.is_version(pipeline.vllm_version):
        problems.append(Problem(f"metadata.annotations[{naming.VLLM_VERSION_ANNOTATION!r}]",
                                f"{pipeline.vllm_version!r} is not a vLLM version: write the version the stages' "
                                "image runs, e.g. 0.33.1"))
    for i, stage in enumerate(pipeline.stages):
        where = f"spec.stages[{i}]"
        if stage.kv.send and not pipeline.downstream_of(stage.name):
            problems.append(Problem(f"{where}.kvTransfer.send", f"is true but no stage lists {stage.name!r} in its "
                                                                "inputs; add it to the receiving stage's inputs or "
                                                                "set send: false"))
        if stage.kv.io_cpus is not None:
            problems += _io_cpus(f"{where}.kvTransfer.ioCpus", stage.kv.io_cpus)
        for j, metric in enumerate(stage.autoscaling.metrics if stage.autoscaling else ()):
            if metric.target == float("inf"):
                problems.append(Problem(f"{where}.autoscaling.metrics[{j}].target",
                                        "is beyond the range of a 64-bit float, which KEDA's threshold and the HPA's "
                                        "metric value are read as; use a target below 1.7e308"))
        version = stage_vllm_version(pipeline, stage)
        problems += [_engine_arg(where, p) for p in engine_args_problems(stage.engine_args, sends_kv=stage.kv.send,
                                                                          vllm_version=version)]
        warnings += [_engine_arg(where, p) for p in engine_args_warnings(stage.engine_args, sends_kv=stage.kv.send,
                                                                          vllm_version=version)]
        problems += _gpus_for_parallelism(where, stage)
        warnings += _shm_over_memory_limit(where, stage)
        if stage.input is not None and vllm_args.applies(version):
            problems += [Problem(f"{where}.input.samplingParams" + (f".{f.key}" if f.key else ""), f.message)
                         for f in vllm_args.sampling_params_problems(stage.input.sampling_params)]
    problems += _stream_cadence_problems(pipeline)
    cycle = find_cycle({s.name: list(s.inputs) for s in pipeline.stages})
    if cycle:
        problems.append(Problem("spec.stages[].inputs", f"the stage graph has a cycle: {' -> '.join(cycle)}; "
                                                        "remove one of these inputs"))
    return problems, warnings


def _shm_over_memory_limit(where: str, stage: Stage) -> list[Problem]:
    """/dev/shm is memory the container's limit counts: a size over the limit is never all
    there (the stage is killed for memory first)."""
    limit = (stage.resources.get("limits") or {}).get("memory")
    try:
        over = limit is not None and parse_quantity(stage.shm_size) > parse_quantity(limit)
    except ValueError:  # not quantities: the schema says so
        return []
    if not over:
        return []
    return [Problem(f"{where}.shmSize", f"{stage.shm_size} is over the container's memory limit {limit}, which "
                                        "/dev/shm counts against: the stage is killed for memory before /dev/shm "
                                        "is full; lower shmSize, or raise resources.limits.memory")]


def _gpus_for_parallelism(where: str, stage: Stage) -> list[Problem]:
    """A stage on GPUs runs a worker on a GPU of its own for each of its data x tensor x
    pipeline parallel ranks: more ranks than the pod's GPUs, and vLLM cannot start (on CPUs,
    ``gpus: 0``, its ranks are processes)."""
    if stage.gpus <= 0:
        return []
    sizes = {}
    for dest in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        size = engine_arg_value(stage.engine_args, dest)
        sizes[dest] = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1
    needed = sizes["data_parallel_size"] * sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]
    if needed <= stage.gpus:
        return []
    asked = " x ".join(f"{dest.replace('_', '-')} {n}" for dest, n in sizes.items() if n > 1)
    return [Problem(f"{where}.gpus", f"is {stage.gpus}, but its engineArgs ask for {asked}: {needed} GPUs, one per "
                                     f"rank; set gpus: {needed}, or lower the parallelism")]


def max_model_len(stage: Stage) -> int | None:
    """The stage's ``max-model-len`` engine argument in any spelling (``max_model_len``,
    ``maxModelLen``; ``32k`` as vLLM reads it), or None where it is not set, is ``auto``, or
    is not a value vLLM takes (the engineArgs check reports that)."""
    length = engine_arg_value(stage.engine_args, "max_model_len")
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 \
        else None


def _stream_cadence_problems(pipeline: Pipeline) -> list[Problem]:
    """A streamed edge whose chunk an engine at either end cannot hold: a chunk of
    ``firstChunkTokens`` or ``chunkTokens`` output tokens is at least the producer's
    ``max-model-len`` (its requests end before they could fill one: the stream would never
    send a chunk of that size) or, for a vLLM consumer (an ar stage), its own (the request a
    chunk extends could never take it)."""
    problems: list[Problem] = []
    index = {s.name: i for i, s in enumerate(pipeline.stages)}
    for i, consumer in enumerate(pipeline.stages):
        for j, edge in enumerate(consumer.streams):
            producer = pipeline.stage(edge.stage)
            ends = [(producer, "producer")] + ([(consumer, "consumer")] if consumer.role == "ar" else [])
            for key, tokens in (("firstChunkTokens", edge.stream.first_chunk_tokens),
                                ("chunkTokens", edge.stream.chunk_tokens)):
                for end, what in ends:
                    limit = max_model_len(end)
                    if limit is not None and tokens >= limit:
                        problems.append(Problem(
                            f"spec.stages[{i}].streams[{j}].{key}",
                            f"is {tokens} tokens on the streamed edge {producer.name} -> {consumer.name}, but the "
                            f"{what} {end.name} runs with max-model-len {limit} "
                            f"(spec.stages[{index[end.name]}].engineArgs), which cannot hold a chunk of that size; "
                            f"set {key} below {limit}, or raise {end.name}'s max-model-len"))
                        break
    return problems


def stage_vllm_version(pipeline: Pipeline, stage: Stage) -> str:
    """The vLLM version a stage runs, as far as the pipeline tells: the one its image's tag
    names (`vllm_args.image_vllm_version`: ``...:0.2.0-vllm0.33.1``, ``vllm/vllm-openai:v0.33.1``),
    else the pipeline's annotation `omnipipeline.dev/vllm-version`, else the contract table's
    (the project's own image pins that vLLM)."""
    named = vllm_args.image_vllm_version(stage.image)
    if named is not None:
        return named
    if pipeline.vllm_version is not None and vllm_args.is_version(pipeline.vllm_version):
        return pipeline.vllm_version
    return vllm_args.table().version


def _engine_arg(where: str, problem: Any) -> Problem:
    """A stage contract finding at its field (the contract's own path under engineArgs)."""
    return Problem(f"{where}.engineArgs{problem.path}", problem.message)


def _io_cpus(where: str, value: str) -> list[Problem]:
    """The order and bound of a CPU list whose syntax the CRD's pattern accepted (the
    contract's rule, omni_contract/cpu_list.py). Whether the pod may use those CPUs is checked
    in the pod at engine start-up."""
    try:
        parse_cpu_list(value)
    except ValueError as exc:
        return [Problem(where, f"{exc}; use \"auto\" or a Linux CPU list such as \"3\" or "
                               "\"2-3,6\" (no spaces)")]
    return []


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
