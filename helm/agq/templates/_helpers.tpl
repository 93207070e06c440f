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
The workers' token, stable on every render and the same everywhere in one:
secret.yaml and the checksum/auth annotations of the server and worker pods
(which include secret.yaml again) each include this, so the value is worked
out once per render, by agq.workerTokenOnce, and kept in the render's root
context (the map every template of the chart shares). Drawing it on each
include would hash a random token the Secret does not hold, and the first
`helm upgrade` (which finds the stored one) would restart every pod.
*/}}
{{- define "agq.workerToken" -}}
{{- if not (hasKey . "agqWorkerToken") }}
{{- $_ := set . "agqWorkerToken" (include "agq.workerTokenOnce" .) }}
{{- end }}
{{- get . "agqWorkerToken" }}
{{- end }}

{{/*
The workers' token, worked out (call agq.workerToken, which caches it):
1. auth.workerToken when set;
2. else the one already stored in the release's Secret (upgrades keep it);
3. else, when `lookup` reaches a live cluster (the namespace's
   kube-root-ca.crt ConfigMap, which Kubernetes >= 1.21 publishes into
   every namespace, is visible), a new random one: a first `helm install`;
4. else fail: a render without a cluster (`helm template`, Argo CD, Flux,
   --dry-run) would otherwise produce a different random token every time,
   rotating the Secret and restarting the pods on every sync.
*/}}
{{- define "agq.workerTokenOnce" -}}
{{- if .Values.auth.workerToken }}
{{- .Values.auth.workerToken }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "agq.secretName" .) }}
{{- if and $existing $existing.data (hasKey $existing.data .Values.worker.tokenKey) }}
{{- index $existing.data .Values.worker.tokenKey | b64dec }}
{{- else if lookup "v1" "ConfigMap" .Release.Namespace "kube-root-ca.crt" }}
{{- randAlphaNum 48 }}
{{- else }}
{{- fail (printf "auth.workerToken is empty and no Secret %s holding it was found: this render has no cluster to look it up in (helm template, Argo CD, Flux, --dry-run) or the namespace %s does not exist yet (--create-namespace). A random token would change on every render, so set one: --set auth.workerToken=$(openssl rand -hex 24) (keep it, e.g. in your secret store), or point auth.existingSecret at a Secret you manage." (include "agq.secretName" .) .Release.Namespace) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Capabilities of a root agw (worker.runAs set), each for what agw does to
its tasks as root (src/worker/sandbox.rs, src/worker/executor.rs), and no
other: CHOWN: fchown each job's scratch directory to the task user;
SETGID, SETUID: setgid, setgroups and setuid to that user between fork and
exec; KILL: SIGKILL the task's process group (end, timeout, cancel, drain)
and processes that escaped it, all of another uid; DAC_OVERRIDE: remove
the scratch directory (mode 0700, the task user's) and what the task made
in it; FOWNER: remove files from sticky directories a task made there.
*/}}
{{- define "agq.rootAgwCapabilities" -}}
CHOWN DAC_OVERRIDE FOWNER KILL SETGID SETUID
{{- end }}

{{/*
Fails on a worker.runAs agw would refuse at start: tasks never run as root.
*/}}
{{- define "agq.validateRunAs" -}}
{{- if eq (toString .Values.worker.runAs) "root" }}
{{- fail "worker.runAs=root: tasks never run as root (agw refuses a --run-as user with uid or gid 0). Name an unprivileged user of the image, e.g. nobody, or leave worker.runAs empty to run agw and its tasks non-root." }}
{{- end }}
{{- end }}

{{/*
The worker pod's securityContext: worker.podSecurityContext, with uid 0
and runAsNonRoot false when worker.runAs runs agw as root.
*/}}
{{- define "agq.workerPodSecurityContext" -}}
{{- $sc := deepCopy (.Values.worker.podSecurityContext | default dict) }}
{{- if .Values.worker.runAs }}
{{- $_ := set $sc "runAsNonRoot" false }}
{{- $_ := set $sc "runAsUser" 0 }}
{{- $_ := set $sc "runAsGroup" 0 }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
The agw container's securityContext: worker.securityContext; when
worker.runAs runs agw as root, with uid 0, runAsNonRoot false, every
capability dropped and only agq.rootAgwCapabilities (plus any the values
add) added back.
*/}}
{{- define "agq.workerSecurityContext" -}}
{{- $sc := deepCopy (.Values.worker.securityContext | default dict) }}
{{- if .Values.worker.runAs }}
{{- include "agq.validateRunAs" . }}
{{- $_ := set $sc "runAsNonRoot" false }}
{{- $_ := set $sc "runAsUser" 0 }}
{{- $_ := set $sc "runAsGroup" 0 }}
{{- $caps := deepCopy ($sc.capabilities | default dict) }}
{{- $add := concat ($caps.add | default list) (splitList " " (include "agq.rootAgwCapabilities" .)) }}
{{- $_ := set $caps "add" ($add | uniq | sortAlpha) }}
{{- $_ := set $caps "drop" (list "ALL") }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
PromQL label matchers (no braces) selecting this release's server series.
*/}}
{{- define "agq.promSelector" -}}
{{- if .Values.monitoring.selector }}
{{- .Values.monitoring.selector }}
{{- else }}
{{- printf "namespace=%q,service=%q" .Release.Namespace (include "agq.fullname" .) }}
{{- end }}
{{- end }}

