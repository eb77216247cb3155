"""Kubernetes' patterns with Go's semantics, and quantities as apimachinery parses them
(issue 44, classes 2 and 3).

A YAML block scalar (``key: |``) ends in a newline, and kubectl sends it: ``"8\\n"``. The API
server checks CRD patterns, CEL ``matches()`` and label values with Go's regexp, where ``$``
is the end of the text, and ``isQuantity`` refuses any byte after the suffix; Python's ``$``
also matches before a final newline. Each pipeline below is written as a user would write it,
and refused naming the field, as ``kubectl apply`` would refuse it. Quantities beyond int64
that ``ParseQuantity`` takes (``1e19``, ``20E``) are accepted. A last test keeps Python's
``re`` away from anchored patterns in the operator: every Kubernetes pattern goes through
``omni_operator.check.gopattern``."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import yaml

from omnip_support import body_of, validate_text
from omni_operator.check.admission import admit, problems_of
from omni_operator.check.gopattern import PatternError, matches
from omni_operator.pipeline.quantities import QuantityError, canonical_quantity, parse
from omni_operator.check.validation import resource_problems

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "omni_operator"

PIPELINE = """\
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
  labels:
    team: ml
spec:
  image: ghcr.io/example/omni-stage:0.1.0
  model:
    name: Qwen/Qwen2.5-Omni-7B
    cache:
      pvc: {claimName: models}
    hubTokenSecretRef: {name: hf-token, key: token}
  stages:
    - name: thinker
      role: ar
      shmSize: 2Gi
      resources:
        requests: {memory: 8Gi}
      nodeSelector:
        pool: gpu
      tolerations:
        - {key: dedicated, operator: Equal, value: ml, effect: NoSchedule}
      env:
        - {name: LOG_LEVEL, value: info}
      engineArgs:
        max-model-len: 4096
      kvTransfer:
        send: true
        ioCpus: "2-3"
      autoscaling:
        maxReplicas: 4
        metrics:
          - {signal: queuedRequests, target: 8}
    - name: talker
      role: generation
      gpus: 0
      inputs: [thinker]
