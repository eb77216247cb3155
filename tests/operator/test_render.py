"""Rendering the children and the stage config: pure functions of the spec."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from omnip_support import pipeline_body
from omni_operator.pipeline import naming
from omni_operator.check.kube_schema import MIN_KUBERNETES, check_object
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.render import ClusterSettings, render_children
from omni_operator.pipeline.stage_config import dump_stage_config, render_stage_config

K8S_VERSION = MIN_KUBERNETES  # the CRD's minimum server version


def parse(body: dict):
    body = copy.deepcopy(body)
    body["metadata"].update(uid="0a0b0c0d-0000-4000-8000-000000000001", generation=3)
    return parse_pipeline(body)


def children(body: dict, podmonitors: bool = True) -> dict[tuple[str, str], dict]:
    """The rendered children by (kind, name); a revision's workload (named P-S-REVISION) by
    its stage's name P-S (its KV Service: P-S/kv), so tests read the same before and after a
    revision change."""
    out = {}
    for c in render_children(parse(body), podmonitor_available=podmonitors):
        labels, name = c["metadata"]["labels"], c["metadata"]["name"]
        if naming.REVISION_LABEL in labels:
            name = naming.stage_name(labels[naming.PIPELINE_LABEL], labels[naming.STAGE_LABEL])
            name += "/kv" if c["kind"] == "Service" else ""
        out[(c["kind"], name)] = c
    return out


def container(kids: dict, stage: str, pipeline: str = "tiny") -> dict:
    return kids[("Deployment", f"{pipeline}-{stage}")]["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def test_children_per_stage_and_per_pipeline():
    kids = children(pipeline_body())
    kinds = sorted(kids)
    for stage in ("thinker", "talker", "code2wav"):
        for kind in ("ConfigMap", "Service", "Deployment", "PodDisruptionBudget"):
            assert (kind, f"tiny-{stage}") in kids
    # A KV Service of the revision for each receiving stage (the first stage receives nothing).
    assert ("Service", "tiny-talker/kv") in kids and ("Service", "tiny-code2wav/kv") in kids
    assert ("Service", "tiny-thinker/kv") not in kids
    assert ("NetworkPolicy", "tiny") in kids and ("PodMonitor", "tiny") in kids
    assert len(kinds) == 3 * 4 + 2 + 2
    revision = parse(pipeline_body()).revision
    real = {c["metadata"]["name"] for c in render_children(parse(pipeline_body()), podmonitor_available=True)}
    assert {f"tiny-{s}-{revision}" for s in ("thinker", "talker", "code2wav")} <= real


def test_podmonitor_only_when_served_and_wanted():
    assert ("PodMonitor", "tiny") not in children(pipeline_body(), podmonitors=False)
    assert ("PodMonitor", "tiny") not in children(pipeline_body(observability={"metrics": False}))


# The Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1) is not among
# kubernetes-validate's schemas: test_third_party_crds.py checks the rendered PodMonitor against
# the upstream CRD itself; here, what its relabelings do (the fields used, and their effect).
PODMETRICSENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings",
                             "metricRelabelings", "scheme"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
RELABEL_ACTIONS = {"replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                   "lowercase", "uppercase", "keepequal", "dropequal"}
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def relabel(meta: dict[str, str], relabelings: list[dict]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (default regex `(.*)`, replacement `$1`), then the
    `__`-prefixed labels dropped: the target labels a scrape of that pod gets."""
    labels = dict(meta)
    for rule in relabelings:
        assert rule["action"] == "replace" and "regex" not in rule and "replacement" not in rule, rule
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["sourceLabels"])
        if value:
            labels[rule["targetLabel"]] = value
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def test_podmonitor_gives_each_series_namespace_pod_pipeline_and_stage():
    kids = children(pipeline_body())
    monitor = kids[("PodMonitor", "tiny")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= PODMETRICSENDPOINT_FIELDS
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    # The runtime's series carry `stage` themselves: keep theirs (no `exported_stage`).
    assert endpoint["honorLabels"] is True
    for rule in endpoint["relabelings"]:
        assert set(rule) <= RELABEL_FIELDS and rule["action"] in RELABEL_ACTIONS
        assert all(LABEL_NAME.match(label) for label in rule["sourceLabels"]), rule
        assert LABEL_NAME.match(rule["targetLabel"]), rule
    # Prometheus' Kubernetes discovery spells the pod label keys with underscores.
    assert {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]} == {
        "namespace": ["__meta_kubernetes_namespace"],
        "pod": ["__meta_kubernetes_pod_name"],
        "pipeline": ["__meta_kubernetes_pod_label_omnipipeline_dev_pipeline"],
        "stage": ["__meta_kubernetes_pod_label_omnipipeline_dev_stage"],
        "revision": ["__meta_kubernetes_pod_label_omnipipeline_dev_revision"],
    }
    revision = parse(pipeline_body()).revision
    for stage in ("thinker", "talker", "code2wav"):
        template = kids[("Deployment", f"tiny-{stage}")]["spec"]["template"]
        pod_labels = template["metadata"]["labels"]
        # The PodMonitor selects every stage's pods, on a port their container names.
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert "http" in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        # What service discovery gives Prometheus for one of these pods, relabelled.
        meta = {"__meta_kubernetes_namespace": "team-a", "__meta_kubernetes_pod_name": f"tiny-{stage}-7d9f-x2",
                **{"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v
                   for k, v in pod_labels.items()}}
        assert relabel(meta, endpoint["relabelings"]) == {
            "namespace": "team-a", "pod": f"tiny-{stage}-7d9f-x2", "pipeline": "tiny", "stage": stage,
            "revision": revision}


