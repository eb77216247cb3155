"""The generated Grafana dashboards: structure, portability, and every query checked
against a real Prometheus and against the metric registries of the code that exports it."""
from __future__ import annotations

import json
import re

import pytest

from omni_mixin import metrics as m
from omni_mixin.alerts import rule_groups
from omni_mixin.dashboards import DASHBOARDS
from omni_mixin.grafana import SCHEMA_VERSION

from . import registries
from .conftest import ROOT
from .promql_names import grouping_labels, selectors, substitute_grafana_variables

LOADED = {name: json.loads((ROOT / "dashboards" / name).read_text()) for name in DASHBOARDS}
KV, PIPELINES = LOADED["omni-kv-transfers.json"], LOADED["omni-pipelines.json"]


def panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def panel_queries(dashboard) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p["targets"]]


def variable_queries(dashboard) -> list[str]:
    """The series selectors inside `label_values(selector, label)` variable queries."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["definition"])
            assert match, var["definition"]
            out.append(match.group(1))
    return out


ALL_QUERIES = sorted(
    {q for d in LOADED.values() for q in panel_queries(d) + variable_queries(d)}
)
ALERT_EXPRS = [r["expr"] for g in rule_groups()["groups"] for r in g["rules"]]


def test_dashboards_have_titles_uids_and_a_current_schema():
    assert KV["title"] == "Omni KV transfers"
    assert PIPELINES["title"] == "Omni pipelines"
    assert len({d["uid"] for d in LOADED.values()}) == len(LOADED)
    for dashboard in LOADED.values():
        assert dashboard["schemaVersion"] >= 39 and dashboard["schemaVersion"] == SCHEMA_VERSION
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", sorted(LOADED))
def test_variables_for_datasource_namespace_pipeline_and_stage(name):
    variables = {v["name"]: v for v in LOADED[name]["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "pipeline", "stage"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # Each later variable is narrowed by the earlier ones.
    assert '"$namespace"' in variables["pipeline"]["definition"]
    assert '"$pipeline"' in variables["stage"]["definition"]
    # Every stage is offered: the scrape's own series, which each stage pod has (sending,
    # receiving or the endpoint); a receiving stage exports no omni_kv_transfers, and from
    # that family it could not be picked (an outside review).
    for variable in ("namespace", "pipeline", "stage"):
        assert variables[variable]["definition"].startswith('label_values(up{pipeline!=""'), variable
    for expr in panel_queries(LOADED[name]):
        if "omni_operator_" not in expr:  # the operator is not part of any pipeline
            assert all(f'=~"${v}"' in expr for v in ("namespace", "pipeline", "stage")), expr


def _datasources(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from _datasources(value)
    elif isinstance(node, list):
        for item in node:
            yield from _datasources(item)


@pytest.mark.parametrize("name", sorted(LOADED))
def test_no_hard_coded_datasource_uid(name):
    found = list(_datasources(LOADED[name]))
    assert found
    for datasource in found:
        if datasource.get("type") == "grafana":  # Grafana's built-in annotations
            assert datasource["uid"] == "-- Grafana --"
        else:
            assert datasource == {"type": "prometheus", "uid": "${datasource}"}


def test_kv_transfers_dashboard_has_the_issue_panels():
    by_title = {p["title"]: p for p in panels(KV)}
    assert set(by_title) >= {
        "Transfers by state",
        "Held KV blocks",
        "Age of the oldest active transfer",
        "Age of the oldest held transfer",
        "Transfer duration",
        "Resolutions by outcome",
        "Transfers started by trigger",
        "Transfer bytes per second",
        "Receiver rejections",
        # a receiving stage's inbox (an outside review: its families were on no panel)
        "Payloads waiting in the inbox",
        "Bytes waiting in the inbox",
        "Payloads dropped unconsumed",
        "Consumer wait for a payload",
    }
    legends = [t["legendFormat"] for t in by_title["Transfer duration"]["targets"]]
    assert [l.split()[0] for l in legends] == ["p50", "p95", "p99"]
    # Age panels draw the alert threshold as a line.
    for title in ("Age of the oldest active transfer", "Age of the oldest held transfer"):
        defaults = by_title[title]["fieldConfig"]["defaults"]
        assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
        assert defaults["thresholds"]["steps"][-1]["value"] == 300


def test_kv_transfers_dashboard_has_a_per_edge_row():
    rows = [p["title"] for p in KV["panels"] if p["type"] == "row"]
    assert any(r.startswith("Per edge") for r in rows)
    by_title = {p["title"]: p for p in panels(KV)}
    edge_panels = {
        "Transfers in flight per edge",
        "Age of the oldest unanswered transfer per edge",
        "Failed or expired share per edge",
        "Resolutions per edge by outcome",
        "Delivered transfer duration per edge (p95)",
        "Received per upstream stage",
    }
    assert set(by_title) >= edge_panels
    for title in edge_panels - {"Received per upstream stage"}:
        (query,) = panel_queries({"panels": [by_title[title]]})
        assert "to_stage" in grouping_labels(query), title
    assert "from_stage" in grouping_labels(by_title["Received per upstream stage"]["targets"][0]["expr"])
    age = by_title["Age of the oldest unanswered transfer per edge"]["fieldConfig"]["defaults"]
    assert age["thresholds"]["steps"][-1]["value"] == 300


def test_kv_transfers_dashboard_has_a_streams_row_per_edge():
    rows = [p["title"] for p in KV["panels"] if p["type"] == "row"]
    assert rows[-1].startswith("Streams")
    by_title = {p["title"]: p for p in panels(KV)}
    stream_panels = {
        "Streams open and held per edge", "Streams waiting per edge", "Age of the oldest stream wait per edge",
        "Time to first chunk per edge", "Chunk hop per edge", "Gap between chunks per edge",
        "Chunks per edge by outcome", "Streams per edge by outcome", "Time out of credit per edge",
    }
    assert set(by_title) >= stream_panels
    for title in stream_panels:  # every series names its edge, whole
        for query in panel_queries({"panels": [by_title[title]]}):
            assert {"from_stage", "to_stage"} <= grouping_labels(query), title
    hop = [t["legendFormat"].split()[0] for t in by_title["Chunk hop per edge"]["targets"]]
    assert hop == ["p50", "p99"]
    age = by_title["Age of the oldest stream wait per edge"]
    assert "> 0" in age["targets"][0]["expr"]  # 0 is "none waits", never "since 1970"
    assert age["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 120


def test_pipelines_dashboard_has_the_issue_panels():
    titles = {p["title"] for p in panels(PIPELINES)}
    assert titles >= {
        "Stage readiness",
        "Request rate",
        "End-to-end request latency",
        "KV-cache usage",
        "Reconcile errors",
    }


@pytest.mark.parametrize("expr", ALL_QUERIES)
def test_query_is_accepted_by_prometheus(empty_prometheus, expr):
    """Prometheus' own parser and type checker (an instant query against an empty TSDB)."""
    answer = empty_prometheus.query(substitute_grafana_variables(expr))
    assert answer["status"] == "success", answer


