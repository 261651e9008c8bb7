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