def test_podmonitor_carries_the_labels_the_operator_is_told_and_its_own():
    from omni_operator.check.admission import admit

    cluster = ClusterSettings(podmonitor_labels=(("release", "kube-prometheus-stack"),))
    rendered = render_children(parse(pipeline_body()), podmonitor_available=True, cluster=cluster)
    (monitor,) = [c for c in rendered if c["kind"] == "PodMonitor"]
    assert monitor["metadata"]["labels"] == {"release": "kube-prometheus-stack", **naming.common_labels("tiny")}
    (admitted,) = [c for c in admit(pipeline_body(), cluster=cluster).children if c["kind"] == "PodMonitor"]
    assert admitted["metadata"]["labels"] == monitor["metadata"]["labels"]
    (plain,) = [c for c in admit(pipeline_body()).children if c["kind"] == "PodMonitor"]
    assert "release" not in plain["metadata"]["labels"]


def test_podmonitor_label_check_has_teeth():
    """A relabeling that keeps the dots of the label key matches no discovered label."""
    endpoint = children(pipeline_body())[("PodMonitor", "tiny")]["spec"]["podMetricsEndpoints"][0]
    broken = [dict(r) for r in endpoint["relabelings"]]
    broken[2]["sourceLabels"] = ["__meta_kubernetes_pod_label_" + naming.PIPELINE_LABEL]
    assert not LABEL_NAME.match(broken[2]["sourceLabels"][0])
    meta = {"__meta_kubernetes_namespace": "team-a", "__meta_kubernetes_pod_name": "p",
            "__meta_kubernetes_pod_label_omnipipeline_dev_pipeline": "tiny",
            "__meta_kubernetes_pod_label_omnipipeline_dev_stage": "thinker"}
    assert "pipeline" not in relabel(meta, broken)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_children_pass_kubernetes_schemas(example):
    """Every object the operator renders for every example is valid for its kind, in the
    Kubernetes schema of the CRD's minimum server version (kubernetes-validate, strict)."""
    body = yaml.safe_load(example.read_text(encoding="utf-8"))
    body["metadata"]["namespace"] = "default"
    kids = render_children(parse(body), podmonitor_available=True)
    assert {c["kind"] for c in kids} >= {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"}
    for child in kids:
        if child["kind"] in ("PodMonitor", "ScaledObject", "OmniStageScaler"):
            continue  # not built-in kinds: checked against their CRDs in test_third_party_crds.py
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert check_object(child) == [], child["kind"]  # the operator's own pre-render guard agrees


def test_validation_would_catch_a_broken_child():
    # The check above has teeth: a malformed Deployment is refused by Kubernetes' schema.
    deployment = children(pipeline_body())[("Deployment", "tiny-thinker")]
    deployment["spec"] = {**deployment["spec"], "replicas": "one"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    assert [f for f, _ in check_object(deployment)] == ["spec.replicas"]
    deployment["spec"]["replicas"] = 2**40  # beyond int32
    assert [f for f, _ in check_object(deployment)] == ["spec.replicas"]
    deployment["spec"]["replicas"] = 1
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "X", "valueFrom": {"secretRef": {}}})
    assert [f for f, _ in check_object(deployment)] == [f"spec.template.spec.containers[0].env[{len(env) - 1}].valueFrom"]


