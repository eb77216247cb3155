"""End to end: `omni-pipeline up --watch` rolls a running local pipeline when its file changes.

Real stages on 127.0.0.1 (the AR stage: vLLM with the omni scheduler and KV connector and the
tiny model; the receiving stage), run by the real supervisor in a process of its own; a
client sends completions one after another through the pipeline's front for the whole test.
Changing an engine argument of the AR stage in the file makes a new revision: its receiver
starts first, then its AR stage; the front switches; the old AR stage drains (its requests
finish, its KV transfers resolve) before the old receiver stops. No request fails and every
request's KV arrives, at the old receiver or at the new one.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import yaml

from omni_operator.local.run import stage_counts
from procs import free_port, stop_group, wait_until

# Two AR engines start on CPUs here (the new revision's while the old one serves): minutes
# on a machine shared with other work.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen2"


def pipeline_file(path: Path, max_model_len: int) -> None:
    from omni_runtime.devtools.tiny_model import ensure_tiny_model

    path.write_text(yaml.safe_dump({
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "roll"},
        "spec": {
            "image": "omni-stage:test",
            "model": {"name": MODEL, "path": str(ensure_tiny_model())},
            "stages": [
                {"name": "ar", "role": "ar", "gpus": 0,
                 "engineArgs": {"dtype": "float32", "max-model-len": max_model_len,
                                "kv-cache-memory-bytes": 64 << 20, "enforce-eager": True},
                 "kvTransfer": {"send": True, "criteria": {"type": "prefill_finished"}, "timeoutSeconds": 30}},
                {"name": "receiver", "role": "generation", "gpus": 0, "inputs": ["ar"]},
            ],
        },
    }))


def arrived(payloads: list[dict]) -> set[str]:
    """The client's request ids whose KV arrived (vLLM names a completion's request
    cmpl-<X-Request-Id>-<n>-<suffix>)."""
    return {p["request_id"].split("cmpl-", 1)[-1].rsplit("-", 2)[0] for p in payloads}


def test_a_changed_file_rolls_the_local_pipeline_receivers_first_and_loses_nothing(tmp_path):
    spec, workdir, log = tmp_path / "pipeline.yaml", tmp_path / "run", tmp_path / "up.log"
    pipeline_file(spec, 512)
    port = free_port()
    # The supervisor's own choice of vLLM's CPU binding (local_stage_env), not the tests'.
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"},
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]),
           # vLLM's one-process executor in each engine core (as tests/runtime/chain.py's
           # stages); the multi-process CPU executor's drain is test_pipeline_e2e.py's.
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "omni_operator.local.cli", "up", str(spec), "--watch", "--port", str(port),
                               "--workdir", str(workdir)], stdout=out, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    front = f"http://127.0.0.1:{port}"
    results: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def client() -> None:
        i = 0
        while not stop.is_set():
            rid = f"roll-{i}"
            try:
                r = requests.post(f"{front}/v1/completions", headers={"X-Request-Id": rid}, timeout=300,
                                  json={"model": MODEL, "prompt": f"Hello number {i}", "max_tokens": 4,
                                        "temperature": 0})
                results.append((rid, r.status_code, r.text[:200]))
            except requests.RequestException as exc:
                results.append((rid, 0, str(exc)))
            i += 1
            stop.wait(1.0)  # a pace (one a second at most), leaving the CPUs to the stages' start-up

    thread = threading.Thread(target=client, daemon=True)
    try:
        def up_log() -> str:
            return log.read_text(errors="replace")

        def front_ready() -> bool:
            assert up.poll() is None, up_log()[-3000:]
            try:
                return requests.get(f"{front}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(front_ready, 400, "the pipeline's front to answer")
        before = json.loads((workdir / "endpoints.json").read_text())
        thread.start()
        wait_until(lambda: len(results) >= 3, 120, "three requests through the front")

        pipeline_file(spec, 384)  # an engine argument of the AR stage: a new revision
        wait_until(lambda: "rolled out" in up_log() or "did not come up" in up_log()
                   or up.poll() is not None, 1200, "the rollout")
        assert up.poll() is None and "did not come up" not in up_log(), up_log()[-3000:]
        after = json.loads((workdir / "endpoints.json").read_text())
        assert after["revision"] != before["revision"] and after["front"] == front
        done = len(results)
        wait_until(lambda: len(results) >= done + 3, 120, "three more requests through the new revision")
        stop.set()
        thread.join(320)

        text = up_log()
        assert [r for r in results if r[1] != 200] == [], results
        # Receivers first; the front switched once the new revision was ready; then the old
        # revision drained, its AR stage before its receiver, with no transfer failed.
        starting = text.index(f"revision {before['revision']} -> {after['revision']}: starting its stages, "
                              "receivers first (receiver -> ar)")
        switched = text.index(f"revision {after['revision']} is ready; the front forwards to ar")
        drained_ar, drained_receiver = text.index("stopped ar (drained"), text.index("stopped receiver (its senders")
        assert starting < switched < drained_ar < drained_receiver
        assert "0 failed or expired" in text[drained_receiver:]
        # Every request's KV arrived, at the old receiver or at the new one: the old AR stage
        # acknowledged (delivered) as many transfers as it served requests, with none failed
        # or expired (its drain summary), the new one the rest; each receiver holds what its
        # own revision sent (the old one's inbox saved when it stopped, less what its 300 s TTL
        # had already evicted), and no request's KV went to both.
        summary = re.search(r"drained \(its KV transfers: (\d+) delivered, (\d+) failed or expired\)", text)
        old_delivered, old_failed = int(summary.group(1)), int(summary.group(2))
        def new_counts() -> dict:
            return stage_counts(requests.get(f"{after['stages']['ar']}/metrics", timeout=10).text)

        # (the last transfers may be acknowledged a moment after their requests answered)
        wait_until(lambda: old_delivered + new_counts().get("delivered", 0) >= len(results), 60,
                   "the new revision's transfers acknowledged")
        assert old_failed == 0 and new_counts().get("failed", 0) == 0
        assert old_delivered + new_counts().get("delivered", 0) == len(results)
        old = arrived(json.loads((workdir / "receiver.arrivals.json").read_text())["payloads"])
        new = arrived(requests.get(f"{after['stages']['receiver']}/v1/kv", timeout=10).json()["payloads"])
        assert old and new and not old & new
        served_by_new = [rid for rid, _, _ in results][old_delivered:]
        assert set(served_by_new) <= new
    finally:
        stop.set()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=240)
            except subprocess.TimeoutExpired:
                stop_group(up, 10)
