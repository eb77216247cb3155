"""The console script, its options, packaging and the import boundary."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from omni_operator.pipeline import crd
from omni_operator.controller.main import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_is_cluster_wide():
    options = parse_args([])
    assert options.clusterwide and options.namespaces == []
    assert (options.metrics_port, options.liveness_port) == (8080, 8081)


def test_listed_namespaces():
    options = parse_args(["-n", "team-a", "--namespace", "team-b", "-n", "team-a", "--resync-seconds", "30"])
    assert options.namespaces == ["team-a", "team-b"] and not options.clusterwide
    assert options.resync_seconds == 30


@pytest.mark.parametrize("argv,text", [
    (["-n", "Team_A"], "--namespace 'Team_A': not a namespace name"),
    (["--metrics-port", "70000"], "--metrics-port 70000: must be from 0 to 65535"),
    (["--resync-seconds", "0"], "--resync-seconds must be positive"),
    (["-n", "a", "-A"], "not allowed with argument"),
])
def test_bad_options_are_refused_with_the_flag_named(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_console_script_help():
    script = os.path.join(os.path.dirname(sys.executable), "omni-operator")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--namespace" in result.stdout


def test_operator_imports_neither_vllm_nor_the_runtime():
    code = ("import sys, omni_operator.controller.main, omni_operator.controller.handlers; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'omni_runtime', 'torch')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_dir_is_not_a_package():
    # `operator/__init__.py` would shadow the standard library's operator module.
    assert not os.path.exists(os.path.join(REPO, "operator", "__init__.py"))


@pytest.mark.parametrize("file", [crd.CRD_FILE, crd.SCALER_CRD_FILE])
def test_every_copy_of_the_crd_is_identical(file):
    source = crd.crd_text(file)
    name = yaml.safe_load(source)["metadata"]["name"]
    copies = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        for name_ in files:
            path = os.path.join(root, name_)
            if name_.endswith((".yaml", ".yml")) and "omni_operator" not in path:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if f"name: {name}" in text and "CustomResourceDefinition" in text:
                    copies.append((path, text))
    assert copies, f"no copy of {name} (the Helm chart carries one)"
    for path, text in copies:
        assert yaml.safe_load(text) == yaml.safe_load(source), f"{path} differs from the operator's CRD; copy it again"
    assert yaml.safe_load(source)["kind"] == "CustomResourceDefinition"
