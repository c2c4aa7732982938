{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{/* The name of one component's objects: <fullname>-gateway, -draft, -verify, -redis. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag) }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The pools that run Tandem code, with what differs between them. */}}
{{- define "tandem.pools" -}}
gateway: {module: gateway}
draft: {module: draft_worker}
verify: {module: verify_worker}
{{- end }}

{{/* Seconds Kubernetes waits after SIGTERM: the preStop sleep, the 0.5 s NOT_SERVING notice and
the drain, plus a margin (a worker also leaves the Redis registry before it drains). */}}
{{- define "tandem.terminationGracePeriodSeconds" -}}
{{- add (int .Values.preStopSleepSeconds) (ceil (addf .Values.graceSeconds 0.5) | int) (int .Values.terminationGraceMarginSeconds) }}
{{- end }}

{{/* The target model: the gateway's TANDEM_MODEL, the verify pool's model, and the draft pool's
TANDEM_TARGET_MODEL. The registry matches these names as strings, so they are one value. */}}
{{- define "tandem.targetModel" -}}
{{- $v := .Values }}
{{- if and (eq $v.gateway.workerDiscovery "redis") $v.gateway.model (ne $v.gateway.model $v.verify.model) }}
{{- fail (printf "gateway.model %q must be spelled exactly as verify.model %q: with redis discovery the gateway only uses workers registered under its own model name (leave gateway.model empty)" $v.gateway.model $v.verify.model) }}
{{- end }}
{{- default $v.verify.model $v.gateway.model }}
{{- end }}

{{/* The pool's weight dtype: its own, else bfloat16 on a GPU and, on the CPU, bfloat16 for verify
(docs/benchmarks.md, "The target's precision") and int8 for draft. int8 and int4 run on the CPU
only (int4 where it has AVX512-VNNI or AVX2) and float16 on a GPU only; the worker refuses them elsewhere. */}}
{{- define "tandem.dtype" -}}
{{- $device := include "tandem.device" . }}
{{- $dtype := .pool.dtype }}
{{- if not $dtype }}
{{- $dtype = ternary (ternary "bfloat16" "int8" (eq .component "verify")) "bfloat16" (eq $device "cpu") }}
{{- end }}
{{- if and (has $dtype (list "int8" "int4")) (ne $device "cpu") }}
{{- fail (printf "%s.dtype %s runs on the CPU only, and this pool's device is %s: use bfloat16" .component $dtype $device) }}
{{- end }}
{{- if and (eq $dtype "float16") (eq $device "cpu") }}
{{- fail (printf "%s.dtype float16 runs on a GPU only, and this pool's device is cpu: use bfloat16 or int8" .component) }}
{{- end }}
{{- $dtype }}
{{- end }}

{{/* torch device: the pool's own setting, else cuda when it has GPUs. */}}
{{- define "tandem.device" -}}
{{- if .pool.device }}{{ .pool.device }}{{ else if gt (int .pool.gpu.count) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* Models an init container fetches for a pool (space separated). */}}
{{- define "tandem.models" -}}
{{- $v := .root.Values }}
{{- $models := list }}
{{- if eq .component "gateway" }}
{{- $models = append $models (include "tandem.targetModel" .root) }}
{{- else if eq .component "verify" }}
{{- $models = append $models $v.verify.model }}
{{- else if and $v.draft.model (ne $v.draft.model "none") }}
{{- /* the target too: the draft checks that their vocabularies match before it starts */}}
{{- $models = list $v.draft.model (include "tandem.targetModel" .root) }}
{{- end }}
{{- join " " (uniq $models) }}
{{- end }}

{{/* Redis: bundled, an external URL in the chart's Secret, or an existing Secret. */}}
{{- define "tandem.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if and $r.enabled (or $r.external.url $r.external.existingSecret) }}
{{- fail "redis: set redis.enabled=false when using redis.external" }}
{{- end }}
{{- if $r.enabled }}
- name: REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "tandem.componentName" (dict "root" . "component" "redis")) | quote }}
{{- else if or $r.external.url $r.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ default (include "tandem.componentName" (dict "root" . "component" "redis")) $r.external.existingSecret }}
      key: {{ $r.external.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Environment shared by every Tandem container of a pool. */}}
{{- define "tandem.commonEnv" -}}
{{- $v := .root.Values }}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: HOME
  value: /tmp
- name: TANDEM_CACHE_DIR
  value: {{ $v.models.cacheDir | quote }}
- name: TANDEM_HOST
  value: "0.0.0.0"
