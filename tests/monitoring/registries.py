"""The metric names (and their labels) that the runtime, the operator and vLLM export.

Each comes from its component's own code: the runtime's and the operator's
prometheus_client registries, and vLLM's metric definitions (read from its source without
importing vLLM, which would load torch).
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from prometheus_client import CollectorRegistry

from omni_mixin import metrics as m

# Labels every scraped series can carry, added by the scrape (see docs/monitoring.md).
SCRAPE_LABELS = frozenset(m.SCRAPE_LABELS) | {"job", "instance"}
# Series Prometheus itself writes for every target.
PROMETHEUS_SYNTHETIC = {"up": frozenset()}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def _expand(name: str, kind: str) -> list[str]:
    if kind == "counter" and name.endswith("_total"):
        name = name[: -len("_total")]
    suffixes = _SUFFIXES.get(kind)
    return [name + s for s in suffixes] if suffixes else [name]


def from_registry(registry) -> dict[str, frozenset[str]]:
    """Sample names -> label names of a prometheus_client registry."""
    names: dict[str, set[str]] = {}
    for family in registry.collect():
        base = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        for name in _expand(family.name, family.type):
            names[name] = set(base) | ({"le"} if name.endswith("_bucket") else set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in names.items()}


def runtime() -> dict[str, frozenset[str]]:
    """The AR stage's families (the ledger's and the per-edge ones) and the receiving stage's."""
    from omni_runtime.observability.edge_metrics import build_registry as build_edge_registry
    from omni_runtime.observability.receiver_metrics import build_registry as build_receiver_registry
    from omni_runtime.observability.metrics import build_registry
    from omni_contract.edges import StreamSettings
    from omni_runtime.observability.stream_metrics import StreamMetrics

    names = from_registry(build_registry(stage="s", model_name="m")[0])
    streams = CollectorRegistry()
    StreamMetrics("s", "m", streams, to_stages={"t": StreamSettings()},
                  from_stages={"u": StreamSettings()})
    names.update(from_registry(streams))
    names.update(from_registry(build_edge_registry(stage="s", model_name="m", to_stages=["t"])[0]))
    names.update(from_registry(build_receiver_registry(stage="s", model_name="m", from_stages=["u"])[0]))
    return names


def operator() -> dict[str, frozenset[str]]:
    from omni_operator.controller.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    # Bind one child of each labelled family so that its label names show in the samples.
    metrics.reconciles.labels("error")
    metrics.api_call("get", "Deployment")
    return from_registry(metrics.registry)


def vllm() -> dict[str, frozenset[str]]:
    """vLLM's `vllm:` families, from the definitions in vllm/v1/metrics/loggers.py."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    tree = ast.parse(source.read_text())
    kinds = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
    names: dict[str, frozenset[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        kind = kinds.get(node.func.attr)
        keywords = {k.arg: k.value for k in node.keywords}
        name = keywords.get("name")
        if kind is None or not isinstance(name, ast.Constant):
            continue
        # labelnames=labelnames + ["finished_reason"]: the base labels plus literals.
        labels = {"model_name", "engine"}
        if "labelnames" in keywords:
            labels |= {
                c.value for c in ast.walk(keywords["labelnames"])
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
        for sample in _expand(name.value, kind):
            names[sample] = frozenset(labels | ({"le"} if sample.endswith("_bucket") else set()))
    return names
