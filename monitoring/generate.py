#!/usr/bin/env python3
"""Generate every file derived from monitoring/omni_mixin (and the chart's CRD copy).

    python monitoring/generate.py           # (re)write the files
    python monitoring/generate.py --check   # exit 1, listing them, if any is stale

Outputs (all committed):
- alerts/omni-pipeline.rules.yaml              plain Prometheus rule file
- charts/omni-pipeline/templates/prometheusrule.yaml  the same rules as a PrometheusRule
- dashboards/*.json and charts/omni-pipeline/dashboards/*.json  Grafana dashboards
- charts/omni-pipeline/crds/*.yaml             byte copies of operator/omni_operator/crd/*.yaml
Modelled on vLLM's tools/generate_grafana_dashboards.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "monitoring"))
sys.path.insert(0, str(ROOT))  # omni_contract: the metric names

from omni_mixin import render  # noqa: E402
from omni_mixin.dashboards import DASHBOARDS  # noqa: E402

RULES_FILE = ROOT / "alerts" / "omni-pipeline.rules.yaml"
CHART = ROOT / "charts" / "omni-pipeline"
CRD_SOURCE = ROOT / "operator" / "omni_operator" / "crd"


def outputs() -> dict[Path, bytes]:
    files: dict[Path, bytes] = {
        RULES_FILE: render.rules_file().encode(),
        CHART / "templates" / "prometheusrule.yaml": render.chart_prometheusrule_template().encode(),
    }
    for name, build in DASHBOARDS.items():
        text = render.dashboard_json(build()).encode()
        files[ROOT / "dashboards" / name] = text
        # Helm reads files only from inside the chart, hence a copy.
        files[CHART / "dashboards" / name] = text
    for crd in sorted(CRD_SOURCE.glob("*.yaml")):
        files[CHART / "crds" / crd.name] = crd.read_bytes()
    return files


def stale(files: dict[Path, bytes]) -> list[Path]:
    out = [p for p, data in files.items() if not p.is_file() or p.read_bytes() != data]
    # A file left behind in a generated folder (a renamed dashboard, a removed CRD).
    for folder, pattern in ((CHART / "dashboards", "*.json"), (CHART / "crds", "*.yaml"),
                            (ROOT / "dashboards", "*.json")):
        out += [p for p in folder.glob(pattern) if p not in files]
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if any output is stale")
    args = parser.parse_args(argv)
    files = outputs()
    if args.check:
        bad = stale(files)
        for path in bad:
            print(f"stale: {path.relative_to(ROOT)}", file=sys.stderr)
        if bad:
            print("run: python monitoring/generate.py", file=sys.stderr)
            return 1
        print(f"{len(files)} generated files are current")
        return 0
    for path in stale(files):
        if path not in files:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)}")
    for path, data in files.items():
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
