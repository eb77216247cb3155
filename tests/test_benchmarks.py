"""The benchmarks' contract that a machine without their hardware still keeps: the last line
is one JSON object, saying what was not measured and why."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_data_path_benchmark_ends_with_one_json_object_on_any_machine():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kv_data_path.py"), "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    last = json.loads(run.stdout.strip().splitlines()[-1])
    if torch.cuda.is_available():
        assert run.returncode == 0 and last["data_plane_s"] > 0, run.stderr
    else:
        assert run.returncode == 1
        assert "data_plane_s" in last["not_measured"] and "CUDA" in last["reason"]
