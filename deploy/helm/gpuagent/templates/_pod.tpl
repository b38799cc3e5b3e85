{{/*
Parts of the pod that depend on the values: the affinity, the environment, the security context.
*/}}

{{/*
The affinity, as JSON {"affinity": ...}: affinity as given, with the node label
nvidia.com/device-plugin.config required of every node selector term where NVIDIA config files
divide the nodes between DaemonSets. (dict "root" $ "instance" INSTANCE)
*/}}
{{- define "gpuagent.affinity" -}}
{{- $affinity := deepCopy (default dict .root.Values.affinity) -}}
{{- if .instance.operator -}}
{{- $label := dict "key" "nvidia.com/device-plugin.config" "operator" .instance.operator "values" .instance.values -}}
{{- $node := default dict $affinity.nodeAffinity -}}
{{- $required := default dict $node.requiredDuringSchedulingIgnoredDuringExecution -}}
{{- $terms := list -}}
{{- range default (list dict) $required.nodeSelectorTerms -}}
{{- $terms = append $terms (set (deepCopy .) "matchExpressions" (append (default list .matchExpressions) $label)) -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- toJson (dict "affinity" $affinity) -}}
{{- end -}}

{{/*
The environment beyond the base's: NVIDIA's values as NVIDIA's variables (the agent reads
them), the NVIDIA runtime's MIG capabilities, and the node-health switches.
(dict "root" $ "plan" PLAN "api" API)
*/}}
{{- define "gpuagent.env" -}}
{{- $v := .root.Values -}}
{{- $env := list -}}
{{- if kindIs "string" $v.migStrategy -}}
{{- $env = append $env (dict "name" "MIG_STRATEGY" "value" $v.migStrategy) -}}
{{- end -}}
{{- if kindIs "bool" $v.failOnInitError -}}
{{- $env = append $env (dict "name" "FAIL_ON_INIT_ERROR" "value" (toString $v.failOnInitError)) -}}
{{- end -}}
{{- if kindIs "bool" $v.compatWithCPUManager -}}
{{- $env = append $env (dict "name" "PASS_DEVICE_SPECS" "value" (toString $v.compatWithCPUManager)) -}}
{{- end -}}
{{- if kindIs "string" $v.deviceListStrategy -}}
{{- $env = append $env (dict "name" "DEVICE_LIST_STRATEGY" "value" $v.deviceListStrategy) -}}
{{- end -}}
{{- if kindIs "string" $v.deviceIDStrategy -}}
{{- $env = append $env (dict "name" "DEVICE_ID_STRATEGY" "value" $v.deviceIDStrategy) -}}
{{- end -}}
{{- if kindIs "string" $v.nvidiaDriverRoot -}}
{{- $env = append $env (dict "name" "NVIDIA_DRIVER_ROOT" "value" $v.nvidiaDriverRoot) -}}
{{- end -}}
{{- if kindIs "string" $v.cdi.nvidiaHookPath -}}
{{- $env = append $env (dict "name" "NVIDIA_CDI_HOOK_PATH" "value" $v.cdi.nvidiaHookPath) -}}
{{- end -}}
{{- /* The NVIDIA container runtime exposes the driver's MIG capabilities only to a container
holding CAP_SYS_ADMIN: monitor (seeing every MIG device), config (making them). */ -}}
{{- if or .plan.mig .plan.dynamicMig -}}
{{- $env = append $env (dict "name" "NVIDIA_MIG_MONITOR_DEVICES" "value" "all") -}}
{{- end -}}
{{- if .plan.dynamicMig -}}
{{- $env = append $env (dict "name" "NVIDIA_MIG_CONFIG_DEVICES" "value" "all") -}}
{{- end -}}
{{- if not .api.condition -}}
{{- $env = append $env (dict "name" "GPUAGENT_NODE_CONDITION" "value" "false") -}}
{{- end -}}
{{- if not .api.events -}}
{{- $env = append $env (dict "name" "GPUAGENT_EVENTS" "value" "false") -}}
{{- end -}}
{{- if .api.taint -}}
{{- $env = append $env (dict "name" "GPUAGENT_TAINT_UNHEALTHY_NODE" "value" "true") -}}
{{- end -}}
{{- if $env -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{/*
The container's security context: securityContext as given, else the base's (every capability
dropped, no escalation, read-only root) with CAP_SYS_ADMIN for MIG and for setting the compute
mode of GPUs shared through MPS, which the API server allows only without
allowPrivilegeEscalation: false. (dict "root" $ "plan" PLAN)
*/}}
{{- define "gpuagent.securityContext" -}}
{{- if .root.Values.securityContext -}}
{{- toYaml .root.Values.securityContext -}}
{{- else -}}
{{- $context := dict "privileged" false "readOnlyRootFilesystem" true "capabilities" (dict "drop" (list "ALL")) -}}
{{- if or .plan.mig .plan.dynamicMig .plan.computeModes -}}
{{- $_ := set $context.capabilities "add" (list "SYS_ADMIN") -}}
{{- else -}}
{{- $_ := set $context "allowPrivilegeEscalation" false -}}
{{- end -}}
{{- toYaml $context -}}
{{- end -}}
{{- end -}}
