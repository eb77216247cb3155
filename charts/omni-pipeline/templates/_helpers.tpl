{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "omni-pipeline.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name when it already holds the chart name. */}}
{{- define "omni-pipeline.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's objects: <fullname>-operator, the full name cut so that the suffix stays
and the name is a 63-character DNS label. */}}
{{- define "omni-pipeline.operatorName" -}}
{{- printf "%s-operator" (include "omni-pipeline.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* The operator's metrics Service: <fullname>-operator-metrics, the full name cut so that
the name is within a Service name's 63 characters (a DNS-1035 label). */}}
{{- define "omni-pipeline.metricsServiceName" -}}
{{- printf "%s-operator-metrics" (include "omni-pipeline.fullname" . | trunc 46 | trimSuffix "-") }}
{{- end }}

{{/* Values that render but could never run: refused here, naming them. */}}
{{- define "omni-pipeline.checkValues" -}}
{{- if eq (int .Values.metrics.port) (int .Values.liveness.port) }}
{{- fail (printf "metrics.port and liveness.port are both %v: the operator listens on each; give them different ports" .Values.metrics.port) }}
{{- end }}
{{- range $where, $context := dict "podSecurityContext" .Values.podSecurityContext "securityContext" .Values.securityContext }}
{{- if and $context $context.runAsNonRoot (hasKey $context "runAsUser") (eq (int $context.runAsUser) 0) }}
{{- fail (printf "%s.runAsUser is 0 (root) and %s.runAsNonRoot is true: the kubelet would not start the operator; use a non-zero user id" $where $where) }}
{{- end }}
{{- end }}
{{- $chartFlags := dict "--namespace" "watch.namespaces" "--all-namespaces" "watch.namespaces (empty: all)" "--liveness-port" "liveness.port" "--metrics-port" "metrics.port" "--prometheus-url" "transferHealth.prometheusUrl" "--transfers-failing-ratio" "transferHealth.failingRatio" "--metrics-timeout-seconds" "transferHealth.timeoutSeconds" "--metrics-concurrency" "transferHealth.concurrency" "--no-transfer-health" "transferHealth.enabled" "--transfer-health" "transferHealth.enabled" "--operator-pod-labels" "podLabels" "--debug" "logLevel" "--verbose" "logLevel" }}
{{- range .Values.extraArgs }}
{{- $flag := regexReplaceAll "=.*" (toString .) "" }}
{{- if hasKey $chartFlags $flag }}
{{- fail (printf "extraArgs sets %s, which the chart sets from the value %s: set that value instead" $flag (get $chartFlags $flag)) }}
{{- end }}
{{- end }}
{{- with .Values.serviceMonitor }}
{{- if and .enabled .interval .scrapeTimeout }}
{{- if gt (int64 (include "omni-pipeline.milliseconds" .scrapeTimeout)) (int64 (include "omni-pipeline.milliseconds" .interval)) }}
{{- fail (printf "serviceMonitor.scrapeTimeout (%s) is longer than serviceMonitor.interval (%s): the Prometheus Operator drops such a ServiceMonitor; make the timeout at most the interval" .scrapeTimeout .interval) }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.extraEnv }}
{{- if has (toString .name) (list "POD_NAME" "POD_NAMESPACE") }}
{{- fail (printf "extraEnv sets %s, which the chart sets from the pod itself (the operator's identity, and the namespace its pods' NetworkPolicy peers are in); remove it" .name) }}
{{- end }}
{{- end }}
{{- range .Values.ingress.hosts }}
{{- if and .host (regexMatch "^[0-9]+([.][0-9]+){3}$" (toString .host)) }}
{{- fail (printf "ingress.hosts[].host %s is an IP address: an Ingress host must be a DNS name; leave host out to match every host" .host) }}
{{- end }}
{{- end }}
{{- include "omni-pipeline.checkPodLabels" . }}
{{- $operators := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/part-of" "app.kubernetes.io/managed-by" "omnipipeline.dev/pipeline" }}
{{- range $key, $_ := .Values.podMonitors.additionalLabels }}
{{- if has $key $operators }}
{{- fail (printf "podMonitors.additionalLabels.%s: the operator sets this label on each PodMonitor itself; use another key" $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/* podMonitors.additionalLabels as the operator's --podmonitor-labels reads them:
key=value,... (the schema keeps keys and values to label syntax, so neither holds a ',' or
a '='). */}}
{{- define "omni-pipeline.podMonitorLabels" -}}
{{- range $i, $key := keys .Values.podMonitors.additionalLabels | sortAlpha }}{{ if $i }},{{ end }}{{ $key }}={{ get $.Values.podMonitors.additionalLabels $key }}{{ end }}
{{- end }}

{{/* A Prometheus duration ("1m30s") in milliseconds. */}}
{{- define "omni-pipeline.milliseconds" -}}
{{- $unit := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000 "w" 604800000 "y" 31536000000 }}
{{- $total := 0 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h|d|w|y)" (toString .) -1 }}
{{- $n := regexFind "^[0-9]+" . }}
{{- $total = add $total (mul (int64 $n) (get $unit (trimPrefix $n .))) }}
{{- end }}
{{- $total }}
{{- end }}

{{/* The labels the chart sets on the operator's pod itself (its Deployment selects the pod by
some of them): podLabels may not set them. */}}
{{- define "omni-pipeline.checkPodLabels" -}}
{{- $own := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/part-of" "helm.sh/chart" }}
{{- range $key, $_ := .Values.podLabels }}
{{- if has $key $own }}
{{- fail (printf "podLabels.%s: the chart sets this label on the operator's pod itself (its Deployment selects the pod by the app.kubernetes.io labels); use another key" $key) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "omni-pipeline.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels on every object. */}}
{{- define "omni-pipeline.labels" -}}
helm.sh/chart: {{ include "omni-pipeline.chart" . }}
{{ include "omni-pipeline.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: omni-pipeline
{{- end }}

{{- define "omni-pipeline.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omni-pipeline.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator pod's labels, which the Deployment and the metrics Service select on. */}}
{{- define "omni-pipeline.operatorSelectorLabels" -}}
{{ include "omni-pipeline.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "omni-pipeline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omni-pipeline.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "omni-pipeline.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}
