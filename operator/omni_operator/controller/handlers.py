"""The kopf handlers: thin, each hands the work to the Reconciler kept in kopf's memo.

The children's watches also feed the reconciler's cache of them (children.py): an index
handler per child kind (kopf runs index handlers first, and no other handler until every
watched kind's first listing is indexed: the first call of any other handler says the cache
is complete), and the child event handler for deletions.

Built into a fresh registry per operator instance (tests run several in one process).
No handler needs a finalizer: children carry ownerReferences and the garbage collector
removes them, so deleting an OmniPipeline never waits for the operator.
"""
from __future__ import annotations

import logging
from typing import Any

import kopf

from omni_operator import GROUP, PLURAL, VERSION

from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CHILD_KINDS

log = logging.getLogger("omni_operator")


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    # kopf's watches use the very credentials of the reconciler's client (one source).
    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
        return connection_info(memo.reconciler.kube.api_client.configuration)

    # Create, update and resume share one level-based reconcile; kopf retries it on errors.
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile_pipeline(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        _indexed(memo)
        memo.reconciler.reconcile(namespace, name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def pipeline_event(type: str | None, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        _indexed(memo)
        if type == "DELETED":
            memo.reconciler.forget(namespace, name)

    for kind in CHILD_KINDS:
        register_child_watch(registry, kind.group, kind.version, kind.plural, kind.kind)

    return registry


def connection_info(config: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a `kubernetes.client.Configuration` (as kopf.login_via_client does)."""
    # The getter runs the refresh hook, so a rotated service-account token is picked up on re-login.
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


def _indexed(memo: kopf.Memo) -> None:
    """kopf runs this handler: every child kind's first listing is in the cache."""
    children = memo.reconciler.children
    if children is not None and not children.ready:
        children.mark_ready()


def register_child_watch(registry: kopf.OperatorRegistry, group: str, version: str, plural: str,
                         kind: str) -> None:
    labels = {naming.MANAGED_BY_LABEL: naming.MANAGER, naming.PIPELINE_LABEL: kopf.PRESENT}

    # Every child as its watch reports it, into the reconciler's cache (kopf's index handlers
    # see each object before any other handler; nothing is kept in kopf's own index).
    @kopf.index(group, version, plural, registry=registry, labels=labels, id=f"children-{plural}")
    def child_seen(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        if memo.reconciler.children is not None:
            memo.reconciler.children.saw(dict(body), kind)

    # A child changed by hand, deleted, or rolling out: reconcile its pipeline (when needed).
    @kopf.on.event(group, version, plural, registry=registry, labels=labels, id=f"child-{plural}")
    def child_event(type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels,
                    memo: kopf.Memo, **_: Any) -> None:
        _indexed(memo)
        child = dict(body)
        reconciler = memo.reconciler
        if type == "DELETED" and reconciler.children is not None:
            reconciler.children.gone(child, kind)
        if not reconciler.child_needs_reconcile(child, deleted=(type == "DELETED")):
            return
        try:
            reconciler.reconcile(namespace, labels[naming.PIPELINE_LABEL])
        except Exception:  # event handlers are not retried: the resync timer will be
            log.exception("reconcile after a %s event failed", plural)
