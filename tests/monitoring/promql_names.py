"""What a PromQL expression refers to, from a real PromQL parser's AST (promql-parser)."""
from __future__ import annotations

import re

import promql_parser

# Grafana's variables are not PromQL; the dashboards' queries are sent with them replaced.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
}


def substitute_grafana_variables(expr: str, value: str = ".*") -> str:
    for name, replacement in GRAFANA_SUBSTITUTIONS.items():
        expr = expr.replace(name, replacement)
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", value, expr)


def parse(expr: str):
    return promql_parser.parse(substitute_grafana_variables(expr))


def selectors(expr: str) -> list[tuple[str, frozenset[str]]]:
    """(metric name, label names matched) for every vector selector in `expr`."""
    found: list[tuple[str, frozenset[str]]] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, frozenset(m.name for m in node.matchers.matchers)))

    promql_parser.walk(parse(expr), visit)
    return found


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)`, `without (...)`, `on (...)`, `ignoring (...)`, `group_x (...)`."""
    labels: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        if isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                labels.update(matching.labels)
            labels.update(node.modifier.group_labels or [])

    promql_parser.walk(parse(expr), visit)
    return labels