- name: TANDEM_PORT
  value: {{ .pool.port | quote }}
- name: TANDEM_LOG_LEVEL
  value: {{ $v.logLevel | quote }}
- name: TANDEM_GRACE_SECONDS
  value: {{ $v.graceSeconds | quote }}
{{- if $v.metrics.enabled }}
- name: TANDEM_METRICS_PORT
  value: {{ $v.metrics.port | quote }}
{{- end }}
{{- if $v.tls.enabled }}
- name: TANDEM_TLS_CERT_FILE
  value: /etc/tandem/tls/tls.crt
- name: TANDEM_TLS_KEY_FILE
  value: /etc/tandem/tls/tls.key
- name: TANDEM_TLS_CA_FILE
  value: /etc/tandem/tls/ca.crt
- name: TANDEM_TLS_SERVER_NAME
  value: {{ $v.tls.serverName | quote }}
- name: TANDEM_HEALTH_PORT
  value: {{ $v.tls.healthPort | quote }}
{{- if and (eq .component "gateway") $v.tls.publicSecretName }}
- name: TANDEM_PUBLIC_TLS_CERT_FILE
  value: /etc/tandem/public-tls/tls.crt
- name: TANDEM_PUBLIC_TLS_KEY_FILE
  value: /etc/tandem/public-tls/tls.key
{{- end }}
{{- else }}
- name: TANDEM_INSECURE
  value: "true"
{{- end }}
{{- if and (eq .component "gateway") $v.auth.existingSecret }}
- name: TANDEM_AUTH_TOKENS_FILE
  value: {{ printf "/etc/tandem/auth/%s" $v.auth.secretKey | quote }}
{{- end }}
{{- include "tandem.redisEnv" .root }}
{{- if $v.otel.enabled }}
- name: OTEL_TRACES_EXPORTER
  value: "otlp"
