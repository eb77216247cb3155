"""A Kubernetes API emulator, resourceVersion-correct enough for kopf, on kmock.

There is no Kubernetes API server in the test environment, so this stands in for one (a
mock, and only where no real part can run). Stock kmock 0.8 replays every object on each
watch, never bumps resourceVersion and answers errors with 500; kopf needs better. This
subclass of `kmock.KubernetesEmulator`:

- gives objects uid, creationTimestamp, generation (bumped on spec changes) and a global,
  monotonically increasing resourceVersion, bumped only by writes that change the object;
- serves LIST with the current resourceVersion, filtered by namespace and label selector;
- serves WATCH from a resourceVersion: only events after it, honouring timeoutSeconds;
- applies JSON merge patches (and JSON patches), keeps status behind the /status subresource,
  rejects a stale resourceVersion with 409 and an unpatchable body with 422;
- creates with generateName, refuses duplicates with 409, deletes with finalizers;
- records every request as an authorizer sees it (`calls`: user = bearer token, verb, API
  group, resource/subresource, namespace), and refuses with 403 what an optional
  `authorize` hook does not allow (the chart's RBAC test runs the operator under its rules),
  and with any status an optional `refuse` hook returns (a 422 of schema validation, a 500).

It does not do schema validation, server-side apply, defaulting or garbage collection; the
tests cover those with pure functions, kubernetes-validate and the CRD's own schema.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Callable

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import apps, dicts, enums, parsing, rendering

CRD_PLURAL = "omnipipeline.dev/v1alpha1/omnipipelines"
SCALERS = "omnipipeline.dev/v1alpha1/omnistagescalers"
PODMONITORS = "monitoring.coreos.com/v1/podmonitors"
SCALEDOBJECTS = "keda.sh/v1alpha1/scaledobjects"


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 fails on the Namespace resource itself (/api/v1/namespaces[/NAME]); parse it."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath(group="", version="v1", plural="namespaces", name=parts[3] if len(parts) == 4 else None)
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 5 and parts[4] in ("status", "finalize"):
        return parsing.ParsedPath(group="", version="v1", plural="namespaces", name=parts[3], subresource=parts[4])
    return _kmock_parse_path(path)


_kmock_parse_path = parsing.parse_path
parsing.parse_path = _parse_path  # rendering.Request._parse looks it up on the module


REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 422: "Invalid",
           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


def _copy(value: Any) -> Any:
    """A deep copy of a JSON value (every object here is one): a JSON round trip, several times
    cheaper than copy.deepcopy, whose cost would otherwise dominate a benchmark's server time."""
    return json.loads(json.dumps(value))


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def parse_selector(selector: str | None) -> list[tuple[str, str, str | None]]:
    """Equality and existence label selectors: a=b, a==b, a!=b, a, !a (comma-separated)."""
    terms = []
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), None))
        else:
            terms.append(("exists", term, None))
    return terms


def selector_matches(labels: dict[str, str], terms: list[tuple[str, str, str | None]]) -> bool:
    for op, key, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "!" and key in labels:
            return False
        if op == "exists" and key not in labels:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class ApiCall:
    """One request as the API server's authorizer sees it (its RequestInfo): who asked, the
    verb, and the resource; `namespace` is None for a cluster-scoped or all-namespaces call."""
    user: str | None  # the bearer token, standing in for the authenticated user
    verb: str | None  # None: a non-resource request (discovery: /api, /apis/<group>/<version>)
    group: str = ""
    resource: str = ""  # "plural" or "plural/subresource"
    namespace: str | None = None
    path: str = ""
    allowed: bool = True  # False: refused with 403 by the emulator's `authorize` hook
    label_selector: str | None = None  # a list's or watch's labelSelector, as sent


def api_call(method: str, path: str, params: Mapping[str, str], authorization: str | None) -> ApiCall:
    """Resolve a request the way kube-apiserver's RequestInfoFactory does, for RBAC."""
    user = authorization.split(" ", 1)[1] if authorization and " " in authorization else authorization
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return ApiCall(user, None, path=path)
    if not rest:
        return ApiCall(user, None, group, path=path)  # discovery of a group version
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    # The Namespace objects themselves are cluster-scoped: /api/v1/namespaces[/NAME[/SUB]].
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    watch = params.get("watch", "").lower() in ("1", "true")
    verb = {"GET": "watch" if watch else ("get" if name else "list"), "HEAD": "get" if name else "list",
            "POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection"}[method.upper()]
    return ApiCall(user, verb, group, f"{resource}/{sub}" if sub else resource, namespace, path,
                   label_selector=params.get("labelSelector"))


class ResourceVersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the resourceVersion, watch and patch semantics kopf relies on."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self.current_rv = 0
        self._log: dict[Any, list[tuple[int, dict[str, Any]]]] = {}
        # Live objects per resource, for LIST without scanning every object of every kind,
        # and per resource and label (key, value), for a LIST by label selector without
        # scanning every object of the kind (as the API server's watch cache indexes them).
        self._index: dict[Any, dict[tuple[str | None, str], dict[str, Any]]] = {}
        self._by_label: dict[Any, dict[tuple[str, str], set[tuple[str | None, str]]]] = {}
        # Every request as the authorizer would see it, in arrival order (an audit log), and
        # an optional authorizer: a call it refuses is answered 403 Forbidden, as RBAC would.
        self.calls: list[ApiCall] = []
        self.authorize: Callable[[ApiCall], bool] | None = None
        # An optional stand-in for the server's refusals beyond RBAC (schema validation,
        # admission webhooks, quotas, overload): (status, message) answers the call with that
        # error, None lets it through. Set by tests that need the server to say no.
        self.refuse: Callable[[ApiCall], tuple[int, str] | None] | None = None
        self.resources.load_bundled()
        self.resources[CRD_PLURAL] = kmock.ResourceInfo(
            kind="OmniPipeline", singular="omnipipeline", namespaced=True, shortnames={"omnip"},
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status"})
        # The operator's second CRD (installed with the first): an autoscaled stage's scale target.
        self.resources[SCALERS] = kmock.ResourceInfo(
            kind="OmniStageScaler", singular="omnistagescaler", namespaced=True, shortnames={"omniss"},
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status", "scale"})

    def serve_keda(self) -> None:
        """Pretend KEDA's CRDs are installed."""
        self.resources[SCALEDOBJECTS] = kmock.ResourceInfo(
            kind="ScaledObject", singular="scaledobject", namespaced=True, shortnames={"so"},
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status"})

    def serve_podmonitors(self) -> None:
        """Pretend the Prometheus Operator's CRDs are installed."""
        self.resources[PODMONITORS] = kmock.ResourceInfo(
            kind="PodMonitor", singular="podmonitor", namespaced=True,
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"})

    # -- helpers ----------------------------------------------------------------------------
    def _has_status_subresource(self, resource: Any) -> bool:
        for res in self.resources:
            if res == resource:
                return "status" in self.resources[res].subresources
        return False

    def _next_rv(self) -> str:
        self.current_rv = next(self._rv)
        return str(self.current_rv)

    async def _emit(self, resource: Any, etype: str, raw: dict[str, Any]) -> None:
        rv = int(raw["metadata"]["resourceVersion"])
        event = {"type": etype, "object": _copy(raw)}
        bucket = self._index.setdefault(resource, {})
        labels = self._by_label.setdefault(resource, {})
        where = (raw["metadata"].get("namespace"), raw["metadata"]["name"])
        previous = bucket.pop(where, None)
        for label in ((previous or {}).get("metadata") or {}).get("labels", {}).items():
            labels.get(label, set()).discard(where)
        if etype != "DELETED":
            bucket[where] = event["object"]
            for label in (event["object"]["metadata"].get("labels") or {}).items():
                labels.setdefault(label, set()).add(where)
        self._log.setdefault(resource, []).append((rv, event))
        await self._buses[resource].put(event)

    def _key(self, request: rendering.Request, name: str | None = None) -> tuple[Any, str | None, str]:
        return (request.resource, request.namespace, name or request.name)

    def _live(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        if key in self._objects and not self._objects[key].deleted:
            return self._objects[key].raw
        return None

    # -- request dispatch -------------------------------------------------------------------
    async def _handle(self, request: rendering.Request):  # type: ignore[override]
        raw = request._raw_request  # aiohttp's request: case-insensitive headers
        call = api_call(raw.method, raw.path, raw.query, raw.headers.get("Authorization"))
        if self.authorize is not None and not self.authorize(call):
            self.calls.append(dataclasses.replace(call, allowed=False))
            raise _error(403, "Forbidden", f"{call.user} cannot {call.verb} resource {call.resource!r} in API group "
                                           f"{call.group!r}" + (f" in the namespace {call.namespace!r}" if call.namespace else ""))
        self.calls.append(call)
        refusal = self.refuse(call) if self.refuse is not None else None
        if refusal is not None:
            status, message = refusal
            raise _error(status, REASONS.get(status, "InternalError"), message)
        # Object requests are served here directly: kmock's DSL matches each request against
        # every past request (quadratic), which a benchmark of thousands of calls cannot afford.
        # Discovery and anything else still goes through kmock's DSL.
        is_object_request = request.resource is not None and bool(request.resource.plural)
        if is_object_request and request.name and request.method == enums.method.PUT:
            async with self._lock:
                await self._replace(request)
            return aiohttp.web.json_response(await self._serve_fetch(request))
        if is_object_request and request.action == enums.action.WATCH:
            return await self._stream_watch(request)
        serve = {
            enums.action.LIST: self._serve_list, enums.action.FETCH: self._serve_fetch,
            enums.action.CREATE: self._serve_create, enums.action.UPDATE: self._serve_update,
            enums.action.DELETE: self._serve_delete,
        }.get(request.action) if is_object_request else None
        if serve is not None:
            return aiohttp.web.json_response(await serve(request), status=201 if request.action == enums.action.CREATE else 200)
        return await apps.RawHandler._handle(self, request)

    async def _stream_watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        try:
            async for event in self._serve_watch(request):
                if isinstance(event, dict):
                    await response.write(json.dumps(event).encode("utf-8") + b"\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away
        return response

    async def _serve_create(self, request: rendering.Request) -> dict[str, Any]:
        async with self._lock:
            obj = _copy(request.data or {})
            meta = obj.setdefault("metadata", {})
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
                meta["name"] = meta["generateName"] + secrets.token_hex(3)
            namespace = request.namespace or meta.get("namespace")
            if namespace:
                meta["namespace"] = namespace
            key = (request.resource, namespace, meta["name"])
            if self._live(key) is not None:
                raise _error(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
            if self._has_status_subresource(request.resource):
                obj.pop("status", None)
            meta.update({
                "uid": str(uuid.uuid4()),
                "creationTimestamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "generation": 1,
                "resourceVersion": self._next_rv(),
            })
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._emit(request.resource, "ADDED", obj)
            return obj

    async def _serve_update(self, request: rendering.Request) -> dict[str, Any]:
        async with self._lock:
            key = self._key(request)
            old = self._live(key)
            if old is None:
                raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            patch = request.data
            try:
                if isinstance(patch, list):
                    new = jsonpatch.apply_patch(_copy(old), patch)
                elif isinstance(patch, dict):
                    new = dict(dicts.merge_patch_dict(_copy(old), self._scope_patch(request, patch)))
                else:
                    raise ValueError("the patch body must be a JSON object or a JSON patch list")
            except (ValueError, TypeError, jsonpatch.JsonPatchException) as exc:
                raise _error(422, "Invalid", f"the patch cannot be applied: {exc}")
            return await self._store(request, key, old, _copy(new), patch_rv=self._patch_rv(patch))

    async def _replace(self, request: rendering.Request) -> None:
        key = self._key(request)
        old = self._live(key)
        if old is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        new = _copy(request.data or {})
        if request.subresource == "status":
            new = {**old, "status": new.get("status")}
        elif self._has_status_subresource(request.resource):
            new["status"] = old.get("status")
        await self._store(request, key, old, new, patch_rv=self._patch_rv(new))

    def _scope_patch(self, request: rendering.Request, patch: dict[str, Any]) -> dict[str, Any]:
        if request.subresource == "status":
            return {"status": patch.get("status")} if "status" in patch else {}
        if self._has_status_subresource(request.resource):
            return {k: v for k, v in patch.items() if k != "status"}
        return patch

    @staticmethod
    def _patch_rv(body: Any) -> str | None:
        if isinstance(body, dict):
            return (body.get("metadata") or {}).get("resourceVersion")
        return None

    async def _store(self, request: rendering.Request, key: Any, old: dict[str, Any], new: dict[str, Any],
                     patch_rv: str | None) -> dict[str, Any]:
        if patch_rv is not None and patch_rv != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified; please apply your changes to the latest version")
        # Fields the server owns cannot be changed by clients.
        for field in ("uid", "creationTimestamp", "generation", "resourceVersion", "name", "namespace"):
            if field in old["metadata"]:
                new.setdefault("metadata", {})[field] = old["metadata"][field]
        if new == old:
            return old  # a no-op write changes nothing: no new resourceVersion, no event
        spec_changed = {k: v for k, v in old.items() if k not in ("metadata", "status")} != \
                       {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if spec_changed:
            new["metadata"]["generation"] = int(old["metadata"].get("generation") or 0) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._objects[key].patch(new)
            self._objects[key].delete()
            await self._emit(request.resource, "DELETED", new)
            return new
        self._objects[key].create(new)  # a new version in kmock's history
        await self._emit(request.resource, "MODIFIED", new)
        return new

    async def _serve_delete(self, request: rendering.Request) -> dict[str, Any]:
        async with self._lock:
            key = self._key(request)
            old = self._live(key)
            if old is None:
                raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            new = _copy(old)
            if old["metadata"].get("finalizers"):
                if not old["metadata"].get("deletionTimestamp"):
                    new["metadata"]["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    new["metadata"]["resourceVersion"] = self._next_rv()
                    self._objects[key].create(new)
                    await self._emit(request.resource, "MODIFIED", new)
                return new
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[key].delete()
            await self._emit(request.resource, "DELETED", new)
            return new

    async def _serve_fetch(self, request: rendering.Request) -> dict[str, Any]:
        async with self._lock:
            obj = self._live(self._key(request))
        if obj is None:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        return obj

    def _visible(self, request: rendering.Request, obj: dict[str, Any], terms: list) -> bool:
        meta = obj.get("metadata") or {}
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        return selector_matches(meta.get("labels") or {}, terms)

    async def _serve_list(self, request: rendering.Request) -> dict[str, Any]:
        known = request.resource in self._index or any(res == request.resource for res in self.resources)
        if not known:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        terms = parse_selector(request.params.get("labelSelector"))
        custom = bool(request.resource.group) and request.resource.group.endswith("omnipipeline.dev")
        async with self._lock:
            items = []
            objects = self._index.get(request.resource, {})
            equal = [(key, value) for op, key, value in terms if op == "="]
            if equal:  # only the objects with the first such label, by name as a server lists them
                found = self._by_label.get(request.resource, {}).get(equal[0], set())
                candidates = [objects[w] for w in sorted(found, key=lambda w: (w[0] or "", w[1])) if w in objects]
            else:
                candidates = list(objects.values())
            for obj in candidates:
                if self._visible(request, obj, terms):
                    # Stored objects are never changed in place (a write stores a new one), and
                    # the list is serialised at once: a shallow copy is enough.
                    if not custom:  # built-in list items carry no apiVersion/kind, as on a real server
                        obj = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
                    items.append(obj)
            return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.current_rv)}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:  # type: ignore[override]
        terms = parse_selector(request.params.get("labelSelector"))
        since = int(request.params.get("resourceVersion") or 0)
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            if since:
                backlog = [e for rv, e in self._log.get(request.resource, []) if rv > since]
            else:  # no resourceVersion: the current objects first, as a real server does
                backlog = [{"type": "ADDED", "object": _copy(o)}
                           for o in self._index.get(request.resource, {}).values()]
        last = since
        try:
            async with contextlib.AsyncExitStack() as stack:
                if timeout:
                    await stack.enter_async_context(_timeout_or_end(timeout))
                for event in backlog:
                    last = max(last, int(event["object"]["metadata"]["resourceVersion"]))
                    if self._visible(request, event["object"], terms):
                        yield event
                async for event in bus.stream(since=mark):
                    rv = int(event["object"]["metadata"]["resourceVersion"])
                    if rv <= last:
                        continue
                    last = rv
                    if self._visible(request, event["object"], terms):
                        yield event
        except _WatchTimeout:
            return
        finally:
            await bus.unmark(mark)


class _WatchTimeout(Exception):
    pass


@contextlib.asynccontextmanager
async def _timeout_or_end(seconds: float):
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise _WatchTimeout()


class EmulatorThread:
    """The emulator and its HTTP server on 127.0.0.1 (a free port), in a thread of its own.

    The operator under test calls it from kopf's loop and from worker threads with the sync
    `kubernetes` client, so the server must not share the test's (or kopf's) event loop.
    """

    def __init__(self, podmonitors: bool = False, keda: bool = False):
        self.podmonitors = podmonitors
        self.keda = keda
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="k8s-emulator", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: ResourceVersionedEmulator | None = None
        self.url = ""

    def __enter__(self) -> "EmulatorThread":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("the Kubernetes emulator did not stop")

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced to the test by __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ResourceVersionedEmulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            if self.podmonitors:
                emulator.serve_podmonitors()
            if self.keda:
                emulator.serve_keda()
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    @property
    def requests(self) -> list[Any]:
        assert self.emulator is not None
        return list(self.emulator._requests)

    def calls(self, user: str | None = None) -> list[ApiCall]:
        """The requests made so far (by one user: a bearer token), as the authorizer sees them."""
        assert self.emulator is not None
        return [c for c in list(self.emulator.calls) if user is None or c.user == user]

    def write_kubeconfig(self, path: str) -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token-not-a-secret"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": "default"}}],
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        return path
