"""Malformed OmniPipelines as users write them: each is refused with its field named, either
by the CRD itself (the API server's schema and CEL rules, evaluated here as the server does,
so `kubectl apply` refuses it) or, where the CRD cannot say it, by `omni-pipeline validate`
and the operator's identical check. And inputs that are not pipelines at all get one line
each, never a traceback."""
from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from omni_operator.local import cli
from omni_operator.check.admission import problems_of
from omni_operator.check.validation import resource_problems

BASE = yaml.safe_load("""
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
spec:
  image: ghcr.io/example/omni-stage:0.1.0
  model:
    name: Qwen/Qwen2.5-Omni-7B
  stages:
    - name: thinker
      role: ar
      kvTransfer: {send: true}
    - name: talker
      role: ar
      inputs: [thinker]
      kvTransfer: {send: true}
    - name: code2wav
      role: generation
      gpus: 0
      inputs: [talker]
""")


def edit(fn: Callable[[dict], Any]) -> dict:
    body = copy.deepcopy(BASE)
    fn(body)
    return body


def stage(i: int, **fields: Any) -> Callable[[dict], None]:
    return lambda b: b["spec"]["stages"][i].update(fields)


def spec(**fields: Any) -> Callable[[dict], None]:
    return lambda b: b["spec"].update(fields)


CRD, CLI = "crd", "cli"  # who refuses: the CRD (kubectl apply fails) or only the shared check

