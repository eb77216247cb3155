"""``omni-pipeline status FILE``: the transfer health of a pipeline run with ``omni-pipeline up``.

``up`` records where its stages listen (:func:`record_endpoints`: ``<workdir>/endpoints.json``,
and a pointer to it under the user's runtime directory, keyed by the pipeline's namespace and
name, removed when ``up`` stops). ``status`` finds that record, reads each stage's ``/metrics``
twice, ``--interval`` seconds apart (the counts of failed and expired transfers are over that
interval), and prints the per-stage and per-edge table computed by the very code that computes
the operator's ``status.stages[].transfers`` and ``TransfersHealthy`` (``transfers.py``).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from omni_operator.health.reader import METRICS_QUERY, fetch_page
from omni_operator.pipeline.model import Pipeline
from omni_operator.health.transfers import PipelineReading, Sample, StageReading, parse_metrics, pod_reading, render_table, transfers_verdict

ENDPOINTS_FILE = "endpoints.json"
#: Exit codes of `status`: TransfersHealthy True, False, Unknown; and "no running pipeline".
EXIT = {"True": 0, "False": 1, "Unknown": 3}
NOT_RUNNING = 2


def state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"omni-pipeline-{os.getuid()}"


def pointer_path(pipeline: Pipeline) -> Path:
    return state_dir() / f"{pipeline.namespace}.{pipeline.name}.json"


def record_endpoints(pipeline: Pipeline, workdir: Path, urls: Mapping[str, str], front: str | None = None) -> Path:
    """Write where the stages' HTTP servers listen ({stage: base URL}, those of the revision
    now running) and, with ``up --watch``, the pipeline's front; returns the pointer."""
    record = {"pipeline": pipeline.name, "namespace": pipeline.namespace, "workdir": str(workdir),
              "pid": os.getpid(), "revision": pipeline.revision, "stages": dict(urls)}
    if front:
        record["front"] = front
    (workdir / ENDPOINTS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    pointer = pointer_path(pipeline)
    pointer.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pointer.write_text(json.dumps(record) + "\n")
    return pointer


def forget_endpoints(pipeline: Pipeline, workdir: Path) -> None:
    pointer = pointer_path(pipeline)
    try:
        if json.loads(pointer.read_text()).get("workdir") == str(workdir):
            pointer.unlink()
    except (OSError, ValueError):
        pass


def running_record(pipeline: Pipeline, workdir: Path | None = None) -> dict[str, Any] | None:
    """The record of the ``up`` that runs the pipeline, from ``workdir`` or from ``up``'s
    pointer; None when there is none, or its process is gone (a record an ``up`` killed
    with -9 left behind)."""
    path = workdir / ENDPOINTS_FILE if workdir is not None else pointer_path(pipeline)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not pid_alive(record.get("pid")):
        return None
    return record


def pid_alive(pid: Any) -> bool:
    """Whether a process of this id exists (a record's or a reservation's writer)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def find_endpoints(pipeline: Pipeline, workdir: Path | None = None) -> dict[str, str] | None:
    """{stage: base URL} of the running pipeline, from ``workdir`` or from ``up``'s pointer
    (None: not running: no record, or the ``up`` that wrote it is gone)."""
    record = running_record(pipeline, workdir)
    if record is None:
        return None
    stages = record.get("stages")
    return {str(k): str(v) for k, v in stages.items()} if isinstance(stages, dict) else None


def read_stages(endpoints: Mapping[str, str], previous: Mapping[str, Sample] | None, *, timeout: float = 2.0,
                fetch: Callable[[str, float], str] = fetch_page, clock: Callable[[], float] = time.time,
                interval: float = 0.0) -> tuple[PipelineReading, dict[str, Sample]]:
    """One reading of every stage (one "pod" each, named after the stage), and its samples."""
    read_at = clock()
    stages, samples = {}, {}
    for stage, url in endpoints.items():
        try:
            sample = parse_metrics(fetch(f"{url.rstrip('/')}/metrics?{METRICS_QUERY}", timeout))
        except (OSError, ValueError) as exc:
            stages[stage] = StageReading((), ((stage, f"GET {url}/metrics failed: {getattr(exc, 'reason', exc)}"),))
            continue
        samples[stage] = sample
        stages[stage] = StageReading((pod_reading(stage, (previous or {}).get(stage), sample),))
    return PipelineReading(read_at=read_at, interval=interval, stages=stages), samples


def show_status(pipeline: Pipeline, out: TextIO, *, workdir: Path | None = None, interval: float = 5.0,
                failing_ratio: float = 0.05, timeout: float = 2.0,
                sleep: Callable[[float], None] = time.sleep) -> int:
    endpoints = find_endpoints(pipeline, workdir)
    if endpoints is None:
        where = workdir / ENDPOINTS_FILE if workdir is not None else pointer_path(pipeline)
        why = "the `up` that wrote it has exited" if where.exists() else "not found"
        print(f"pipeline {pipeline.namespace}/{pipeline.name} is not running here ({where}: {why}); "
              "start it with `omni-pipeline up FILE`", file=out)
        return NOT_RUNNING
    reading, samples = read_stages(endpoints, None, timeout=timeout)
    if interval > 0:
        sleep(interval)  # the interval the failed and expired counts cover
        reading, _ = read_stages(endpoints, samples, timeout=timeout, interval=interval)
    verdict = transfers_verdict(pipeline, reading, failing_ratio)
    print(render_table(pipeline, verdict), file=out)
    return EXIT[verdict.status]
