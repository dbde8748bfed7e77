{{/* Chart name, truncated to 63 characters. */}}
{{- define "inferscale.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name already holds the chart name. */}}
{{- define "inferscale.fullname" -}}
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

{{- define "inferscale.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inferscale.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "inferscale.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "inferscale.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "inferscale.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Secret (name) holding the admin key under `admin-key`. */}}
{{- define "inferscale.adminSecret" -}}
{{- .Values.admin.existingSecret | default (printf "%s-admin" (include "inferscale.fullname" .)) }}
{{- end }}

{{- define "inferscale.redisHost" -}}
{{ include "inferscale.fullname" . }}-redis
{{- end }}

{{/* Secret (name) holding the in-release Redis password under `redis-password`. */}}
{{- define "inferscale.redisSecret" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "inferscale.fullname" .)) }}
{{- end }}

{{- define "inferscale.stateClaim" -}}
{{- .Values.state.existingClaim | default (printf "%s-state" (include "inferscale.fullname" .)) }}
{{- end }}

{{/* Environment of every inferscale container: secrets are referenced, never inlined. */}}
{{- define "inferscale.env" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "inferscale.redisSecret" . }}, key: redis-password}
- name: INFERSCALE_REDIS__URL
  value: "redis://:$(REDIS_PASSWORD)@{{ include "inferscale.redisHost" . }}:6379/0"
{{- else }}
- name: INFERSCALE_REDIS__URL
  valueFrom:
    secretKeyRef: {name: {{ required "redis.external.urlSecret is required when redis.enabled is false" .Values.redis.external.urlSecret }}, key: redis-url}
{{- end }}
- name: INFERSCALE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "inferscale.adminSecret" . }}, key: admin-key}
- name: INFERSCALE_STATE_DIR
  value: {{ .Values.state.mountPath | quote }}
- name: INFERSCALE_SYSTEM_PROMPT
  value: {{ .Values.serve.systemPrompt | quote }}
{{- $fast := eq .Values.serve.proxy "haproxy" }}
- name: INFERSCALE_SERVE__PROXY
  value: {{ .Values.serve.proxy | quote }}
- name: RAY_SERVE_ENABLE_HA_PROXY  # read by Ray when it starts on each node: the same on head and workers
  value: {{ ternary "1" "0" $fast | quote }}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" $fast | quote }}
{{- end }}

{{- define "inferscale.volumeMounts" -}}
- name: state
  mountPath: {{ .Values.state.mountPath }}
{{- end }}

{{- define "inferscale.volumes" -}}
- name: state
  persistentVolumeClaim:
    claimName: {{ include "inferscale.stateClaim" . }}
{{- end }}

{{/* The Serve application: the project's builder and its args (AppArgs); no secret in it. */}}
{{- define "inferscale.serveConfig" -}}
{{- $llm := .Values.serve.llm -}}
{{- $engine := merge (dict "dtype" $llm.dtype) $llm.engineKwargs -}}
applications:
  - name: inferscale
    import_path: deployments.ray_serve.app:build_app
    route_prefix: /
    args:
      state_dir: {{ .Values.state.mountPath | quote }}
      system_prompt: {{ .Values.serve.systemPrompt | quote }}
      encoding_window: {{ .Values.serve.encodingWindow }}
      settings:
        residency:
          {{- $residency := .Values.serve.residency }}
          {{- with $residency.memoryKvBytes }}
          memory_kv_bytes: {{ . | int64 }}
          {{- end }}
          {{- with $residency.nodeKvBytes }}
          node_kv_bytes: {{ . | int64 }}
          {{- end }}
          half_life_s: {{ $residency.halfLifeSeconds }}
          reencode_after_uses: {{ $residency.reencodeAfterUses }}
          min_resident_s: {{ $residency.minResidentSeconds }}
      llm:
        {{- with $llm.model }}
        model: {{ . | quote }}
        {{- end }}
        dtype: {{ $llm.dtype }}
        served_name: {{ $llm.servedName | quote }}
        engine_kwargs:
          {{- toYaml $engine | nindent 10 }}
        device_cache_bytes: {{ $llm.deviceCacheBytes | int64 }}
        {{- with $llm.deviceTenantBytes }}
        device_tenant_bytes: {{ . | int64 }}
        {{- end }}
        on_load_failure: {{ $llm.onLoadFailure }}
        record_dtype: {{ $llm.recordDtype }}
        record_precision: {{ $llm.recordPrecision }}
        arena_precision: {{ $llm.arenaPrecision }}
        {{- if $llm.offload.enabled }}
        tiers:
          disk_cache_dir: /var/cache/inferscale/tiers
          host_cache_bytes: {{ $llm.offload.hostCacheBytes | int64 }}
          {{- with $llm.offload.diskCacheBytes }}
          disk_cache_bytes: {{ . | int64 }}
          {{- end }}
          compress_lower: true
          pin_host_at_start: {{ $llm.offload.pinHostAtStart }}
        {{- end }}
        autoscaling_config:
          {{- toYaml $llm.autoscaling | nindent 10 }}
        max_ongoing_requests: {{ $llm.maxOngoingRequests }}
        ray_actor_options:
          num_cpus: 1
          num_gpus: {{ $llm.gpusPerReplica }}
      ingress:
        num_replicas: {{ .Values.serve.ingress.replicas }}
        rate_per_s: {{ .Values.serve.ingress.ratePerSecond }}
        burst: {{ .Values.serve.ingress.burst }}
        max_body_bytes: {{ .Values.serve.ingress.maxBodyBytes | int64 }}
        default_recompute: {{ .Values.serve.ingress.defaultRecompute | int }}
        chat_transport: {{ .Values.serve.ingress.chatTransport }}
        embed_device: {{ .Values.serve.ingress.embedDevice }}
        ray_actor_options:
          num_cpus: 1
          {{- if eq .Values.serve.ingress.embedDevice "cuda" }}
          {{- if ge (float64 $llm.gpusPerReplica) (float64 .Values.gpuWorkers.gpus) }}
          {{- fail "serve.ingress.embedDevice=cuda needs GPU room beside the LLM replicas: set serve.llm.gpusPerReplica below gpuWorkers.gpus (e.g. 0.9 with one GPU a worker)" }}
          {{- end }}
          num_gpus: {{ .Values.serve.ingress.gpuShare }}
          {{- end }}
{{- end }}

{{/* One container spec for Ray pods; args: dict with ctx, name, resources, probes. */}}
{{- define "inferscale.rayContainer" -}}
{{- $ctx := .ctx -}}
- name: {{ .name }}
  image: {{ include "inferscale.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  env:
    {{- include "inferscale.env" $ctx | nindent 4 }}
  volumeMounts:
    {{- include "inferscale.volumeMounts" $ctx | nindent 4 }}
    {{- with .extraMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  {{- with .ports }}
  ports:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