# (id, body, field named, who refuses it, text in the message)
CASES = [
    # names that make child names Kubernetes refuses
    ("pipeline-name-with-dot", edit(lambda b: b["metadata"].update(name="qwen.omni")), "metadata.name", CRD, "DNS-1035"),
    ("pipeline-name-starts-with-digit", edit(lambda b: b["metadata"].update(name="2stage")), "metadata.name", CRD, "DNS-1035"),
    ("pipeline-name-upper-case", edit(lambda b: b["metadata"].update(name="QwenOmni")), "metadata.name", CRD, "DNS-1035"),
    ("stage-name-starts-with-digit", edit(stage(0, name="1st")), "spec.stages[0].name", CRD, "does not match"),
    ("stage-name-upper-case", edit(stage(0, name="Thinker")), "spec.stages[0].name", CRD, "does not match"),
    ("stage-name-underscore", edit(stage(2, name="code_2_wav")), "spec.stages[2].name", CRD, "does not match"),
    ("names-too-long-together", edit(lambda b: (b["metadata"].update(name="q" * 40), b["spec"]["stages"][0].update(name="t" * 30))),
     "spec.stages", CRD, "at most 63 characters"),
    # quantities
    ("negative-memory", edit(stage(0, resources={"requests": {"memory": "-4Gi"}})),
     "spec.stages[0].resources.requests.memory", CRD, "non-negative quantity"),
    ("memory-with-space", edit(stage(0, resources={"limits": {"memory": "16 Gi"}})),
     "spec.stages[0].resources.limits.memory", CRD, "without spaces"),
    ("memory-with-trailing-space", edit(stage(0, resources={"limits": {"memory": "16Gi "}})),
     "spec.stages[0].resources.limits.memory", CRD, "without spaces"),
    ("request-above-limit", edit(stage(0, resources={"requests": {"cpu": "8"}, "limits": {"cpu": "4000m"}})),
     "spec.stages[0].resources.requests", CRD, "cannot exceed the limit"),
    ("misspelled-resource", edit(stage(0, resources={"requests": {"memroy": "8Gi"}})),
     "spec.stages[0].resources.requests", CRD, "resource names are"),
    ("gpu-in-resources", edit(stage(0, resources={"limits": {"nvidia.com/gpu": 2}})),
     "spec.stages[0].resources.limits", CRD, "set gpus instead"),
    ("resources-unknown-section", edit(stage(0, resources={"request": {"cpu": "1"}})),
     "spec.stages[0].resources", CRD, "'request' was unexpected"),
    # An exponent beyond int64 is no quantity (apimachinery reads it with strconv.ParseInt);
    # 1e999999999 is one (an int32 exponent, kept as written: test_go_semantics.py).
    ("huge-exponent-shm", edit(stage(0, shmSize="1e9999999999999999999")), "spec.stages[0].shmSize", CRD,
     "positive quantity"),
    ("zero-shm", edit(stage(0, shmSize=0)), "spec.stages[0].shmSize", CRD, "positive quantity"),
    ("shm-with-unit-typo", edit(stage(0, shmSize="2GB")), "spec.stages[0].shmSize", CRD, "positive quantity"),
    ("fractional-extended-resource", edit(stage(0, resources={"requests": {"example.com/fpga": "500m"},
                                                              "limits": {"example.com/fpga": "500m"}})),
     "spec.stages[0].resources.requests['example.com/fpga']", CLI, "whole units"),
    ("extended-resource-overcommitted", edit(stage(0, resources={"requests": {"example.com/fpga": 1},
                                                                 "limits": {"example.com/fpga": 2}})),
     "spec.stages[0].resources.requests['example.com/fpga']", CLI, "request must equal its limit"),
    # pod fields passed through
    ("node-selector-key-with-space", edit(stage(0, nodeSelector={"gpu type": "a100"})),
     "spec.stages[0].nodeSelector", CRD, "keys must be label names"),
    ("node-selector-value-with-slash", edit(stage(0, nodeSelector={"gpu": "a100/80gb"})),
     "spec.stages[0].nodeSelector.gpu", CRD, "does not match"),
    ("node-selector-number", edit(stage(0, nodeSelector={"gpus": 8})), "spec.stages[0].nodeSelector.gpus", CRD, "must be a string"),
    ("toleration-exists-with-value", edit(stage(0, tolerations=[{"key": "gpu", "operator": "Exists", "value": "true"}])),
     "spec.stages[0].tolerations[0].value", CRD, "operator Exists matches every value"),
    ("toleration-operator-lower-case", edit(stage(0, tolerations=[{"key": "gpu", "operator": "exists"}])),
     "spec.stages[0].tolerations[0].operator", CRD, "is not one of"),
    ("toleration-seconds-without-noexecute", edit(stage(0, tolerations=[{"key": "spot", "operator": "Exists",
                                                                         "effect": "NoSchedule", "tolerationSeconds": 300}])),
     "spec.stages[0].tolerations[0].effect", CRD, "needs effect NoExecute"),
    ("toleration-seconds-as-text", edit(stage(0, tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoExecute",
                                                               "tolerationSeconds": "300"}])),
     "spec.stages[0].tolerations[0].tolerationSeconds", CRD, "must be an integer"),
    ("toleration-without-key", edit(stage(0, tolerations=[{"operator": "Equal", "value": "x"}])),
     "spec.stages[0].tolerations[0].operator", CRD, "without a key"),
    ("toleration-unknown-field", edit(stage(0, tolerations=[{"key": "gpu", "operator": "Exists", "effects": "NoSchedule"}])),
     "spec.stages[0].tolerations[0]", CRD, "'effects' was unexpected"),
    ("env-value-from-unknown-field", edit(stage(0, env=[{"name": "TOKEN", "valueFrom": {"secretKeyRefs": {"name": "s", "key": "k"}}}])),
     "spec.stages[0].env[0].valueFrom", CRD, "'secretKeyRefs' was unexpected"),
    ("env-value-from-missing-key", edit(stage(0, env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s"}}}])),
     "spec.stages[0].env[0].valueFrom.secretKeyRef", CRD, "'key' is a required property"),
    ("env-value-from-two-sources", edit(stage(0, env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"},
                                                                                   "fieldRef": {"fieldPath": "metadata.name"}}}])),
     "spec.stages[0].env[0].valueFrom", CRD, "exactly one of"),
    ("env-value-and-value-from", edit(stage(0, env=[{"name": "X", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])),
     "spec.stages[0].env[0].valueFrom", CRD, "not both"),
    ("env-value-number", edit(stage(0, env=[{"name": "WORKERS", "value": 8}])), "spec.stages[0].env[0].value", CRD, "must be a string"),
    ("env-name-with-space", edit(stage(0, env=[{"name": "MY VAR", "value": "1"}])), "spec.stages[0].env[0].name", CRD, "does not match"),
    ("env-reserved-name", edit(stage(0, env=[{"name": "OMNI_STAGE", "value": "x"}])), "spec.stages[0].env[0].name", CRD, "OMNI_"),
    ("env-ucx-port-range", edit(stage(0, env=[{"name": "LOG", "value": "1"}, {"name": "UCX_TCP_PORT_RANGE", "value": "20000-20100"}])),
     "spec.stages[0].env[1].name", CRD, "the operator sets UCX_TCP_PORT_RANGE to 9700-9731"),
    # An outside review: with gpus 0 and NVIDIA_VISIBLE_DEVICES=all, NVIDIA's runtime showed the
    # pod every GPU of its node, past the device plugin and the quota.
    ("env-nvidia-visible-devices", edit(stage(0, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
     "spec.stages[0].env[0].name", CRD, "NVIDIA_VISIBLE_DEVICES is the GPU device plugin's"),
    # The model the stage downloads (an outside review: each passed, and the pods would crash-loop).
    ("model-name-with-spaces", edit(lambda b: b["spec"]["model"].update(name="Qwen Omni 7B")),
     "spec.model.name", CRD, "is not a Hugging Face repository id"),
    ("model-name-too-deep", edit(lambda b: b["spec"]["model"].update(name="a/b/c/d")),
     "spec.model.name", CRD, "is not a Hugging Face repository id"),
    ("model-name-double-dash", edit(lambda b: b["spec"]["model"].update(name="Qwen/Qwen--7B")),
     "spec.model.name", CRD, "no '--' or '..'"),
    ("model-revision-newline", edit(lambda b: b["spec"]["model"].update(revision="main\nx")),
     "spec.model.revision", CRD, "does not match"),
    ("env-as-map", edit(stage(0, env={"HF_HOME": "/models"})), "spec.stages[0].env", CRD, "must be a list"),
    # integers beyond their format
    ("replicas-beyond-int32", edit(stage(0, replicas=2**40)), "spec.stages[0].replicas", CRD, "maximum"),
    ("token-id-beyond-64-bits", edit(stage(0, kvTransfer={"send": True, "criteria": {"type": "special_token", "tokenId": 2**70}})),
     "spec.stages[0].kvTransfer.criteria.tokenId", CRD, "maximum"),
    ("toleration-seconds-beyond-64-bits", edit(stage(0, tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoExecute",
                                                                      "tolerationSeconds": 2**64}])),
     "spec.stages[0].tolerations[0].tolerationSeconds", CRD, "maximum"),
    ("timeout-with-unit", edit(stage(0, kvTransfer={"send": True, "timeoutSeconds": "30s"})),
     "spec.stages[0].kvTransfer.timeoutSeconds", CRD, "must be an integer"),
    ("gpus-as-text", edit(stage(0, gpus="1")), "spec.stages[0].gpus", CRD, "must be an integer"),
    ("io-cpus-a-number", edit(stage(0, kvTransfer={"send": True, "ioCpus": 3})),
     "spec.stages[0].kvTransfer.ioCpus", CRD, "must be a string"),
    ("io-cpus-a-word", edit(stage(0, kvTransfer={"send": True, "ioCpus": "all"})),
     "spec.stages[0].kvTransfer.ioCpus", CRD, "or a Linux CPU list"),
    ("io-cpus-empty", edit(stage(0, kvTransfer={"send": True, "ioCpus": ""})),
     "spec.stages[0].kvTransfer.ioCpus", CRD, "does not match"),
    ("io-cpus-on-a-receiving-stage", edit(stage(2, kvTransfer={"ioCpus": "2-3"})),
     "spec.stages[2].kvTransfer.ioCpus", CRD, "only used by a stage that sends KV"),
    ("io-cpus-descending", edit(stage(0, kvTransfer={"send": True, "ioCpus": "6-2"})),
     "spec.stages[0].kvTransfer.ioCpus", CLI, "descending CPU range"),
    ("stuck-seconds-a-week", edit(spec(observability={"alerts": {"stuckTransferSeconds": 604800}})),
     "spec.observability.alerts.stuckTransferSeconds", CRD, "maximum"),
    # not an OmniPipeline, or not shaped like one
    ("api-version-typo", edit(lambda b: b.update(apiVersion="omnipipeline.dev/v1")), "apiVersion", CLI, "must be omnipipeline.dev/v1alpha1"),
    ("kind-plural", edit(lambda b: b.update(kind="OmniPipelines")), "kind", CLI, "must be OmniPipeline"),
    ("a-deployment", {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {}}, "kind", CLI, "not an OmniPipeline"),
    ("metadata-a-string", edit(lambda b: b.update(metadata="qwen-omni")), "metadata", CRD, "must be an object"),
    ("metadata-a-list", edit(lambda b: b.update(metadata=[{"name": "qwen-omni"}])), "metadata", CRD, "must be an object"),
    ("metadata-missing", edit(lambda b: b.pop("metadata")), "<root>", CRD, "'metadata' is a required property"),
    ("name-missing", edit(lambda b: b.update(metadata={"namespace": "ml"})), "metadata", CRD, "'name' is a required property"),
    ("labels-not-strings", edit(lambda b: b["metadata"].update(labels={"tier": 1})), "metadata.labels.tier", CRD, "must be a string"),
    ("spec-missing", edit(lambda b: b.pop("spec")), "<root>", CRD, "'spec' is a required property"),
    ("stages-a-map", edit(spec(stages={"thinker": {"role": "ar"}})), "spec.stages", CRD, "must be a list"),
    ("inputs-a-string", edit(stage(1, inputs="thinker")), "spec.stages[1].inputs", CRD, "must be a list"),
    ("kv-transfer-true", edit(stage(0, kvTransfer=True)), "spec.stages[0].kvTransfer", CRD, "must be an object"),
    ("image-pull-secrets-strings", edit(spec(imagePullSecrets=["regcred"])), "spec.imagePullSecrets[0]", CRD, "must be an object"),
    # other fields the pods would not start with
    ("image-with-space", edit(spec(image="ghcr.io/example/omni stage:0.1")), "spec.image", CRD, "is not an image reference"),
    # An outside review: each passed (only spaces were refused), and the kubelet refuses it.
    ("image-upper-case-and-two-tags", edit(spec(image="UPPER/Case:tag:two")), "spec.image", CRD, "is not an image reference"),
    ("image-empty-tag", edit(stage(1, image="ghcr.io/x/y:")), "spec.stages[1].image", CRD, "is not an image reference"),
    ("cache-mounted-on-tmp", edit(spec(model={"name": "m", "cache": {"pvc": {"claimName": "models"}, "mountPath": "/tmp"}})),
     "spec.model.cache.mountPath", CRD, "already mount"),
    ("claim-name-upper-case", edit(spec(model={"name": "m", "cache": {"pvc": {"claimName": "Models"}}})),
     "spec.model.cache.pvc.claimName", CRD, "does not match"),
    ("token-secret-underscore", edit(spec(model={"name": "m", "hubTokenSecretRef": {"name": "hf_token"}})),
     "spec.model.hubTokenSecretRef.name", CRD, "does not match"),
    ("service-account-upper-case", edit(spec(serviceAccountName="Omni")), "spec.serviceAccountName", CRD, "does not match"),
    ("otlp-without-scheme", edit(spec(observability={"tracing": {"otlpEndpoint": "otel-collector:4318"}})),
     "spec.observability.tracing.otlpEndpoint", CRD, "does not match"),
    # rules the schema cannot state
    ("cycle", edit(stage(0, inputs=["code2wav"])), "spec.stages[].inputs", CLI, "cycle"),
    ("reserved-engine-arg", edit(stage(0, engineArgs={"port": 9000})), "spec.stages[0].engineArgs.port", CLI, "fixed at 8000"),
    ("reserved-engine-arg-dashes", edit(stage(0, engineArgs={"--model": "other"})), "spec.stages[0].engineArgs.--model", CLI, "spec.model"),
    ("send-to-nobody", edit(stage(2, role="ar", kvTransfer={"send": True})), "spec.stages[2].kvTransfer.send", CLI, "no stage lists"),
]


