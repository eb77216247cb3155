"""Alertmanager and a webhook receiver for it, both real processes/servers on 127.0.0.1."""
from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from procs import PrometheusServer, ReadyServer, free_port

if TYPE_CHECKING:
    from omni_mixin.config import Config


class WebhookReceiver:
    """Collects the JSON bodies Alertmanager's webhook_config posts."""

    def __init__(self):
        self.payloads: list[dict] = []
        lock = threading.Lock()
        payloads = self.payloads

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # keep the test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, name: str, status: str = "firing") -> list[dict]:
        return [a for p in list(self.payloads) for a in p["alerts"]
                if a["labels"].get("alertname") == name and a["status"] == status]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


class Alertmanager(ReadyServer):
    """A real Alertmanager on 127.0.0.1 routing every alert to ``webhook_url``."""

    name = "alertmanager"

    def __init__(self, workdir: Path, webhook_url: str):
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        if binary is None:
            pytest.fail("Alertmanager not found: `make setup` installs prometheus-alertmanager",
                        pytrace=False)
        port = free_port()
        config = workdir / "alertmanager.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "route": {"receiver": "webhook", "group_by": ["alertname"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "webhook",
                           "webhook_configs": [{"url": webhook_url, "send_resolved": False}]}],
        }))
        super().__init__(workdir, [
            binary, f"--config.file={config}", f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no gossip port: a single, local instance
        ], port)


def prometheus_config(rules: Path, alertmanager: "Alertmanager",
                      targets: list[tuple[int, dict[str, str]]]) -> str:
    """A Prometheus config that scrapes each (port, labels) of ``targets`` on 127.0.0.1 every
    second, as the operator's PodMonitor does on Kubernetes (docs/monitoring.md: the pod's
    labels kept, ``honor_labels``), evaluates ``rules`` every second and sends its alerts to
    ``alertmanager``."""
    return json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "alerting": {"alertmanagers": [{"static_configs": [
            {"targets": [f"127.0.0.1:{alertmanager.port}"]}]}]},
        "scrape_configs": [{
            "job_name": "omni-stages",
            "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}
                               for port, labels in targets],
        }],
    })


def alerting_prometheus(tmp: Path, rules: "Config", alertmanager: "Alertmanager",
                        targets: list[tuple[int, dict[str, str]]]) -> PrometheusServer:
    """A real Prometheus in ``tmp`` with the mixin's rules rendered for ``rules`` (the
    thresholds a test can wait for), scraping ``targets`` and alerting ``alertmanager``
    (:func:`prometheus_config`)."""
    from omni_mixin import render

    path = tmp / "omni.rules.yaml"
    path.write_text(render.rules_file(rules))
    return PrometheusServer(tmp, prometheus_config(path, alertmanager, targets))
