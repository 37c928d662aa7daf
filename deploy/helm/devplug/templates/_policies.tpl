{{/*
Pieces shared by the chart's ValidatingAdmissionPolicies (advertise-rbac.yaml,
node-labels-rbac.yaml, refused-pods-rbac.yaml, dra-rbac.yaml, uninstall.yaml). RBAC can grant a
verb on a kind; only an admission policy can say "this node's object" and "these fields". Each
policy matches the requests of one service account and denies with failurePolicy Fail, so a
policy that cannot be evaluated refuses rather than lets a write through. devplug checks at start
that each policy is in force (a server-side dry run of a write it must refuse) and does not run a
feature whose policy is missing (docs/install.md, "What each token may write and read").
*/}}

{{/*
The CEL variable `userNode`: the node a pod's token was issued on
(`authentication.kubernetes.io/node-name`, Kubernetes 1.32+), '' for any other token.
*/}}
{{- define "devplug.policy.userNode" -}}
- name: userNode
  expression: >-
    request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')
{{- end }}

{{/*
A CEL expression: whether label key `k` is one devplug may write. Under the GPU vendors'
prefixes, and none of the GPU operators' control labels, which select what those operators
deploy or configure (the same rule as devplug_cluster::node_labels::writable_key).
*/}}
{{- define "devplug.policy.labelKeyOk" -}}
((k.startsWith('nvidia.com/') || k.startsWith('amd.com/') || k.startsWith('gpu.intel.com/')) && !(k.startsWith('nvidia.com/gpu.deploy.') || k.startsWith('nvidia.com/mig.config') || k.startsWith('nvidia.com/vgpu.config') || k.startsWith('nvidia.com/gpu.workload.config') || k.startsWith('nvidia.com/device-plugin.config') || k.startsWith('nvidia.com/gpu-driver-upgrade') || k.startsWith('nvidia.com/cc.') || k.startsWith('nvidia.com/ofed-driver-upgrade')))
{{- end }}

{{/*
A CEL expression: the Node's status other than capacity and allocatable, and its metadata other
than labels, the same before and after (the status subresource of a Node accepts metadata
changes too).
*/}}
{{- define "devplug.policy.nodeOtherwiseUnchanged" -}}
object.metadata.?annotations.orValue({}) == oldObject.metadata.?annotations.orValue({}) &&
object.metadata.?finalizers.orValue([]) == oldObject.metadata.?finalizers.orValue([]) &&
object.metadata.?ownerReferences.orValue([]) == oldObject.metadata.?ownerReferences.orValue([]) &&
object.spec == oldObject.spec &&
object.status.?conditions.orValue([]) == oldObject.status.?conditions.orValue([]) &&
object.status.?addresses.orValue([]) == oldObject.status.?addresses.orValue([]) &&
object.status.?daemonEndpoints == oldObject.status.?daemonEndpoints &&
object.status.?nodeInfo == oldObject.status.?nodeInfo &&
object.status.?images.orValue([]) == oldObject.status.?images.orValue([]) &&
object.status.?volumesInUse.orValue([]) == oldObject.status.?volumesInUse.orValue([]) &&
object.status.?volumesAttached.orValue([]) == oldObject.status.?volumesAttached.orValue([]) &&
object.status.?config == oldObject.status.?config &&
object.status.?phase == oldObject.status.?phase &&
object.status.?runtimeHandlers.orValue([]) == oldObject.status.?runtimeHandlers.orValue([]) &&
object.status.?features == oldObject.status.?features
{{- end }}

{{/*
CEL variables over a Node's status: `changedCapacity`, the capacity and allocatable keys added,
changed or removed; `addedCapacity`, those added or changed (not only removed).
*/}}
{{- define "devplug.policy.capacityVariables" -}}
- name: newCapacity
  expression: object.status.?capacity.orValue({})
- name: oldCapacity
  expression: oldObject.status.?capacity.orValue({})
- name: newAllocatable
  expression: object.status.?allocatable.orValue({})
- name: oldAllocatable
  expression: oldObject.status.?allocatable.orValue({})
- name: addedCapacity
  expression: >-
    variables.newCapacity.filter(k, !(k in variables.oldCapacity) || variables.oldCapacity[k] != variables.newCapacity[k]) +
    variables.newAllocatable.filter(k, !(k in variables.oldAllocatable) || variables.oldAllocatable[k] != variables.newAllocatable[k])
- name: changedCapacity
  expression: >-
    variables.addedCapacity +
    variables.oldCapacity.filter(k, !(k in variables.newCapacity)) +
    variables.oldAllocatable.filter(k, !(k in variables.newAllocatable))
{{- end }}

{{/*
CEL variables over a Node's labels: `changedLabels`, the keys added, changed or removed;
`addedLabels`, those added or changed.
*/}}
{{- define "devplug.policy.labelVariables" -}}
- name: newLabels
  expression: object.metadata.?labels.orValue({})
- name: oldLabels
  expression: oldObject.metadata.?labels.orValue({})
- name: addedLabels
  expression: >-
    variables.newLabels.filter(k, !(k in variables.oldLabels) || variables.oldLabels[k] != variables.newLabels[k])
- name: changedLabels
  expression: >-
    variables.addedLabels + variables.oldLabels.filter(k, !(k in variables.newLabels))
{{- end }}

{{/*
The `matchConditions` of a policy for one service account: `account` in the release's namespace.
*/}}
{{- define "devplug.policy.matchAccount" -}}
matchConditions:
  - name: devplug
    expression: >-
      request.userInfo.username == "system:serviceaccount:{{ .root.Release.Namespace }}:{{ .account }}"
{{- end }}

{{/*
The names of the config's `advertise:` resources, as a JSON list.
*/}}
{{- define "devplug.advertisedNames" -}}
{{- $names := list }}
{{- range (include "devplug.config" . | fromYaml).resources }}
{{- if .advertise }}{{ $names = append $names .name }}{{ end }}
{{- end }}
{{- $names | toJson }}
{{- end }}