def test_the_last_guard_names_the_stage(monkeypatch):
    """A rendered child Kubernetes would refuse (a gap in the earlier checks) refuses the
    pipeline, naming the stage, before anything is created."""
    from omni_operator.check import admission
    from omni_operator.pipeline.errors import SpecError

    real = admission.render_children

    def broken(pipeline, **kw):
        kids = real(pipeline, **kw)
        for child in kids:
            if child["kind"] == "Service" and child["metadata"]["name"] == "gate-talker":
                child["spec"]["ports"][0]["port"] = "eighty"
        return kids

    monkeypatch.setattr(admission, "render_children", broken)
    with pytest.raises(SpecError) as info:
        admission.admit(pipeline_body(name="gate"))
    (problem,) = info.value.problems
    assert problem.field == "spec.stages[1]"
    assert "renders Service gate-talker" in problem.message and "spec.ports[0].port" in problem.message


def test_every_child_is_owned_and_labelled():
    for (kind, name), child in children(pipeline_body()).items():
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{
            "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline", "name": "tiny",
            "uid": "0a0b0c0d-0000-4000-8000-000000000001", "controller": True, "blockOwnerDeletion": True}]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "omni-operator"
        assert labels["app.kubernetes.io/instance"] == "tiny"
        assert labels["app.kubernetes.io/part-of"] == "omni-pipeline"
        assert labels[naming.PIPELINE_LABEL] == "tiny"


def test_deployment_gpu_scheduling_and_probes():
    body = pipeline_body()
    body["spec"]["stages"][0].update(gpus=2, nodeSelector={"gpu": "h100"},
                                     tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}])
    kids = children(body)
    pod = kids[("Deployment", "tiny-thinker")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in pod["tolerations"]
    assert c["command"] == ["omni-stage", "--config", "/etc/omni/stage.yaml"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "kv": 9600}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # The CPU stage asks for no GPU and tolerates no GPU taint.
    cpu_pod = kids[("Deployment", "tiny-code2wav")]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"].get("limits", {})
    assert "tolerations" not in cpu_pod


def test_restricted_security_context():
    pod = children(pipeline_body())[("Deployment", "tiny-thinker")]["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True  # the stage writes only to its emptyDirs
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False


def test_the_kubelet_kills_only_after_the_stage_s_own_drain_and_stop():
    body = pipeline_body()
    body["spec"]["stages"][0]["kvTransfer"]["timeoutSeconds"] = 42
    pod = children(body)[("Deployment", "tiny-thinker")]["spec"]["template"]["spec"]
    # omni-stage drains for the transfer timeout, then gives vLLM 30 s before killing it.
    assert pod["terminationGracePeriodSeconds"] > 42 + 30


def test_env_names_pipeline_stage_and_downstream():
    kids = children(pipeline_body())
    env = env_of(container(kids, "thinker"))
    assert env["OMNI_PIPELINE"]["value"] == "tiny"
    assert env["OMNI_STAGE"]["value"] == "thinker"
    revision = parse(pipeline_body()).revision
    # A sender reaches the receivers of its own revision only: their revision's KV Service.
    assert env["OMNI_DOWNSTREAM_ENDPOINTS"]["value"] == f"tiny-talker-{revision}.team-a.svc:9600"
    assert env["OMNI_REVISION"]["value"] == revision
    assert env_of(container(kids, "code2wav"))["OMNI_DOWNSTREAM_ENDPOINTS"]["value"] == ""
    assert not any(name.startswith("OTEL_") for name in env)  # no tracing configured
    assert env["UCX_TCP_PORT_RANGE"]["value"] == "9700-9731"


def test_otlp_env_when_tracing_is_set():
    kids = children(pipeline_body(observability={"tracing": {"otlpEndpoint": "http://otel:4318"}}))
    env = env_of(container(kids, "talker"))
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "tiny-talker"


def test_hub_token_is_a_secret_ref_and_never_in_a_configmap():
    kids = children(pipeline_body(model={"name": "org/model", "hubTokenSecretRef": {"name": "hf", "key": "tok"}}))
    for stage in ("thinker", "talker", "code2wav"):
        env = env_of(container(kids, stage))
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}
        text = kids[("ConfigMap", f"tiny-{stage}")]["data"]["stage.yaml"]
        assert "hf" not in yaml.safe_load(text)["model"].values() and "secret" not in text.lower()


def test_a_stage_template_change_is_a_new_revision_of_every_stage():
    """What the stages must agree on changed (one stage's engine arguments): the whole
    pipeline gets a new revision, every stage a new workload (named after it), while the
    stable children (the stage Services, PDBs, the NetworkPolicy, the PodMonitor) stay."""
    before = children(pipeline_body())
    body = pipeline_body()
    body["spec"]["stages"][1]["engineArgs"] = {"max-model-len": 2048}
    after = children(body)
    assert parse(body).revision != parse(pipeline_body()).revision
    changed = {key for key in before if before[key] != after[key]}
    workloads = {(k, f"tiny-{s}") for s in ("thinker", "talker", "code2wav") for k in ("ConfigMap", "Deployment")}
    assert changed == workloads | {("Service", "tiny-talker/kv"), ("Service", "tiny-code2wav/kv")}
    annotation = naming.CONFIG_HASH_ANNOTATION
    assert before[("Deployment", "tiny-talker")]["spec"]["template"]["metadata"]["annotations"][annotation] != \
        after[("Deployment", "tiny-talker")]["spec"]["template"]["metadata"]["annotations"][annotation]


def test_replicas_autoscaling_and_rollout_limits_are_no_revision():
    """How many pods, and how they are replaced, are not what the stages must agree on: the
    same revision, and (but for the Deployment's strategy and the autoscaler) the same
    children; the Deployment carries no replicas (the rollout's)."""
    body = pipeline_body()
    body["spec"]["stages"][0]["replicas"] = 4
    body["spec"]["stages"][1]["rollout"] = {"maxSurge": 2}
    body["spec"]["stages"][2]["autoscaling"] = {"maxReplicas": 3, "metrics": [{"signal": "incomingTransfers", "target": 2}]}
    assert parse(body).revision == parse(pipeline_body()).revision
    before, after = children(pipeline_body()), children(body)
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {("Deployment", "tiny-talker")}
    assert after[("Deployment", "tiny-talker")]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 1}
    assert "replicas" not in after[("Deployment", "tiny-thinker")]["spec"]
    assert set(after) - set(before) == {("OmniStageScaler", "tiny-code2wav"), ("ScaledObject", "tiny-code2wav"),
                                        ("HorizontalPodAutoscaler", "tiny-code2wav")}


