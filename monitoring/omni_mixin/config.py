"""Tunables shared by the alert rules and the dashboards.

The chart exposes the same tunables as Helm values; its defaults must equal these (a test
renders the chart with default values and compares the rules with the plain rule file).
"""
from __future__ import annotations

from dataclasses import dataclass

# Where the runbooks live; each alert links to `<base>#<alertname lowercased>`.
DEFAULT_RUNBOOK_BASE_URL = (
    "https://github.com/omni-pipeline/omni-pipeline/blob/main/docs/runbooks.md"
)


@dataclass(frozen=True)
class Config:
    # An active transfer normally resolves within milliseconds and the runtime expires it at
    # its deadline (`timeout_seconds`, typically tens of seconds). One still active after
    # this long means the engine loop or the deadline sweep is not running.
    stuck_transfer_seconds: int | str = 300
    stuck_transfer_for: str = "1m"
    # Held transfers keep KV blocks allocated after the request finished: memory the
    # scheduler cannot give to new requests.
    held_too_long_seconds: int | str = 300
    held_too_long_for: str = "1m"
    # Fraction of resolved transfers that failed or expired, over `failure_rate_window`.
    failure_ratio: float | str = 0.05
    failure_rate_window: str = "10m"
    failure_rate_for: str = "10m"
    # The same two conditions per edge (the alert names the downstream stage, `to_stage`),
    # with the same thresholds.
    edge_stuck_for: str = "1m"
    stage_down_for: str = "5m"
    # A stage target counts as down only where it was up within this window: a pod still
    # loading its model (up to the startup probe's 30 minutes) has never answered, and its
    # readiness is the kubelet's to report, not a page.
    stage_was_up_window: str = "1h"
    # A KV transport thread that ended: a stage stopping on purpose exits within seconds of
    # it (its series then disappears), so one still at 0 after this long died.
    transport_thread_down_for: str = "1m"
    metrics_absent_for: str = "10m"
    # A stream waiting (for a chunk, an ack or a credit) longer than this: its deadlines
    # (30 s to the first chunk, 10 s between chunks by default) should have ended it long
    # before, so the stream ledger's sweep or the engine loop is not running. (The operator's
    # StreamStalled condition uses each pipeline's own observability.alerts.stalledStreamSeconds.)
    stalled_stream_seconds: int | str = 120
    stalled_stream_for: str = "1m"
    # Share of a streamed edge's streams (or chunks) resolved over the window that expired.
    stream_deadline_ratio: float | str = 0.05
    # Share of a streamed edge's streams that ended in producer_error, or of its chunks that
    # failed, over the window.
    stream_failure_ratio: float | str = 0.05
    reconcile_error_window: str = "10m"
    reconcile_error_for: str = "15m"
    # Pipelines running while Prometheus scrapes no stage of any: the PodMonitors are not
    # selected. Longer than a rollout's first scrape takes.
    unscraped_for: str = "15m"
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL
