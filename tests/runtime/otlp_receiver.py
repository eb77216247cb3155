"""A minimal OTLP/HTTP trace receiver for tests: decodes ExportTraceServiceRequest bodies with
opentelemetry-proto and keeps every span, so a test can wait for the spans it expects."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _attrs(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    """``with OtlpReceiver() as rx:`` listens on 127.0.0.1 (a free port); ``rx.endpoint`` is
    the traces URL to give an exporter."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.raw_bodies: list[bytes] = []
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._add(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attrs(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                        status_code=s.status.code,
                        resource=resource,
                    ))
        with self._lock:
            self.raw_bodies.append(body)
            self.spans.extend(spans)
            self._lock.notify_all()

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], Any], timeout: float
    ) -> Any:
        """Wait until ``predicate(spans)`` is truthy and return its value; fail at timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                result = predicate(list(self.spans))
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self.spans})
                    raise AssertionError(
                        f"spans not received within {timeout}s; have {len(self.spans)}: {names}")
                self._lock.wait(left)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