def test_the_kv_payload_format_version_is_part_of_the_revision(monkeypatch):
    """A new KV payload format (the runtime protocol's WIRE_VERSION, known to the operator as
    omni_contract.kv_wire.KV_WIRE_VERSION) makes a new revision of the same spec, so its
    senders only ever reach receivers that speak it; the runtime's protocol speaks the
    contract's version."""
    from omni_contract import kv_wire
    from omni_operator.pipeline import model
    from omni_runtime.kv.transport import protocol

    assert protocol.Compat.__dataclass_fields__["wire_version"].default == kv_wire.KV_WIRE_VERSION
    before = parse(pipeline_body()).revision
    monkeypatch.setattr(model, "KV_WIRE_VERSION", kv_wire.KV_WIRE_VERSION + 1)
    assert parse(pipeline_body()).revision != before


def test_revision_names_fit_63_characters_and_stay_apart():
    long_pipeline, revision = "p" * 30, "0123456789"
    names = {naming.revision_name(long_pipeline, "s" * 32 + suffix, revision) for suffix in ("a", "b")}
    assert len(names) == 2 and all(len(n) <= 63 and n.endswith(revision) and n[0].isalpha() for n in names)
    assert naming.revision_name("tiny", "talker", revision) == f"tiny-talker-{revision}"


def test_rendering_is_deterministic():
    assert render_children(parse(pipeline_body()), podmonitor_available=True) == \
        render_children(parse(pipeline_body()), podmonitor_available=True)


def test_networkpolicy_limits_kv_port_to_pipeline_pods():
    policy = children(pipeline_body())[("NetworkPolicy", "tiny")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {naming.PIPELINE_LABEL: "tiny"}}
    kv_rule, data_rule, http_rule = policy["ingress"]
    assert kv_rule == {"from": [{"podSelector": {"matchLabels": {naming.PIPELINE_LABEL: "tiny"}}}],
                       "ports": [{"protocol": "TCP", "port": 9600}]}
    # The KV data plane's UCX ports: a range, from the pipeline's own pods only.
    assert data_rule == {"from": [{"podSelector": {"matchLabels": {naming.PIPELINE_LABEL: "tiny"}}}],
                         "ports": [{"protocol": "TCP", "port": 9700, "endPort": 9731}]}
    # The API, /metrics and the pipeline's endpoint (clients; the stages' links to it).
    assert "from" not in http_rule and http_rule["ports"] == [{"protocol": "TCP", "port": 8000},
                                                               {"protocol": "TCP", "port": 8080}]


