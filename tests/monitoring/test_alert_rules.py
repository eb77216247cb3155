"""The alert rules: promtool checks them and runs their unit tests; every alert is complete."""
from __future__ import annotations

import re
import subprocess

import yaml

from omni_mixin import metrics as m
from omni_mixin import render
from omni_mixin.alerts import rule_groups
from omni_mixin.config import Config

from .conftest import ROOT, RULE_TESTS, RULES_FILE
from .promql_names import grouping_labels, selectors

ALERTS = [rule for group in rule_groups()["groups"] for rule in group["rules"]]
EXPECTED = {
    "OmniKVTransferStuck",
    "OmniKVBlocksHeldTooLong",
    "OmniKVTransferFailureRateHigh",
    "OmniKVEdgeTransferStuck",
    "OmniKVEdgeFailureRateHigh",
    "OmniStageDown",
    "OmniKVMetricsAbsent",
    "OmniKVTransportThreadDown",
    "OmniOperatorReconcileErrors",
    "OmniStagesNotScraped",
    "OmniStreamStalled",
    "OmniStreamDeadlineRate",
    "OmniStreamSendFailures",
}


def test_the_rule_file_holds_the_issue_alerts():
    loaded = yaml.safe_load(RULES_FILE.read_text())
    names = {r["alert"] for g in loaded["groups"] for r in g["rules"]}
    assert names == EXPECTED


def test_promtool_check_rules_is_clean(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES_FILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPECTED)} rules found" in result.stdout
    # promtool reports lint findings (e.g. duplicate rules) on stderr even on success.
    assert result.stderr.strip() == ""


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run([promtool, "test", "rules", *map(str, sorted(RULE_TESTS.glob("*.yaml")))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_catch_a_wrong_threshold(promtool, tmp_path):
    """The unit tests are not vacuous: a stuck threshold of an hour breaks them."""
    wrong = tmp_path / "wrong.rules.yaml"
    wrong.write_text(render.rules_file(Config(stuck_transfer_seconds=3600)))
    tests = (RULE_TESTS / "omni-pipeline.test.yaml").read_text()
    tests = tests.replace("../../../alerts/omni-pipeline.rules.yaml", str(wrong))
    (tmp_path / "t.yaml").write_text(tests)
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "alertname: OmniKVTransferStuck" in result.stdout + result.stderr
    assert "OmniKVBlocksHeldTooLong, time" not in result.stdout + result.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing():
    suites = [yaml.safe_load(p.read_text()) for p in RULE_TESTS.glob("*.yaml")]
    cases = [c for s in suites for t in s["tests"] for c in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert firing == EXPECTED
    assert quiet == EXPECTED


def _runbook_anchors() -> set[str]:
    text = (ROOT / "docs" / "runbooks.md").read_text()
    # GitHub's heading anchors: lower case, spaces to dashes, punctuation dropped.
    return {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#{2,3} (.+)$", text, flags=re.M)
    }


def test_every_alert_has_severity_summary_description_and_runbook():
    anchors = _runbook_anchors()
    for rule in ALERTS:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert "{{" not in annotations["summary"], f"{name}: the summary must be static"
        assert "$labels" in annotations["description"], f"{name}: describe which stage"
        url = annotations["runbook_url"]
        assert url.startswith(Config().runbook_base_url + "#"), name
        assert url.split("#", 1)[1] in anchors, f"{name}: no heading for it in docs/runbooks.md"
        assert rule["for"], name


def test_alerts_group_only_by_bounded_labels():
    """Alert label sets come from the stage identity, never from request or block ids."""
    allowed = set(m.STAGE_LABELS) | set(m.SCRAPE_LABELS) | {"le"}
    for rule in ALERTS:
        edge = rule["alert"].startswith("OmniKVEdge")
        stream = rule["alert"].startswith("OmniStream")
        names = {"to_stage"} if edge else {"from_stage", "to_stage"} if stream else set()
        assert grouping_labels(rule["expr"]) <= allowed | names, rule["alert"]
        for label in names:  # the edge names itself: kept through every aggregation
            assert label in rule["annotations"]["description"]
            assert "sum by" not in rule["expr"] or label in grouping_labels(rule["expr"])


def test_alerts_query_only_the_contract_state_and_outcome_values():
    for rule in ALERTS:
        for name, _labels in selectors(rule["expr"]):
            assert name in {
                "up", m.KV_TRANSFERS, m.KV_OLDEST_START, m.KV_RESOLVED, m.OPERATOR_RECONCILES, m.OPERATOR_PIPELINES,
                m.KV_TRANSPORT_THREAD_UP, m.KV_EDGE_OLDEST_START, m.KV_EDGE_RESOLVED,
                m.KV_STREAM_OLDEST_WAIT, m.KV_STREAMS_RESOLVED, m.KV_STREAM_CHUNKS,
            }, (rule["alert"], name)
        # A stream family's outcomes are the contract's (ARCHITECTURE.md, "Streams").
        for family, outcomes in ((m.KV_STREAMS_RESOLVED, {"finished", "producer_error", "consumer_error", "expired",
                                                          "aborted"}),
                                 (m.KV_STREAM_CHUNKS, {"acked", "failed", "expired"})):
            for value in re.findall(re.escape(family) + r'\{outcome=~"([^"]*)"\}', rule["expr"]):
                assert set(value.split("|")) <= outcomes, (rule["alert"], value)
    stuck = next(r for r in ALERTS if r["alert"] == "OmniKVTransferStuck")["expr"]
    assert 'state="active"' in stuck and "> 0" in stuck


def test_the_runbooks_select_a_stage_within_its_pipeline():
    """A stage's name is unique within its pipeline only: a selector of a stage alone lists
    the same-named stages of every pipeline in the namespace (an outside review)."""
    text = (ROOT / "docs" / "runbooks.md").read_text()
    selectors = re.findall(r"-l\s+([^\s`]+)", text.replace("\n", " "))
    stage_alone = [s for s in selectors if "omnipipeline.dev/stage=" in s and "omnipipeline.dev/pipeline=" not in s]
    assert selectors and not stage_alone, stage_alone
