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

{{/* The operator's objects: <fullname>-operator. */}}
{{- define "omni-pipeline.operatorName" -}}
{{- printf "%s-operator" (include "omni-pipeline.fullname" .) | trunc 63 | trimSuffix "-" }}
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
