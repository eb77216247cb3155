"""The classes of rule an outside review found missing (issue 21): each pipeline the API
server, a kubelet or the stage would refuse is refused by the shared check (`omni-pipeline
validate` and the operator alike), naming its field and the fix; each one they accept is
accepted. Cases of our own, written as users would write them."""
from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from omni_operator.local import cli
from omni_operator.check.admission import admit, problems_of
from omni_operator.check.validation import resource_problems

BASE = yaml.safe_load("""
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
  namespace: ml
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


def meta(**fields: Any) -> dict:
    return edit(lambda b: b["metadata"].update(fields))


def stage(i: int, **fields: Any) -> dict:
    return edit(lambda b: b["spec"]["stages"][i].update(fields))


def env(*items: dict) -> dict:
    return stage(0, env=list(items))


def value_from(source: str, ref: dict) -> dict:
    return env({"name": "X", "valueFrom": {source: ref}})


def resources(requests: dict | None = None, limits: dict | None = None) -> dict:
    res = {}
    if requests is not None:
        res["requests"] = requests
    if limits is not None:
        res["limits"] = limits
    return stage(0, resources=res)


# (id, body, the field named (a prefix), a word of the message: what is wrong or the fix)
REFUSED = [
    # -- the pipeline's own metadata (apimachinery's ValidateObjectMeta) --------------------
    ("label-key-with-space", meta(labels={"team name": "ml"}), "metadata.labels['team name']", "label key"),
    ("label-key-two-slashes", meta(labels={"a/b/c": "x"}), "metadata.labels['a/b/c']", "qualified name"),
    ("label-key-upper-case-prefix", meta(labels={"Example.com/team": "ml"}), "metadata.labels['Example.com/team']",
     "prefix part"),
    ("label-key-empty-prefix", meta(labels={"/team": "ml"}), "metadata.labels['/team']", "prefix part must be non-empty"),
    ("label-key-name-too-long", meta(labels={"t" * 64: "x"}), "metadata.labels", "no more than 63 characters"),
    ("label-value-with-slash", meta(labels={"team": "ml/infra"}), "metadata.labels.team", "valid label"),
    ("label-value-too-long", meta(labels={"team": "x" * 64}), "metadata.labels.team", "no more than 63"),
    ("label-value-a-number", meta(labels={"tier": 2}), "metadata.labels.tier", "must be a string"),
    ("annotation-key-with-space", meta(annotations={"my note": "x"}), "metadata.annotations['my note']",
     "annotation key"),
    ("annotations-too-large", meta(annotations={"notes": "x" * (256 * 1024)}), "metadata.annotations",
     "at most 262144"),
    ("namespace-upper-case", meta(namespace="ML"), "metadata.namespace", "RFC 1123 label"),
    ("namespace-with-dot", meta(namespace="ml.prod"), "metadata.namespace", "RFC 1123 label"),
    ("finalizer-with-space", meta(finalizers=["clean up"]), "metadata.finalizers[0]", "qualified name"),
    ("finalizer-two-slashes", meta(finalizers=["example.com/a/b"]), "metadata.finalizers[0]", "qualified name"),
    ("finalizers-orphan-and-foreground", meta(finalizers=["orphan", "foregroundDeletion"]), "metadata.finalizers",
     "cannot be both set"),
    ("metadata-unknown-field", meta(lables={"team": "ml"}), "metadata", "'lables' was unexpected"),
    ("metadata-unknown-field-annotation-typo", meta(annotation={"a": "b"}), "metadata", "unknown field"),
    ("owner-reference-without-uid", meta(ownerReferences=[{"apiVersion": "v1", "kind": "ConfigMap", "name": "x"}]),
     "metadata.ownerReferences", "'uid' is a required property"),
    ("owner-reference-empty-uid", meta(ownerReferences=[{"apiVersion": "v1", "kind": "ConfigMap", "name": "x",
                                                          "uid": ""}]), "metadata.ownerReferences[0].uid", "must not be empty"),
    ("two-controllers", meta(ownerReferences=[
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "a", "uid": "1", "controller": True},
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "b", "uid": "2", "controller": True}]),
     "metadata.ownerReferences", "Only one reference can have Controller set"),
    # -- resources: hugepages and extended resources (pod validation) ------------------------
    ("hugepages-not-a-page-multiple", resources({"memory": "1Gi", "hugepages-2Mi": "3Mi"}, {"hugepages-2Mi": "3Mi"}),
     "spec.stages[0].resources.requests.hugepages-2Mi", "whole number of 2Mi pages"),
    ("hugepages-bad-page-size", resources(None, {"memory": "1Gi", "hugepages-big": "2Mi"}),
     "spec.stages[0].resources.limits.hugepages-big", "not a page size"),
    ("hugepages-fractional-page-size", resources(None, {"memory": "1Gi", "hugepages-1500m": "3"}),
     "spec.stages[0].resources.limits.hugepages-1500m", "not a page size"),
    ("hugepages-request-without-limit", resources({"memory": "1Gi", "hugepages-2Mi": "4Mi"}),
     "spec.stages[0].resources.requests.hugepages-2Mi", "cannot be overcommitted"),
    ("hugepages-request-below-limit", resources({"memory": "1Gi", "hugepages-1Gi": "1Gi"}, {"hugepages-1Gi": "2Gi"}),
     "spec.stages[0].resources.requests.hugepages-1Gi", "must equal its limit"),
    ("hugepages-without-cpu-or-memory", resources(None, {"hugepages-2Mi": "4Mi"}), "spec.stages[0].resources",
     "need a cpu or memory"),
    ("extended-resource-request-without-limit", resources({"example.com/fpga": 1}),
     "spec.stages[0].resources.requests['example.com/fpga']", "set limits['example.com/fpga']"),
    # -- env sources ------------------------------------------------------------------------
    ("field-ref-labels-whole", value_from("fieldRef", {"fieldPath": "metadata.labels"}),
     "spec.stages[0].env[0].valueFrom.fieldRef.fieldPath", "a pod field an environment variable can read"),
    ("field-ref-restart-policy", value_from("fieldRef", {"fieldPath": "spec.restartPolicy"}),
     "spec.stages[0].env[0].valueFrom.fieldRef.fieldPath", "metadata.name"),
    ("field-ref-status-phase", value_from("fieldRef", {"fieldPath": "status.phase"}),
     "spec.stages[0].env[0].valueFrom.fieldRef.fieldPath", "does not match"),
    ("field-ref-bad-label-key", value_from("fieldRef", {"fieldPath": "metadata.labels['team name']"}),
     "spec.stages[0].env[0].valueFrom.fieldRef.fieldPath", "does not match"),
    ("field-ref-api-version-v2", value_from("fieldRef", {"apiVersion": "v2", "fieldPath": "metadata.name"}),
     "spec.stages[0].env[0].valueFrom.fieldRef.apiVersion", "is not one of"),
    ("resource-field-ref-gpu", value_from("resourceFieldRef", {"resource": "limits.nvidia.com/gpu"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.resource", "limits.cpu"),
    ("resource-field-ref-bare-name", value_from("resourceFieldRef", {"resource": "memory"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.resource", "does not match"),
    ("resource-field-ref-other-container", value_from("resourceFieldRef", {"containerName": "sidecar",
                                                                            "resource": "limits.memory"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.containerName", "'stage'"),
    ("resource-field-ref-cpu-divisor-1k", value_from("resourceFieldRef", {"resource": "limits.cpu", "divisor": "1k"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.divisor", "use one of 1, 1m"),
    ("resource-field-ref-memory-divisor-1024", value_from("resourceFieldRef", {"resource": "requests.memory",
                                                                                "divisor": "1024"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.divisor", "1Ki"),
    ("resource-field-ref-memory-divisor-exponent", value_from("resourceFieldRef", {"resource": "limits.memory",
                                                                                    "divisor": "1e3"}),
     "spec.stages[0].env[0].valueFrom.resourceFieldRef.divisor", "reads it as 1e3"),
    ("secret-key-ref-without-name", value_from("secretKeyRef", {"key": "token"}),
     "spec.stages[0].env[0].valueFrom.secretKeyRef", "'name' is a required property"),
    ("config-map-key-ref-without-name", value_from("configMapKeyRef", {"key": "mode"}),
     "spec.stages[0].env[0].valueFrom.configMapKeyRef", "'name' is a required property"),
    ("secret-key-ref-empty-name", value_from("secretKeyRef", {"name": "", "key": "token"}),
     "spec.stages[0].env[0].valueFrom.secretKeyRef.name", "DNS-1123 subdomain"),
    ("secret-key-dot-dot", value_from("secretKeyRef", {"name": "s", "key": ".."}),
     "spec.stages[0].env[0].valueFrom.secretKeyRef.key", "not '.' or '..'"),
    ("config-map-key-starting-dot-dot", value_from("configMapKeyRef", {"name": "c", "key": "..data"}),
     "spec.stages[0].env[0].valueFrom.configMapKeyRef.key", "not starting with '..'"),
    ("hub-token-key-dot", edit(lambda b: b["spec"]["model"].update(hubTokenSecretRef={"name": "hf", "key": "."})),
     "spec.model.hubTokenSecretRef.key", "not '.'"),
    # -- what the operator renders from it ----------------------------------------------------
    ("configmap-over-the-annotation-limit", stage(0, engineArgs={"chat-template": "x" * (300 * 1024)}),
     "spec.stages[0]", "make them smaller"),
    ("configmap-over-1-mib", stage(0, engineArgs={"chat-template": "x" * (1100 * 1024)}), "spec.stages[0]",
     "at most 1048576"),
    ("env-too-large-for-the-deployment", env({"name": "PROMPT", "value": "x" * (300 * 1024)}), "spec.stages[0]",
     "renders Deployment qwen-omni-thinker"),
    # -- engine arguments the stage refuses (the stage contract, omni_contract) --------------
    ("reserved-snake-case", stage(0, engineArgs={"served_model_name": "x"}), "spec.stages[0].engineArgs.served_model_name",
     "spec.model.name"),
    ("reserved-camel-case", stage(0, engineArgs={"schedulerCls": "x"}), "spec.stages[0].engineArgs.schedulerCls",
     "omni AR scheduler"),
    ("reserved-upper-case", stage(0, engineArgs={"PORT": 9000}), "spec.stages[0].engineArgs.PORT", "fixed at 8000"),
    ("reserved-title-case", stage(0, engineArgs={"Model": "other"}), "spec.stages[0].engineArgs.Model", "spec.model"),
    ("reserved-shutdown-timeout", stage(0, engineArgs={"shutdown-timeout": 5}),
     "spec.stages[0].engineArgs.shutdown-timeout", "timeoutSeconds"),
    ("reserved-on-a-receiving-stage", stage(2, engineArgs={"host": "0.0.0.0"}), "spec.stages[2].engineArgs.host",
     "remove it"),
    ("same-flag-twice", stage(0, engineArgs={"max-model-len": 4096, "max_model_len": 2048}),
     "spec.stages[0].engineArgs.max_model_len", "keep one"),
    ("not-a-flag-name", stage(0, engineArgs={"max model len": 4096}), "spec.stages[0].engineArgs.max model len",
     "not a vLLM flag name"),
    ("omni-kv-config-in-additional-config", stage(0, engineArgs={"additional_config": {"omni_kv_config": {}}}),
     "spec.stages[0].engineArgs.additional_config.omni_kv_config", "set by the stage"),
    ("additional-config-a-string", stage(0, engineArgs={"additional-config": "{}"}),
     "spec.stages[0].engineArgs.additional-config", "must be a mapping"),
    ("kv-transfer-config-not-json", stage(0, engineArgs={"kv-transfer-config": "{kv_connector: X"}),
     "spec.stages[0].engineArgs.kv-transfer-config", "not valid JSON"),
    ("kv-transfer-config-without-role", stage(0, engineArgs={"kvTransferConfig": {"kv_connector": "LMCacheConnectorV1"}}),
     "spec.stages[0].engineArgs.kvTransferConfig", "needs a kv_role"),
    ("kv-transfer-config-naming-ours", stage(0, engineArgs={"kv_transfer_config": {"kv_connector": "OmniKVConnector",
                                                                                    "kv_role": "kv_producer"}}),
     "spec.stages[0].engineArgs.kv_transfer_config", "kvTransfer.ioCpus"),
    ("kv-transfer-config-empty-multi", stage(0, engineArgs={"kv-transfer-config": {"kv_connector": "MultiConnector",
                                                                                    "kv_role": "kv_both"}}),
     "spec.stages[0].engineArgs.kv-transfer-config", "non-empty list"),
    ("kv-transfer-config-a-list", stage(2, engineArgs={"kv-transfer-config": ["LMCacheConnectorV1"]}),
     "spec.stages[2].engineArgs.kv-transfer-config", "must be a mapping"),
    # vLLM's KVTransferConfig refuses a connector without a role (it was taken on a stage that
    # sends no KV, where the config passes to vLLM as it is: an outside review).
    ("kv-transfer-config-without-role-on-a-stage-that-does-not-send",
     stage(2, engineArgs={"kv-transfer-config": {"kv_connector": "SomeConsumer"}}),
     "spec.stages[2].engineArgs.kv-transfer-config", "needs a kv_role"),
    ("kv-transfer-config-unknown-key", stage(2, engineArgs={"kv-transfer-config": {
        "kv_connector": "SomeConsumer", "kv_role": "kv_consumer", "kv_buffer_size": 1}}),
     "spec.stages[2].engineArgs.kv-transfer-config", "has no field kv_buffer_size"),
    ("gpu-memory-utilization-over-1", stage(0, engineArgs={"gpu-memory-utilization": 2.0}),
     "spec.stages[0].engineArgs.gpu-memory-utilization", "> 0 and <= 1"),
    ("max-num-seqs-negative", stage(1, engineArgs={"maxNumSeqs": -4}), "spec.stages[1].engineArgs.maxNumSeqs",
     "SchedulerConfig.max_num_seqs"),
    ("tensor-parallel-over-the-gpus", stage(0, gpus=2, engineArgs={"tensor-parallel-size": 3}),
     "spec.stages[0].gpus", "set gpus: 3"),
    ("data-x-tensor-parallel-over-the-gpus", stage(1, gpus=4, engineArgs={"tensorParallelSize": 4, "data-parallel-size": 2}),
     "spec.stages[1].gpus", "8 GPUs"),
    ("unknown-top-level-field", edit(lambda b: b.update(bogus=1)), "<root>", "'bogus' was unexpected"),
    # -- a stage input's sampling parameters, as vLLM's SamplingParams takes them (the stage
    # builds them at its start and stopped there) --------------------------------------------
    ("sampling-max-tokens-negative", stage(1, input={"samplingParams": {"max_tokens": -1}}),
     "spec.stages[1].input.samplingParams.max_tokens", ">= 1"),
    ("sampling-temperature-a-word", stage(1, input={"samplingParams": {"temperature": "hot"}}),
     "spec.stages[1].input.samplingParams.temperature", "must be a number"),
    ("sampling-unknown-field", stage(1, input={"samplingParams": {"temperture": 0.5}}),
     "spec.stages[1].input.samplingParams.temperture", "did you mean temperature"),
    # -- secrets and the operator's environment (an outside review: a token in a ConfigMap, a
    # plain HF_TOKEN replacing the Secret's) --------------------------------------------------
    ("hf-token-in-engine-args", stage(0, engineArgs={"hf-token": "hf_SECRET"}),
     "spec.stages[0].engineArgs.hf-token", "hubTokenSecretRef"),
    ("api-key-in-engine-args", stage(1, engineArgs={"apiKey": "k"}), "spec.stages[1].engineArgs.apiKey",
     "secretKeyRef"),
    ("plain-hf-token-beside-the-secret", edit(lambda b: (
        b["spec"]["model"].update(hubTokenSecretRef={"name": "hub"}),
        b["spec"]["stages"][0].update(env=[{"name": "HF_TOKEN", "value": "plain"}]))),
     "spec.stages[0].env[0].name", "Secret 'hub'"),
    ("home-in-env", env({"name": "A", "value": "1"}, {"name": "HOME", "value": "/root"}),
     "spec.stages[0].env[1].name", "set by the operator"),
    ("env-name-twice", env({"name": "A", "value": "1"}, {"name": "B", "value": "2"}, {"name": "A", "value": "3"}),
     "spec.stages[0].env[2].name", "set twice"),
]

# Bodies the API server, the kubelet and the stage all accept: refusing them would be wrong.
ACCEPTED = [
    ("labels-kubernetes-style", meta(labels={"app.kubernetes.io/name": "omni", "MyLabel": "", "team": "ML_infra-1"})),
    ("label-value-null-is-empty", meta(labels={"team": None})),
    ("annotation-key-mixed-case", meta(annotations={"Example.COM/Owner": "ml team", "note": "any text: at all"})),
    ("annotations-just-under-the-limit", meta(annotations={"n": "x" * (256 * 1024 - 1)})),
    ("finalizers-qualified-and-standard", meta(finalizers=["example.com/cleanup", "kubernetes", "orphan"])),
    ("server-set-metadata", meta(uid="1c4", resourceVersion="42", generation=3, creationTimestamp="2024-01-01T00:00:00Z")),
    ("hugepages-with-memory", resources({"memory": "1Gi", "hugepages-2Mi": "4Mi"}, {"hugepages-2Mi": "4Mi"})),
    ("hugepages-limit-only", resources(None, {"cpu": "2", "hugepages-1Gi": "2Gi"})),
    ("extended-resource-limit-only", resources(None, {"example.com/fpga": 2})),
    ("extended-resource-equal", resources({"example.com/fpga": "2"}, {"example.com/fpga": 2})),
    ("field-refs-env-supports", env(*[{"name": f"V{i}", "valueFrom": {"fieldRef": {"fieldPath": p}}} for i, p in enumerate([
        "metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
        "spec.host", "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs",
        "metadata.labels['app.kubernetes.io/name']", "metadata.annotations['Example.com/Owner']"])])),
    ("field-ref-api-version-v1", value_from("fieldRef", {"apiVersion": "v1", "fieldPath": "metadata.name"})),
    ("resource-field-refs", env(
        {"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1m"}}},
        {"name": "B", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1000m"}}},
        {"name": "C", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "D", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1000"}}},
        {"name": "E", "valueFrom": {"resourceFieldRef": {"resource": "limits.ephemeral-storage", "divisor": 1}}},
        {"name": "F", "valueFrom": {"resourceFieldRef": {"resource": "limits.hugepages-2Mi", "divisor": "1024Ki"}}},
        {"name": "G", "valueFrom": {"resourceFieldRef": {"containerName": "stage", "resource": "requests.memory"}}})),
    ("keys-with-one-leading-dot", env({"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": ".env"}}},
                                      {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "a..b"}}})),
    ("engine-args-every-spelling", stage(0, engineArgs={"max_model_len": 4096, "gpuMemoryUtilization": 0.9,
                                                        "--enforce-eager": True, "speculative-config.method": "ngram"})),
    ("kv-transfer-config-composable", stage(0, engineArgs={"kv-transfer-config": {
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}})),
    ("kv-transfer-config-json-text", stage(0, engineArgs={"kv_transfer_config": '{"kv_connector": "X", "kv_role": "kv_both"}'})),
    ("kv-transfer-config-on-a-stage-that-does-not-send", stage(2, engineArgs={"kv-transfer-config": {
        "kv_connector": "SomeConsumer", "kv_role": "kv_consumer"}})),
    ("explicit-nulls-the-server-drops", edit(lambda b: (b["spec"]["stages"][0].update(replicas=None, gpus=None,
                                                                                      shmSize=None, kvTransfer=None),
                                                        b["spec"].update(observability=None, imagePullPolicy=None),
                                                        b["metadata"].update(labels=None, annotations=None)))),
    ("explicit-null-engine-arg", stage(0, engineArgs={"max-model-len": None})),
    ("sampling-params-vllm-takes", stage(1, input={"samplingParams": {"max_tokens": 16, "temperature": 0,
                                                                      "stop_token_ids": [2], "seed": None}})),
    # Ranks on CPUs are processes; a stage may hold more GPUs than its ranks use.
    ("tensor-parallel-on-cpus", stage(2, engineArgs={"tensor-parallel-size": 2})),
    ("tensor-parallel-within-the-gpus", stage(0, gpus=4, engineArgs={"tensor_parallel_size": 2})),
    # HF_TOKEN is the user's to set where the operator sets none (no hubTokenSecretRef).
    ("hf-token-from-own-secret", env({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})),
]


def _fields(problems) -> list[str]:
    return [p.field for p in problems]


@pytest.mark.parametrize("case_id,body,field,text", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_naming_the_field_and_the_fix(case_id, body, field, text):
    problems = problems_of(copy.deepcopy(body))
    assert any(f.startswith(field) for f in _fields(problems)), problems
    assert any(text in p.message or text in p.field for p in problems), problems


@pytest.mark.parametrize("case_id,body", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_as_the_server_accepts(case_id, body):
    assert problems_of(copy.deepcopy(body)) == []
    assert admit(copy.deepcopy(body)).children


def test_the_cases_cover_every_class_the_review_named():
    ids = {c[0] for c in REFUSED}
    for needed in ("label-key-with-space", "label-value-with-slash", "annotation-key-with-space",
                   "annotations-too-large", "namespace-upper-case", "finalizer-with-space", "metadata-unknown-field",
                   "hugepages-bad-page-size", "hugepages-not-a-page-multiple", "hugepages-request-below-limit",
                   "hugepages-without-cpu-or-memory", "extended-resource-request-without-limit",
                   "field-ref-restart-policy", "resource-field-ref-gpu", "secret-key-ref-without-name",
                   "config-map-key-ref-without-name", "configmap-over-1-mib", "reserved-snake-case",
                   "reserved-camel-case", "reserved-upper-case", "kv-transfer-config-without-role"):
        assert needed in ids
    assert len(REFUSED) >= 50 and len(ACCEPTED) >= 15


def test_what_kubectl_apply_refuses_is_refused_by_the_crd_too():
    """Rules a schema can state are the CRD's: the API server refuses them at kubectl apply,
    naming the same field (the metadata rules are the server's own)."""
    crd_classes = ("label-key-with-space", "label-value-with-slash", "annotations-too-large", "namespace-upper-case",
                   "finalizer-with-space", "metadata-unknown-field", "field-ref-restart-policy",
                   "resource-field-ref-gpu", "resource-field-ref-other-container", "secret-key-ref-without-name",
                   "secret-key-dot-dot", "hub-token-key-dot", "field-ref-api-version-v2")
    cases = {c[0]: c for c in REFUSED}
    for case_id in crd_classes:
        _, body, field, _ = cases[case_id]
        assert any(f.startswith(field) for f, _ in resource_problems(copy.deepcopy(body))), case_id


# -- messages ----------------------------------------------------------------------------------

def _all_messages() -> list[str]:
    from test_malformed_pipelines import CASES

    bodies = [c[1] for c in REFUSED] + [c[1] for c in CASES]
    bodies += [edit(lambda b: b["spec"].update(stages=[{"name": f"s{i}", "role": "ar"} for i in range(17)])),
               stage(0, shmSize=[1]), stage(0, tolerations=[{"key": None, "operator": None}]),
               stage(0, inputs=["thinker", "thinker"]), edit(lambda b: b["spec"]["stages"].append(
                   copy.deepcopy(b["spec"]["stages"][0])))]
    return [str(p) for body in bodies for p in problems_of(copy.deepcopy(body))]


def test_no_python_internals_reach_a_user():
    for message in _all_messages():
        assert "None" not in message, message
        assert "is not valid under any of the given schemas" not in message, message
        assert "{'" not in message and "Traceback" not in message, message


def test_a_list_too_long_says_its_bound_not_the_list():
    body = edit(lambda b: b["spec"].update(stages=[{"name": f"s{i}", "role": "ar"} for i in range(17)]))
    (problem,) = [p for p in problems_of(body) if p.field == "spec.stages"]
    assert "at most 16 stages" in problem.message and "s16" not in problem.message, problem


def test_an_input_naming_no_stage_says_which_entry_and_value():
    body = stage(2, inputs=["talker", "talkr"])
    (problem,) = problems_of(body)
    assert "spec.stages[2].inputs[1] is 'talkr'" in problem.message, problem
    assert "(thinker, talker, code2wav)" in problem.message, problem


def test_an_int_or_string_of_the_wrong_type_says_what_it_takes():
    (problem,) = problems_of(stage(0, shmSize=[1]))
    assert problem.field == "spec.stages[0].shmSize"
    assert problem.message == "must be an integer or a string, not a list"


def test_the_long_name_rule_names_the_child():
    body = edit(lambda b: (b["metadata"].update(name="p" * 40), b["spec"]["stages"][1].update(name="t" * 25)))
    messages = [p.message for p in problems_of(body)]
    assert any(f"{'p' * 40}-{'t' * 25} has 66" in m for m in messages), messages


def test_validate_prints_one_line_per_problem_with_the_field(tmp_path: Path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(meta(labels={"team name": "ml"})))
    out = io.StringIO()
    assert cli.cmd_validate([path], out) == 1
    (line,) = out.getvalue().splitlines()
    assert line.startswith(f"{path}: document 1 (qwen-omni): metadata.labels['team name']: ")


def test_a_stage_listing_itself_is_named():
    (problem,) = problems_of(stage(1, inputs=["thinker", "talker"]))
    assert problem.field == "spec.stages"
    assert "spec.stages[1].inputs[1] is 'talker', the stage itself" in problem.message, problem
