"""Builds the observers (metrics, tracing) that the scheduler attaches to its ledger, and
prepares the process environment that makes the metrics visible on the stage's /metrics.

This module imports neither prometheus_client nor OpenTelemetry at import time, so a stage
launcher can import it and call :func:`prepare_prometheus_multiproc_dir` before anything else
has imported prometheus_client (which fixes its single/multi-process mode at import).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from omni_runtime.transfers import TransferObserver

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def build_observers(
    *, stage: str, model_name: str, timeout_seconds: float, vllm_config: Any = None
) -> list[TransferObserver]:
    """Metrics always; tracing only when something asks for traces (else no observer, no
    cost). Called once per scheduler, in the engine-core process."""
    from omni_runtime.metrics import TransferMetrics
    from omni_runtime.tracing import TransferTracing, resolve_tracer

    if MULTIPROC_ENV not in os.environ:
        # Fine with an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); with vLLM's
        # default engine-core process the API server's /metrics will not show omni_ families.
        logger.warning(
            "%s is not set: omni_ KV transfer metrics are only visible from this process "
            "(see docs/metrics.md)", MULTIPROC_ENV)
    observers: list[TransferObserver] = [
        TransferMetrics(stage=stage, model_name=model_name, deadline_seconds=timeout_seconds)
    ]
    tracer = resolve_tracer(vllm_config)
    if tracer is not None:
        observers.append(TransferTracing(tracer, stage=stage, model_name=model_name))
    return observers


def prepare_prometheus_multiproc_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` empty and point ``PROMETHEUS_MULTIPROC_DIR`` at it.

    Whoever starts a stage calls this (or does the same in its shell) before the stage's
    Python process imports prometheus_client, or in a launcher before it starts that process
    (which inherits the variable), so that the API server and the engine-core process share
    one metrics directory. Emptying it drops the files of a previous run, whose series would
    otherwise linger (counters of a dead run would be added to the new one's).
    """
    directory = Path(path)
    current = os.environ.get(MULTIPROC_ENV)
    if "prometheus_client" in sys.modules and current and Path(current) == directory:
        # Already this process's directory, so this process (in multiprocess mode) or the
        # children it started may be writing there: emptying it would lose their series.
        raise RuntimeError(f"{directory} is already the live {MULTIPROC_ENV}")
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(directory)
    return directory
