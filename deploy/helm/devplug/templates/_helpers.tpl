{{/*
Chart name, truncated to 63 characters (the DNS label limit).
*/}}
{{- define "devplug.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the release name, plus the chart name unless the release name already has it.
*/}}
{{- define "devplug.fullname" -}}
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
Chart label value: name-version.
*/}}
{{- define "devplug.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "devplug.labels" -}}
helm.sh/chart: {{ include "devplug.chart" . }}
{{ include "devplug.selectorLabels" . }}
app.kubernetes.io/component: device-plugin
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels (immutable once the DaemonSet exists).
*/}}
{{- define "devplug.selectorLabels" -}}
app.kubernetes.io/name: {{ include "devplug.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Service account name. With serviceAccount.create false the account is the operator's own and
must be named: the roles would otherwise be bound to the namespace's "default" account, which
every other pod of the namespace runs as.
*/}}
{{- define "devplug.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "devplug.fullname" .) .Values.serviceAccount.name }}
{{- else if .Values.serviceAccount.name }}
{{- .Values.serviceAccount.name }}
{{- else }}
{{- fail "serviceAccount.name is required when serviceAccount.create is false: name the existing ServiceAccount devplug runs as (the chart binds its roles to it; without a name they would go to the namespace's \"default\" account, which every other pod there uses)" }}
{{- end }}
{{- end }}

{{/*
Container image: repository:tag, the tag defaulting to the chart's appVersion.
*/}}
{{- define "devplug.image" -}}
{{- printf "%s:%s%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) (include "devplug.imageSuffix" .) }}
{{- end }}

{{/*
"-gpu" for NVIDIA GPU nodes: the image whose binaries are built for glibc, so that they can load
the driver's libnvidia-ml.so.1 (the main image's static binaries cannot load any library). Not
twice: an image.tag that already ends in -gpu is kept.
*/}}
{{- define "devplug.imageSuffix" -}}
{{- if and (eq (toString .Values.gpu.vendor) "nvidia") (not (hasSuffix "-gpu" (toString .Values.image.tag))) }}-gpu{{ end }}
{{- end }}

{{/*
devplug's config file: .Values.config, except that with gpu.vendor set its resources are the
vendor's GPU resource and gpu.extraResources. Everything that looks at the resources reads this.
*/}}
{{- define "devplug.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- if not (hasKey $config "refused_pods") -}}
{{- $_ := set $config "refused_pods" (include "devplug.refusedPods" .) -}}
{{- end -}}
{{- if not (hasKey $config "node_labels") -}}
{{- $_ := set $config "node_labels" (dict "mode" (include "devplug.nodeLabels" .)) -}}
{{- end -}}
{{- $vendor := toString .Values.gpu.vendor -}}
{{- if $vendor -}}
{{- $backends := dict "nvidia" "nvidia" "amdgpu" "amdgpu" "intel-gpu" "intel_gpu" -}}
{{- $intel := printf "gpu.intel.com/%s" (default "i915" (toString (get (default dict .Values.gpu.settings) "driver"))) -}}
{{- $names := dict "nvidia" "nvidia.com/gpu" "amdgpu" "amd.com/gpu" "intel-gpu" $intel -}}
{{- if not (hasKey $backends $vendor) -}}
{{- fail (printf "gpu.vendor: %q is not a GPU vendor devplug serves: use nvidia, amdgpu or intel-gpu (or \"\" for none)" $vendor) -}}
{{- end -}}
{{- $settings := dict "cdi_dir" .Values.dra.cdiDir -}}
{{- if eq $vendor "nvidia" -}}
{{- $_ := set $settings "driver_roots" (list "/driver-root") -}}
{{- $_ := set $settings "host_driver_root" .Values.gpu.driverRoot -}}
{{- end -}}
{{- $settings = mergeOverwrite $settings (deepCopy (default dict .Values.gpu.settings)) -}}
{{- $resource := dict "name" (default (get $names $vendor) .Values.gpu.resourceName) (get $backends $vendor) $settings -}}
{{- with .Values.gpu.dra }}{{ $_ := set $resource "dra" (deepCopy .) }}{{ end -}}
{{- $_ := set $config "resources" (concat (list $resource) (default list .Values.gpu.extraResources)) -}}
{{- end -}}
{{- if not (get $config "resources") -}}
{{- fail "config.resources: no resources, so this install would serve nothing. Name devplug's resources under config.resources (docs/configuration.md) or set gpu.vendor; for the demo's fake devices, install with -f deploy/helm/devplug/examples/demo-values.yaml" -}}
{{- end -}}
{{- toYaml $config -}}
{{- end }}

{{/*
The pods' node selector: .Values.nodeSelector, and with gpu.vendor set, gpu.nodeSelector when
given (the vendor's node affinity, below, is then not used).
*/}}
{{- define "devplug.nodeSelector" -}}
{{- $selector := deepCopy (default dict .Values.nodeSelector) -}}
{{- if and (toString .Values.gpu.vendor) .Values.gpu.nodeSelector -}}
{{- $selector = mergeOverwrite $selector (deepCopy .Values.gpu.nodeSelector) -}}
{{- end -}}
{{- with $selector }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/*
The labels any one of which marks a node with the vendor's GPUs (each "true"): Node Feature
Discovery's as the vendor's tooling configures it (NVIDIA's GPU operator labels PCI devices by
vendor; AMD's and Intel's NodeFeatureRules), NFD's defaults (display and 3D controller classes
with the vendor), and for NVIDIA nvidia.com/gpu.present, which GPU Feature Discovery and the GPU
operator write and an operator without NFD sets by hand. A JSON list; empty without gpu.vendor
or with gpu.nodeSelector.
*/}}
{{- define "devplug.gpuNodeLabels" -}}
{{- $vendor := toString .Values.gpu.vendor -}}
{{- $labels := dict
  "nvidia" (list "feature.node.kubernetes.io/pci-10de.present" "feature.node.kubernetes.io/pci-0300_10de.present" "feature.node.kubernetes.io/pci-0302_10de.present" "nvidia.com/gpu.present")
  "amdgpu" (list "feature.node.kubernetes.io/amd-gpu" "feature.node.kubernetes.io/pci-0300_1002.present" "feature.node.kubernetes.io/pci-0380_1002.present")
  "intel-gpu" (list "intel.feature.node.kubernetes.io/gpu" "feature.node.kubernetes.io/pci-0300_8086.present" "feature.node.kubernetes.io/pci-0380_8086.present") -}}
{{- if and $vendor (not .Values.gpu.nodeSelector) -}}
{{- get $labels $vendor | default list | toJson -}}
{{- else -}}
[]
{{- end -}}
{{- end }}

{{/*
The pods' affinity: .Values.affinity, and in GPU mode (without gpu.nodeSelector) a required node
affinity with one term per label of devplug.gpuNodeLabels: terms are ORed, so any one label
places the pods, with NFD or without it. Terms already required in .Values.affinity are
combined with each (both must hold).
*/}}
{{- define "devplug.affinity" -}}
{{- $affinity := deepCopy (default dict .Values.affinity) -}}
{{- $labels := include "devplug.gpuNodeLabels" . | fromJsonArray -}}
{{- if $labels -}}
{{- $node := default dict (get $affinity "nodeAffinity") -}}
{{- $required := default dict (get $node "requiredDuringSchedulingIgnoredDuringExecution") -}}
{{- $given := default (list (dict)) (get $required "nodeSelectorTerms") -}}
{{- $terms := list -}}
{{- range $term := $given -}}
{{- range $label := $labels -}}
{{- $expr := dict "key" $label "operator" "In" "values" (list "true") -}}
{{- $t := deepCopy $term -}}
{{- $_ := set $t "matchExpressions" (append (default list (get $t "matchExpressions")) $expr) -}}
{{- $terms = append $terms $t -}}
{{- end -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- with $affinity }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/*
"true" when the host's /dev and /sys are mounted: hostdev.enabled, or a GPU backend's resource
(from gpu.vendor or config.resources: device nodes and sysfs are how GPUs are found and watched).
*/}}
{{- define "devplug.hostDevices" -}}
{{- if .Values.hostdev.enabled }}true{{ end }}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if or .nvidia .amdgpu .intel_gpu }}true{{ end }}{{ end }}
{{- end }}

{{/*
"true" when the pods write CDI specs the container runtime reads: dra: resources, and the GPU
backends (nvidia, amdgpu, intel_gpu write a spec by default), whether from gpu.vendor or listed
in config.resources.
*/}}
{{/*
The folder of the MPS daemons of GPUs shared by capacity (the first nvidia resource with
`share:`; its `dir`, default /run/devplug/mps), mounted from the host at the same path; "" when
none is shared.
*/}}
{{- define "devplug.mpsDir" -}}
{{- $dir := "" -}}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if and (not $dir) .nvidia }}{{ if and (hasKey .nvidia "share") (not (kindIs "invalid" .nvidia.share)) }}{{ $dir = default "/run/devplug/mps" (get .nvidia.share "dir") }}{{ end }}{{ end }}{{ end -}}
{{- $dir -}}
{{- end }}

