"""monitoring/generate.py: the committed outputs are current, and --check notices when not."""
from __future__ import annotations

import shutil
import subprocess
import sys

from .conftest import CHART, MONITORING, ROOT

GENERATE = MONITORING / "generate.py"


def run_generate(root, *args):
    return subprocess.run(
        [sys.executable, str(root / "monitoring" / "generate.py"), *args],
        capture_output=True, text=True, timeout=120,
    )


def test_committed_outputs_are_current():
    result = run_generate(ROOT, "--check")
    assert result.returncode == 0, result.stderr


def _copy_tree(tmp_path):
    """The generator's inputs and outputs, in a scratch copy of the repository."""
    for rel in ("monitoring", "alerts", "dashboards", "charts/omni-pipeline", "operator/omni_operator/crd"):
        src = ROOT / rel
        if src.exists():
            shutil.copytree(src, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_check_fails_on_a_hand_edited_output_and_generate_repairs_it(tmp_path):
    root = _copy_tree(tmp_path)
    rules = root / "alerts" / "omni-pipeline.rules.yaml"
    rules.write_text(rules.read_text().replace("> 300", "> 301"))
    dashboard = root / "charts" / "omni-pipeline" / "dashboards" / "omni-kv-transfers.json"
    dashboard.write_text(dashboard.read_text().replace("Held KV blocks", "Held blocks"))

    result = run_generate(root, "--check")
    assert result.returncode == 1
    assert "stale: alerts/omni-pipeline.rules.yaml" in result.stderr
    assert "stale: charts/omni-pipeline/dashboards/omni-kv-transfers.json" in result.stderr
    assert "dashboards/omni-pipelines.json" not in result.stderr

    assert run_generate(root).returncode == 0
    assert run_generate(root, "--check").returncode == 0


def test_check_fails_on_a_leftover_generated_file(tmp_path):
    root = _copy_tree(tmp_path)
    (root / "charts" / "omni-pipeline" / "dashboards" / "old.json").write_text("{}")
    result = run_generate(root, "--check")
    assert result.returncode == 1
    assert "stale: charts/omni-pipeline/dashboards/old.json" in result.stderr


def test_chart_dashboards_are_copies_of_the_committed_ones():
    for path in (ROOT / "dashboards").glob("*.json"):
        assert (CHART / "dashboards" / path.name).read_bytes() == path.read_bytes()
