"""The operator's children as its watches last reported them, by pipeline: what a reconcile
that an event started reads instead of listing each child kind (a LIST per kind, seven for a
pipeline), as controller-runtime reads its informers' cache.

Fed by kopf (handlers.py): an index handler per child kind sees each child before any other
handler runs, and kopf holds every other handler until each watched kind's first listing is
indexed; so from the first call of another handler on (``mark_ready``) the cache holds every
child that existed when the watches began, and every change since. The child event handler
reports deletions; the reconciler puts in its own writes as the API server answered them (a
reconcile right after a write must not miss what it wrote). Until ready, ``children`` says
None and the reconcile lists.

What the cache may get wrong, and why that is safe: a watch event trails its write, and a
watch that restarts after a gap re-lists without reporting what was deleted meanwhile. A
reconcile reading it may then patch a child that already matches (the merge patch changes
nothing), create one that exists (409: read, compared, patched), or miss a child deleted in a
gap. The resync timer lists each child kind once per namespace and replaces the namespace's
entries with what it found (``replace`` without a pipeline) before it reconciles the pipelines there, so
such a ghost lives one resync interval at most.

Versions: a newer report of a child replaces an older one, never the other way round (a
watch event that trails the reconciler's write must not bring the old object back; a
deletion reported for an older version must not remove the object made again since).
``resourceVersion`` is opaque to clients in general; every API server this operator runs
against (etcd's revisions, and the emulator's) gives increasing integers, and where one does
not, the latest report wins.

Thread-safe: kopf's loop feeds it while reconciles read it from kopf's handler threads and the
resync thread. A reader gets the stored objects themselves, which nobody changes (a report
replaces an object, it never edits it).
"""
from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from omni_operator.pipeline import naming

ChildKey = tuple[str, str]  # (kind, name)


def _version(obj: Mapping[str, Any]) -> int | None:
    text = (obj.get("metadata") or {}).get("resourceVersion")
    return int(text) if isinstance(text, str) and text.isdigit() else None


def _older(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether ``new`` is a report of an older version than ``old`` (unknown: no)."""
    new_version, old_version = _version(new), _version(old)
    return new_version is not None and old_version is not None and new_version < old_version


class ChildCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (namespace, pipeline) -> (kind, name) -> the child as last reported.
        self._by_pipeline: dict[tuple[str, str], dict[ChildKey, dict[str, Any]]] = {}
        # (namespace, kind, name) -> the pipeline it is filed under (its label may change).
        self._filed: dict[tuple[str, str, str], str] = {}
        self._ready = threading.Event()

    # -- what the watches and the writes report ------------------------------------------------
    def saw(self, obj: Mapping[str, Any], kind: str | None = None) -> None:
        """A child as a watch event or a write's answer reports it (``kind`` where the object
        does not say it: a list's items; it wins over what the object says)."""
        with self._lock:
            self._saw(obj, kind)

    def gone(self, obj: Mapping[str, Any], kind: str | None = None) -> None:
        """A child deleted (a watch's DELETED event, or the reconciler's delete: then without
        a version, and whatever is stored goes)."""
        meta = obj.get("metadata") or {}
        kind = kind or obj.get("kind")
        namespace, name = meta.get("namespace") or "default", meta.get("name")
        with self._lock:
            filed = self._filed.get((namespace, kind, name))
            if filed is None:
                return
            old = self._by_pipeline.get((namespace, filed), {}).get((kind, name))
            if old is not None and _older(obj, old):
                return  # the deletion of an older object: the one stored was made since
            self._unfile(namespace, kind, name, filed)

    def replace(self, namespace: str, kinds: Iterable[str], found: Iterable[Mapping[str, Any]],
                pipeline: str | None = None) -> None:
        """What fresh lists of ``kinds`` found in ``namespace``, labelled for ``pipeline`` (or,
        without one, every pipeline's children there): those children of those kinds are these
        and no others."""
        kinds = set(kinds)
        with self._lock:
            if pipeline is None:
                stale = [(kind, name, owner) for (ns, kind, name), owner in self._filed.items()
                         if ns == namespace and kind in kinds]
            else:
                stale = [(kind, name, pipeline) for kind, name in self._by_pipeline.get((namespace, pipeline), {})
                         if kind in kinds]
            for kind, name, owner in stale:
                self._unfile(namespace, kind, name, owner)
            for obj in found:
                self._saw(obj)

    def forget(self, namespace: str, pipeline: str) -> None:
        """The pipeline is gone (its children go with it, by the garbage collector)."""
        with self._lock:
            for kind, name in list(self._by_pipeline.get((namespace, pipeline), {})):
                self._unfile(namespace, kind, name, pipeline)

    def mark_ready(self) -> None:
        """Every watched kind's first listing is in (kopf has started another handler)."""
        self._ready.set()

    # -- what a reconcile reads ----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def children(self, namespace: str, pipeline: str) -> dict[ChildKey, dict[str, Any]] | None:
        """The children labelled for the pipeline, by (kind, name); None until ready."""
        if not self._ready.is_set():
            return None
        with self._lock:
            return dict(self._by_pipeline.get((namespace, pipeline), {}))

    def __len__(self) -> int:
        with self._lock:
            return len(self._filed)

    def _saw(self, obj: Mapping[str, Any], kind: str | None = None) -> None:
        meta = obj.get("metadata") or {}
        kind = kind or obj.get("kind")
        namespace, name = meta.get("namespace") or "default", meta.get("name")
        pipeline = (meta.get("labels") or {}).get(naming.PIPELINE_LABEL)
        if not kind or not name:
            return
        child = obj if obj.get("kind") == kind else {**obj, "kind": kind}
        if "managedFields" in meta:  # the API server's field-ownership records: often most of
            # an object's metadata, and nothing a reconcile reads (controller-runtime's caches
            # drop them too)
            child = {**child, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
        filed = self._filed.get((namespace, kind, name))
        if filed is not None:
            old = self._by_pipeline.get((namespace, filed), {}).get((kind, name))
            if old is not None and _older(child, old):
                return
            if filed != pipeline:
                self._unfile(namespace, kind, name, filed)
        if pipeline is None:  # no longer labelled as a pipeline's: not a child any more
            return
        self._by_pipeline.setdefault((namespace, pipeline), {})[(kind, name)] = child
        self._filed[(namespace, kind, name)] = pipeline

    def _unfile(self, namespace: str, kind: str, name: str, pipeline: str) -> None:
        children = self._by_pipeline.get((namespace, pipeline))
        if children is not None:
            children.pop((kind, name), None)
            if not children:
                del self._by_pipeline[(namespace, pipeline)]
        self._filed.pop((namespace, kind, name), None)