{{- define "devplug.cdi" -}}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if or .dra .nvidia .amdgpu .intel_gpu .vfio .qat .ascend .fpga }}true{{ end }}{{ end }}
{{- end }}

{{/*
Host folders under the kubelet's root dir.
*/}}
{{- define "devplug.devicePluginsDir" -}}
{{- printf "%s/device-plugins" (trimSuffix "/" .Values.kubeletDir) }}
{{- end }}

{{- define "devplug.pluginsRegistryDir" -}}
{{- printf "%s/plugins_registry" (trimSuffix "/" .Values.kubeletDir) }}
{{- end }}

{{/*
"true" when the config has an `advertise:` resource (the DaemonSet then needs NODE_NAME, a token
and RBAC on its Node); empty otherwise.
*/}}
{{- define "devplug.advertise" -}}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if .advertise }}true{{ end }}{{ end }}
{{- end }}

{{/*
"true" when the config has a `dra:` resource (served as a DRA driver: ResourceSlices, claims,
the kubelet's plugins/ folder and /var/run/cdi); empty otherwise.
*/}}
{{- define "devplug.dra" -}}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if .dra }}true{{ end }}{{ end }}
{{- end }}

{{/*
The driver names of the config's `dra:` resources, as a JSON list (for RBAC resourceNames and
the admission policies' CEL).
*/}}
{{- define "devplug.draDrivers" -}}
{{- $drivers := list }}
{{- range (include "devplug.config" . | fromYaml).resources }}
{{- if .dra }}{{ $drivers = append $drivers .dra.driver }}{{ end }}
{{- end }}
{{- $drivers | toJson }}
{{- end }}

