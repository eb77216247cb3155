"""charts/omni-pipeline, rendered by the real Helm engine and checked against Kubernetes'
schemas, the operator's code and the monitoring mixin."""
from __future__ import annotations

import json
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from omni_mixin.render import chart_default_values

from . import operator_permissions
from .chart import NAMESPACE, RELEASE, by_kind, crds, notes, one, render
from .conftest import CHART, ROOT, RULES_FILE

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas known.
KUBE_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# Kinds from CRDs that kubernetes-validate has no schema for; checked separately below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}

NON_DEFAULT = {
    "fullnameOverride": "omni",
    "image": {"repository": "registry.example/omni-operator", "digest": "sha256:" + "a" * 64,
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watch": {"namespaces": ["ml-team", "research"]},
    "logLevel": "debug",
    "extraArgs": ["--resync-seconds=30"],
    "extraEnv": [{"name": "TZ", "value": "UTC"}],
    "serviceAccount": {"create": True, "name": "omni-sa", "annotations": {"team": "ml"}},
    "metrics": {"port": 9090, "service": {"enabled": True, "type": "ClusterIP"}},
    "liveness": {"port": 9091},
    "serviceMonitor": {"enabled": True, "namespace": "monitoring", "interval": "15s",
                       "additionalLabels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True, "namespace": "monitoring",
                       "additionalLabels": {"release": "kube-prometheus-stack"},
                       "stuckTransferSeconds": 120, "heldTooLongSeconds": 600,
                       "failureRatio": 0.2,
                       "runbookBaseUrl": "https://wiki.example/omni/runbooks"},
    "dashboards": {"enabled": True, "namespace": "grafana",
                   "annotations": {"grafana_folder": "Omni"}},
    "ingress": {"enabled": True, "pipeline": "qwen-omni", "entryStage": "thinker",
                "namespace": "ml-team", "className": "nginx",
                "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
                "hosts": [{"host": "omni.example.com",
                           "paths": [{"path": "/v1", "pathType": "Prefix"}]},
                          {"host": "", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                "tls": [{"secretName": "omni-example-tls", "hosts": ["omni.example.com"]}]},
    "podAnnotations": {"a": "b"},
    "podLabels": {"team": "ml"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
}
ALL_ON = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
          "dashboards": {"enabled": True},
          "ingress": {"enabled": True, "pipeline": "tiny-omni-streaming", "entryStage": "thinker"}}
VALUE_SETS = {"default": {}, "all-toggles-on": ALL_ON, "non-default": NON_DEFAULT}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(values, kube_version):
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, kube_version, strict=True)
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "omni-pipeline"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "omni-pipeline-0.1.0"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_the_crd_is_valid_for_kubernetes(kube_version):
    for crd in crds():
        kubernetes_validate.validate(yaml.safe_load(crd["data"]), kube_version, strict=True)


def test_crds_are_byte_identical_to_the_operator_source():
    source = sorted((ROOT / "operator" / "omni_operator" / "crd").glob("*.yaml"))
    assert source, "the operator's CRD is missing"
    in_chart = {c["name"].removeprefix("crds/"): c["data"] for c in crds()}
    assert set(in_chart) == {p.name for p in source}
    for path in source:
        assert (CHART / "crds" / path.name).read_bytes() == path.read_bytes()
        assert in_chart[path.name] == path.read_text()


def test_defaults_install_the_operator_and_nothing_optional():
    objects = render()
    assert sorted(o["kind"] for o in objects) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount"
    ]


def _container(objects):
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_operator_pod_meets_the_restricted_pod_security_standard(values):
    deployment, container = _container(render(values))
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostPath" not in json.dumps(pod["volumes"])
    assert not pod.get("hostNetwork") and not pod.get("hostPID")


def test_probes_use_kopfs_liveness_endpoint_on_the_port_the_operator_is_told():
    for values, port in (({}, 8081), (NON_DEFAULT, 9091)):
        _, container = _container(render(values))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["healthz"] == port
        assert f"--liveness-port={port}" in container["args"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_operator_arguments_parse_with_the_operators_own_cli():
    from omni_operator.controller.main import parse_args

    _, container = _container(render())
    options = parse_args(container["args"])
    assert options.clusterwide and options.metrics_port == 8080 and options.liveness_port == 8081
    assert container["command"] == ["omni-operator"]

    _, container = _container(render(NON_DEFAULT))
    options = parse_args(container["args"])
    assert options.namespaces == ["ml-team", "research"]
    assert options.metrics_port == 9090 and options.debug and options.resync_seconds == 30
    assert container["image"] == "registry.example/omni-operator@sha256:" + "a" * 64


def test_podmonitor_labels_reach_the_operator_and_the_operators_own_are_refused():
    """kube-prometheus-stack's Prometheus takes only the PodMonitors labelled with its release:
    without a way to label them, no stage pod was scraped there (an outside review)."""
    from omni_operator.controller.main import parse_args
    from omni_operator.pipeline import naming

    _, container = _container(render({"podMonitors": {"additionalLabels": {"release": "kps", "team": "ml"}}}))
    assert "--podmonitor-labels=release=kps,team=ml" in container["args"]
    assert parse_args(container["args"]).cluster.podmonitor_labels == (("release", "kps"), ("team", "ml"))
    _, container = _container(render())
    assert not any(a.startswith("--podmonitor-labels") for a in container["args"])
    for key in naming.common_labels("p"):  # the chart's list and the operator's own labels agree
        with pytest.raises(helm.HelmError, match=f"podMonitors.additionalLabels.{key}: the operator sets"):
            render({"podMonitors": {"additionalLabels": {key: "x"}}})
        with pytest.raises(SystemExit):
            parse_args([f"--podmonitor-labels={key}=x"])


def test_transfer_health_values_reach_the_operator_and_its_rbac():
    """Pod reads (the default) and rollouts (which pods of an old revision remain) need
    `list pods`, whichever way transfer health is read, or not at all."""
    from omni_operator.controller.main import parse_args

    pods = ("", "pods", "list")
    objects = render()
    deployment, container = _container(objects)
    options = parse_args(container["args"])
    assert options.transfer_health and options.prometheus_url is None and options.failing_ratio == 0.05
    assert pods in operator_permissions.granted(one(objects, "ClusterRole")["rules"])
    # The NetworkPolicy peer the operator renders selects its own pod.
    assert options.operator_pod_labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert options.operator_pod_labels["app.kubernetes.io/component"] == "operator"
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}

    url = "http://prometheus-operated.monitoring.svc:9090"
    for values in ({"transferHealth": {"prometheusUrl": url, "failingRatio": 0.1}},
                   {"transferHealth": {"enabled": False}, "watch": {"namespaces": ["ml-team"]}}):
        objects = render(values)
        options = parse_args(_container(objects)[1]["args"])
        if values["transferHealth"].get("enabled", True):
            assert options.prometheus_url == url and options.failing_ratio == 0.1
        else:
            assert not options.transfer_health
        roles = by_kind(objects, "Role") or by_kind(objects, "ClusterRole")
        for role in roles:
            assert pods in operator_permissions.granted(role["rules"])


def test_metrics_service_selects_the_operator_pod():
    objects = render()
    deployment, container = _container(objects)
    service = one(objects, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics"
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in container["ports"]


def test_service_monitor_scrapes_the_metrics_service():
    objects = render(NON_DEFAULT)
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["interval"] == "15s"


def test_prometheus_rule_with_defaults_is_the_plain_rule_file():
    rule = one(render(ALL_ON), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    # The chart's defaults are the mixin's (so the equality above is by construction).
    assert {k: v for k, v in render_values()["prometheusRule"].items()
            if k in chart_default_values()} == chart_default_values()


def render_values():
    with helm.Chart.load(CHART) as chart:
        return chart.values


def test_prometheus_rule_takes_the_thresholds_and_passes_promtool(promtool, tmp_path):
    rule = one(render(NON_DEFAULT), "PrometheusRule")
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert rules["OmniKVTransferStuck"]["expr"].rstrip().endswith("> 120")
    assert rules["OmniKVBlocksHeldTooLong"]["expr"].rstrip().endswith("> 600")
    assert rules["OmniKVTransferFailureRateHigh"]["expr"].rstrip().endswith("> 0.2")
    assert rules["OmniStageDown"]["annotations"]["runbook_url"] == \
        "https://wiki.example/omni/runbooks#omnistagedown"
    # Prometheus' own templates survive Helm's.
    assert "{{ $labels.stage }}" in rules["OmniKVTransferStuck"]["annotations"]["description"]
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmaps_carry_the_sidecar_label_and_the_dashboards():
    objects = render(NON_DEFAULT)
    maps = [m for m in by_kind(objects, "ConfigMap")
            if m["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(maps) == 2
    found = {}
    for cm in maps:
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Omni"}
        ((name, text),) = cm["data"].items()
        found[name] = text
    for name, text in found.items():
        assert text == (ROOT / "dashboards" / name).read_text()
    assert set(found) == {"omni-kv-transfers.json", "omni-pipelines.json"}


@pytest.mark.parametrize("clusterwide", [True, False], ids=["cluster-wide", "namespaced"])
def test_rbac_grants_exactly_what_the_operator_calls(clusterwide):
    values = {} if clusterwide else {"watch": {"namespaces": ["ml-team", "research"]}}
    objects = render(values)
    required = operator_permissions.required(clusterwide)
    if clusterwide:
        assert not by_kind(objects, "Role")
        role = one(objects, "ClusterRole")
        binding = one(objects, "ClusterRoleBinding")
        assert operator_permissions.granted(role["rules"]) == required
        bindings = [binding]
    else:
        # Only kopf's cluster observation is cluster-wide; everything else is per namespace.
        role, binding = one(objects, "ClusterRole"), one(objects, "ClusterRoleBinding")
        assert operator_permissions.granted(role["rules"]) == operator_permissions.required_cluster_scoped(False)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        roles, bindings = by_kind(objects, "Role"), by_kind(objects, "RoleBinding") + [binding]
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-team", "research"]
        for namespaced in roles:
            assert operator_permissions.granted(namespaced["rules"]) == operator_permissions.required_namespaced()
        assert operator_permissions.granted(role["rules"]) | operator_permissions.required_namespaced() == required
    sa = one(objects, "ServiceAccount")
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                        "namespace": NAMESPACE}]


def test_rbac_check_is_not_vacuous():
    """A permission the operator does not use, or one it lacks, is caught."""
    role = one(render(), "ClusterRole")
    granted = operator_permissions.granted(role["rules"])
    required = operator_permissions.required(True)
    assert granted | {("", "secrets", "get")} != required
    assert granted - {("apps", "deployments", "patch")} != required


@pytest.mark.parametrize("bad", [
    {"replicaCount": 2},
    {"unknownKey": True},
    {"prometheusRule": {"stuckTransferSeconds": "5m"}},
    {"watch": {"namespaces": ["Not_A_Namespace"]}},
    {"logLevel": "trace"},
    {"serviceMonitor": {"interval": "soon"}},
    {"transferHealth": {"prometheusUrl": "prometheus:9090"}},
    {"transferHealth": {"failingRatio": 1}},
    {"ingress": {"pipeline": "Tiny"}},
    {"ingress": {"entryStage": "2talker"}},
    {"ingress": {"hosts": [{"host": "https://omni.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}]}},
    {"ingress": {"hosts": [{"host": "omni.example.com:443", "paths": [{"path": "/", "pathType": "Prefix"}]}]}},
    {"ingress": {"hosts": [{"host": "omni.example.com", "paths": [{"path": "v1", "pathType": "Prefix"}]}]}},
    {"ingress": {"hosts": [{"host": "omni.example.com", "paths": [{"path": "/", "pathType": "Regex"}]}]}},
    {"ingress": {"hosts": [{"host": "omni.example.com", "paths": []}]}},
    {"ingress": {"tls": [{"secretName": "Bad_Name"}]}},
    {"ingress": {"tls": [{"secretName": "ok", "host": "omni.example.com"}]}},
    # A ratio of 1 would leave the alert it sets never firing (the rule is "> ratio").
    {"prometheusRule": {"failureRatio": 1}},
    {"prometheusRule": {"streamDeadlineRatio": 1}},
    {"prometheusRule": {"streamFailureRatio": 1}},
    # A user id as a string once rendered as root (0) and failed naming the wrong cause.
    {"securityContext": {"runAsUser": "abc"}},
    {"podSecurityContext": {"runAsUser": -1}},
    {"podSecurityContext": {"runAsNonRoot": "yes"}},
    # Each of these rendered and failed only at install, or (a label with ',' or '=' in
    # --podmonitor-labels) was read by the operator as other labels (an outside review).
    {"podLabels": {"bad key!": "x"}},
    {"podLabels": {"team": "x y"}},
    {"podMonitors": {"additionalLabels": {"release": "a,b=c"}}},
    {"podMonitors": {"additionalLabels": {"bad key": "v"}}},
    {"podMonitors": {"additionalLabels": {"release": "kps: x"}}},
    {"serviceMonitor": {"additionalLabels": {"release": "-x"}}},
    {"nodeSelector": {"kubernetes.io/os": "linux os"}},
    {"podAnnotations": {"not a key": "x"}},
    {"serviceAccount": {"name": "Bad_Name"}},
    {"nameOverride": "x y"},
    {"fullnameOverride": "Omni_Pipeline"},
    {"image": {"tag": "bad tag:x"}},
    {"priorityClassName": "High Priority"},
    {"dashboards": {"label": "team: omni"}},
    {"dashboards": {"labelValue": "a b"}},
    {"serviceMonitor": {"interval": "30s30s"}},
    {"ingress": {"hosts": [{"host": "omni.example.com", "paths": [{"path": "/ #x", "pathType": "Prefix"}]}]}},
])
def test_values_schema_rejects_bad_values(bad):
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values({}))  # the defaults pass
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(chart.merge_values(bad))


def test_service_monitor_without_the_metrics_service_fails_to_render():
    with pytest.raises(helm.HelmError, match="needs metrics.service.enabled"):
        render({"serviceMonitor": {"enabled": True}, "metrics": {"service": {"enabled": False}}})


def test_notes_say_what_was_installed():
    text = notes(NON_DEFAULT)
    assert "ml-team, research" in text and "fires after 120s" in text
    assert 'grafana_dashboard="1"' in text
    assert "all namespaces" in notes()


# ---------------------------------------------------------------------------- the Ingress
def test_no_ingress_unless_enabled():
    assert not by_kind(render(), "Ingress")
    assert "Ingress" not in notes()


def test_the_ingress_serves_the_port_the_operator_gives_the_pipelines_endpoint():
    """Its backend is the Service and port the operator renders for the pipeline's endpoint
    (its entry stage's stable Service, port `endpoint`), in the pipeline's namespace, and
    `status.endpoint` names the same Service and port."""
    from omni_operator.pipeline import naming
    from omni_operator.check.admission import admit

    body = yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml").read_text())
    body["metadata"]["namespace"] = "ml-team"
    children = admit(body).children
    ingress = one(render({"ingress": {"enabled": True, "pipeline": "tiny-omni-streaming",
                                      "entryStage": "thinker", "namespace": "ml-team"}}),
                  "Ingress")
    assert ingress["metadata"]["namespace"] == "ml-team"
    assert ingress["metadata"]["name"] == "tiny-omni-streaming-endpoint"
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "omni-pipeline.local"  # the default host
    [path] = rule["http"]["paths"]
    backend = path["backend"]["service"]
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    service = services[backend["name"]]
    assert service["metadata"]["namespace"] == "ml-team"
    [port] = [p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"]]
    assert port["port"] == naming.ENDPOINT_PORT
    assert naming.pipeline_endpoint("tiny-omni-streaming", "thinker", "ml-team") == \
        f"http://{backend['name']}.ml-team.svc:{port['port']}"
    # No other stage's Service has the port.
    assert [n for n, s in services.items()
            if any(p["name"] == "endpoint" for p in s["spec"]["ports"])] == [backend["name"]]


def test_the_ingress_takes_class_annotations_hosts_and_tls_as_given():
    ingress = one(render(NON_DEFAULT), "Ingress")
    assert ingress["metadata"]["namespace"] == "ml-team"
    assert ingress["metadata"]["annotations"] == {"cert-manager.io/cluster-issuer": "letsencrypt"}
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["omni.example.com"], "secretName": "omni-example-tls"}]
    first, anyhost = spec["rules"]
    assert first["host"] == "omni.example.com" and "host" not in anyhost
    assert [p["path"] for p in first["http"]["paths"]] == ["/v1"]
    assert {p["backend"]["service"]["name"] for r in spec["rules"] for p in r["http"]["paths"]} \
        == {"qwen-omni-thinker"}
    text = notes(NON_DEFAULT)
    assert "https://omni.example.com/v1" in text and "http://<any host>/" in text


@pytest.mark.parametrize("ingress, message", [
    ({"enabled": True, "entryStage": "thinker"}, "ingress.enabled needs ingress.pipeline"),
    ({"enabled": True, "pipeline": "tiny"}, "ingress.enabled needs ingress.entryStage"),
    ({"enabled": True, "pipeline": "a" * 40, "entryStage": "b" * 30}, "over 63 characters"),
    ({"enabled": True, "pipeline": "tiny", "entryStage": "thinker", "hosts": []},
     "at least one entry in ingress.hosts"),
])
def test_an_ingress_without_its_pipeline_fails_to_render_naming_the_value(ingress, message):
    with pytest.raises(helm.HelmError, match=message):
        render({"ingress": ingress})


@pytest.mark.parametrize("values", [
    {"fullnameOverride": "o" * 70},
    {"nameOverride": "n" * 40},
], ids=["long-fullname", "long-name"])
def test_names_stay_dns_labels_with_long_release_names(values):
    """A Service's name is a 63-character DNS label: a long full name once rendered the
    metrics Service 71 characters long, which the API server refuses (an outside review)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="r" * 53, namespace=NAMESPACE, is_install=True)
    objects = [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
               for doc in yaml.safe_load_all(text) if doc]
    named = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert all(len(name) <= 63 for kind, name in named if kind in ("Service", "Deployment", "ServiceAccount")), named
    service = one(objects, "Service")["metadata"]["name"]
    assert service.endswith("-operator-metrics") and len(service) <= 63
    assert one(objects, "Deployment")["metadata"]["name"].endswith("-operator")


def test_a_timeout_within_the_interval_and_other_extra_args_render():
    monitor = one(render({"serviceMonitor": {"enabled": True, "interval": "1m30s", "scrapeTimeout": "90s"}}),
                  "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["scrapeTimeout"] == "90s"
    args = one(render({"extraArgs": ["--resync-seconds=30"]}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-1] == "--resync-seconds=30"


def test_dashboards_keep_names_of_their_own_with_a_long_release_name():
    """The release's name is shortened, never the dashboard's: two dashboards cut to one name
    once failed the install (an outside review)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render({"fullnameOverride": "f" * 63, "dashboards": {"enabled": True}},
                                 name=RELEASE, namespace=NAMESPACE, is_install=True)
    names = [doc["metadata"]["name"] for path, text in manifests.items() if "dashboards" in path
             for doc in yaml.safe_load_all(text) if doc]
    assert len(names) == len(set(names)) >= 2 and all(len(n) <= 63 for n in names), names
    assert all(n.startswith("f") and not n.startswith("f" * 63) for n in names), names


def test_pod_labels_may_not_replace_the_labels_the_deployment_selects_by():
    with pytest.raises(helm.HelmError, match="podLabels.app.kubernetes.io/name: the chart sets this label"):
        render({"podLabels": {"app.kubernetes.io/name": "other"}})
    deployment = one(render({"podLabels": {"team": "ml"}}), "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml"


@pytest.mark.parametrize("values, message", [
    ({"metrics": {"port": 8081}}, "metrics.port and liveness.port are both 8081"),
    ({"podSecurityContext": {"runAsNonRoot": True, "runAsUser": 0}}, "podSecurityContext.runAsUser is 0"),
    ({"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}, "securityContext.runAsUser is 0"),
    # Beside the chart's own --all-namespaces (argparse: mutually exclusive): a crash loop.
    ({"extraArgs": ["--namespace=x"]}, "extraArgs sets --namespace, which the chart sets from the value watch.namespaces"),
    ({"extraArgs": ["--metrics-port", "9000"]}, "extraArgs sets --metrics-port, .* metrics.port"),
    ({"serviceMonitor": {"enabled": True, "interval": "1m30s", "scrapeTimeout": "2m"}},
     r"serviceMonitor.scrapeTimeout \(2m\) is longer than serviceMonitor.interval \(1m30s\)"),
    # A second POD_NAMESPACE won (the last entry): the NetworkPolicy peers in the wrong namespace.
    ({"extraEnv": [{"name": "POD_NAMESPACE", "value": "x"}]}, "extraEnv sets POD_NAMESPACE, which the chart sets"),
    ({"extraEnv": [{"name": "POD_NAME", "value": "x"}]}, "extraEnv sets POD_NAME"),
    ({"ingress": {"enabled": True, "pipeline": "p", "entryStage": "s",
                  "hosts": [{"host": "10.0.0.1", "paths": [{"path": "/", "pathType": "Prefix"}]}]}},
     "ingress.hosts.*host 10.0.0.1 is an IP address"),
])
def test_values_that_could_never_run_fail_to_render_naming_them(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_values_that_yaml_would_read_otherwise_render_as_given():
    """Values written into the manifests are quoted: a priority class of digits, an Ingress
    path with ':' or '#', stayed strings only by chance, or changed silently (an outside
    review: `/ #x` became `/`)."""
    deployment = one(render({"priorityClassName": "1000", "podMonitors": {"additionalLabels": {"release": "1.0"}}}),
                     "Deployment")
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == "1000"
    assert "--podmonitor-labels=release=1.0" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    ingress = one(render({"ingress": {"enabled": True, "pipeline": "p", "entryStage": "s", "hosts": [
        {"host": "omni.example.com", "paths": [{"path": "/v1:x", "pathType": "Prefix"}]}]}}), "Ingress")
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/v1:x"
    configmaps = [c for c in render({"dashboards": {"enabled": True, "label": "example.com/dashboard",
                                                    "labelValue": "true"}}) if c["kind"] == "ConfigMap"]
    assert configmaps and all(c["metadata"]["labels"]["example.com/dashboard"] == "true" for c in configmaps)
