"""A pipeline chain as real processes for the e2e tests: stage configs in the stage contract's
form on local ports (the operator's rendering of the same pipeline is tested against them in
tests/operator), each stage an ``omni-stage`` process, and the pipeline's endpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from procs import StageProcess, free_port, stop_groups, wait_all_healthy

from omni_runtime.devtools.tiny_model import ensure_tiny_model

MODEL = "tiny-qwen2"
ENGINE_ARGS = {"dtype": "float32", "max-model-len": 256, "kv-cache-memory-bytes": 32 << 20,
               "enforce-eager": True}


def chain_configs(stages: list[dict[str, Any]], *, pipeline: str = "chain",
                  timeout_seconds: float = 10, otlp_endpoint: str | None = None
                  ) -> dict[str, dict[str, Any]]:
    """The stage configs of a chain, each stage fed by the one before, and the endpoint's
    (``"endpoint"``). ``stages``: ``{"name", "role", "input"?, "engineArgs"?, "stream"?}`` in
    order (``stream``: the edge into the stage is streamed, with these settings);
    ``otlp_endpoint``: where the vLLM stages export their traces (the others follow the
    standard OTEL_* variables)."""
    model = {"name": MODEL, "path": str(ensure_tiny_model())}
    names = [s["name"] for s in stages]
    ports = {name: {"http": free_port(), "kv": free_port()} for name in [*names, "endpoint"]}
    configs: dict[str, dict[str, Any]] = {}
    for i, stage in enumerate(stages):
        name = stage["name"]
        config: dict[str, Any] = {"pipeline": pipeline, "stage": name, "role": stage["role"],
                                  "model": model, "ports": ports[name]}
        if i:
            config["inputs"] = [edge(names[i - 1], stage)]
        if stage["role"] == "ar":
            config["engineArgs"] = {**ENGINE_ARGS, **stage.get("engineArgs", {})}
            if otlp_endpoint:
                config["observability"] = {"tracing": {"otlpEndpoint": otlp_endpoint}}
            if stage.get("input"):
                config["input"] = stage["input"]
            if i + 1 < len(stages):
                config["kvTransfer"] = {"send": True, "timeoutSeconds": timeout_seconds}
                into = edge(names[i + 1], stages[i + 1])
                config["downstream"] = [
                    {**(into if isinstance(into, dict) else {"stage": into}),
                     "endpoint": f"127.0.0.1:{ports[names[i + 1]]['kv']}"}]
        configs[name] = config
    configs["endpoint"] = {
        "pipeline": pipeline, "stage": "endpoint", "role": "endpoint", "model": model,
        "ports": ports["endpoint"],
        "endpoint": {
            "entry": {"stage": names[0], "url": f"http://127.0.0.1:{ports[names[0]]['http']}"},
            "sink": names[-1], "advertise": f"http://127.0.0.1:{ports['endpoint']['http']}",
            "edges": [{"from": a, "to": b, "timeoutSeconds": timeout_seconds}
                      for a, b in zip(names, names[1:])]}}
    return configs


def edge(stage: str, into: dict[str, Any]) -> str | dict[str, Any]:
    """The edge from ``stage`` into the stage ``into`` as a config writes it (the contract's
    form: omni_contract/edges.py)."""
    from omni_contract.edges import STREAM, Edge, parse_stream

    if "stream" not in into:
        return stage
    return Edge(stage, STREAM, parse_stream(into["stream"], "stream")).to_config()


#: vLLM's engine core runs the model itself (its one-process executor: a one-GPU stage's
#: topology; on this CPU build vLLM would otherwise add a worker process to every engine).
#: The tests of vLLM's multi-process CPU executor under a stage are test_pipeline_e2e.py,
#: test_soak.py and the monitoring e2e tests; a chain test that needs it passes its own.
CHAIN_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def running(configs: dict[str, dict[str, Any]], workdir: Path,
            env: dict[str, str] | None = None) -> Iterator[dict[str, StageProcess]]:
    """Every stage launched at once, the last first (a sender's first hand-off waits for a
    request, which comes only once every stage is healthy), the endpoint last; each then
    waited for; all stopped side by side on leaving (the endpoint and upstream stages
    signalled first)."""
    procs = {name: StageProcess(config, workdir, env={**CHAIN_ENV, **(env or {})})
             for name, config in configs.items()}
    order = [name for name in reversed(list(configs)) if name != "endpoint"] + ["endpoint"]
    try:
        for name in order:
            procs[name].launch()
        wait_all_healthy([procs[name] for name in order], timeout=240)
        yield procs
    finally:
        stop_groups([procs[n].proc for n in reversed(order) if procs[n].proc is not None], 60)
