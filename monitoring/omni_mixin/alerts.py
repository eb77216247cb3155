"""The alert rules: one source for alerts/omni-pipeline.rules.yaml and the chart's
PrometheusRule.

Every alert carries `severity`, a static `summary`, a templated `description` and a
`runbook_url` into docs/runbooks.md (anchor = the alert name in lower case).
"""
from __future__ import annotations

from typing import Any

from . import metrics as m
from .config import Config

STAGE_BY = ", ".join(m.STAGE_LABELS)
EDGE_BY = STAGE_BY + ", to_stage"
# Alert labels name the stage; descriptions refer to these labels.
WHERE = "{{ $labels.namespace }}/{{ $labels.pipeline }} stage {{ $labels.stage }}"
EDGE = WHERE + " to stage {{ $labels.to_stage }}"
# A streamed edge, named whole; `stage` is the end that reports it.
STREAM_BY = STAGE_BY + ", from_stage, to_stage"
STREAM = ("{{ $labels.namespace }}/{{ $labels.pipeline }} edge {{ $labels.from_stage }} -> "
          "{{ $labels.to_stage }} (at stage {{ $labels.stage }})")


def _alert(
    cfg: Config,
    name: str,
    expr: str,
    for_: str,
    severity: str,
    summary: str,
    description: str,
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr.strip() + "\n",
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{cfg.runbook_base_url}#{name.lower()}",
        },
    }


def _oldest_age_alert(cfg: Config, name: str, state: str, seconds, for_, severity, summary, what):
    """`what` completes "The oldest ... on <stage> (pod <pod>) has been <state> for <age>"."""
    # The gauge is 0 when no transfer is in `state`; `> 0` drops those series so that
    # time() - 0 (decades) never fires. The timestamp keeps ageing while the engine hangs,
    # which an age gauge updated by the engine itself would not.
    expr = f"""
time() - ({m.KV_OLDEST_START}{{state="{state}"}} > 0)
  > {seconds}
"""
    description = (
        f"The oldest {what} on {WHERE} (pod {{{{ $labels.pod }}}}) has been {state} for "
        "{{ $value | humanizeDuration }}."
    )
    return _alert(cfg, name, expr, for_, severity, summary, description)


def kv_transfer_rules(cfg: Config) -> list[dict[str, Any]]:
    failure_expr = f"""
(
  sum by ({STAGE_BY}) (rate({m.KV_RESOLVED}{{outcome=~"failed|expired"}}[{cfg.failure_rate_window}]))
/
  sum by ({STAGE_BY}) (rate({m.KV_RESOLVED}[{cfg.failure_rate_window}]))
) > {cfg.failure_ratio}
"""
    return [
        _oldest_age_alert(
            cfg,
            "OmniKVTransferStuck",
            "active",
            cfg.stuck_transfer_seconds,
            cfg.stuck_transfer_for,
            "critical",
            "A KV transfer has been active far longer than any transfer should take.",
            "KV transfer",
        ),
        _oldest_age_alert(
            cfg,
            "OmniKVBlocksHeldTooLong",
            "held",
            cfg.held_too_long_seconds,
            cfg.held_too_long_for,
            "warning",
            "A finished request's KV blocks stay allocated, waiting for its transfer.",
            "transfer holding a finished request's KV blocks",
        ),
        _alert(
            cfg,
            "OmniKVTransferFailureRateHigh",
            failure_expr,
            cfg.failure_rate_for,
            "warning",
            "Many KV transfers fail or expire.",
            f"{{{{ $value | humanizePercentage }}}} of the KV transfers resolved by {WHERE} "
            f"in the last {cfg.failure_rate_window} failed or expired.",
        ),
    ]


