"""Prepares the process environment that makes omni_ metrics visible on the stage's /metrics
(prometheus_client's multiprocess mode: the engine-core process writes, the API server reads).

Imports nothing of prometheus_client, so a stage launcher can call
:func:`prepare_prometheus_multiproc_dir` before anything has imported prometheus_client
(which fixes its single/multi-process mode at import).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


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
