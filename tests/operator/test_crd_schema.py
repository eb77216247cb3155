"""The CRD: structural, its defaults and CEL rules behave as intended, and the examples pass."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

from omnip_cases import BOTH_REJECT, OPERATOR_REJECTS
from omnip_support import pipeline_body
from omni_operator.check.validation import validate
from omni_operator.pipeline import crd
from omni_operator.check.admission import admit
from omni_operator.pipeline.errors import SpecError
from omni_operator.pipeline.model import parse_pipeline

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))


@pytest.fixture(scope="module")
def schema():
    return crd.openapi_schema()


def test_crd_names_and_printer_columns():
    manifest = crd.crd()
    assert manifest["metadata"]["name"] == "omnipipelines.omnipipeline.dev"
    names = manifest["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("OmniPipeline", "omnipipelines", ["omnip"])
    assert manifest["spec"]["scope"] == "Namespaced"
    (version,) = manifest["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Ready": ".status.stagesReady", "Phase": ".status.phase", "Revision": ".status.revision",
                       "Endpoint": ".status.endpoint", "Transfers": ".status.transfersHealth",
                       "Age": ".metadata.creationTimestamp"}


def _walk(node, path="schema"):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural(schema):
    # Every node has a type (or is int-or-string / preserves unknown fields), as apiextensions/v1 requires.
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields"), path
        if node.get("type") == "array" and any("x-kubernetes-validations" in n for _, n in _walk(node)):
            assert "maxItems" in node, f"{path}: CEL over an unbounded list exceeds the server's cost budget"


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_examples_are_valid(schema, path):
    with open(path, encoding="utf-8") as f:
        body = yaml.safe_load(f)
    assert validate(schema, body) == []
    admit({**body, "metadata": {**body["metadata"], "namespace": "default"}})


def test_three_examples_cover_the_named_pipelines():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"tiny-pipeline.yaml", "bagel-ar-diffusion.yaml", "qwen-omni-thinker-talker.yaml",
            "tiny-omni-streaming.yaml"} <= names


def test_minimal_spec_is_valid_and_defaulted(schema):
    body = pipeline_body()
    assert validate(schema, body) == []
    spec = crd.apply_defaults(schema["properties"]["spec"], body["spec"])
    stage = spec["stages"][1]
    assert stage["replicas"] == 1 and stage["gpus"] == 1 and stage["shmSize"] == "2Gi"
    assert stage["kvTransfer"]["criteria"] == {"type": "prefill_finished"}
    assert stage["kvTransfer"]["timeoutSeconds"] == 30
    assert spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["observability"] == {"metrics": True, "alerts": {"stuckTransferSeconds": 120, "stalledStreamSeconds": 60}}


def test_operator_defaults_come_from_the_crd(schema):
    # The model reads its defaults from the CRD: both agree because there is one source.
    pipeline = parse_pipeline({**pipeline_body(), "metadata": {"name": "tiny", "namespace": "ns"}})
    stage_schema = schema["properties"]["spec"]["properties"]["stages"]["items"]["properties"]
    assert pipeline.stages[0].kv.timeout_seconds == stage_schema["kvTransfer"]["properties"]["timeoutSeconds"]["default"]
    assert pipeline.stages[1].shm_size == stage_schema["shmSize"]["default"]
    assert pipeline.observability.stuck_transfer_seconds == \
        schema["properties"]["spec"]["properties"]["observability"]["properties"]["alerts"]["properties"]["stuckTransferSeconds"]["default"]


def test_unknown_fields_are_rejected(schema):
    body = pipeline_body()
    body["spec"]["stages"][0]["gpu"] = 1  # a typo of gpus
    errors = validate(schema, body)
    assert any("'gpu' was unexpected" in e for e in errors), errors


def test_engine_args_keep_unknown_fields(schema):
    body = pipeline_body()
    body["spec"]["stages"][0]["engineArgs"] = {"max-model-len": 4096, "speculative-config": {"method": "ngram"}}
    assert validate(schema, body) == []


@pytest.mark.parametrize("case_id,body,field,crd_text", BOTH_REJECT, ids=[c[0] for c in BOTH_REJECT])
def test_schema_and_operator_both_reject(schema, case_id, body, field, crd_text):
    errors = validate(schema, copy.deepcopy(body))
    assert any(crd_text in e for e in errors), errors
    # The operator's check evaluates the CRD itself: the same field and words, once.
    with pytest.raises(SpecError) as info:
        admit(body)
    assert field in info.value.fields, str(info.value)
    assert crd_text in str(info.value)


@pytest.mark.parametrize("case_id,body,field,text", OPERATOR_REJECTS, ids=[c[0] for c in OPERATOR_REJECTS])
def test_operator_catches_what_the_schema_cannot(schema, case_id, body, field, text):
    assert validate(schema, copy.deepcopy(body)) == []  # the API server would accept it
    with pytest.raises(SpecError) as info:
        admit(body)
    assert field in info.value.fields, str(info.value)
    assert text in str(info.value)


# -- the CRD's pass-through fields against Kubernetes' own schema -------------------------------

def _upstream(name: str) -> dict:
    from omni_operator.check.kube_schema import definition
    return definition(name)


def _resolve(node: dict) -> dict:
    ref = node.get("$ref")
    return _upstream(ref.rsplit("/", 1)[1]) if ref else node


def _types(node: dict) -> set[str]:
    node = _resolve(node)
    if "oneOf" in node:  # Quantity: string or number
        return {"int-or-string"}
    types = node.get("type")
    return {t for t in (types if isinstance(types, list) else [types]) if t != "null"}


def _crd_types(node: dict) -> set[str]:
    return {"int-or-string"} if node.get("x-kubernetes-int-or-string") else {node["type"]}


def _same_shape(crd_node: dict, upstream: dict, path: str) -> None:
    """Every field the CRD lets through exists upstream with the same type, and whatever
    upstream requires the CRD requires too: the CRD is a checked subset, never a variant."""
    upstream = _resolve(upstream)
    assert set(upstream.get("required") or []) <= set(crd_node.get("required") or []), path
    for name, sub in (crd_node.get("properties") or {}).items():
        assert name in upstream["properties"], f"{path}.{name} is not a Kubernetes field"
        theirs = upstream["properties"][name]
        assert _crd_types(sub) == _types(theirs) or (_crd_types(sub) == {"integer"} and _types(theirs) == {"integer"}), \
            f"{path}.{name}: {_crd_types(sub)} vs {_types(theirs)}"
        if sub.get("properties"):
            _same_shape(sub, theirs, f"{path}.{name}")
    extra = crd_node.get("additionalProperties")
    if isinstance(extra, dict):
        theirs = _resolve(upstream)["additionalProperties"] if "additionalProperties" in upstream else upstream
        assert _crd_types(extra) == _types(theirs), path


def test_pass_through_fields_are_a_subset_of_kubernetes_types(schema):
    stage = schema["properties"]["spec"]["properties"]["stages"]["items"]["properties"]
    _same_shape(stage["tolerations"]["items"], _upstream("io.k8s.api.core.v1.Toleration"), "tolerations[]")
    _same_shape(stage["env"]["items"], _upstream("io.k8s.api.core.v1.EnvVar"), "env[]")
    _same_shape(stage["resources"], _upstream("io.k8s.api.core.v1.ResourceRequirements"), "resources")
    _same_shape(stage["nodeSelector"], _upstream("io.k8s.api.core.v1.PodSpec")["properties"]["nodeSelector"], "nodeSelector")
    value_from = stage["env"]["items"]["properties"]["valueFrom"]
    # EnvVarSource of the minimum server version, field for field (newer ones add fileKeyRef).
    assert set(value_from["properties"]) == set(_upstream("io.k8s.api.core.v1.EnvVarSource")["properties"])


def test_the_subset_check_has_teeth(schema):
    stage = copy.deepcopy(schema["properties"]["spec"]["properties"]["stages"]["items"]["properties"])
    stage["tolerations"]["items"]["properties"]["tolerationSecond"] = {"type": "integer"}
    with pytest.raises(AssertionError, match="not a Kubernetes field"):
        _same_shape(stage["tolerations"]["items"], _upstream("io.k8s.api.core.v1.Toleration"), "tolerations[]")
    stage["env"]["items"]["properties"]["value"] = {"type": "integer"}
    with pytest.raises(AssertionError):
        _same_shape(stage["env"]["items"], _upstream("io.k8s.api.core.v1.EnvVar"), "env[]")


def test_the_crd_rules_evaluate_in_every_example(schema):
    # Every CEL rule compiles (cel-python parses the expression) and none errors on a valid spec.
    from omni_operator.check.validation import _program
    for _, node in _walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            _program(rule["rule"])
            assert "\\." not in rule["rule"], f"CEL string literals take no '\\.': {rule['rule']}"


def test_integer_fields_are_bounded(schema):
    for path, node in _walk(schema):
        if node.get("type") == "integer" and ".status" not in path:
            assert "maximum" in node and "minimum" in node, path


@pytest.mark.parametrize("stage, io_cpus, parsed", [
    (0, "3", "3"), (0, "0-3,8,10-11", "0-3,8,10-11"), (1, "auto", None),
    (2, "auto", None),  # "auto" asks for nothing: allowed on a stage that does not send
])
def test_io_cpus_the_schema_and_the_operator_accept(schema, stage, io_cpus, parsed):
    body = pipeline_body()
    body["spec"]["stages"][stage].setdefault("kvTransfer", {})["ioCpus"] = io_cpus
    assert validate(schema, copy.deepcopy(body)) == []
    assert admit(body).pipeline.stages[stage].kv.io_cpus == parsed
