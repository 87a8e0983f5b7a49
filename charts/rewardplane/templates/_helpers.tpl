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

{{/* The operator image: image.repository (tag: image.tag, else the appVersion) when set; without
one, the image the installed operator Deployment runs (a `helm upgrade` without --reuse-values
keeps what the install used), and on a first install ghcr.io/rewardplane/operator. */}}
{{- define "rewardplane.operatorImage" -}}
{{- if .Values.image.repository }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- else }}
{{- $running := "" }}
{{- $dep := lookup "apps/v1" "Deployment" .Release.Namespace (include "rewardplane.fullname" .) }}
{{- if $dep }}
{{- range $dep.spec.template.spec.containers }}
{{- if eq .name "operator" }}{{ $running = .image }}{{ end }}
{{- end }}
{{- end }}
{{- $running | default (printf "ghcr.io/rewardplane/operator:%s" (.Values.image.tag | default .Chart.AppVersion)) }}
{{- end }}
{{- end }}