{{/*
True (non-empty) when an autoscaler owns the worker replica count; fails
when both KEDA and the HPA are on.
*/}}
{{- define "agq.workerAutoscaled" -}}
{{- $a := .Values.autoscaling }}
{{- if and $a.keda.enabled $a.hpa.enabled }}
{{- fail "autoscaling.keda.enabled and autoscaling.hpa.enabled are alternatives: turn on at most one (KEDA manages its own HPA for the Deployment)." }}
{{- end }}
{{- if and .Values.worker.enabled (or $a.keda.enabled $a.hpa.enabled) }}true{{ end }}
{{- end }}

{{/*
Ready jobs per worker the autoscalers aim at.
*/}}
{{- define "agq.targetReadyJobsPerWorker" -}}
{{- if .Values.autoscaling.targetReadyJobsPerWorker }}
{{- .Values.autoscaling.targetReadyJobsPerWorker }}
{{- else }}
{{- .Values.worker.maxConcurrentJobs }}
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

{{/*
True (non-empty) when the web console listens on the pod's network, with a
container port and a Service port `console`: console.enabled and
auth.enabled. Without auth agq refuses a non-loopback console, so it stays
on the pod's loopback.
*/}}
{{- define "agq.consoleExposed" -}}
{{- if and .Values.console.enabled .Values.auth.enabled }}true{{ end }}
{{- end }}

{{/*
True (non-empty) in the clustered mode: store.type=postgres, the server a
Deployment of any number of replicas sharing one PostgreSQL database.
Empty with store.type=sqlite: one StatefulSet pod on its SQLite file.
*/}}
{{- define "agq.clustered" -}}
{{- if eq (.Values.store.type | default "sqlite") "postgres" }}true{{ end }}
{{- end }}

{{/*
Name of the Secret holding the PostgreSQL URL: store.postgres.existingSecret,
or the one the chart renders from store.postgres.url.
*/}}
{{- define "agq.storeSecretName" -}}
{{- if .Values.store.postgres.existingSecret }}
{{- .Values.store.postgres.existingSecret }}
{{- else }}
{{- printf "%s-store" (include "agq.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Checks the store values; renders nothing. Fails on a PostgreSQL store
without a URL (or with two), a URL agq would not take, store.postgres
values with store.type=sqlite, and more than one replica on SQLite. The URL
itself never appears in a message: it may hold a password.
*/}}
{{- define "agq.validateStore" -}}
{{- $pg := .Values.store.postgres }}
{{- $replicas := .Values.server.replicas }}
{{- if include "agq.clustered" . }}
{{- if and $pg.url $pg.existingSecret }}
{{- fail "store.postgres.url and store.postgres.existingSecret are alternatives: set one, not both (the chart renders a Secret from url; existingSecret names a Secret you manage)." }}
{{- end }}
{{- if not (or $pg.url $pg.existingSecret) }}
{{- fail (printf "store.type=postgres needs the database URL: set store.postgres.existingSecret to a Secret holding it under store.postgres.secretKey (%s), e.g. CloudNativePG's <cluster>-app with --set store.postgres.secretKey=uri, or set store.postgres.url (postgres://user:password@host:5432/db) and the chart renders a Secret from it." $pg.secretKey) }}
{{- end }}
{{- if and $pg.url (not (or (hasPrefix "postgres://" $pg.url) (hasPrefix "postgresql://" $pg.url) (hasPrefix "host=" $pg.url))) }}
{{- fail "store.postgres.url must start with postgres://, postgresql:// or host= (a PostgreSQL connection URL or key=value string)." }}
{{- end }}
{{- else }}
{{- if or $pg.url $pg.existingSecret }}
{{- fail "store.postgres.url or store.postgres.existingSecret is set but store.type is sqlite: set store.type=postgres to run on PostgreSQL, or clear both to stay on SQLite." }}
{{- end }}
{{- if and (not (kindIs "invalid" $replicas)) (gt (int $replicas) 1) }}
{{- fail (printf "server.replicas=%d needs store.type=postgres: on SQLite the server is one StatefulSet pod, the only writer of its database file. Set server.replicas to 1 (or leave it empty), or run the clustered mode on PostgreSQL (store.type=postgres, docs/deployment.md)." (int $replicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Server replicas: server.replicas, or when empty 1 on SQLite and 3 on
PostgreSQL.
*/}}
{{- define "agq.serverReplicas" -}}
{{- if not (kindIs "invalid" .Values.server.replicas) }}
{{- int .Values.server.replicas }}
{{- else if include "agq.clustered" . }}3
{{- else }}1
{{- end }}
{{- end }}

{{/*
PromQL aggregation of the depth gauges (agq_queue_length, agq_workers)
across the server's scrape targets. Each replica of the clustered mode
reports the depths of the one shared database, so its replicas' series are
the same number: max, not sum. One SQLite server has one series: sum, as
always.
*/}}
{{- define "agq.depthAgg" -}}
{{- if include "agq.clustered" . }}max{{ else }}sum{{ end }}
{{- end }}
