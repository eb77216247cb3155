"""The resync timer: every interval, reconcile every OmniPipeline the operator watches.

It refreshes status and repairs drift that no event reported, and it is where the stages'
transfer metrics are read (``health.TransferHealth.refresh``): once per round, for every
pipeline, before the pipelines are reconciled; a reconcile itself never reads them. From that
reading it also sets each stage pod's deletion cost (``deletion_cost.py``). A plain
thread rather than a kopf timer, because kopf timers put a finalizer on each resource, and
deleting a pipeline should not depend on the operator running.
"""
from __future__ import annotations

import logging
import threading

from . import deletion_cost
from omni_operator.health.reader import TransferHealth
from .reconcile import Reconciler, ResyncRound

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
            self._set_deletion_costs(pipelines)
        # From fresh lists, what the watches' cache missed is repaired here: each child kind
        # listed once per namespace into the cache, then the pipelines there reconciled from
        # it (without a cache ready, each reconcile lists for itself).
        round_ = ResyncRound()
        for body in pipelines:
            meta = body.get("metadata") or {}
            try:
                self.reconciler.reconcile(meta.get("namespace") or "default", meta["name"], fresh=round_)
            except Exception:
                log.exception("resync of %s/%s failed", meta.get("namespace"), meta.get("name"))
        self.rounds += 1

    def _set_deletion_costs(self, pipelines: list[dict]) -> None:
        """Each stage pod's deletion cost from the streams open at it, where it changed
        (deletion_cost.py): a scale-in then removes idle replicas first."""
        for body in pipelines:
            meta = body.get("metadata") or {}
            namespace = meta.get("namespace") or "default"
            reading = self.health.reading(namespace, meta.get("name", ""))
            if reading is None:
                continue
            for pod, patch in deletion_cost.patches(reading).items():
                try:
                    self.reconciler.kube.patch_pod(namespace, pod, patch)
                except Exception as exc:  # noqa: BLE001 - a pod gone meanwhile; the next round sees
                    log.info("resync: setting the deletion cost of pod %s/%s failed: %s",
                             namespace, pod, getattr(exc, "status", "") or exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()
