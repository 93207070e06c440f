{{/*
Chart name, truncated to the 63 characters a DNS label allows.
*/}}
{{- define "agq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources: <release>-<chart>, or the release name
alone when it already contains the chart name.
*/}}
{{- define "agq.fullname" -}}
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

{{/*
Name of the worker Deployment.
*/}}
{{- define "agq.workerName" -}}
{{- printf "%s-worker" (include "agq.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "agq.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every resource.
*/}}
{{- define "agq.labels" -}}
helm.sh/chart: {{ include "agq.chart" . }}
app.kubernetes.io/name: {{ include "agq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels of the server pods.
*/}}
{{- define "agq.serverSelectorLabels" -}}
app.kubernetes.io/name: {{ include "agq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/*
Selector labels of the worker pods.
*/}}
{{- define "agq.workerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "agq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end }}

{{/*
Name of the ServiceAccount the pods run as.
*/}}
{{- define "agq.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "agq.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "agq.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
Name of the Secret holding the auth file and the workers' token.
*/}}
{{- define "agq.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "agq.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The workers' token: auth.workerToken when set, else the one already stored in
the release's Secret (so upgrades keep it), else a new random one.
*/}}
{{- define "agq.workerToken" -}}
{{- if .Values.auth.workerToken }}
{{- .Values.auth.workerToken }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "agq.secretName" .) }}
{{- if and $existing $existing.data (hasKey $existing.data .Values.worker.tokenKey) }}
{{- index $existing.data .Values.worker.tokenKey | b64dec }}
{{- else }}
{{- randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Address the workers dial.
*/}}
{{- define "agq.serverAddress" -}}
{{- if .Values.worker.server }}
{{- .Values.worker.server }}
{{- else }}
{{- printf "http://%s:%d" (include "agq.fullname" .) (int .Values.service.grpcPort) }}
{{- end }}
{{- end }}

{{/*
Mount path of the auth file inside the server container.
*/}}
{{- define "agq.authDir" -}}
/etc/agq/auth
{{- end }}
