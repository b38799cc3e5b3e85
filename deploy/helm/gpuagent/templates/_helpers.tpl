{{/*
Names, labels and the image. With the release named "gpuagent" every name is the one
manifests/base uses.
*/}}
{{- define "gpuagent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuagent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpuagent.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* The labels of every object and pod. */}}
{{- define "gpuagent.labels" -}}
app.kubernetes.io/name: {{ include "gpuagent.name" . }}
app.kubernetes.io/part-of: gpuagent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 }}
{{- end -}}

{{/* What the DaemonSet selects its pods by (and the Service its endpoints). */}}
{{- define "gpuagent.selectorLabels" -}}
{{- if .Values.selectorLabelsOverride -}}
{{- toYaml .Values.selectorLabelsOverride -}}
{{- else -}}
app.kubernetes.io/name: {{ include "gpuagent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- end -}}

{{- define "gpuagent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The user name of the agent's service account, as the admission policies match it. */}}
{{- define "gpuagent.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" (include "gpuagent.namespace" .) (include "gpuagent.fullname" .) -}}
{{- end -}}

{{/*
What of the API server the agent uses, as JSON: the node condition, events, the taint, DRA.
*/}}
{{- define "gpuagent.apiUse" -}}
{{- $dra := ne (toString .Values.dra.gpus) "none" -}}
{{- $use := dict "condition" .Values.nodeHealth.condition "events" .Values.nodeHealth.events "taint" .Values.nodeHealth.taintUnhealthyNode "dra" $dra -}}
{{- $_ := set $use "any" (or $use.condition $use.events $use.taint $dra) -}}
{{- toJson $use -}}
{{- end -}}

{{/* The metrics port: the port of service.address (the agent's --metrics-address). */}}
{{- define "gpuagent.metricsPort" -}}
{{- $port := regexFind "[0-9]+$" (toString .Values.service.address) -}}
{{- if not $port -}}
{{- fail (printf "service.address: %q has no port (HOST:PORT or :PORT)" .Values.service.address) -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{/* Whether the metrics port speaks TLS (the kubelet's probes then use HTTPS). */}}
{{- define "gpuagent.webTLS" -}}
{{- if or .Values.web.tlsSecret (hasKey .Values.web.config "tls_server_config") -}}
true
{{- else -}}
false
{{- end -}}
{{- end -}}

{{- define "gpuagent.webEnabled" -}}
{{- if or .Values.web.config .Values.web.existingSecret -}}
true
{{- else -}}
false
{{- end -}}
{{- end -}}
