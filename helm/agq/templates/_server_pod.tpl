{{/*
The server pod (template metadata and spec), shared by the StatefulSet of
store.type=sqlite and the Deployment of store.type=postgres. On SQLite the
database lives on the /data volume; on PostgreSQL the pod keeps nothing on
disk and reads the database URL (AGQ_STORE) from a Secret.
*/}}
{{- define "agq.serverPodTemplate" -}}
{{- $clustered := include "agq.clustered" . -}}
metadata:
  labels:
    {{- include "agq.labels" . | nindent 4 }}
    {{- include "agq.serverSelectorLabels" . | nindent 4 }}
    {{- with .Values.server.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $ownSecret := and .Values.auth.enabled (not .Values.auth.existingSecret) }}
  {{- $ownStoreSecret := and $clustered (not .Values.store.postgres.existingSecret) }}
  {{- if or $ownSecret $ownStoreSecret .Values.server.podAnnotations }}
  annotations:
    {{- if $ownSecret }}
    # Restart the server when the chart's auth file changes.
    checksum/auth: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
    {{- end }}
    {{- if $ownStoreSecret }}
    # Restart the servers when the chart's database URL changes.
    checksum/store: {{ include (print $.Template.BasePath "/store-secret.yaml") . | sha256sum }}
    {{- end }}
    {{- with .Values.server.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  serviceAccountName: {{ include "agq.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
  # No AGQ_*_PORT / AGQ_SERVICE_* variables from Services: they would
  # share the prefix of agq's own settings.
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ .Values.server.terminationGracePeriodSeconds }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.server.podSecurityContext | nindent 4 }}
  containers:
    - name: agq
      image: {{ include "agq.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - agq
        - serve
        {{- with .Values.server.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: AGQ_LISTEN
          value: "0.0.0.0:6380"
        - name: AGQ_METRICS_LISTEN
          value: "0.0.0.0:6381"
        {{- if $clustered }}
        # The shared PostgreSQL database. The URL holds a password, so it
        # comes from a Secret, never from a literal value.
        - name: AGQ_STORE
          valueFrom:
            secretKeyRef:
              name: {{ include "agq.storeSecretName" . }}
              key: {{ .Values.store.postgres.secretKey }}
        {{- else }}
        - name: AGQ_DB
          value: /data/agq.db
        {{- end }}
        - name: AGQ_HEARTBEAT_INTERVAL_SECS
          value: {{ .Values.server.heartbeatIntervalSecs | quote }}
        - name: AGQ_JOB_RETENTION_SECS
          value: {{ .Values.server.jobRetentionSecs | quote }}
        - name: AGQ_LOG_FORMAT
          value: {{ .Values.server.logFormat | quote }}
        - name: RUST_LOG
          value: {{ .Values.server.logLevel | quote }}
        {{- if .Values.auth.enabled }}
        - name: AGQ_AUTH_FILE
          value: {{ printf "%s/%s" (include "agq.authDir" .) .Values.auth.fileKey | quote }}
        {{- else }}
        # auth.enabled=false: no tokens, anyone who reaches the Service
        # may call every RPC. Insecure; for trusted networks only.
        - name: AGQ_INSECURE
          value: "true"
        {{- end }}
        {{- if not .Values.console.enabled }}
        - name: AGQ_NO_CONSOLE
          value: "true"
        {{- else if .Values.auth.enabled }}
        # The web console on its own port; every request needs a client
        # or admin token.
        - name: AGQ_CONSOLE_LISTEN
          value: "0.0.0.0:6382"
        {{- else }}
        # No tokens: the console stays on the pod's loopback (agq refuses
        # a public one), reachable only through kubectl port-forward.
        - name: AGQ_CONSOLE_LISTEN
          value: "127.0.0.1:6382"
        {{- end }}
        {{- with .Values.server.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: 6380
          protocol: TCP
        - name: metrics
          containerPort: 6381
          protocol: TCP
        {{- if include "agq.consoleExposed" . }}
        - name: console
          containerPort: 6382
          protocol: TCP
        {{- end }}
      startupProbe:
        {{- toYaml .Values.server.startupProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml .Values.server.livenessProbe | nindent 8 }}
      readinessProbe:
        {{- toYaml .Values.server.readinessProbe | nindent 8 }}
      resources:
        {{- toYaml .Values.server.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.server.securityContext | nindent 8 }}
      volumeMounts:
        {{- if not $clustered }}
        - name: data
          mountPath: /data
        {{- end }}
        - name: tmp
          mountPath: /tmp
        {{- if .Values.auth.enabled }}
        - name: auth
          mountPath: {{ include "agq.authDir" . }}
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if .Values.auth.enabled }}
    - name: auth
      secret:
        secretName: {{ include "agq.secretName" . }}
        defaultMode: 0440
        items:
          - key: {{ .Values.auth.fileKey }}
            path: {{ .Values.auth.fileKey }}
    {{- end }}
    {{- if not $clustered }}
    {{- if .Values.persistence.existingClaim }}
    - name: data
      persistentVolumeClaim:
        claimName: {{ .Values.persistence.existingClaim }}
    {{- else if not .Values.persistence.enabled }}
    - name: data
      emptyDir: {}
    {{- end }}
    {{- end }}
  {{- with .Values.server.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.server.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- else }}
  {{- if $clustered }}
  # Spread the replicas over nodes where the scheduler can, so that one
  # node going down takes at most one of them (server.affinity replaces
  # this).
  affinity:
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "agq.serverSelectorLabels" . | nindent 16 }}
  {{- end }}
  {{- end }}
  {{- with .Values.server.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
