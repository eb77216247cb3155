"""Reading the stages' transfer metrics, on the resync timer (never in a reconcile).

Two sources, one result (a ``transfers.PipelineReading`` per pipeline):

- :class:`PodMetricsSource` (the default): lists the pipelines' pods (one ``list pods`` per
  namespace and round) and GETs each running pod's ``/metrics`` on its ``http`` port,
  concurrently (``concurrency`` at a time) with a short timeout each, so one slow or dead pod
  costs one worker one timeout and delays no other pod. Counter increases are taken between
  this round's and the previous round's sample of the same pod (by uid).
- :class:`PrometheusSource` (``--prometheus-url``): a few instant queries per round to
  Prometheus' HTTP API over every watched pipeline at once: the gauges, ``increase()`` of the
  counters over the interval, and ``up`` for pods it cannot scrape. It needs the stage
  series labelled ``namespace``, ``pipeline``, ``stage``, ``pod`` (the operator's
  PodMonitor does that; docs/monitoring.md).

:class:`TransferHealth` keeps the last reading of each pipeline; the reconciler turns it into
status (``transfers.transfers_verdict``), so a reconcile does no I/O for it.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterable, Mapping, Protocol

from omni_operator.pipeline import naming
from omni_operator.pipeline.model import Pipeline
from .transfers import (
    DEFAULT_FAILING_RATIO,
    REQUEST_FAMILIES,
    EDGE_GAUGES,
    EDGE_RESOLVED,
    FAMILIES,
    HELD_BLOCKS,
    OLDEST,
    RECEIVED,
    RESOLVED,
    STREAM_GAUGES,
    TRANSFERS,
    EdgeReading,
    PipelineReading,
    PodReading,
    Sample,
    StageReading,
    TransfersVerdict,
    add_edge_value,
    add_stream_value,
    edge_samples,
    parse_metrics,
    pod_reading,
    stream_samples,
    transfers_verdict,
)

log = logging.getLogger("omni_operator")

Key = tuple[str, str]  # (namespace, pipeline name)
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CONCURRENCY = 32
#: A /metrics page larger than this is cut (vLLM's own page is a few hundred KiB at most).
MAX_PAGE_BYTES = 8 << 20
#: Asked of the stage's /metrics (prometheus_client's exposition honours it; others ignore it).
METRICS_QUERY = urllib.parse.urlencode([("name[]", f) for f in FAMILIES + REQUEST_FAMILIES])
POD_SELECTOR = f"app.kubernetes.io/managed-by={naming.MANAGER},{naming.PIPELINE_LABEL},{naming.STAGE_LABEL}"


class MetricsSource(Protocol):
    def read(self, pipelines: Iterable[Key]) -> dict[Key, PipelineReading]: ...

    def close(self) -> None: ...


def fetch_page(url: str, timeout: float) -> str:
    """GET a /metrics page (raises OSError / ValueError on failure)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = resp.read(MAX_PAGE_BYTES)
    return body.decode("utf-8", errors="replace")


