"""Pipelines the old check passed that a real cluster breaks (issue 44, classes 4 and 5),
written as users write them: a cache mount path that resolves to one of the pods' own mounts
(the kubelet drops a trailing or doubled '/' and a '.' segment: `/tmp/` shadows the pod's
`/tmp`), a KEDA ScaledObject whose name passes 54 characters (KEDA's HPA is `keda-hpa-NAME`,
and newer KEDA's webhook refuses it), and autoscaling with `observability.metrics: false` (no
PodMonitor: the signals never exist)."""
from __future__ import annotations

import copy

import pytest
import yaml

from k8s_emulator import EmulatorThread
from omnip_support import NAMESPACE, body_of, create_pipeline, make_kube, validate_text
from omni_operator.pipeline import naming
from omni_operator.check.admission import admit
from omni_operator.pipeline.kinds import HPA, SCALEDOBJECT
from omni_operator.controller.reconcile import Reconciler
from omni_operator.check.validation import resource_problems

PIPELINE = """\
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
spec:
  image: ghcr.io/example/omni-stage:0.1.0
  model:
    name: Qwen/Qwen2.5-Omni-7B
    cache:
      pvc: {claimName: model-cache}
      mountPath: /models
  stages:
    - name: thinker
      role: ar
      kvTransfer: {send: true}
    - name: code2wav
      role: generation
      inputs: [thinker]
      autoscaling:
        minReplicas: 0
        maxReplicas: 8
        metrics:
          - {signal: incomingTransfers, target: 2}
  observability:
    metrics: true
"""


@pytest.mark.parametrize("path", ["/tmp/", "/tmp", "//tmp", "/./tmp", "/tmp/.", "/tmp//", "/dev/shm/", "/dev//shm",
                                  "/dev/./shm", "/etc/omni/", "/etc/omni/models", "/etc//omni", "/", "/etc", "/dev/"])
def test_a_cache_path_the_kubelet_resolves_to_the_pods_own_mounts_is_refused(tmp_path, path):
    text = PIPELINE.replace("mountPath: /models", f"mountPath: {path}")
    code, lines = validate_text(tmp_path, text)
    assert code == 1, lines
    (line,) = lines
    assert ": spec.model.cache.mountPath: " in line and repr(path) in line and "already mount" in line
    assert "choose another path" in line
    # kubectl apply is refused too: the CRD's rule says it.
    assert [f for f, _ in resource_problems(body_of(text))] == ["spec.model.cache.mountPath"]


def test_a_dot_dot_segment_is_refused_with_the_fix(tmp_path):
    code, lines = validate_text(tmp_path, PIPELINE.replace("mountPath: /models", "mountPath: /models/../tmp"))
    assert code == 1, lines
    (line,) = lines
    assert "spec.model.cache.mountPath: '/models/../tmp' holds a '..' segment: write the path it resolves to" in line


@pytest.mark.parametrize("path", ["/models/", "/models//cache", "/tmp/models", "/dev/shm-models", "/etc/omnibus",
                                  "/.models", "/data/..cache", "/mnt/./models"])
def test_other_cache_paths_are_accepted(tmp_path, path):
    code, lines = validate_text(tmp_path, PIPELINE.replace("mountPath: /models", f"mountPath: {path}"))
    assert code == 0, lines


# -- KEDA's name limit -----------------------------------------------------------------------

LONG = PIPELINE.replace("name: qwen-omni", "name: " + "q" * 40).replace("name: code2wav", "name: code2wav-vocoder-x")


def test_a_scaledobject_name_is_cut_to_what_keda_takes(tmp_path):
    code, lines = validate_text(tmp_path, LONG)
    assert code == 0, lines
    body = body_of(LONG)
    body["metadata"]["namespace"] = "ml"
    children = admit(body).children
    (so,) = [c for c in children if c["kind"] == SCALEDOBJECT.kind]
    (hpa,) = [c for c in children if c["kind"] == HPA.kind]
    name = so["metadata"]["name"]
    stage_name = naming.stage_name("q" * 40, "code2wav-vocoder-x")
    assert len(stage_name) > 54
    assert len(name) <= 54 and len(f"keda-hpa-{name}") <= 63
    assert name.startswith(stage_name[:40]) and name != stage_name[:54]  # cut, then a hash keeps stages apart
    # What it scales is still the stage's scaler; the plain HPA keeps the stage's name.
    assert so["spec"]["scaleTargetRef"]["name"] == stage_name
    assert hpa["metadata"]["name"] == stage_name


def test_two_stages_cut_to_the_same_prefix_keep_distinct_scaledobjects():
    a = naming.scaledobject_name("p" * 30, "stage-" + "a" * 20 + "-one")
    b = naming.scaledobject_name("p" * 30, "stage-" + "a" * 20 + "-two")
    assert a != b and len(a) <= 54 and len(b) <= 54
    assert naming.scaledobject_name("tiny", "code2wav") == "tiny-code2wav"  # short names are unchanged


def test_the_operator_creates_the_cut_scaledobject():
    with EmulatorThread(keda=True) as emu:
        kube = make_kube(emu.url)
        kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        body = body_of(LONG)
        body["metadata"]["namespace"] = NAMESPACE
        create_pipeline(kube, body)
        reconciler = Reconciler(make_kube(emu.url))
        reconciler.reconcile(NAMESPACE, "q" * 40)
        name = naming.scaledobject_name("q" * 40, "code2wav-vocoder-x")
        so = kube.get(SCALEDOBJECT, NAMESPACE, name)
        assert so is not None and so["spec"]["minReplicaCount"] == 0
        assert kube.get(SCALEDOBJECT, NAMESPACE, naming.stage_name("q" * 40, "code2wav-vocoder-x")) is None
        reconciler.kube.close()
        kube.close()


# -- autoscaling needs the metrics -----------------------------------------------------------

def test_autoscaling_without_metrics_is_refused_naming_the_stages(tmp_path):
    text = PIPELINE.replace("  observability:\n    metrics: true", "  observability:\n    metrics: false")
    code, lines = validate_text(tmp_path, text)
    assert code == 1, lines
    (line,) = lines
    assert ": spec.observability.metrics: is false, so no PodMonitor scrapes the stages" in line
    assert "code2wav never exist" in line and "set observability.metrics: true, or remove their autoscaling" in line
    assert [f for f, _ in resource_problems(body_of(text))] == ["spec.observability.metrics"]


def test_metrics_off_without_autoscaling_is_accepted(tmp_path):
    text = PIPELINE.replace("  observability:\n    metrics: true", "  observability:\n    metrics: false")
    body = body_of(text)
    del body["spec"]["stages"][1]["autoscaling"]
    code, lines = validate_text(tmp_path, yaml.safe_dump(copy.deepcopy(body)))
    assert code == 0, lines