def kv_edge_rules(cfg: Config) -> list[dict[str, Any]]:
    """The stuck and failing conditions per edge of the pipeline graph: the alert's labels
    name the edge (`stage` sends to `to_stage`), so a fan-out says which of its edges is bad."""
    stuck_expr = f"""
time() - ({m.KV_EDGE_OLDEST_START} > 0)
  > {cfg.stuck_transfer_seconds}
"""
    failure_expr = f"""
(
  sum by ({EDGE_BY}) (rate({m.KV_EDGE_RESOLVED}{{outcome=~"failed|expired"}}[{cfg.failure_rate_window}]))
/
  sum by ({EDGE_BY}) (rate({m.KV_EDGE_RESOLVED}[{cfg.failure_rate_window}]))
) > {cfg.failure_ratio}
"""
    return [
        _alert(
            cfg,
            "OmniKVEdgeTransferStuck",
            stuck_expr,
            cfg.edge_stuck_for,
            "warning",
            "KV transfers to one downstream stage are stuck.",
            f"The oldest KV transfer from {EDGE} (pod {{{{ $labels.pod }}}}) has been unanswered "
            "for {{ $value | humanizeDuration }}.",
        ),
        _alert(
            cfg,
            "OmniKVEdgeFailureRateHigh",
            failure_expr,
            cfg.failure_rate_for,
            "warning",
            "Many KV transfers to one downstream stage fail or expire.",
            f"{{{{ $value | humanizePercentage }}}} of the KV transfers from {EDGE} resolved "
            f"in the last {cfg.failure_rate_window} failed or expired.",
        ),
    ]


def _share(cfg: Config, counter: str, outcomes: str) -> str:
    """The share of a streamed edge's resolutions (per reporting end) with these outcomes."""
    return f"""(
  sum by ({STREAM_BY}) (rate({counter}{{outcome=~"{outcomes}"}}[{cfg.failure_rate_window}]))
/
  sum by ({STREAM_BY}) (rate({counter}[{cfg.failure_rate_window}]))
)"""


def stream_rules(cfg: Config) -> list[dict[str, Any]]:
    """A streamed edge's stall, deadlines and send failures; each alert names the edge
    (`from_stage` -> `to_stage`) and the end that reports it (`stage`)."""
    stalled_expr = f"""
time() - ({m.KV_STREAM_OLDEST_WAIT} > 0)
  > {cfg.stalled_stream_seconds}
"""
    deadline_expr = f"""
{_share(cfg, m.KV_STREAMS_RESOLVED, "expired")} > {cfg.stream_deadline_ratio}
or
{_share(cfg, m.KV_STREAM_CHUNKS, "expired")} > {cfg.stream_deadline_ratio}
"""
    failure_expr = f"""
{_share(cfg, m.KV_STREAMS_RESOLVED, "producer_error")} > {cfg.stream_failure_ratio}
or
{_share(cfg, m.KV_STREAM_CHUNKS, "failed")} > {cfg.stream_failure_ratio}
"""
    return [
        _alert(
            cfg,
            "OmniStreamStalled",
            stalled_expr,
            cfg.stalled_stream_for,
            "critical",
            "A stream has waited far longer than its deadlines allow.",
            f"The oldest stream on {STREAM} (pod {{{{ $labels.pod }}}}) has waited for a chunk, "
            "an ack or a credit for {{ $value | humanizeDuration }}.",
        ),
        _alert(
            cfg,
            "OmniStreamDeadlineRate",
            deadline_expr,
            cfg.failure_rate_for,
            "warning",
            "Many streams or stream chunks expire at their deadlines.",
            f"{{{{ $value | humanizePercentage }}}} of the streams or chunks resolved on {STREAM} "
            f"in the last {cfg.failure_rate_window} expired.",
        ),
        _alert(
            cfg,
            "OmniStreamSendFailures",
            failure_expr,
            cfg.failure_rate_for,
            "warning",
            "A stream producer fails to send.",
            f"{{{{ $value | humanizePercentage }}}} of the streams (ended by a producer error) or "
            f"chunks (failed) resolved on {STREAM} in the last {cfg.failure_rate_window} failed.",
        ),
    ]