def test_every_stage_s_ucx_listens_inside_the_range_the_networkpolicy_opens():
    """UCX_TCP_PORT_RANGE on every stage container is exactly the range the policy opens to the
    pipeline's pods: what UCX binds (the receiver's NIXL reads connect there) is reachable, and
    nothing else is opened."""
    kids = children(pipeline_body())
    rules = kids[("NetworkPolicy", "tiny")]["spec"]["ingress"]
    opened = [(p["port"], p.get("endPort", p["port"])) for r in rules if "from" in r for p in r["ports"]]
    for stage in ("thinker", "talker", "code2wav"):
        value = env_of(container(kids, stage))["UCX_TCP_PORT_RANGE"]["value"]
        first, last = (int(x) for x in value.split("-"))
        assert (first, last) in opened and (first, last) == naming.KV_DATA_PORTS
    # The range holds neither the http nor the kv port (each has its own rule), and has room
    # for the ~2 ports per NIXL agent of a tensor-parallel stage of 8 ranks, twice over.
    first, last = naming.KV_DATA_PORTS
    assert not first <= naming.HTTP_PORT <= last and not first <= naming.KV_PORT <= last
    assert last - first + 1 >= 2 * 8 * 2


def test_the_port_range_rule_is_what_the_api_server_accepts():
    """kubernetes-validate checks the schema (endPort is an int32); the API server's own
    NetworkPolicyPort rules (ValidateNetworkPolicyPort: endPort only with a numeric port, at
    least that port, both at most 65535) are restated here, with a broken rule refused."""
    policy = children(pipeline_body())[("NetworkPolicy", "tiny")]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert check_object(policy) == []
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            if "endPort" in port:
                assert isinstance(port["port"], int) and port["port"] <= port["endPort"] <= 65535
    broken = copy.deepcopy(policy)
    broken["spec"]["ingress"][1]["ports"][0]["endPort"] = "9731"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    assert [f for f, _ in check_object(broken)] == ["spec.ingress[1].ports[0].endPort"]


def test_stage_config_keys():
    body = pipeline_body()
    body["spec"]["stages"][0]["kvTransfer"] = {"send": True, "criteria": {"type": "special_token", "tokenId": 151645},
                                               "timeoutSeconds": 45}
    body["spec"]["stages"][0]["engineArgs"] = {"max-model-len": 4096}
    config = render_stage_config(parse(body), "thinker")
    revision = parse(body).revision
    assert config == {
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "StageConfig",
        "pipeline": "tiny", "namespace": "team-a", "revision": revision, "stage": "thinker", "role": "ar",
        "model": {"name": "tiny-qwen2"},
        "engineArgs": {"max-model-len": 4096},
        "kvTransfer": {"send": True, "criteria": {"type": "special_token", "tokenId": 151645}, "timeoutSeconds": 45},
        "inputs": [],
        "downstream": [{"stage": "talker", "endpoint": f"tiny-talker-{revision}.team-a.svc:9600"}],
        "ports": {"http": 8000, "kv": 9600},
        "observability": {"metrics": True, "tracing": {"otlpEndpoint": None}, "alerts": {"stuckTransferSeconds": 120}},
    }


def test_stage_config_endpoints_can_be_local():
    config = render_stage_config(parse(pipeline_body()), "talker", endpoint_for=lambda s: f"127.0.0.1:{9600 + len(s)}")
    assert config["downstream"] == [{"stage": "code2wav", "endpoint": "127.0.0.1:9608"}]
    assert config["inputs"] == ["thinker"]


