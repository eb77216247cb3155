"""`omni-operator`: start the operator, cluster-wide or for listed namespaces.

Serves the operator's metrics on --metrics-port (/metrics) and kopf's liveness probe on
--liveness-port (/healthz). On its resync timer it reads the stages' transfer metrics, from
each stage pod's /metrics or, with --prometheus-url, from Prometheus (docs/operator.md,
"Transfer health").
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import kopf
from prometheus_client import start_http_server

from omni_operator.check.gopattern import matches
from .handlers import build_registry
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CHILD_KINDS
from omni_operator.pipeline.render import ClusterSettings
from omni_operator.health.reader import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT_S, PodMetricsSource, PrometheusSource, TransferHealth
from .kube import Kube
from .metrics import OperatorMetrics
from omni_operator.check.objectmeta import is_dns1123_label, is_qualified_name, is_valid_label_value
from .reconcile import Reconciler
from .children import ChildCache
from .resync import Resync
from omni_operator.health.transfers import DEFAULT_FAILING_RATIO

log = logging.getLogger("omni_operator")


def _namespace_name(text: str) -> bool:
    """A namespace name (a DNS-1123 label), by apimachinery's rule."""
    return not is_dns1123_label(text)


def _label_pair(text: str) -> bool:
    """KEY=VALUE, a label key and value by apimachinery's rules."""
    key, equals, value = text.partition("=")
    return bool(equals) and not is_qualified_name(key) and not is_valid_label_value(value)


def _labels(parser: argparse.ArgumentParser, flag: str, text: str | None) -> dict[str, str] | None:
    """KEY=VALUE,... as labels (None: the flag not given); a parser error naming ``flag``."""
    if not text:
        return None
    pairs = [p for p in text.split(",") if p]
    bad = [p for p in pairs if not _label_pair(p)]
    if bad or not pairs:
        parser.error(f"{flag}: not KEY=VALUE label pairs: {', '.join(bad) or text}")
    return dict(p.split("=", 1) for p in pairs)