def http_port(pod: Mapping[str, Any]) -> int:
    """The container port named ``http`` of the pod (the stage contract's 8000 by default)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return naming.HTTP_PORT


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class PodMetricsSource:
    """Reads each running stage pod's /metrics (see the module docstring)."""

    def __init__(self, kube: Any, *, timeout: float = DEFAULT_TIMEOUT_S, concurrency: int = DEFAULT_CONCURRENCY,
                 fetch: Callable[[str, float], str] = fetch_page, clock: Callable[[], float] = time.time):
        self.kube = kube
        self.timeout = timeout
        self.fetch = fetch
        self.clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="omni-metrics")
        # Pod uid -> its last sample, for counter increases.
        self._previous: dict[str, Sample] = {}
        self._last_read: dict[Key, float] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _get(self, url: str) -> Sample | str:
        try:
            return parse_metrics(self.fetch(url, self.timeout))
        except urllib.error.HTTPError as exc:
            return f"GET /metrics answered {exc.code}"
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return f"GET /metrics failed: {reason}"

    def read(self, pipelines: Iterable[Key]) -> dict[Key, PipelineReading]:
        wanted = set(pipelines)
        read_at = self.clock()
        targets: list[tuple[Key, str, str, str, bool, str, bool]] = []  # key, stage, pod, uid, ready, url, draining
        errors: dict[Key, str] = {}
        costs: dict[Key, dict[str, str | None]] = {k: {} for k in wanted}
        for namespace in sorted({ns for ns, _ in wanted}):
            try:
                pods = self.kube.list_pods(namespace, POD_SELECTOR)
            except Exception as exc:  # noqa: BLE001 - reported in the status, retried next round
                log.warning("listing the pods of namespace %s failed: %s", namespace, exc)
                for key in wanted:
                    if key[0] == namespace:
                        errors[key] = f"listing the stage pods failed: {getattr(exc, 'status', '') or exc}"
                continue
            for pod in pods:
                meta, status = pod.get("metadata") or {}, pod.get("status") or {}
                labels = meta.get("labels") or {}
                key = (namespace, labels.get(naming.PIPELINE_LABEL, ""))
                ip = status.get("podIP")
                if key not in wanted or status.get("phase") != "Running" or not ip:
                    continue
                if not meta.get("deletionTimestamp"):
                    costs[key][meta.get("name", "")] = (meta.get("annotations") or {}).get(
                        naming.POD_DELETION_COST)
                host = f"[{ip}]" if ":" in ip else ip
                url = f"http://{host}:{http_port(pod)}/metrics?{METRICS_QUERY}"
                targets.append((key, labels.get(naming.STAGE_LABEL, ""), meta.get("name", ""),
                                meta.get("uid") or meta.get("name", ""), _pod_ready(pod), url,
                                bool(meta.get("deletionTimestamp"))))
        results = list(self._pool.map(self._get, [t[5] for t in targets]))
        stages: dict[Key, dict[str, tuple[list[PodReading], list[tuple[str, str]]]]] = {k: {} for k in wanted}
        draining: dict[Key, dict[str, PodReading]] = {k: {} for k in wanted}
        seen: dict[str, Sample] = {}
        for (key, stage, pod, uid, ready, _, terminating), result in zip(targets, results):
            if terminating:  # draining (an old revision's pod): for the rollout, not the verdict
                if not isinstance(result, str):
                    draining[key][pod] = pod_reading(pod, self._previous.get(uid), result)
                    seen[uid] = result
                continue
            pods, unreadable = stages[key].setdefault(stage, ([], []))
            if isinstance(result, str):
                if ready:  # a pod that is not ready yet (or not any more) is the Ready condition's news
                    unreadable.append((pod, result))
                if uid in self._previous:  # its next good read counts from its last one
                    seen[uid] = self._previous[uid]
                continue
            pods.append(pod_reading(pod, self._previous.get(uid), result))
            seen[uid] = result
        self._previous = seen  # pods gone are forgotten
        out = {}
        for key in wanted:
            last = self._last_read.get(key)
            out[key] = PipelineReading(
                read_at=read_at, interval=read_at - last if last is not None else 0.0,
                stages={s: StageReading(tuple(p), tuple(u)) for s, (p, u) in stages[key].items()},
                error=errors.get(key, ""), draining=draining[key],
                deletion_costs=None if key in errors else costs[key])
            self._last_read[key] = read_at
        for key in list(self._last_read):
            if key not in wanted:
                del self._last_read[key]
        return out


