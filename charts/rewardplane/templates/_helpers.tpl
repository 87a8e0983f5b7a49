{{/* Chart name, truncated to a DNS label. */}}
{{- define "rewardplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "rewardplane.fullname" -}}
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

{{- define "rewardplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rewardplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rewardplane
{{- end }}

{{- define "rewardplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rewardplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rewardplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rewardplane.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The default reward-server image (serverImage; tag: the appVersion), empty without a repository. */}}
{{- define "rewardplane.serverImage" -}}
{{- with .Values.serverImage.repository }}
{{- printf "%s:%s" . ($.Values.serverImage.tag | default $.Chart.AppVersion) }}
{{- end }}
{{- end }}