{{/*
"true" when the pods talk to the API server (advertise: or dra: resources, node events): they
then get a token and NODE_NAME.
*/}}
{{- define "devplug.apiClient" -}}
{{- if or (include "devplug.advertise" .) (include "devplug.dra" .) .Values.nodeEvents.enabled (include "devplug.refusedPodsOn" .) (include "devplug.nodeLabelsMode" .) }}true{{ end }}
{{- end }}

{{/*
nodeLabels, checked and resolved: direct, node-feature or off (auto: direct with gpu.vendor).
*/}}
{{- define "devplug.nodeLabels" -}}
{{- $mode := toString .Values.nodeLabels -}}
{{- if not (has $mode (list "auto" "direct" "node-feature" "off")) -}}
{{- fail (printf "nodeLabels: %q is not a mode: use auto, direct, node-feature or off" $mode) -}}
{{- end -}}
{{- if eq $mode "auto" -}}
{{- $mode = ternary "direct" "off" (ne (toString .Values.gpu.vendor) "") -}}
{{- end -}}
{{- $mode -}}
{{- end }}

{{/*
The config's node_labels mode when it writes labels (direct or node-feature), else empty: the
pods then need a token, NODE_NAME, POD_NAMESPACE and the RBAC of node-labels-rbac.yaml.
*/}}
{{- define "devplug.nodeLabelsMode" -}}
{{- $config := .Values.config | default dict -}}
{{- $mode := include "devplug.nodeLabels" . -}}
{{- if hasKey $config "node_labels" -}}
{{- $mode = toString (get (get $config "node_labels" | default dict) "mode" | default "off") -}}
{{- end -}}
{{- if ne $mode "off" }}{{ $mode }}{{ end }}
{{- end }}

{{/*
refusedPods, checked: delete-replaced, report or off.
*/}}
{{- define "devplug.refusedPods" -}}
{{- $policy := toString .Values.refusedPods -}}
{{- if not (has $policy (list "delete-replaced" "report" "off")) -}}
{{- fail (printf "refusedPods: %q is not a policy: use delete-replaced, report or off" $policy) -}}
{{- end -}}
{{- $policy -}}
{{- end }}

{{/*
"true" when devplug deals with refused pods: the config's refused_pods is not off and a resource
is served as a device plugin (the kubelet refuses pods only for those; `dra:` resources without
`device_plugin: true` and `advertise:` ones are not). The pods then need a token, NODE_NAME and
the RBAC of refused-pods-rbac.yaml.
*/}}
{{- define "devplug.refusedPodsOn" -}}
{{- $config := include "devplug.config" . | fromYaml -}}
{{- $plugin := false -}}
{{- range $config.resources -}}
{{- if and (not .advertise) (or (not .dra) .dra.device_plugin) }}{{ $plugin = true }}{{ end -}}
{{- end -}}
{{- if and $plugin (ne (toString $config.refused_pods) "off") (ne (toString $config.refused_pods) "false") }}true{{ end }}
{{- end }}

{{/*
The kubelet's plugins folder: DRA drivers serve <plugins>/<driver>/dra.sock there (dra-<tag>.sock beside another instance).
*/}}
{{- define "devplug.pluginsDir" -}}
{{- printf "%s/plugins" (trimSuffix "/" .Values.kubeletDir) }}
{{- end }}

{{/*
The binary the DaemonSet runs: the full /devplug when the pods talk to the API server, else
/devplug-lite, the device-plugin-only build (no API client: less memory). Keyed on
devplug.apiClient, like the token, NODE_NAME and RBAC; a new cluster feature extends that
helper (and devplug's config::needs_cluster) and this follows.
*/}}
{{- define "devplug.binary" -}}
{{- if include "devplug.apiClient" . }}/devplug{{ else }}/devplug-lite{{ end }}
{{- end }}

{{/*
"true" when a resource registers through the kubelet's plugin watcher (registration: watcher).
*/}}
{{- define "devplug.watcher" -}}
{{- if eq (toString .Values.config.registration) "watcher" }}true{{ end }}
{{- range (include "devplug.config" . | fromYaml).resources }}{{ if eq (toString .registration) "watcher" }}true{{ end }}{{ end }}
{{- end }}

{{/*
Where watcher-route plugin sockets live on the host: outside device-plugins/, which a restarting
kubelet wipes.
*/}}
{{- define "devplug.pluginSocketDir" -}}
{{- printf "%s/plugins/devplug" (trimSuffix "/" .Values.kubeletDir) -}}
{{- end }}
