{{/*
Rules in the namespaces where OmniPipelines live. Verbs per resource follow the operator's
calls: its Kube layer gets, lists, creates, patches and deletes children, reads
OmniPipelines, patches their status and posts events; kopf lists and watches every
resource it has handlers for (OmniPipelines and each child kind) and patches OmniPipelines
and their status (its handler progress and last-handled state).
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
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
Cluster-scoped rules, cluster-wide mode only: kopf watches CRDs to notice resources that
appear later (the Prometheus Operator's PodMonitor). Without them (namespaced mode) kopf
warns and discovers resources once, at start-up. Namespaces are not listed: the operator
watches all namespaces or exact names, never name patterns.
*/}}
{{- define "omni-pipeline.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
