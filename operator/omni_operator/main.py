"""`omni-operator`: start the operator, cluster-wide or for listed namespaces.

Serves the operator's metrics on --metrics-port (/metrics) and kopf's liveness probe on
--liveness-port (/healthz).
"""
from __future__ import annotations

import argparse
import logging
import re
import threading
from dataclasses import dataclass
from typing import Sequence

import kopf
from prometheus_client import start_http_server

from .handlers import build_registry
from .kube import Kube
from .metrics import OperatorMetrics
from .reconcile import Reconciler
from .resync import Resync

log = logging.getLogger("omni_operator")
NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    for ns in args.namespace:
        if not NAMESPACE.match(ns):
            parser.error(f"--namespace {ns!r}: not a namespace name (lower case letters, digits, '-')")
    for flag, port in (("--metrics-port", args.metrics_port), ("--liveness-port", args.liveness_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} {port}: must be from 0 to 65535")
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be positive")
    return Options(namespaces=list(dict.fromkeys(args.namespace)), metrics_host=args.metrics_host,
                   metrics_port=args.metrics_port, liveness_host=args.liveness_host,
                   liveness_port=args.liveness_port, resync_seconds=args.resync_seconds,
                   verbose=args.verbose, debug=args.debug)


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Only warnings become Kubernetes events; routine handler logs stay in the pod log.
    settings.posting.level = logging.WARNING
    # Reconnect watches now and then, so a silently dropped connection does not go unnoticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def run(options: Options, *, kube: Kube | None = None, metrics: OperatorMetrics | None = None,
        stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
        settings: kopf.OperatorSettings | None = None) -> None:
    """Run the operator until stop_flag is set (or forever); blocks the calling thread."""
    metrics = metrics or OperatorMetrics()
    kube = kube or Kube.from_environment(on_call=metrics.api_call)
    reconciler = Reconciler(kube, metrics)
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