def run_validate(tmp_path: Path, text: str | bytes, name: str = "pipeline.yaml") -> tuple[int, list[str]]:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    out = io.StringIO()
    code = cli.cmd_validate([path], out)
    return code, out.getvalue().splitlines()


def fields_named(lines: list[str]) -> list[str]:
    """The FIELD of each `FILE: document N (NAME): FIELD: MESSAGE` line."""
    fields = []
    for line in lines:
        _, _, rest = line.partition("): ") if "): " in line else line.partition(": document 1: ")
        fields.append(rest.split(": ", 1)[0])
    return fields


@pytest.mark.parametrize("case_id,body,field,who,text", CASES, ids=[c[0] for c in CASES])
def test_malformed_pipeline_is_refused_with_its_field(tmp_path, case_id, body, field, who, text):
    code, lines = run_validate(tmp_path, yaml.safe_dump(body))
    assert code == 1, lines
    assert any(f.startswith(field) for f in fields_named(lines)), lines
    assert any(text in line for line in lines), lines
    assert all(line.startswith(f"{tmp_path / 'pipeline.yaml'}: document 1") for line in lines), lines
    crd_fields = [f for f, _ in resource_problems(copy.deepcopy(body))]
    if who == CRD:  # kubectl apply is refused, naming the same field
        assert any(f.startswith(field) for f in crd_fields), crd_fields
    else:  # the CRD cannot state it: the API server accepts, the shared check refuses
        assert crd_fields == [] or case_id in ("api-version-typo", "kind-plural", "a-deployment")
    # The operator runs the very same check before it renders.
    assert any(p.field.startswith(field) for p in problems_of(copy.deepcopy(body)))