def stage_rules(cfg: Config) -> list[dict[str, Any]]:
    # Stage targets are the ones the scrape labels with their pipeline; down, one that
    # answered before and no longer does (vLLM listens before it has loaded its model, and a
    # target that never answered yet is a pod still loading, or one the kubelet reports).
    down_expr = f"""
up{{pipeline!=""}} == 0
and on (namespace, pod)
max_over_time(up{{pipeline!=""}}[{cfg.stage_was_up_window}]) == 1
"""
    # Every pipeline has a sending stage, whose runtime exports omni_kv_transfers even when
    # idle. A pipeline whose stages all answer scrapes but export none of it runs without the
    # omni scheduler or without its multiprocess metrics: its transfers are invisible. (One
    # that does not answer yet, a sending stage still loading say, is not that.)
    absent_expr = f"""
count by (namespace, pipeline) (up{{pipeline!=""}} == 1)
unless on (namespace, pipeline)
count by (namespace, pipeline) (up{{pipeline!=""}} == 0)
unless on (namespace, pipeline)
count by (namespace, pipeline) ({m.KV_TRANSFERS})
"""
    return [
        _alert(
            cfg,
            "OmniStageDown",
            down_expr,
            cfg.stage_down_for,
            "critical",
            "A pipeline stage cannot be scraped any more.",
            f"Prometheus scraped {WHERE} (pod {{{{ $labels.pod }}}}, "
            "instance {{ $labels.instance }}) before and cannot now.",
        ),
        _alert(
            cfg,
            "OmniKVTransportThreadDown",
            f"{m.KV_TRANSPORT_THREAD_UP} == 0",
            cfg.transport_thread_down_for,
            "critical",
            "A stage's KV transport thread died: it cannot send or receive KV.",
            f"The KV {{{{ $labels.thread }}}} thread of {WHERE} (pod {{{{ $labels.pod }}}}) "
            "has stopped; every transfer through it fails until the stage restarts.",
        ),
        _alert(
            cfg,
            "OmniKVMetricsAbsent",
            absent_expr,
            cfg.metrics_absent_for,
            "warning",
            "A pipeline exports no KV-transfer metrics.",
            "No stage of pipeline {{ $labels.namespace }}/{{ $labels.pipeline }} exports "
            f"{m.KV_TRANSFERS} although all its stages are scraped: stuck transfers would go "
            "unnoticed.",
        ),
    ]


def operator_rules(cfg: Config) -> list[dict[str, Any]]:
    # The stage alerts need stage targets: where none exists at all while pipelines run, the
    # PodMonitors the operator creates are not selected by this Prometheus (a Prometheus that
    # selects PodMonitors by label, kube-prometheus-stack's), and nothing else would say so.
    unscraped_expr = f"""
sum by (namespace, pod) ({m.OPERATOR_PIPELINES}{{{m.RUNNING_PHASES}}}) > 0
unless on ()
count(up{{pipeline!=""}}) > 0
"""
    expr = f"""
sum by (namespace, pod) (increase({m.OPERATOR_RECONCILES}{{{m.FAILED_RECONCILES}}}[{cfg.reconcile_error_window}]))
  > 0
"""
    return [
        _alert(
            cfg,
            "OmniOperatorReconcileErrors",
            expr,
            cfg.reconcile_error_for,
            "warning",
            "The omni-pipeline operator keeps failing to reconcile.",
            "The operator {{ $labels.namespace }}/{{ $labels.pod }} has failed "
            "{{ $value | humanize }} reconciles in the last "
            f"{cfg.reconcile_error_window}.",
        ),
        _alert(
            cfg,
            "OmniStagesNotScraped",
            unscraped_expr,
            cfg.unscraped_for,
            "warning",
            "Pipelines run, and Prometheus scrapes no stage of any.",
            "{{ $value }} pipelines of the operator {{ $labels.namespace }}/{{ $labels.pod }} "
            "have run, and no stage pod of any pipeline is scraped: every stage alert, dashboard "
            "and autoscaling trigger is without data.",
        ),
    ]


def rule_groups(cfg: Config = Config()) -> dict[str, Any]:
    """The rule file's content: `{"groups": [...]}` (also a PrometheusRule's spec)."""
    return {
        "groups": [
            {"name": "omni-pipeline.kv-transfers", "rules": kv_transfer_rules(cfg)},
            {"name": "omni-pipeline.kv-edges", "rules": kv_edge_rules(cfg)},
            {"name": "omni-pipeline.streams", "rules": stream_rules(cfg)},
            {"name": "omni-pipeline.stages", "rules": stage_rules(cfg)},
            {"name": "omni-pipeline.operator", "rules": operator_rules(cfg)},
        ]
    }
