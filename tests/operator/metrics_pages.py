"""Stage /metrics pages for the operator's transfer-health tests and benchmark.

`ar_page` writes the text a sending stage serves (its omni_kv_* families, in Prometheus' text
format, as prometheus_client prints them, optionally after vLLM's own families); `PageServer`
serves such pages on a free 127.0.0.1 port, where a stage pod's `http` port would be. It stands
in for a stage only where a test is about the operator's reading and arithmetic (what a real
stage exports is covered by tests/runtime and by the end-to-end tests against real stages).
"""
from __future__ import annotations

import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Mapping

from omnip_support import NAMESPACE

OUTCOMES = ("acked", "failed", "expired", "cancelled")


def _labels(**labels: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def ar_page(stage: str = "thinker", *, pending: int = 0, active: int = 0, held: int = 0, held_blocks: int = 0,
            oldest_active: float = 0.0, oldest_held: float = 0.0, resolved: Mapping[str, float] | None = None,
            edges: Mapping[str, Mapping[str, float]] | None = None, vllm_lines: int = 0,
            model: str = "tiny", streams: Mapping[tuple[str, str], Mapping[str, float]] | None = None) -> str:
    """A sending stage's page. ``edges``: to_stage -> {"active", "oldest", "held",
    "held_blocks", "oldest_held", outcome: total}; ``streams``: see :func:`stream_lines`."""
    base = {"stage": stage, "model_name": model}
    lines = []
    for i in range(vllm_lines):  # vLLM's own families come first on a real page
        lines.append(f'vllm:request_prompt_tokens_bucket{{engine="0",le="{i}",model_name="{model}"}} {i}.0')
    lines.append("# HELP omni_kv_transfers KV transfers in each state now.")
    lines.append("# TYPE omni_kv_transfers gauge")
    for state, n in (("pending", pending), ("active", active), ("held", held)):
        lines.append(f"omni_kv_transfers{{{_labels(**base, state=state)}}} {float(n)}")
    lines.append(f"omni_kv_held_blocks{{{_labels(**base)}}} {float(held_blocks)}")
    for state, ts in (("pending", 0.0), ("active", oldest_active), ("held", oldest_held)):
        lines.append(f"omni_kv_transfer_oldest_start_timestamp_seconds{{{_labels(**base, state=state)}}} {ts!r}")
    lines.append("# TYPE omni_kv_transfers_resolved_total counter")
    for outcome in OUTCOMES:
        lines.append(f"omni_kv_transfers_resolved_total{{{_labels(**base, outcome=outcome)}}} "
                     f"{float((resolved or {}).get(outcome, 0))}")
        lines.append(f"omni_kv_transfers_resolved_created{{{_labels(**base, outcome=outcome)}}} 1.7e9")
    for to_stage, edge in (edges or {}).items():
        lines.append(f"omni_kv_edge_transfers_active{{{_labels(**base, to_stage=to_stage)}}} "
                     f"{float(edge.get('active', 0))}")
        lines.append(f"omni_kv_edge_oldest_active_start_timestamp_seconds{{{_labels(**base, to_stage=to_stage)}}} "
                     f"{float(edge.get('oldest', 0.0))!r}")
        lines.append(f"omni_kv_edge_transfers_held{{{_labels(**base, to_stage=to_stage)}}} "
                     f"{float(edge.get('held', 0))}")
        lines.append(f"omni_kv_edge_held_blocks{{{_labels(**base, to_stage=to_stage)}}} "
                     f"{float(edge.get('held_blocks', 0))}")
        lines.append(f"omni_kv_edge_oldest_held_start_timestamp_seconds{{{_labels(**base, to_stage=to_stage)}}} "
                     f"{float(edge.get('oldest_held', 0.0))!r}")
        for outcome in ("acked", "failed", "expired"):
            lines.append(f"omni_kv_edge_transfers_resolved_total{{{_labels(**base, to_stage=to_stage, outcome=outcome)}}}"
                         f" {float(edge.get(outcome, 0))}")
    return "\n".join(lines) + "\n" + stream_lines(stage, streams or {}, model)


def stream_lines(stage: str, streams: Mapping[tuple[str, str], Mapping[str, float]], model: str = "tiny") -> str:
    """The stream families of a stage at one or more streamed edges: (from_stage, to_stage) ->
    {"open", "held", "waiting", "oldest_wait"} (a unix time; 0: none), as the runtime exports
    them (omni_contract.metrics.STREAM_FAMILIES, EDGE_LABELS: the reporting end in ``stage``)."""
    lines = []
    if streams:
        lines.append("# TYPE omni_kv_streams gauge")
    for (source, target), figures in streams.items():
        base = {"stage": stage, "model_name": model, "from_stage": source, "to_stage": target}
        for state in ("open", "held", "waiting"):
            lines.append(f"omni_kv_streams{{{_labels(**base, state=state)}}} {float(figures.get(state, 0))}")
        lines.append(f"omni_kv_stream_oldest_wait_start_timestamp_seconds{{{_labels(**base)}}} "
                     f"{float(figures.get('oldest_wait', 0.0))!r}")
        lines.append(f"omni_kv_streams_resolved_total{{{_labels(**base, outcome='finished')}}} 3.0")
    return "".join(line + "\n" for line in lines)


class PageServer:
    """Serves `page` on GET /metrics at 127.0.0.1:<free port>; `delay` holds each answer back
    (a slow pod), `hits` counts the GETs."""

    def __init__(self, page: str = "", delay: float = 0.0):
        self.page = page
        self.delay = delay
        self.hits = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.hits += 1
                if server.delay:
                    time.sleep(server.delay)  # the slow pod under test: its answer comes late
                body = server.page.encode()
                try:
                    self.send_response(HTTPStatus.OK)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the reader timed out and left

        class Server(ThreadingHTTPServer):
            # One server stands for many pods read at once (the benchmark): a listen backlog
            # of 5 would drop connections and delay them by TCP's 1 s SYN retry.
            request_queue_size = 256

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def create_pod(kube, pipeline: str, stage: str, name: str, port: int, *, namespace: str = NAMESPACE,
               ip: str = "127.0.0.1", ready: bool = True, phase: str = "Running") -> dict:
    """A stage pod as the Deployment controller and the kubelet would leave it: the stage's
    labels, its container's `http` port, and a status with its IP and readiness."""
    from omni_operator.pipeline import naming

    body = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": naming.common_labels(pipeline, stage)},
        "spec": {"containers": [{"name": "stage", "image": "omni-stage:test",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                                           {"name": "kv", "containerPort": 9600, "protocol": "TCP"}]}]},
    }
    created = kube.request("create", "Pod", "POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    set_pod_status(kube, name, ip=ip, ready=ready, phase=phase, namespace=namespace)
    return created


def set_pod_status(kube, name: str, *, ip: str = "127.0.0.1", ready: bool = True, phase: str = "Running",
                   namespace: str = NAMESPACE) -> None:
    status = {"phase": phase, "podIP": ip if phase == "Running" else None,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    kube.request("patch", "Pod", "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                 body={"status": status}, content_type="application/merge-patch+json")