- name: OTEL_SERVICE_NAME
  value: {{ printf "tandem-%s" .component | quote }}
{{- with $v.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $v.otel.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $v.otel.tracesSampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $v.otel.tracesSamplerArg | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)" .root.Release.Name }}{{ with $v.otel.resourceAttributes }},{{ . }}{{ end }}
{{- with $v.otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment of one pool's service: its flags' TANDEM_* twins. */}}
{{- define "tandem.poolEnv" -}}
{{- $v := .root.Values }}
{{- if eq .component "gateway" }}
- name: TANDEM_MODEL
  value: {{ include "tandem.targetModel" .root | quote }}
{{- if eq $v.gateway.workerDiscovery "static" }}
- name: TANDEM_VERIFY_WORKERS
  value: {{ printf "%s:%d" (include "tandem.componentName" (dict "root" .root "component" "verify")) (int $v.verify.port) | quote }}
- name: TANDEM_DRAFT_WORKERS
  value: {{ printf "%s:%d" (include "tandem.componentName" (dict "root" .root "component" "draft")) (int $v.draft.port) | quote }}
{{- else if not (or $v.redis.enabled $v.redis.external.url $v.redis.external.existingSecret) }}
{{- fail "gateway.workerDiscovery=redis needs a Redis: redis.enabled or redis.external" }}
{{- else }}
# only the verify pool's precision: a worker of another (a release before a dtype change) is not used
- name: TANDEM_VERIFY_DTYPE
  value: {{ include "tandem.dtype" (dict "root" .root "component" "verify" "pool" $v.verify) | quote }}
{{- end }}
- name: TANDEM_MAX_MIGRATIONS
  value: {{ $v.gateway.maxMigrations | quote }}
- name: TANDEM_SESSION_TTL_SECONDS
  value: {{ $v.gateway.sessionTtlSeconds | quote }}
- name: TANDEM_DEFAULT_DRAFT_METHOD
  value: {{ $v.gateway.defaultDraftMethod | quote }}
- name: TANDEM_DEFAULT_SPECULATIVE_TOKENS
  value: {{ $v.gateway.defaultSpeculativeTokens | quote }}
- name: TANDEM_MAX_SPECULATIVE_TOKENS
  value: {{ $v.gateway.maxSpeculativeTokens | quote }}
- name: TANDEM_DEFAULT_MAX_NEW_TOKENS
  value: {{ $v.gateway.defaultMaxNewTokens | quote }}
- name: TANDEM_MAX_NEW_TOKENS
  value: {{ $v.gateway.maxNewTokens | quote }}
{{- else }}
# the registry entry: the gateway dials this pod directly, not the pool's Service
- name: TANDEM_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%d" (int .pool.port) | quote }}
- name: TANDEM_HEARTBEAT_SECONDS
  value: {{ $v.heartbeatSeconds | quote }}
- name: TANDEM_MODEL
  value: {{ .pool.model | quote }}
- name: TANDEM_DEVICE
  value: {{ include "tandem.device" . | quote }}
- name: TANDEM_DTYPE
  value: {{ include "tandem.dtype" . | quote }}
- name: TANDEM_CALIBRATE
  value: {{ .pool.calibrate | quote }}
- name: TANDEM_THREADS
  value: {{ .pool.threads | quote }}
{{- if eq .component "verify" }}
- name: TANDEM_MAX_PROPOSAL
  value: {{ .pool.maxProposal | quote }}
- name: TANDEM_KV_BUDGET_TOKENS
  value: {{ .pool.kvBudgetTokens | int64 | quote }}
- name: TANDEM_MAX_BATCH_TOKENS
  value: {{ .pool.maxBatchTokens | int64 | quote }}
- name: TANDEM_ADMISSION_TIMEOUT
  value: {{ .pool.admissionTimeout | quote }}
- name: TANDEM_PACKED_GEMM
  value: {{ .pool.packedGemm | quote }}
- name: TANDEM_HEAD
  value: {{ .pool.head | default "" | quote }}
- name: TANDEM_HEAD_SHA256
  value: {{ .pool.headSha256 | default "" | quote }}
{{- else }}
# the name it registers under: without it the gateway would use this pod for n-gram drafting only
- name: TANDEM_TARGET_MODEL
  value: {{ include "tandem.targetModel" .root | quote }}
- name: TANDEM_NGRAM_MAX
  value: {{ .pool.ngramMax | quote }}
- name: TANDEM_PIPELINE
  value: {{ .pool.pipeline | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Container resources with the pool's GPUs added to requests and limits. */}}
{{- define "tandem.resources" -}}
{{- $res := deepCopy (default dict .pool.resources) }}
{{- if gt (int (default 0 (dig "gpu" "count" 0 .pool))) 0 }}
{{- $gpu := dict .pool.gpu.resourceName (int .pool.gpu.count) }}
{{- $_ := set $res "limits" (merge $gpu (default dict $res.limits)) }}
{{- $_ := set $res "requests" (merge (deepCopy $gpu) (default dict $res.requests)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* The pool's affinity: its own, or anti-affinity spreading its replicas over nodes. */}}
{{- define "tandem.affinity" -}}
{{- if .pool.affinity }}
{{- toYaml .pool.affinity }}
{{- else if eq .pool.antiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "tandem.selectorLabels" . | nindent 10 }}
{{- else if eq .pool.antiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "tandem.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}

{{/* A native gRPC probe on the pool's port; the health service answers for "" (the server).
With TLS on, on the plaintext health-only port instead: kubelet's gRPC probes cannot speak TLS. */}}
{{- define "tandem.grpcProbe" -}}
grpc:
  port: {{ .port }}
{{ toYaml .probe }}
{{- end }}

{{/* Secret volumes for TLS and tokens: mounted as folders (not subPath), so a rotated Secret
reaches the pod and the gateway re-reads its tokens without a restart. */}}
{{- define "tandem.secretMounts" -}}
{{- $v := .root.Values }}
{{- if $v.tls.enabled }}
- {name: tls, mountPath: /etc/tandem/tls, readOnly: true}
{{- if and (eq .component "gateway") $v.tls.publicSecretName }}
- {name: public-tls, mountPath: /etc/tandem/public-tls, readOnly: true}
{{- end }}
{{- end }}
{{- if and (eq .component "gateway") $v.auth.existingSecret }}
- {name: auth, mountPath: /etc/tandem/auth, readOnly: true}
{{- end }}
{{- end }}

{{- define "tandem.secretVolumes" -}}
{{- $v := .root.Values }}
{{- if $v.tls.enabled }}
- name: tls
  secret: {secretName: {{ required "tls.secretName is required with tls.enabled" $v.tls.secretName | quote }}}
{{- if and (eq .component "gateway") $v.tls.publicSecretName }}
- name: public-tls
  secret: {secretName: {{ $v.tls.publicSecretName | quote }}}
{{- end }}
{{- end }}
{{- if and (eq .component "gateway") $v.auth.existingSecret }}
- name: auth
  secret: {secretName: {{ $v.auth.existingSecret | quote }}}
{{- end }}
{{- end }}