def test_prometheus_rejects_a_broken_query(empty_prometheus):
    """The check above is not vacuous."""
    answer = empty_prometheus.query("sum by (stage) (rate(omni_kv_transfers_started_total))")
    assert answer["status"] == "error" and answer["errorType"] == "bad_data"


@pytest.fixture(scope="module")
def known_metrics() -> dict[str, frozenset[str]]:
    names = dict(registries.PROMETHEUS_SYNTHETIC)
    names.update(registries.runtime())
    names.update(registries.operator())
    names.update(registries.vllm())
    return names


@pytest.mark.parametrize("expr", ALL_QUERIES + ALERT_EXPRS)
def test_every_queried_metric_and_label_exists(known_metrics, expr):
    for name, labels in selectors(expr):
        assert name in known_metrics, f"{name} is exported by no registry"
        assert labels <= known_metrics[name] | registries.SCRAPE_LABELS, (name, labels)


@pytest.mark.parametrize("expr", ALL_QUERIES + ALERT_EXPRS)
def test_grouping_only_by_bounded_labels(expr):
    allowed = set(m.STAGE_LABELS) | registries.SCRAPE_LABELS | set(m.EDGE_LABELS) | {
        "le", "state", "trigger", "outcome", "result", "reason", "finished_reason"
    }
    assert grouping_labels(expr) <= allowed, expr
