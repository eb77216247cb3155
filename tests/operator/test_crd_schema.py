"""The CRD: structural, its defaults and CEL rules behave as intended, and the examples pass."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

from omnip_cases import BOTH_REJECT, OPERATOR_REJECTS
from omnip_support import pipeline_body
from omni_operator.validation import validate
from omni_operator import crd
from omni_operator.errors import SpecError
from omni_operator.model import parse_pipeline

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
    assert columns == {"Ready": ".status.stagesReady", "Phase": ".status.phase", "Age": ".metadata.creationTimestamp"}


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
    parse_pipeline({**body, "metadata": {**body["metadata"], "namespace": "default"}})


def test_three_examples_cover_the_named_pipelines():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"tiny-pipeline.yaml", "bagel-ar-diffusion.yaml", "qwen-omni-thinker-talker.yaml"} <= names


def test_minimal_spec_is_valid_and_defaulted(schema):
    body = pipeline_body()
    assert validate(schema, body) == []
    spec = crd.apply_defaults(schema["properties"]["spec"], body["spec"])
    stage = spec["stages"][1]
    assert stage["replicas"] == 1 and stage["gpus"] == 1 and stage["shmSize"] == "2Gi"
    assert stage["kvTransfer"]["criteria"] == {"type": "prefill_finished"}
    assert stage["kvTransfer"]["timeoutSeconds"] == 30
    assert spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["observability"] == {"metrics": True, "alerts": {"stuckTransferSeconds": 120}}


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
    with pytest.raises(SpecError) as info:
        parse_pipeline(body)
    assert field in info.value.fields, str(info.value)


@pytest.mark.parametrize("case_id,body,field,text", OPERATOR_REJECTS, ids=[c[0] for c in OPERATOR_REJECTS])
def test_operator_catches_what_the_schema_cannot(schema, case_id, body, field, text):
    assert validate(schema, copy.deepcopy(body)) == []  # the API server would accept it
    with pytest.raises(SpecError) as info:
        parse_pipeline(body)
    assert field in info.value.fields, str(info.value)
    assert text in str(info.value)