@dataclass
class Options:
    namespaces: list[str]  # empty: cluster-wide
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080
    liveness_host: str = "0.0.0.0"
    liveness_port: int = 8081
    resync_seconds: float = 60.0
    verbose: bool = False
    debug: bool = False
    transfer_health: bool = True
    prometheus_url: str | None = None  # None: read each stage pod's /metrics
    metrics_timeout: float = DEFAULT_TIMEOUT_S
    metrics_concurrency: int = DEFAULT_CONCURRENCY
    failing_ratio: float = DEFAULT_FAILING_RATIO
    # Where the operator's own pods are, for the pipelines' NetworkPolicy (both or neither).
    operator_namespace: str | None = None
    operator_pod_labels: dict[str, str] | None = None
    # Labels every pipeline's PodMonitor carries besides the operator's own.
    podmonitor_labels: dict[str, str] | None = None

    @property
    def cluster(self) -> ClusterSettings:
        """What the rendering follows besides the spec (the operator's peer: both or neither)."""
        peer = bool(self.operator_namespace and self.operator_pod_labels)
        return ClusterSettings(operator_namespace=self.operator_namespace if peer else None,
                               operator_pod_labels=tuple((self.operator_pod_labels or {}).items()) if peer else (),
                               podmonitor_labels=tuple((self.podmonitor_labels or {}).items()))

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="omni-operator", description="Reconcile OmniPipeline resources into stage Deployments.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NAME",
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--metrics-port", type=int, default=8080, help="port of /metrics (0 disables)")
    parser.add_argument("--liveness-host", default="0.0.0.0")
    parser.add_argument("--liveness-port", type=int, default=8081, help="port of kopf's /healthz (0 disables)")
    parser.add_argument("--resync-seconds", type=float, default=60.0,
                        help="reconcile every pipeline this often, to refresh status and repair drift")
    health = parser.add_argument_group("transfer health (read on the resync timer)")
    health.add_argument("--no-transfer-health", dest="transfer_health", action="store_false",
                        help="do not read the stages' transfer metrics (no TransfersHealthy condition)")
    health.add_argument("--prometheus-url", metavar="URL",
                        help="read them from this Prometheus' query API instead of each pod's /metrics")
    health.add_argument("--metrics-timeout-seconds", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="timeout of one read of a pod's /metrics (or of a Prometheus query, x2.5)")
    health.add_argument("--metrics-concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="N",
                        help="pods read at once")
    health.add_argument("--transfers-failing-ratio", type=float, default=DEFAULT_FAILING_RATIO, metavar="R",
                        help="share of the transfers resolved over a resync interval that may fail or expire "
                             "before TransfersHealthy turns False (TransfersFailing)")
    health.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE") or None,
                        help="namespace of the operator's pods (default: $POD_NAMESPACE); with "
                             "--operator-pod-labels, each pipeline's NetworkPolicy lets them reach the http port")
    health.add_argument("--operator-pod-labels", metavar="K=V,...", help="labels selecting the operator's pods")
    parser.add_argument("--podmonitor-labels", metavar="K=V,...",
                        help="labels every pipeline's PodMonitor carries besides the operator's own, for a "
                             "Prometheus that selects PodMonitors by label (kube-prometheus-stack: release=NAME)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    for ns in args.namespace:
        if not _namespace_name(ns):
            parser.error(f"--namespace {ns!r}: not a namespace name (lower case letters, digits, '-')")
    for flag, port in (("--metrics-port", args.metrics_port), ("--liveness-port", args.liveness_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} {port}: must be from 0 to 65535")
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be positive")
    if args.metrics_timeout_seconds <= 0:
        parser.error("--metrics-timeout-seconds must be positive")
    if not 1 <= args.metrics_concurrency <= 1024:
        parser.error("--metrics-concurrency must be from 1 to 1024")
    if not 0 <= args.transfers_failing_ratio < 1:
        parser.error("--transfers-failing-ratio must be at least 0 and below 1")
    if args.prometheus_url and not matches(r"^https?://[^\s/]+", args.prometheus_url):
        parser.error(f"--prometheus-url {args.prometheus_url!r}: not an http(s) URL")
    if args.operator_namespace and not _namespace_name(args.operator_namespace):
        parser.error(f"--operator-namespace {args.operator_namespace!r}: not a namespace name")
    labels = _labels(parser, "--operator-pod-labels", args.operator_pod_labels)
    podmonitor_labels = _labels(parser, "--podmonitor-labels", args.podmonitor_labels)
    ours = sorted(set(podmonitor_labels or ()) & set(naming.common_labels("pipeline")))
    if ours:
        parser.error(f"--podmonitor-labels: {', '.join(ours)}: the operator sets this label itself; choose another")
    return Options(namespaces=list(dict.fromkeys(args.namespace)), metrics_host=args.metrics_host,
                   metrics_port=args.metrics_port, liveness_host=args.liveness_host,
                   liveness_port=args.liveness_port, resync_seconds=args.resync_seconds,
                   verbose=args.verbose, debug=args.debug, transfer_health=args.transfer_health,
                   prometheus_url=args.prometheus_url, metrics_timeout=args.metrics_timeout_seconds,
                   metrics_concurrency=args.metrics_concurrency, failing_ratio=args.transfers_failing_ratio,
                   operator_namespace=args.operator_namespace, operator_pod_labels=labels,
                   podmonitor_labels=podmonitor_labels)


def build_health(options: Options, kube: Kube) -> TransferHealth | None:
    """The transfer-health reader the options ask for (None: off)."""
    if not options.transfer_health:
        return None
    if options.prometheus_url:
        # increase() over at least a minute: shorter windows miss samples at a 15 s scrape.
        source = PrometheusSource(options.prometheus_url, window_seconds=max(options.resync_seconds, 60.0),
                                  timeout=2.5 * options.metrics_timeout)
    else:
        source = PodMetricsSource(kube, timeout=options.metrics_timeout, concurrency=options.metrics_concurrency)
    return TransferHealth(source, failing_ratio=options.failing_ratio)


#: Objects per page of a watch's first list.
LIST_PAGE_SIZE = 500


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Only warnings become Kubernetes events; routine handler logs stay in the pod log.
    settings.posting.level = logging.WARNING
    # Reconnect watches now and then, so a silently dropped connection does not go unnoticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # The children's watches ask the server for the operator's children alone: kopf applies a
    # handler's label filter on the client, so without this every ConfigMap, Service and
    # Deployment of the cluster would be listed and streamed to the operator. First lists
    # come in pages, so that a large namespace never arrives as one response.
    for kind in CHILD_KINDS:
        settings.watching.label_selectors[kind.api_version, kind.plural] = naming.CHILDREN_SELECTOR
    settings.watching.chunk_size = LIST_PAGE_SIZE
    return settings


def run(options: Options, *, kube: Kube | None = None, metrics: OperatorMetrics | None = None,
        stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
        settings: kopf.OperatorSettings | None = None, children: ChildCache | None = None) -> None:
    """Run the operator until stop_flag is set (or forever); blocks the calling thread.
    ``children``: the cache its watches feed (a new one when None)."""
    metrics = metrics or OperatorMetrics()
    kube = kube or Kube.from_environment(on_call=metrics.api_call)
    health = build_health(options, kube)
    reconciler = Reconciler(kube, metrics, health=health, cluster=options.cluster,
                            children=children if children is not None else ChildCache())
    resync = Resync(reconciler, options.namespaces or None, options.resync_seconds)
    server = None
    if options.metrics_port:
        server, _ = start_http_server(options.metrics_port, addr=options.metrics_host, registry=metrics.registry)
    liveness = f"http://{options.liveness_host}:{options.liveness_port}/healthz" if options.liveness_port else None
    resync.start()
    try:
        kopf.run(
            registry=build_registry(),
            settings=settings or operator_settings(),
            clusterwide=options.clusterwide,
            namespaces=options.namespaces,
            standalone=True,  # one replica; no peering CRDs needed
            liveness_endpoint=liveness,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            memo=kopf.Memo(reconciler=reconciler, metrics=metrics),
        )
    finally:
        resync.stop()
        reconciler.close()
        if health is not None:
            health.close()
        if server is not None:
            server.shutdown()
            server.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    kopf.configure(debug=options.debug, verbose=options.verbose)
    log.info("omni-operator watching %s", "all namespaces" if options.clusterwide else ", ".join(options.namespaces))
    run(options)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