def test_the_cases_cover_the_reported_classes():
    ids = {c[0] for c in CASES}
    assert len(CASES) >= 50
    for needed in ("pipeline-name-with-dot", "stage-name-starts-with-digit", "negative-memory", "memory-with-space",
                   "request-above-limit", "node-selector-key-with-space", "misspelled-resource",
                   "toleration-exists-with-value", "env-value-from-unknown-field", "token-id-beyond-64-bits",
                   "api-version-typo", "metadata-a-string", "metadata-a-list", "metadata-missing", "huge-exponent-shm"):
        assert needed in ids


# -- files that are not (only) pipelines --------------------------------------------------------

VALID = yaml.safe_dump(BASE)


@pytest.mark.parametrize("text,expected", [
    ("", "holds no document"),
    ("# just a comment\n", "holds no document"),
    ("---\n---\n", "holds no document"),
    ("spec: [unclosed", "not valid YAML"),
    ("key: value\n  bad indent: x\n", "not valid YAML"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary data"),
    (b"\xff\xfe n\x00a\x00m\x00e\x00", "binary data"),
    (b"name: caf\xe9\n", "not UTF-8"),
    ("[" * 5000 + "]" * 5000, "nested deeper"),
    ("a: " + "{b: " * 80 + "1" + "}" * 80, "nested deeper"),
    ("- &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(f"- &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                                                     for p, c in zip("abcdefgh", "bcdefghi")), "more than"),
    ("just a string\n", "must be an OmniPipeline object"),
    ("- a\n- list\n", "must be an OmniPipeline object"),
    ("42\n", "must be an OmniPipeline object"),
    ("value: .nan\n", "not a JSON number"),
    ("value: !!binary aGVsbG8=\n", "binary"),
    ("? [a, b]\n: c\n", "not valid YAML"),
    ("!!set {a, b}\n", "cannot be sent"),
])
def test_input_that_is_no_pipeline_gets_one_line_each(tmp_path, text, expected):
    code, lines = run_validate(tmp_path, text)
    assert code == 1
    assert lines and all(line.startswith(str(tmp_path / "pipeline.yaml")) for line in lines), lines
    assert any(expected in line for line in lines), lines
    assert not any("Traceback" in line or "internal error" in line for line in lines), lines