class PrometheusSource:
    """Reads the same figures from Prometheus' query API (see the module docstring)."""

    GAUGES = (TRANSFERS, HELD_BLOCKS, OLDEST, *EDGE_GAUGES, *STREAM_GAUGES) + REQUEST_FAMILIES

    def __init__(self, url: str, *, window_seconds: float, timeout: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.url = url.rstrip("/")
        self.window = max(1, int(round(window_seconds)))
        self.timeout = timeout
        self.clock = clock

    def close(self) -> None:
        pass

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"}).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=data,
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                body = json.loads(resp.read(MAX_PAGE_BYTES * 4))
        except urllib.error.HTTPError as exc:  # Prometheus says why in its JSON body
            try:
                detail = json.loads(exc.read(65536)).get("error") or exc.reason
            except ValueError:
                detail = exc.reason
            raise ValueError(f"{exc.code} {detail}") from None
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def read(self, pipelines: Iterable[Key]) -> dict[Key, PipelineReading]:
        wanted = set(pipelines)
        read_at = self.clock()
        if not wanted:
            return {}
        # Namespace names are DNS labels: nothing in them is special in a PromQL regex.
        namespaces = "|".join(sorted({ns for ns, _ in wanted if re.fullmatch(r"[a-z0-9][-a-z0-9]*", ns)}))
        where = f'namespace=~"{namespaces}", pipeline!=""'
        window = f"[{self.window}s]"
        try:
            gauges = self.query("{__name__=~\"" + "|".join(self.GAUGES) + "\", " + where + "}", read_at)
            resolved = self.query(f"increase({RESOLVED}{{{where}}}{window})", read_at)
            edge_resolved = self.query(f"increase({EDGE_RESOLVED}{{{where}}}{window})", read_at)
            received = self.query(f"increase({RECEIVED}{{{where}}}{window})", read_at)
            up = self.query(f"up{{{where}}}", read_at)
        except (OSError, ValueError, KeyError) as exc:
            reason = getattr(exc, "reason", None) or exc
            error = f"querying Prometheus at {self.url} failed: {reason}"
            log.warning("%s", error)
            return {k: PipelineReading(read_at=read_at, interval=float(self.window), error=error) for k in wanted}

        pods: dict[tuple[Key, str, str], dict[str, Any]] = {}

        def pod_of(series: Mapping[str, Any]) -> dict[str, Any] | None:
            m = series["metric"]
            key = (m.get("namespace", ""), m.get("pipeline", ""))
            if key not in wanted:
                return None
            return pods.setdefault((key, m.get("stage", ""), m.get("pod", "") or m.get("instance", "")), {
                "states": {}, "held_blocks": 0.0, "oldest": {}, "increase": {}, "edges": {}, "received": {},
                "sends": False, "receives": False, "up": None, "requests": None, "streams": {}})

        def value(series: Mapping[str, Any]) -> float:
            v = float(series["value"][1])
            return 0.0 if v != v else v

        for s in gauges:
            p = pod_of(s)
            if p is None:
                continue
            m, v = s["metric"], value(s)
            name = m.get("__name__")
            if name == TRANSFERS:
                p["sends"] = True
                p["states"][m.get("state", "")] = p["states"].get(m.get("state", ""), 0.0) + v
            elif name == HELD_BLOCKS:
                p["held_blocks"] += v
            elif name in REQUEST_FAMILIES:
                p["requests"] = (p["requests"] or 0.0) + v
            elif name == OLDEST and v > 0:
                p["oldest"][m.get("state", "")] = min(p["oldest"].get(m.get("state", "")) or v, v)
            elif name in EDGE_GAUGES and m.get("to_stage"):
                add_edge_value(p["edges"], name, m, v)
            elif name in STREAM_GAUGES and m.get("from_stage") and m.get("to_stage"):
                add_stream_value(p["streams"], name, m, v)
        for s in resolved:
            p = pod_of(s)
            if p is not None:
                o = s["metric"].get("outcome", "")
                p["increase"][o] = p["increase"].get(o, 0.0) + value(s)
        for s in edge_resolved:
            p = pod_of(s)
            if p is not None and s["metric"].get("to_stage"):
                # Here "resolved" holds each outcome's increase over the window.
                add_edge_value(p["edges"], EDGE_RESOLVED, s["metric"], value(s))
        for s in received:
            p = pod_of(s)
            if p is not None:
                p["receives"] = True
                o = s["metric"].get("outcome", "")
                p["received"][o] = p["received"].get(o, 0.0) + value(s)
        for s in up:
            p = pod_of(s)
            if p is not None:
                p["up"] = value(s) == 1.0

        stages: dict[Key, dict[str, tuple[list[PodReading], list[tuple[str, str]]]]] = {k: {} for k in wanted}
        for (key, stage, pod), p in sorted(pods.items()):
            readings, unreadable = stages[key].setdefault(stage, ([], []))
            if p["up"] is False:
                unreadable.append((pod, "Prometheus cannot scrape it (up == 0)"))
                continue
            readings.append(PodReading(
                pod=pod, states=p["states"], held_blocks=p["held_blocks"], oldest=p["oldest"],
                increase=p["increase"], received_increase=p["received"], sends=p["sends"], receives=p["receives"],
                requests=p["requests"], streams=stream_samples(p["streams"]),
                edges={n: EdgeReading(e.active, e.oldest_active, e.resolved, e.held, e.held_blocks,
                                      e.oldest_held) for n, e in edge_samples(p["edges"]).items()}))
        return {key: PipelineReading(
            read_at=read_at, interval=float(self.window),
            stages={s: StageReading(tuple(r), tuple(u)) for s, (r, u) in stages[key].items()})
            for key in wanted}


class TransferHealth:
    """The last reading of every watched pipeline's stage metrics, refreshed by the resync
    timer; :meth:`verdict` (pure, no I/O) is what a reconcile puts in the status."""

    def __init__(self, source: MetricsSource, *, failing_ratio: float = DEFAULT_FAILING_RATIO):
        self.source = source
        self.failing_ratio = failing_ratio
        self._readings: dict[Key, PipelineReading] = {}
        self._lock = threading.Lock()
        self.rounds = 0
        self.last_round_seconds = 0.0

    def refresh(self, pipelines: Iterable[Mapping[str, Any]]) -> None:
        """Read every listed pipeline's stages (OmniPipeline bodies, as listed by the resync)."""
        keys = set()
        for body in pipelines:
            meta = body.get("metadata") or {}
            if meta.get("name") and not meta.get("deletionTimestamp"):
                keys.add((meta.get("namespace") or "default", meta["name"]))
        started = time.monotonic()
        readings = self.source.read(keys)
        with self._lock:
            self._readings = readings
        self.rounds += 1
        self.last_round_seconds = time.monotonic() - started

    def reading(self, namespace: str, name: str) -> PipelineReading | None:
        with self._lock:
            return self._readings.get((namespace, name))

    def verdict(self, pipeline: Pipeline) -> TransfersVerdict | None:
        """None until the pipeline's stages have been read once."""
        reading = self.reading(pipeline.namespace, pipeline.name)
        return None if reading is None else transfers_verdict(pipeline, reading, self.failing_ratio)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._readings.pop((namespace, name), None)

    def close(self) -> None:
        self.source.close()


__all__ = ["FAMILIES", "MetricsSource", "PodMetricsSource", "PrometheusSource", "TransferHealth"]
