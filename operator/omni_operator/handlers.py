"""The kopf handlers: thin, each hands the work to the Reconciler kept in kopf's memo.

Built into a fresh registry per operator instance (tests run several in one process).
No handler needs a finalizer: children carry ownerReferences and the garbage collector
removes them, so deleting an OmniPipeline never waits for the operator.
"""
from __future__ import annotations

import logging
from typing import Any

import kopf

from . import GROUP, PLURAL, VERSION, naming
from .kinds import CHILD_KINDS

log = logging.getLogger("omni_operator")


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    # Create, update and resume share one level-based reconcile; kopf retries it on errors.
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile_pipeline(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.reconcile(namespace, name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def pipeline_event(type: str | None, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        if type == "DELETED":
            memo.reconciler.forget(namespace, name)

    for kind in CHILD_KINDS:
        group, _, version = kind.api_version.rpartition("/")
        register_child_watch(registry, group, version or kind.api_version, kind.plural)

    return registry


def register_child_watch(registry: kopf.OperatorRegistry, group: str, version: str, plural: str) -> None:
    # A child changed by hand, deleted, or rolling out: reconcile its pipeline (when needed).
    @kopf.on.event(group, version, plural, registry=registry,
                   labels={"app.kubernetes.io/managed-by": naming.MANAGER, naming.PIPELINE_LABEL: kopf.PRESENT},
                   id=f"child-{plural}")
    def child_event(type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels,
                    memo: kopf.Memo, **_: Any) -> None:
        child = dict(body)
        reconciler = memo.reconciler
        if not reconciler.child_needs_reconcile(child, deleted=(type == "DELETED")):
            return
        try:
            reconciler.reconcile(namespace, labels[naming.PIPELINE_LABEL])
        except Exception:  # event handlers are not retried: the resync timer will be
            log.exception("reconcile after a %s event failed", plural)
