{{/*
The CSI driver name. It is part of the binary's contract (--driver-name), the CSIDriver object,
every StorageClass's provisioner and the kubelet plugin paths, so it is not a value.
*/}}
{{- define "s3csi.driverName" -}}
s3csi.dev
{{- end }}

{{- define "s3csi.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Object name prefix: the release name, or "<release>-<chart>" when the release name does not
contain the chart name.
*/}}
{{- define "s3csi.fullname" -}}
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

{{- define "s3csi.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "s3csi.labels" -}}
helm.sh/chart: {{ include "s3csi.chart" . }}
app.kubernetes.io/name: {{ include "s3csi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels; call with (dict "ctx" $ "component" "node"). */}}
{{- define "s3csi.selectorLabels" -}}
app.kubernetes.io/name: {{ include "s3csi.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "s3csi.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "repository:tag" of an image block. */}}
{{- define "s3csi.sidecarImage" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{- define "s3csi.nodeServiceAccountName" -}}
{{- default (printf "%s-node" (include "s3csi.fullname" .)) .Values.serviceAccount.node.name }}
{{- end }}

{{- define "s3csi.controllerServiceAccountName" -}}
{{- default (printf "%s-controller" (include "s3csi.fullname" .)) .Values.serviceAccount.controller.name }}
{{- end }}

{{- define "s3csi.mounterServiceAccountName" -}}
{{- default (printf "%s-mounter" (include "s3csi.fullname" .)) .Values.mounter.serviceAccount.name }}
{{- end }}

{{/* True ("true") when mounters run as Pods (mounter.mode: pod), else "". */}}
{{- define "s3csi.podMounters" -}}
{{- if eq .Values.mounter.mode "pod" }}true{{ end }}
{{- end }}

{{/*
The path of the s3csi binary in the image (the Containerfile's ENTRYPOINT), which mounter Pods
run as their command.
*/}}
{{- define "s3csi.binaryPath" -}}
/usr/local/bin/s3csi
{{- end }}

{{/* "repository:tag" of the mounter Pods; empty mounter.image fields take the driver's. */}}
{{- define "s3csi.mounterImage" -}}
{{- $m := .Values.mounter.image }}
{{- printf "%s:%s" (default .Values.image.repository $m.repository) (default (default .Chart.AppVersion .Values.image.tag) $m.tag) }}
{{- end }}

{{- define "s3csi.mounterImagePullPolicy" -}}
{{- default .Values.image.pullPolicy .Values.mounter.image.pullPolicy }}
{{- end }}

{{/*
mounter.resources as the JSON ResourceRequirements that --mounter-resources parses. Quantities
written as YAML numbers become strings ("1", "0.5"): Kubernetes quantities are strings in JSON.
*/}}
{{- define "s3csi.mounterResourcesJson" -}}
{{- $out := dict }}
{{- range $section, $value := .Values.mounter.resources }}
{{- if has $section (list "requests" "limits") }}
{{- $quantities := dict }}
{{- range $name, $q := $value }}
{{- if kindIs "string" $q }}
{{- $_ := set $quantities $name $q }}
{{- else if eq (float64 (int64 $q)) (float64 $q) }}
{{- $_ := set $quantities $name (toString (int64 $q)) }}
{{- else }}
{{- $_ := set $quantities $name (toString $q) }}
{{- end }}
{{- end }}
{{- $_ := set $out $section $quantities }}
{{- else }}
{{- $_ := set $out $section $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Name of the static-credentials Secret, or "" when the SDK's default chain is used. */}}
{{- define "s3csi.awsSecretName" -}}
{{- if .Values.awsCredentials.create }}
{{- default (printf "%s-aws-credentials" (include "s3csi.fullname" .)) .Values.awsCredentials.secretName }}
{{- else }}
{{- .Values.awsCredentials.secretName }}
{{- end }}
{{- end }}

{{/* The kubelet directory without a trailing slash. */}}
{{- define "s3csi.kubeletPath" -}}
{{- .Values.node.kubeletPath | trimSuffix "/" }}
{{- end }}

{{/* Host directory of the node plugin's socket: <kubeletPath>/plugins/<driver>. */}}
{{- define "s3csi.pluginDir" -}}
{{- printf "%s/plugins/%s" (include "s3csi.kubeletPath" .) (include "s3csi.driverName" .) }}
{{- end }}

{{/* Environment shared by the node and controller s3csi containers. */}}
{{- define "s3csi.awsEnv" -}}
{{- with .Values.s3.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with include "s3csi.awsSecretName" . }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: accessKeyId
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: secretAccessKey
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: sessionToken
      optional: true
{{- end }}
{{- end }}

{{/*
Prometheus metrics (metrics.*) of the s3csi container; call with (dict "ctx" $ "healthPort" N),
N being the component's livenessprobe port, which the metrics port must not take.
*/}}
{{- define "s3csi.metricsArgs" -}}
{{- if .ctx.Values.metrics.enabled }}
{{- if eq (int .ctx.Values.metrics.port) (int .healthPort) }}
{{- fail (printf "metrics.port %v is the healthPort of the livenessprobe sidecar; choose another" .ctx.Values.metrics.port) }}
{{- end }}
- --metrics-address=:{{ .ctx.Values.metrics.port }}
{{- end }}
{{- end }}

{{- define "s3csi.metricsPort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations of the node and controller pods, when asked for. */}}
{{- define "s3csi.metricsAnnotations" -}}
{{- if and .Values.metrics.enabled .Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
True ("true") when mounter Pods run in the host's network namespace, else "":
mounter.hostNetwork when it is set (true or false), node.hostNetwork when it is null.
*/}}
{{- define "s3csi.mounterHostNetwork" -}}
{{- $hostNetwork := .Values.node.hostNetwork }}
{{- if kindIs "bool" .Values.mounter.hostNetwork }}
{{- $hostNetwork = .Values.mounter.hostNetwork }}
{{- end }}
{{- if $hostNetwork }}true{{ end }}
{{- end }}

{{/*
The livenessprobe sidecar's --http-endpoint; call with (dict "hostNetwork" BOOL "port" N).
On the host's network it listens on 127.0.0.1 only (the probe then names host 127.0.0.1),
elsewhere on every interface of the pod's own network namespace, where the kubelet probes
the pod IP.
*/}}
{{- define "s3csi.healthEndpoint" -}}
{{- if .hostNetwork }}127.0.0.1:{{ .port }}{{ else }}:{{ .port }}{{ end }}
{{- end }}

{{/*
The cluster's Kubernetes version as Helm sees it (the API server's at install, --kube-version
for `helm template`), for the fields that depend on it.
*/}}
{{- define "s3csi.kubeVersion" -}}
{{- .Capabilities.KubeVersion.Version }}
{{- end }}

{{/*
The CSIDriver's fsGroupPolicy. The node plugin advertises VOLUME_MOUNT_GROUP, so a kubelet
that delegates fsGroup to CSI drivers (DelegateFSGroupToCSIDriver: GA in 1.26) passes the
pod's fsGroup in NodePublishVolume, s3csi makes it the mount's group, and the kubelet changes
no file itself ("File" only says fsGroup applies to every access mode). An older kubelet, which
does not delegate, would with "File" chown and chmod every object of the bucket itself, and
fail the mount when that fails: "None" there (use the gid= mount option instead).
*/}}
{{- define "s3csi.fsGroupPolicy" -}}
{{- if semverCompare ">=1.26.0-0" (include "s3csi.kubeVersion" .) }}File{{ else }}None{{ end }}
{{- end }}
