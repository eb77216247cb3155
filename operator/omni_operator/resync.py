"""The resync timer: every interval, reconcile every OmniPipeline the operator watches.

It refreshes status and repairs drift that no event reported, and it is where the stages'
transfer metrics are read (``health.TransferHealth.refresh``): once per round, for every
pipeline, before the pipelines are reconciled; a reconcile itself never reads them. A plain
thread rather than a kopf timer, because kopf timers put a finalizer on each resource, and
deleting a pipeline should not depend on the operator running.
"""
from __future__ import annotations

import logging
import threading

from .health import TransferHealth
from .reconcile import Reconciler

log = logging.getLogger("omni_operator")


class Resync:
    def __init__(self, reconciler: Reconciler, namespaces: list[str] | None, interval: float,
                 health: TransferHealth | None = None):
        self.reconciler = reconciler
        self.health = health if health is not None else reconciler.health
        self.namespaces = namespaces  # None: every namespace
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-resync", daemon=True)
        self.rounds = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def run_once(self) -> None:
        pipelines = []
        for namespace in self.namespaces or [None]:
            try:
                pipelines += self.reconciler.kube.list_pipelines(namespace)
            except Exception:
                log.exception("resync: listing OmniPipelines failed")
        if self.health is not None:
            try:
                self.health.refresh(pipelines)
            except Exception:
                log.exception("resync: reading the stages' transfer metrics failed")
        for body in pipelines:
            meta = body.get("metadata") or {}
            try:
                self.reconciler.reconcile(meta.get("namespace") or "default", meta["name"])
            except Exception:
                log.exception("resync of %s/%s failed", meta.get("namespace"), meta.get("name"))
        self.rounds += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()
