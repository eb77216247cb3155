"""omni-pipeline validate and the pure parts of omni-pipeline up (the processes are started
by tests/runtime/test_local_up.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from omni_operator.local import LocalStage, launch_order, local_stage_configs, render_table, stage_counts
from omni_operator.model import parse_pipeline

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_operator.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_validate_accepts_every_example():
    proc = run_cli("validate", *map(str, EXAMPLES))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count(": valid (") == len(EXAMPLES)


def test_validate_names_each_bad_field(tmp_path):
    bad = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    bad["spec"]["stages"][1]["role"] = "decoder"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1
    assert "spec.stages[1].role: 'decoder' is not one of" in proc.stdout


def test_validate_runs_the_crd_cel_rules(tmp_path):
    bad = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    bad["spec"]["stages"][0]["kvTransfer"]["criteria"] = {"type": "special_token"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1
    assert "tokenId" in proc.stdout and "spec.stages[0].kvTransfer" in proc.stdout


def test_validate_catches_a_cycle_the_schema_cannot(tmp_path):
    body = yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text())
    body["spec"]["stages"][0]["inputs"] = [body["spec"]["stages"][-1]["name"]]
    path = tmp_path / "cycle.yaml"
    path.write_text(yaml.safe_dump(body))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1 and "cycle" in proc.stdout.lower()


def test_validate_reports_unreadable_files(tmp_path):
    (tmp_path / "broken.yaml").write_text("spec: [unclosed")
    proc = run_cli("validate", str(tmp_path / "broken.yaml"), str(tmp_path / "missing.yaml"))
    assert proc.returncode == 1
    assert "not valid YAML" in proc.stdout and "cannot read it" in proc.stdout


def test_stages_launch_downstream_first():
    pipeline = parse_pipeline(yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text()))
    order = launch_order(pipeline)
    for stage in pipeline.stages:
        for upstream in stage.inputs:
            assert order.index(stage.name) < order.index(upstream)


def test_local_configs_point_every_stage_at_its_downstream_on_loopback():
    pipeline = parse_pipeline(yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text()))
    ports = {s.name: {"http": 10000 + i, "kv": 11000 + i} for i, s in enumerate(pipeline.stages)}
    configs = local_stage_configs(pipeline, ports)
    for stage in pipeline.stages:
        cfg = configs[stage.name]
        assert cfg["ports"] == ports[stage.name]
        assert [d["endpoint"] for d in cfg["downstream"]] == [
            f"127.0.0.1:{ports[d]['kv']}" for d in pipeline.downstream_of(stage.name)
        ]


def test_the_table_reads_the_stage_metrics():
    ar_page = "\n".join([
        "# TYPE omni_kv_transfers gauge",
        'omni_kv_transfers{model_name="m",stage="ar",state="pending"} 1.0',
        'omni_kv_transfers{model_name="m",stage="ar",state="active"} 2.0',
        'omni_kv_transfers{model_name="m",stage="ar",state="held"} 2.0',
        "# TYPE omni_kv_transfers_resolved_total counter",
        'omni_kv_transfers_resolved_total{model_name="m",outcome="acked",stage="ar"} 7.0',
        'omni_kv_transfers_resolved_total{model_name="m",outcome="expired",stage="ar"} 1.0',
        'omni_kv_transfers_resolved_total{model_name="m",outcome="failed",stage="ar"} 2.0',
    ])
    ar = LocalStage("ar", "ar", Path("x"), Path("y"), 8000, "127.0.0.1", ready=True, counts=stage_counts(ar_page))
    rx = LocalStage("rx", "generation", Path("x"), Path("y"), 8001, "127.0.0.1")
    table = render_table("p", [ar, rx])
    row = next(line for line in table.splitlines() if line.startswith("ar "))
    assert row.split()[:6] == ["ar", "ar", "yes", "1/2/2", "7", "3"]
    assert "waiting" in next(line for line in table.splitlines() if line.startswith("rx "))
