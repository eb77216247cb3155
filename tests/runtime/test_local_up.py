"""`omni-pipeline up examples/tiny-pipeline.yaml`: the file `kubectl apply` takes, run as local
processes (what `make demo` runs): requests' KV arrives downstream, the table shows it, and
Ctrl-C stops every stage."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import yaml
from procs import http_get, wait_until

from omni_runtime.devtools.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (every descendant inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours
        if marker.encode() in environ.split(b"\0") and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found


def test_up_runs_the_tiny_pipeline_and_ctrl_c_stops_every_stage(tmp_path):
    # The example names its model by a path relative to where `up` runs (the repo root for
    # `make demo`); run it from a scratch directory holding that path.
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    model_path = tmp_path / body["spec"]["model"]["path"]
    model_path.parent.mkdir(parents=True)
    shutil.copytree(ensure_tiny_model(), model_path)
    workdir = tmp_path / "run"
    marker = f"OMNI_TEST_RUN={uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_operator.cli", "up", str(ROOT / "examples" / "tiny-pipeline.yaml"),
         "--demo", "2", "--workdir", str(workdir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", marker.split("=")[0]: marker.split("=")[1]},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        text = lambda: "".join(lines)  # noqa: E731
        wait_until(lambda: re.search(r"^ar\s+ar\s+yes\s+0/0/0\s+2\s+0", text(), re.M), 300,
                   f"the table to show 2 deliveries; output so far:\n{text()}" )
        out = text()
        assert out.count("KV arrived at stage receiver") == 1
        assert len(re.findall(r"^  cmpl-\S+: seq_len=\d+ float32\[2, 2, 2, \d+, 32\]", out, re.M)) == 2
        urls = set(re.findall(r"http://127\.0\.0\.1:\d+/metrics", out))
        assert len(urls) == 2
        for url in urls:
            assert http_get(url)[0] == 200
        assert len(processes_with_env(marker)) >= 5, "runner, 2 stages, vLLM, its engine core"
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=120) == 0
        wait_until(lambda: not processes_with_env(marker), 30, "every stage process to be gone")
        for url in urls:
            try:
                status = http_get(url, timeout=2)[0]
            except OSError:
                status = None
            assert status is None, f"{url} still answers after Ctrl-C"
        assert (workdir / "ar.yaml").exists() and (workdir / "receiver.log").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_with_env(marker):  # whatever survived a failure above
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=10)