def test_io_cpus_are_rendered_into_the_stage_config_only_when_set():
    body = pipeline_body()
    body["spec"]["stages"][0]["kvTransfer"]["ioCpus"] = "2-3,6"
    body["spec"]["stages"][1]["kvTransfer"]["ioCpus"] = "auto"  # the default: nothing to say
    kids = children(body)
    thinker = yaml.safe_load(kids[("ConfigMap", "tiny-thinker")]["data"]["stage.yaml"])
    talker = yaml.safe_load(kids[("ConfigMap", "tiny-talker")]["data"]["stage.yaml"])
    assert thinker["kvTransfer"]["ioCpus"] == "2-3,6"
    assert "ioCpus" not in talker["kvTransfer"]
    # Left out or "auto": the same config (the server's default is "auto": the same revision too).
    auto = pipeline_body()
    auto["spec"]["stages"][1]["kvTransfer"]["ioCpus"] = "auto"
    assert children(auto)[("ConfigMap", "tiny-talker")] == children(pipeline_body())[("ConfigMap", "tiny-talker")]


def test_the_rendered_io_cpus_reach_the_omni_kv_connector():
    """The ConfigMap as omni-stage reads it (omni_runtime's own parser and command builder,
    no engine started): the connector's kv_connector_extra_config carries io_cpus."""
    import json

    from omni_runtime.stages.ar import vllm_command
    from omni_runtime.stages.config import parse_stage_config

    body = pipeline_body()
    body["spec"]["stages"][0]["kvTransfer"]["ioCpus"] = "3"
    text = children(body)[("ConfigMap", "tiny-thinker")]["data"]["stage.yaml"]
    argv = vllm_command(parse_stage_config(yaml.safe_load(text)), "0.0.0.0", python="python")
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert connector["kv_connector"] == "OmniKVConnector"
    assert connector["kv_connector_extra_config"]["io_cpus"] == "3"


def test_a_valid_shape_is_remembered_and_an_invalid_child_still_refused():
    """check_object remembers valid shapes (strings the kind's schema never reads differ);
    a child whose structure differs is checked in full, with its own values in the message."""
    from omni_operator.check.kube_schema import _VALID_SHAPES, check_object

    deployment = children(pipeline_body(), podmonitors=False)[("Deployment", "tiny-thinker")]
    assert check_object(deployment) == []
    renamed = copy.deepcopy(deployment)
    renamed["metadata"]["name"] = "other-name"
    before = len(_VALID_SHAPES)
    assert check_object(renamed) == [] and len(_VALID_SHAPES) == before  # the same shape
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    errors = check_object(broken)
    assert errors and errors[0][0] == "spec.template.spec.containers[0].ports[0].containerPort"
    assert "'http'" in errors[0][1]
    wrong_kind_string = copy.deepcopy(deployment)
    wrong_kind_string["apiVersion"] = "apps/v2"
    assert check_object(wrong_kind_string) is None  # no such built-in kind: not remembered as valid


def test_user_ucx_settings_that_do_not_touch_the_port_range_pass_through():
    """Only UCX_TCP_PORT_RANGE is the operator's: other UCX tuning (the transports, the NICs)
    is accepted at the door and reaches the container, after the operator's variables."""
    from omni_operator.check.admission import admit

    body = pipeline_body()
    body["spec"]["stages"][0]["env"] = [{"name": "UCX_TLS", "value": "tcp,cma"},
                                        {"name": "UCX_NET_DEVICES", "value": "eth0"}]
    body["metadata"].update(uid="0a0b0c0d-0000-4000-8000-000000000001", generation=1)
    (deployment,) = [c for c in admit(body).children
                     if c["kind"] == "Deployment" and c["metadata"]["labels"][naming.STAGE_LABEL] == "thinker"]
    names = [e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.count("UCX_TCP_PORT_RANGE") == 1
    assert names.index("UCX_TCP_PORT_RANGE") < names.index("UCX_TLS") < names.index("UCX_NET_DEVICES")


def test_the_crd_refuses_the_port_range_variable_naming_the_operator_s_range():
    """The CRD's rule is YAML: it must name the variable and the range naming.py sets."""
    from omni_operator.pipeline import crd

    text = yaml.safe_dump(crd.crd())
    assert f"self.name != '{naming.KV_DATA_PORT_RANGE_ENV}'" in text
    assert f"sets {naming.KV_DATA_PORT_RANGE_ENV} to {naming.KV_DATA_PORT_RANGE}," in text.replace("\n", " ").replace("  ", " ")


_YAML_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=150),
    st.sampled_from(["yes", "off", "~", "null", "1e3", "0x1f", "12:30", "", " a", "a: b", "- x", "#c", "x\ny", "é",
                     "\u2028", "a b " * 40]))