def test_a_file_too_large_for_the_api_server(tmp_path):
    code, lines = run_validate(tmp_path, VALID + "#" * (3 * 1024 * 1024))
    assert code == 1 and "3 MiB" in lines[0]


def test_each_document_of_a_file_and_a_directory_is_reported(tmp_path):
    other = edit(lambda b: b["metadata"].update(name="second"))
    bad = edit(lambda b: (b["metadata"].update(name="third"), b["spec"]["stages"][0].update(role="decoder")))
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    (tmp_path / "many.yaml").write_text(yaml.safe_dump_all([BASE, other, None, bad, configmap]))
    (tmp_path / "one.yml").write_text(VALID)
    (tmp_path / "notes.txt").write_text("not looked at")
    out = io.StringIO()
    assert cli.cmd_validate([tmp_path], out) == 1
    lines = out.getvalue().splitlines()
    many = [line for line in lines if line.startswith(str(tmp_path / "many.yaml"))]
    assert many[0].endswith("document 1 (qwen-omni): valid (3 stages)")
    assert many[1].endswith("document 2 (second): valid (3 stages)")
    assert any("document 4 (third): spec.stages[0].role:" in line for line in many)  # the empty document 3 is skipped
    assert any("document 5 (c): kind: must be OmniPipeline" in line for line in many)
    assert [line for line in lines if "one.yml" in line] == [f"{tmp_path / 'one.yml'}: document 1 (qwen-omni): valid (3 stages)"]
    assert not any("notes.txt" in line for line in lines)


