{{/*
The prefix of every object's name. Release `castellan` gives the names the plain
manifests have always had (castellan-operator, castellan-agent, castellan-pod-labels…);
another release name keeps a second installation's cluster-scoped objects apart.
*/}}
{{- define "castellan.prefix" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "castellan.operator" -}}{{ include "castellan.prefix" . }}-operator{{- end -}}
{{- define "castellan.agent" -}}{{ include "castellan.prefix" . }}-agent{{- end -}}

{{/* The user name a service account's requests carry (what the policies match). */}}
{{- define "castellan.operator.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "castellan.operator" . }}
{{- end -}}
{{- define "castellan.agent.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "castellan.agent" . }}
{{- end -}}

{{- define "castellan.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
Labels of every object. Not app.kubernetes.io/managed-by: Castellan's own objects carry
managed-by=castellan, and its watches select on it.
*/}}
{{- define "castellan.labels" -}}
app.kubernetes.io/part-of: castellan
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