_YAML_VALUES = st.recursive(_YAML_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=20), inner, max_size=4)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=150), _YAML_VALUES, min_size=1, max_size=8))
def test_the_stage_config_text_is_pyyaml_s_whole_document(config):
    """dump_stage_config builds the YAML an entry at a time (memoised): the text, and so the
    config hash and the pods, are yaml.safe_dump's of the whole config, whatever it holds."""
    assert dump_stage_config(config) == yaml.safe_dump(config, sort_keys=True, default_flow_style=False)


def test_a_stage_config_entry_that_changes_is_dumped_afresh():
    """The entry memo is keyed by the value: a changed engineArgs (or name) never gets the
    text of the one dumped before."""
    config = render_stage_config(parse(pipeline_body()), "talker")
    first = dump_stage_config(config)
    changed = {**config, "engineArgs": {"max-model-len": 2048}, "pipeline": "other"}
    text = dump_stage_config(changed)
    assert text == yaml.safe_dump(changed, sort_keys=True, default_flow_style=False) != first
    assert "max-model-len: 2048" in text and "pipeline: other" in text
    assert dump_stage_config(config) == first


# ---------------------------------------------------------------------------- the endpoint

CHAIN = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny-chain.yaml").read_text())


def test_the_pipelines_endpoint_runs_beside_its_entry_stage():
    """One endpoint per pipeline: a container beside the entry stage's (its config in that
    stage's ConfigMap), reaching the stage in its own pod and reached by the stages at the
    pod's address; the entry stage's Service gives it a port; no other stage has one."""
    body = copy.deepcopy(CHAIN)
    body["metadata"]["namespace"] = "default"
    kids = children(body)
    pod = kids[("Deployment", "tiny-chain-thinker")]["spec"]["template"]["spec"]
    stage, endpoint = pod["containers"]
    assert stage["name"] == "stage" and endpoint["name"] == "endpoint"
    assert endpoint["command"] == ["omni-stage", "--config", "/etc/omni/endpoint.yaml"]
    assert endpoint["ports"] == [{"name": "endpoint", "containerPort": 8080, "protocol": "TCP"}]
    assert env_of(endpoint)["POD_IP"]["valueFrom"] == {
        "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    assert endpoint["readinessProbe"]["httpGet"]["port"] == "endpoint"
    assert endpoint["securityContext"] == stage["securityContext"]
    config = yaml.safe_load(kids[("ConfigMap", "tiny-chain-thinker")]["data"]["endpoint.yaml"])
    assert config["role"] == "endpoint" and config["endpoint"] == {
        "entry": {"stage": "thinker", "url": "http://127.0.0.1:8000"},
        "sink": "vocoder", "advertise": "http://${POD_IP}:8080",
        "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 10},
                  {"from": "talker", "to": "vocoder", "timeoutSeconds": 10}]}
    ports = {p["name"]: p["port"] for p in kids[("Service", "tiny-chain-thinker")]["spec"]["ports"]}
    assert ports == {"http": 8000, "kv": 9600, "endpoint": 8080}
    for other in ("talker", "vocoder"):
        assert len(kids[("Deployment", f"tiny-chain-{other}")]["spec"]["template"]["spec"]["containers"]) == 1
        assert "endpoint.yaml" not in kids[("ConfigMap", f"tiny-chain-{other}")]["data"]
        assert "endpoint" not in {p["name"] for p in kids[("Service", f"tiny-chain-{other}")]["spec"]["ports"]}


def test_a_pipeline_of_two_last_stages_has_no_one_endpoint():
    body = copy.deepcopy(CHAIN)
    body["spec"]["stages"].append({"name": "archive", "role": "generation", "gpus": 0,
                                   "inputs": ["talker"]})
    kids = children(body)
    assert all(len(c["spec"]["template"]["spec"]["containers"]) == 1
               for (kind, _), c in kids.items() if kind == "Deployment")


def test_a_stage_input_is_in_its_stage_config():
    body = copy.deepcopy(CHAIN)
    body["spec"]["stages"][1]["input"] = {"hook": "hooks.tts:to_codes", "maxInputs": 8,
                                          "samplingParams": {"max_tokens": 16}, "loadKV": False}
    config = render_stage_config(parse(body), "talker")
    assert config["input"] == {"hook": "hooks.tts:to_codes", "maxInputs": 8, "loadKV": False,
                               "samplingParams": {"max_tokens": 16}}
    assert "input" not in render_stage_config(parse(body), "thinker")