def test_an_empty_directory_and_a_missing_file_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    out = io.StringIO()
    assert cli.cmd_validate([tmp_path / "empty", tmp_path / "missing.yaml"], out) == 1
    text = out.getvalue()
    assert "is a directory with no .yaml" in text and "cannot read it" in text


def test_valid_yaml_oddities_are_accepted(tmp_path):
    """YAML reads `2024-01-01` as a date and `2**70` as an integer beyond 64 bits; kubectl sends
    the first as a string and the second as a number (a float64 on the server, so given to a
    flag vLLM reads as a float: `--seed`, an integer, would refuse 1.1805916207174113e+21):
    valid revisions and engine arguments."""
    body = copy.deepcopy(BASE)
    body["spec"]["model"]["revision"] = "DATE"
    body["spec"]["model"]["name"] = "Qwen/Qwen2.5-Omni-7B_v1.0"  # a repository id at its fullest
    body["spec"]["stages"][0]["engineArgs"] = {"revision": "DATE", "cpu-offload-gb": 2**70,
                                               "gpu-memory-utilization": 0.9}
    text = yaml.safe_dump(body).replace("DATE", "2024-01-01")
    assert yaml.safe_load(text)["spec"]["model"]["revision"].__class__.__name__ == "date"  # what plain PyYAML sees
    code, lines = run_validate(tmp_path, text)
    assert code == 0, lines
    assert lines == [f"{tmp_path / 'pipeline.yaml'}: document 1 (qwen-omni): valid (3 stages)"]


def test_the_console_script_runs_validate(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(BASE))  # JSON is YAML too
    result = subprocess.run([sys.executable, "-m", "omni_operator.local.cli", "validate", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "valid (3 stages)" in result.stdout, result.stdout + result.stderr