"""


def with_block(old: str, key: str, value: str) -> str:
    """The pipeline with the line ``old`` replaced by ``key: |`` and the value on the next
    line, as a user writes a block scalar (the value then ends in a newline)."""
    assert old in PIPELINE, old
    indent = old[: len(old) - len(old.lstrip())]
    lines = f"{indent}{key}".split("\n")
    deeper = " " * (len(lines[-1]) - len(lines[-1].lstrip()) + 4)
    return PIPELINE.replace(old, f"{indent}{key} |\n{deeper}{value}", 1)


def test_the_pipeline_is_valid(tmp_path):
    code, lines = validate_text(tmp_path, PIPELINE)
    assert code == 0, lines


# (id, the line a user writes as a block scalar, key, value, the field named)
TRAILING_NEWLINE = [
    ("pipeline-name", "  name: qwen-omni", "name:", "qwen-omni", "metadata.name"),
    ("label-value", "    team: ml", "team:", "ml", "metadata.labels.team"),
    ("image", "  image: ghcr.io/example/omni-stage:0.1.0", "image:", "ghcr.io/example/omni-stage:0.1.0", "spec.image"),
    ("claim-name", "      pvc: {claimName: models}", "pvc:\n        claimName:", "models", "spec.model.cache.pvc.claimName"),
    ("secret-key", "    hubTokenSecretRef: {name: hf-token, key: token}",
     "hubTokenSecretRef:\n      name: hf-token\n      key:", "token", "spec.model.hubTokenSecretRef.key"),
    ("stage-name", "    - name: thinker", "- name:", "thinker", "spec.stages[0].name"),
    ("shm-size", "      shmSize: 2Gi", "shmSize:", "2Gi", "spec.stages[0].shmSize"),
    ("memory-request", "        requests: {memory: 8Gi}", "requests:\n          memory:", "8Gi",
     "spec.stages[0].resources.requests.memory"),
    ("node-selector-value", "        pool: gpu", "pool:", "gpu", "spec.stages[0].nodeSelector.pool"),
    ("toleration-value", "        - {key: dedicated, operator: Equal, value: ml, effect: NoSchedule}",
     "- key: dedicated\n          operator: Equal\n          effect: NoSchedule\n          value:", "ml",
     "spec.stages[0].tolerations[0].value"),
    ("env-name", "        - {name: LOG_LEVEL, value: info}", "- value: info\n          name:", "LOG_LEVEL",
     "spec.stages[0].env[0].name"),
    ("io-cpus", '        ioCpus: "2-3"', "ioCpus:", "2-3", "spec.stages[0].kvTransfer.ioCpus"),
    ("autoscaling-target", "          - {signal: queuedRequests, target: 8}",
     "- signal: queuedRequests\n            target:", "8", "spec.stages[0].autoscaling.metrics[0].target"),
    ("engine-args-key", "        max-model-len: 4096", "? |\n          max-model-len\n        :", "4096",
     "spec.stages[0].engineArgs"),
]


@pytest.mark.parametrize("case_id,old,key,value,field", TRAILING_NEWLINE, ids=[c[0] for c in TRAILING_NEWLINE])
def test_a_trailing_newline_is_refused_as_kubectl_apply_refuses_it(tmp_path, case_id, old, key, value, field):
    if case_id == "engine-args-key":  # a block scalar as a map key
        text = PIPELINE.replace(old, f"        ? |\n          max-model-len\n        : {value}")
    else:
        text = with_block(old, key, value)
    body = body_of(text)
    code, lines = validate_text(tmp_path, text)
    assert code == 1, lines
    assert any(f": {field}" in line for line in lines), lines
    assert all("\n" not in line for line in lines)
    if case_id != "engine-args-key":  # the stage contract, not the API server, refuses that one
        assert any(f.startswith(field) for f, _ in resource_problems(copy.deepcopy(body))), field


def test_a_label_key_and_a_resource_name_with_a_newline_are_refused():
    body = body_of(PIPELINE)
    body["metadata"]["labels"] = {"team\n": "ml"}
    assert any(p.field.startswith("metadata.labels") for p in problems_of(copy.deepcopy(body)))
    body = body_of(PIPELINE)
    body["spec"]["stages"][0]["resources"] = {"limits": {"example.com/fpga\n": 1}, "requests": {"example.com/fpga\n": 1}}
    fields = [f for f, _ in resource_problems(copy.deepcopy(body))]  # the CEL rule's k.matches(...)
    assert any(f.startswith("spec.stages[0].resources") for f in fields), fields


def test_go_regexp_semantics():
    assert matches(r"^[0-9]+$", "8") and not matches(r"^[0-9]+$", "8\n")
    assert not matches(r"^\d+$", "\u0663")  # Go's \d is ASCII: no Arabic-Indic three
    assert matches(r"^\S+$", "a\u2003b")  # Go's \s is [\t\n\f\r ]: an em space is no space to it
    assert matches(r"^\s$", "\t") and not matches(r"^\s$", "\v")
    assert matches(r"(?m)^a$", "a\nb")  # with the m flag, $ is the end of a line, as in Go
    with pytest.raises(PatternError):
        matches(r"^(?=a)", "a")  # Go refuses look-arounds


# -- quantities ------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("1e19", 10**19), ("20E", 2 * 10**19), ("1e999999999", None), ("9223372036854775808", 2**63),
    ("16Ei", 2**63 - 1),  # a binary value is capped at int64, as apimachinery caps it
    ("0.1n", None), ("1.5Gi", 1610612736), ("1.G", 10**9), (".5", None), ("+1", 1),
])
def test_quantities_apimachinery_takes(text, value):
    quantity = parse(text)
    if value is not None:
        assert quantity.value == value


@pytest.mark.parametrize("text", ["8\n", " 8", "8 ", "", "2GB", "16 Gi", "1e", "1i", "0x10", "1e3e",
                                  "1e9999999999999999999", "-.Ei"])
def test_what_is_no_quantity(text):
    with pytest.raises(QuantityError):
        parse(text)


def test_the_api_servers_canonical_form():
    for text, canonical in [("1000m", "1"), ("1024Ki", "1Mi"), ("1e3", "1e3"), ("1e19", "10e18"), ("20E", "20E"),
                            ("1.5Gi", "1536Mi"), ("0.5Ki", "512"), ("12000", "12k"), ("1500", "1500"),
                            ("0.1n", "1n"), ("1e21", "1e21"), ("1000E", "1e21")]:
        assert canonical_quantity(text) == canonical, text


@pytest.mark.parametrize("line,new", [
    ("      shmSize: 2Gi", '      shmSize: "1e19"'),
    ("      shmSize: 2Gi", "      shmSize: 20E"),
    ("      shmSize: 2Gi", '      shmSize: "1e999999999"'),
    ("          - {signal: queuedRequests, target: 8}", '          - {signal: queuedRequests, target: "1e19"}'),
    ("        requests: {memory: 8Gi}", "        requests: {memory: 10E}"),
])
def test_quantities_beyond_int64_are_accepted(tmp_path, line, new):
    code, lines = validate_text(tmp_path, PIPELINE.replace(line, new))
    assert code == 0, lines


def test_a_target_beyond_a_float64_is_refused_for_what_it_is(tmp_path):
    text = PIPELINE.replace("target: 8}", 'target: "1e999999999"}')
    code, lines = validate_text(tmp_path, text)
    assert code == 1, lines
    (line,) = lines
    assert "spec.stages[0].autoscaling.metrics[0].target" in line and "64-bit float" in line
    assert "positive" not in line  # a positive value is never called anything else


def test_the_rendered_target_is_the_quantity_kubernetes_reads():
    body = body_of(PIPELINE.replace("target: 8}", 'target: "1e19"}'))
    body["metadata"]["namespace"] = "ml"
    children = admit(body).children
    (keda,) = [c for c in children if c["kind"] == "ScaledObject"]
    (hpa,) = [c for c in children if c["kind"] == "HorizontalPodAutoscaler"]
    assert parse(keda["spec"]["triggers"][0]["metadata"]["threshold"]).value == 10**19
    assert parse(hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"]).value == 10**19


# -- the one place ---------------------------------------------------------------------------

def _anchored_python_patterns() -> list[str]:
    """Calls of Python's re with a literal pattern that anchors with `$`, in the operator."""
    found, paths = [], sorted(OPERATOR.rglob("*.py"))
    assert len(paths) > 30, f"the operator's modules are not where this looks: {OPERATOR}"
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"):
                continue
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "$" in arg.value.replace("\\$", ""):
                    found.append(f"{path.name}:{node.lineno}: re.{node.func.attr}({arg.value!r})")
    return found


def test_no_kubernetes_pattern_is_evaluated_by_pythons_re():
    """Go semantics in one place (omni_operator.check.gopattern); Python-side parsing matches whole
    (fullmatch), never with a `$` that also matches before a final newline."""
    assert _anchored_python_patterns() == []


def test_crd_patterns_and_cel_matches_run_on_go_regexp():
    from omni_operator.check import gopattern, kube_schema, validation

    assert validation.CEL_FUNCTIONS["matches"] is validation._matches
    assert validation._crd_validator().__class__ is gopattern.SchemaValidator
    assert kube_schema._definition_validator(kube_schema.TOLERATION).__class__ is gopattern.SchemaValidator
    assert yaml  # the module reads YAML as kubectl does (documents.py)
