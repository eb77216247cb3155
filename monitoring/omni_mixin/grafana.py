"""A small Grafana dashboard builder (plain dicts; the JSON is what Grafana imports).

Only what the omni dashboards use. Every panel and query refers to the `datasource`
variable, never to a datasource uid, so the dashboards import into any Grafana.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Grafana 10.4/11 write 39; anything older is migrated on load.
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "includeAll": False,
        "multi": False,
    }


def query_variable(name: str, label: str, metric_selector: str) -> dict[str, Any]:
    """A multi-value variable over the values of label `name` on `metric_selector`.

    "All" is `.*`, so `label=~"$var"` also matches series that lack the label (a local run
    has no Kubernetes namespace or pod)."""
    definition = f"label_values({metric_selector}, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": {"query": definition, "refId": f"{name}-variable-query", "qryType": 1},
        "refresh": 2,  # on time-range change: pipelines come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "sort": 1,
        "current": {},
        "hide": 0,
        "regex": "",
        "options": [],
    }


def target(expr: str, legend: str, ref_id: str) -> dict[str, Any]:
    return {
        "refId": ref_id,
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "instant": False,
        "editorMode": "code",
    }


@dataclass
class Panel:
    title: str
    description: str
    queries: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    threshold: float | None = None  # drawn as a red line (e.g. an alert's threshold)
    stack: bool = False
    min: float | None = 0
    extra_defaults: dict[str, Any] = field(default_factory=dict)

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        if self.threshold is not None:
            steps.append({"color": "red", "value": self.threshold})
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "thresholds": {"mode": "absolute", "steps": steps},
            "color": {"mode": "palette-classic" if self.kind == "timeseries" else "thresholds"},
            **self.extra_defaults,
        }
        if self.min is not None:
            defaults["min"] = self.min
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 10,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
                "thresholdsStyle": {"mode": "line" if self.threshold is not None else "off"},
            }
            options: dict[str, Any] = {
                "legend": {
                    "displayMode": "table",
                    "placement": "bottom",
                    "showLegend": True,
                    "calcs": ["lastNotNull", "max"],
                },
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        else:
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background",
                "graphMode": "none",
                "textMode": "value_and_name",
                "orientation": "auto",
                "justifyMode": "auto",
            }
        return {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [
                target(expr, legend, chr(ord("A") + i))
                for i, (expr, legend) in enumerate(self.queries)
            ],
        }


@dataclass
class Row:
    title: str
    panels: list[Panel]


def dashboard(
    uid: str, title: str, description: str, variables: list[dict[str, Any]], rows: list[Row]
) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row in rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x, row_height = 0, 0
        for panel in row.panels:
            if x + panel.width > 24:  # wrap onto a new line of the grid
                x, y, row_height = 0, y + row_height, 0
            panels.append(panel.to_json(next_id, x, y))
            next_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["omni-pipeline"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": panels,
    }
