{{/*
Rules in the namespaces where OmniPipelines live. Verbs per resource follow the operator's
calls: its Kube layer gets, lists, creates, patches and deletes children (an autoscaled
stage's OmniStageScaler and its HorizontalPodAutoscaler or KEDA ScaledObject among them),
patches the scalers' status, reads OmniPipelines, patches their status and posts events, and
lists the stage pods (while an old revision drains, and on the resync timer to read their
/metrics for transfer health) and patches them (their deletion cost from their open streams); kopf lists and watches every resource it has handlers for
(OmniPipelines and each child kind) and patches OmniPipelines and their status (its handler
progress and last-handled state).
*/}}
{{- define "omni-pipeline.namespacedRules" -}}
- apiGroups: ["omnipipeline.dev"]
  resources: ["omnipipelines"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["omnipipeline.dev"]
  resources: ["omnipipelines/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["omnipipeline.dev"]
  resources: ["omnistagescalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["omnipipeline.dev"]
  resources: ["omnistagescalers/status"]
  verbs: ["patch"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch"]
{{- end }}

{{/*
Cluster-scoped rules: kopf's observation of the cluster. It watches CRDs to notice resources
that appear later (the Prometheus Operator's PodMonitor); in namespaced mode it also lists
and watches Namespaces, to notice a listed namespace created after it starts. Refused, kopf
falls back, but only after retrying each refused call for about a minute, during which it
handles no events (tests/monitoring/test_rbac_measured.py runs the operator under these
rules and measures what it calls).
*/}}
{{- define "omni-pipeline.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watch.namespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}
