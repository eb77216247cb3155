"""Shared valid and invalid OmniPipeline specs for the schema and validation tests."""
from __future__ import annotations

import copy
from typing import Any, Callable

from omnip_support import pipeline_body


def mutate(fn: Callable[[dict], Any], **kw: Any) -> dict:
    body = copy.deepcopy(pipeline_body(**kw))
    fn(body["spec"])
    return body


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(spec: dict) -> None:
        node = spec
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        last = keys[-1]
        if value is _DELETE:
            del node[last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return apply


_DELETE = object()

# (id, body, field named (the CRD's own field: the shared check evaluates it as the server
# does), text the CRD's rejection must contain)
BOTH_REJECT = [
    ("no-stages", mutate(_set("stages", [])), "spec.stages", "stages"),
    ("duplicate-stage", mutate(_set("stages.1.name", "thinker")), "spec.stages[1]", "unique"),
    ("stage-name-not-dns", mutate(_set("stages.0.name", "Thinker_1")), "spec.stages[0].name", "does not match"),
    ("unknown-input", mutate(_set("stages.1.inputs", ["thinkr"])), "spec.stages", "must name a stage"),
    ("self-input", mutate(_set("stages.0.inputs", ["thinker"])), "spec.stages", "cannot list itself"),
    ("special-token-without-id", mutate(_set("stages.0.kvTransfer.criteria", {"type": "special_token"})),
     "spec.stages[0].kvTransfer.criteria.tokenId", "tokenId is required"),
    ("token-id-without-special-token", mutate(_set("stages.0.kvTransfer.criteria", {"type": "prefill_finished", "tokenId": 7})),
     "spec.stages[0].kvTransfer.criteria.tokenId", "tokenId is required"),
    ("bad-criteria-type", mutate(_set("stages.0.kvTransfer.criteria", {"type": "sometimes"})),
     "spec.stages[0].kvTransfer.criteria.type", "is not one of"),
    ("bad-role", mutate(_set("stages.0.role", "vocoder")), "spec.stages[0].role", "is not one of"),
    ("zero-replicas", mutate(_set("stages.0.replicas", 0)), "spec.stages[0].replicas", "minimum"),
    ("negative-gpus", mutate(_set("stages.0.gpus", -1)), "spec.stages[0].gpus", "minimum"),
    ("send-from-generation", mutate(_set("stages.2.kvTransfer", {"send": True})),
     "spec.stages[2].kvTransfer.send", "only supported on stages with role 'ar'"),
    ("zero-timeout", mutate(_set("stages.0.kvTransfer.timeoutSeconds", 0)), "spec.stages[0].kvTransfer.timeoutSeconds", "minimum"),
    ("io-cpus-with-spaces", mutate(_set("stages.0.kvTransfer.ioCpus", "2, 3")), "spec.stages[0].kvTransfer.ioCpus", "does not match"),
    ("io-cpus-a-list", mutate(_set("stages.0.kvTransfer.ioCpus", [2, 3])), "spec.stages[0].kvTransfer.ioCpus", "must be a string"),
    ("io-cpus-without-send", mutate(_set("stages.2.kvTransfer", {"ioCpus": "1"})),
     "spec.stages[2].kvTransfer.ioCpus", "only used by a stage that sends"),
    ("no-image", mutate(_set("image", _DELETE)), "spec", "'image' is a required property"),
    ("no-model-name", mutate(_set("model", {"path": "/models/x"})), "spec.model", "'name' is a required property"),
    ("names-too-long", mutate(lambda s: None, name="p" * 40, stages=[{"name": "s" * 30, "role": "ar"}]),
     "spec.stages", "at most 63 characters"),
    ("reserved-env", mutate(_set("stages.0.env", [{"name": "OMNI_STAGE", "value": "x"}])), "spec.stages[0].env[0].name", "OMNI_"),
    ("gpu-in-resources", mutate(_set("stages.0.resources", {"limits": {"nvidia.com/gpu": 2}})),
     "spec.stages[0].resources.limits", "set gpus instead"),
    ("bad-quantity", mutate(_set("stages.0.resources", {"requests": {"memory": "lots"}})),
     "spec.stages[0].resources.requests.memory", "non-negative quantity"),
    ("bad-shm-size", mutate(_set("stages.0.shmSize", "big")), "spec.stages[0].shmSize", "positive quantity"),
    ("bad-otlp-endpoint", mutate(_set("observability", {"tracing": {"otlpEndpoint": "collector:4318"}})),
     "spec.observability.tracing.otlpEndpoint", "does not match"),
    ("stream-not-an-input", mutate(_set("stages.1.streams", [{"stage": "code2wav"}])),
     "spec.stages[1].streams", "not one of the stage's inputs"),
    ("stream-from-a-stage-that-does-not-send", mutate(lambda s: (_set("stages.1.streams", [{"stage": "thinker"}])(s),
                                                                 _set("stages.0.kvTransfer.send", False)(s),
                                                                 _set("stages.1.kvTransfer.send", False)(s))),
     "spec.stages", "thinker does not send KV"),
    ("stream-deadline-zero", mutate(_set("stages.1.streams", [{"stage": "thinker", "gapSeconds": 0}])),
     "spec.stages[1].streams[0].gapSeconds", "greater than 0"),
]

# Rules the schema cannot state: only the operator catches these.
OPERATOR_REJECTS = [
    ("cycle", mutate(_set("stages.0.inputs", ["code2wav"])), "spec.stages[].inputs", "cycle: thinker -> talker -> code2wav -> thinker"),
    ("send-with-no-receiver", mutate(_set("stages.2", {"name": "code2wav", "role": "ar", "inputs": ["talker"], "kvTransfer": {"send": True}})),
     "spec.stages[2].kvTransfer.send", "no stage lists 'code2wav'"),
    ("reserved-engine-arg", mutate(_set("stages.0.engineArgs", {"port": 9000})), "spec.stages[0].engineArgs.port", "fixed at 8000"),
    ("io-cpus-descending", mutate(_set("stages.0.kvTransfer.ioCpus", "3-1")), "spec.stages[0].kvTransfer.ioCpus", "descending CPU range '3-1'"),
    ("stream-chunk-over-max-model-len", mutate(lambda s: (_set("stages.1.streams", [{"stage": "thinker"}])(s),
                                                          _set("stages.0.engineArgs", {"max-model-len": 16})(s))),
     "spec.stages[1].streams[0].chunkTokens", "producer thinker runs with max-model-len 16"),
    ("io-cpus-above-the-bound", mutate(_set("stages.0.kvTransfer.ioCpus", "0,70000")), "spec.stages[0].kvTransfer.ioCpus",
     "CPU id above 65535: '70000'"),
]
