"""YAML read as `kubectl apply -f` reads it: sigs.k8s.io/yaml over go-yaml v2, whose scalar
rules are neither PyYAML's YAML 1.1 nor YAML 1.2. Each expectation below is what go-yaml v2's
resolve.go and sigs.k8s.io/yaml's conversion make of the text, then what the API server's
JSON decoder makes of the JSON kubectl sends."""
from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import yaml

from omni_operator.local import cli
from omni_operator.check.documents import load_documents


def value_of(text: str):
    (doc,) = load_documents(f"v: {text}\n")
    assert doc.error is None, doc.error
    return doc.value["v"]


@pytest.mark.parametrize("text,expected", [
    # booleans: go-yaml's table, with the one-letter forms PyYAML reads as strings
    ("y", True), ("Y", True), ("n", False), ("N", False), ("yes", True), ("No", False), ("ON", True), ("off", False),
    ("True", True), ("FALSE", False), ("'y'", "y"), ("yES", "yES"),
    # null
    ("~", None), ("null", None), ("NULL", None), ("", None), ("nil", "nil"),
    # integers in Go's syntax (underscores anywhere dropped)
    ("42", 42), ("+42", 42), ("-0", 0), ("0x1F", 31), ("0X1f", 31), ("0o17", 15), ("0O17", 15), ("0755", 493),
    ("0b101", 5), ("-0b101", -5), ("1_000", 1000), ("_1", "_1"), ("9223372036854775807", 2**63 - 1),
    # floats: 1e3 is a float to go-yaml, and JSON writes it 1000, an integer to the server
    ("1e3", 1000), ("1E3", 1000), ("2.0", 2), ("1.", 1), (".5", 0.5), ("1.5e-3", 0.0015), ("08", 8), ("1.0e3", 1000),
    ("1e400", "1e400"), (".inf2", ".inf2"),
    # beyond int64: a float64 on the server
    ("9223372036854775808", 9.223372036854776e18), ("99999999999999999999", 1e20),
    # strings: sexagesimal, timestamps, hex floats, anything else
    ("1:30", "1:30"), ("190:20:30", "190:20:30"), ("2024-01-01", "2024-01-01"), ("2001-12-14t21:59:43.10-05:00",
                                                                                "2001-12-14t21:59:43.10-05:00"),
    ("0x1p-2", "0x1p-2"), ("1.5Gi", "1.5Gi"), ("=", "="),
    # explicit tags
    ("!!str 12", "12"), ("!!int '42'", 42), ("!!float 3", 3), ("!!bool yes", True), ("!!null ''", None),
    ("!!timestamp 2024-01-01", "2024-01-01"), ("!custom text", "text"),
])
def test_scalars(text, expected):
    value = value_of(text)
    assert value == expected and type(value) is type(expected), (text, value)


def test_keys_become_strings_as_sigs_k8s_io_yaml_writes_them():
    (doc,) = load_documents("{1: a, 1.5: b, 1e6: c, 0x10: d, true: e, n: f, 2024-01-01: g, 0.1: h}\n")
    assert doc.value == {"1": "a", "1.5": "b", "1e+06": "c", "16": "d", "true": "e", "false": "f",
                         "2024-01-01": "g", "0.1": "h"}


@pytest.mark.parametrize("text,words", [
    ("~: x\n", "null map key"),
    ("v: !!int abc\n", "cannot decode !!str `abc` as a !!int"),
    ("v: !!bool 1\n", "as a !!bool"),
    ("v: .nan\n", ".nan is not a JSON number"),
    ("v: -.inf\n", "-.inf is not a JSON number"),
    ("v: {<<: [a]}\n", "a merge"),
    ("? [a]\n: b\n", "not valid YAML"),
])
def test_what_kubectl_cannot_send_is_refused(text, words):
    (doc,) = load_documents(text)
    assert doc.value is None and words in doc.error, doc.error


def test_merge_keys_apply_in_go_yamls_order():
    """A merged map overrides the keys before the `<<` and is overridden by those after it;
    of a list of maps, the first wins."""
    (doc,) = load_documents("base: &b {x: 1, y2: 2}\nm: {x: 0, <<: *b, y2: 3}\nl: {<<: [{x: 1}, {x: 2, z: 2}]}\n")
    assert doc.value["m"] == {"x": 1, "y2": 3}
    assert doc.value["l"] == {"x": 1, "z": 2}


PIPELINE = """
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
spec:
  image: ghcr.io/example/omni-stage:0.1.0
  model: {name: Qwen/Qwen2.5-Omni-7B}
  stages:
    - name: thinker
      role: ar
      kvTransfer: {send: true, timeoutSeconds: TIMEOUT}
      STAGE
    - name: talker
      role: generation
      gpus: 0
      inputs: [thinker]
"""


def validate(tmp_path: Path, stage: str = "replicas: 1", timeout: str = "30") -> list[str]:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.replace("STAGE", stage).replace("TIMEOUT", timeout))
    out = io.StringIO()
    cli.cmd_validate([path], out)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("stage,timeout", [
    ("replicas: 1e3", "30"),           # PyYAML: the string "1e3"; kubectl: 1000
    ("replicas: 2.0", "30"),           # a float that JSON writes as 2
    ("replicas: 0x10", "0x1E"),        # Go's hex integers
    ("env: [{name: WINDOW, value: 1:30}]", "30"),  # PyYAML: the integer 90; kubectl: "1:30"
    ("gpus:", "30"),                   # an explicit null the server drops: the default applies
    ("kvTransfer:", "30"),
    ("nodeSelector: {zone: 'y'}", "30"),
    ("<<: {replicas: 2, gpus: 0}", "30"),
])
def test_pipelines_kubectl_accepts_are_valid(tmp_path, stage, timeout):
    lines = validate(tmp_path, stage, timeout)
    assert len(lines) == 1 and lines[0].endswith("valid (2 stages)"), lines


@pytest.mark.parametrize("stage,field,words", [
    ("env: [{name: DEBUG, value: y}]", "spec.stages[0].env[0].value", "must be a string, not the boolean true"),
    ("nodeSelector: {zone: 08}", "spec.stages[0].nodeSelector.zone", "must be a string, not the integer 8"),
    ("nodeSelector: {pool: n}", "spec.stages[0].nodeSelector.pool", "not the boolean false"),
    ("replicas: 1e4", "spec.stages[0].replicas", "maximum of 1024"),
    ("replicas: 1.5", "spec.stages[0].replicas", "must be an integer"),
    ("env: [null]", "spec.stages[0].env[0]", "must be an object, not null"),
])
def test_pipelines_kubectl_refuses_are_refused(tmp_path, stage, field, words):
    lines = validate(tmp_path, stage)
    assert any(f"): {field}: " in line and words in line for line in lines), lines


def test_what_pyyaml_alone_would_read_differently():
    """The reason for all this: PyYAML's own reading of these differs from kubectl's."""
    assert yaml.safe_load("v: y")["v"] == "y" and value_of("y") is True
    assert yaml.safe_load("v: 1e3")["v"] == "1e3" and value_of("1e3") == 1000
    assert yaml.safe_load("v: 1:30")["v"] == 90 and value_of("1:30") == "1:30"
    assert yaml.safe_load("v: 08")["v"] == "08" and value_of("08") == 8
    assert math.isclose(value_of("1.5e-3"), 0.0015)
