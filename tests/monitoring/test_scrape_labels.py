"""The labels the scrape attaches (the operator's PodMonitor for stages, the chart's
ServiceMonitor for the operator) are the labels the alerts and dashboards filter and group on."""
from __future__ import annotations

import copy

import pytest

from omni_mixin import metrics as m
from omni_mixin.alerts import rule_groups
from omni_mixin.dashboards import DASHBOARDS
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.render import render_children

from . import registries
from .chart import one, render
from .promql_names import grouping_labels, selectors

# Labels Prometheus writes on every target whatever the relabeling.
PROMETHEUS_TARGET_LABELS = {"job", "instance"}
# Labels of the series themselves that queries may use beyond the scrape's.
OWN_LABELS = {"le", "state", "trigger", "outcome", "result", "reason", "finished_reason",
              "model_name", "engine", "verb", "kind", "phase", *m.EDGE_LABELS}
PIPELINE = {
    "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
    "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u-1", "generation": 1},
    "spec": {"image": "omni-stage:test", "model": {"name": "tiny"},
             "stages": [{"name": "ar", "role": "ar", "kvTransfer": {"send": True}},
                        {"name": "receiver", "role": "generation", "inputs": ["ar"]}]},
}


def podmonitor() -> dict:
    children = render_children(parse_pipeline(copy.deepcopy(PIPELINE)), podmonitor_available=True)
    return next(c for c in children if c["kind"] == "PodMonitor")


def target_labels(endpoint: dict) -> set[str]:
    return {r["targetLabel"] for r in endpoint.get("relabelings", [])}


def queries() -> list[str]:
    exprs = [t["expr"] for build in DASHBOARDS.values() for p in build()["panels"]
             for t in p.get("targets", [])]
    return exprs + [r["expr"] for g in rule_groups()["groups"] for r in g["rules"]]


def used_labels(expr: str) -> set[str]:
    return grouping_labels(expr) | {label for _, labels in selectors(expr) for label in labels}


def is_operator_query(expr: str) -> bool:
    return any(name.startswith("omni_operator_") for name, _ in selectors(expr))


def test_the_podmonitor_sets_exactly_the_mixins_scrape_labels():
    (endpoint,) = podmonitor()["spec"]["podMetricsEndpoints"]
    assert target_labels(endpoint) == set(m.SCRAPE_LABELS)
    assert endpoint["honorLabels"] is True  # the series' own `stage` is kept


@pytest.mark.parametrize("expr", [q for q in queries() if not is_operator_query(q)])
def test_stage_queries_use_only_labels_the_stage_scrape_provides(expr):
    (endpoint,) = podmonitor()["spec"]["podMetricsEndpoints"]
    assert used_labels(expr) <= target_labels(endpoint) | PROMETHEUS_TARGET_LABELS | OWN_LABELS, expr


def test_the_service_monitor_names_the_operator_by_namespace_and_pod_only():
    (endpoint,) = one(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor")["spec"]["endpoints"]
    assert target_labels(endpoint) == {"namespace", "pod"}
    sources = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert sources == {"namespace": ["__meta_kubernetes_namespace"], "pod": ["__meta_kubernetes_pod_name"]}
    # Stage-only labels never appear on the operator's target (OmniStageDown selects
    # targets by pipeline!="").
    assert not target_labels(endpoint) & {"pipeline", "stage"}


@pytest.mark.parametrize("expr", [q for q in queries() if is_operator_query(q)])
def test_operator_queries_use_only_labels_the_service_monitor_and_operator_provide(expr):
    """Each selector against its own target: an operator query may also ask whether any stage
    target exists (OmniStagesNotScraped), with the stage's labels there."""
    (endpoint,) = one(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor")["spec"]["endpoints"]
    operator_labels = set().union(*registries.operator().values())
    (stage_endpoint,) = podmonitor()["spec"]["podMetricsEndpoints"]
    ours = target_labels(endpoint) | PROMETHEUS_TARGET_LABELS | operator_labels
    stages = target_labels(stage_endpoint) | PROMETHEUS_TARGET_LABELS | OWN_LABELS
    for name, labels in selectors(expr):
        assert set(labels) <= (ours if name.startswith("omni_operator_") else stages), (name, expr)
    assert grouping_labels(expr) <= ours, expr


def test_label_checks_have_teeth():
    assert not used_labels('sum by (exported_stage) (omni_kv_transfers{pipeline="x"})') <= \
        set(m.SCRAPE_LABELS) | PROMETHEUS_TARGET_LABELS | OWN_LABELS
