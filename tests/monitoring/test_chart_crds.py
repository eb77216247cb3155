"""The chart's ServiceMonitor and PrometheusRule against the Prometheus Operator's real CRDs
(the upstream files kept as reference data next to the project, ../shared/reference/crds/,
not copied into it), with the operator's own schema and CEL evaluation (crd_check.py)."""
from __future__ import annotations

import copy

import pytest

from omni_operator.check import crd_check

from .chart import by_kind, render
from .conftest import ROOT
from .test_chart import ALL_ON, NON_DEFAULT

UPSTREAM = ROOT.parent / "shared" / "reference" / "crds"

pytestmark = pytest.mark.skipif(not UPSTREAM.is_dir(), reason=f"the upstream CRDs are not at {UPSTREAM}")


@pytest.mark.parametrize("values", [ALL_ON, NON_DEFAULT], ids=["all-toggles-on", "non-default"])
def test_the_charts_monitoring_objects_pass_the_upstream_crds(values):
    upstream = crd_check.CRDSet(UPSTREAM)
    objects = render(values)
    checked = by_kind(objects, "ServiceMonitor") + by_kind(objects, "PrometheusRule")
    assert {o["kind"] for o in checked} == {"ServiceMonitor", "PrometheusRule"}
    for obj in checked:
        assert upstream.check(obj) == [], obj["kind"]
    # With teeth: a rule without its expression is what the CRD refuses.
    rule = copy.deepcopy(by_kind(objects, "PrometheusRule")[0])
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert any("'expr' is a required property" in p for p in upstream.check(rule))
