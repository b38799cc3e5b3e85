{{/*
What one DaemonSet runs, as JSON: the agent's config file, and the facts the pod is built from.
(dict "root" $ "instance" INSTANCE)  →  {"config": {...}, "cdi": bool, "mig": bool,
"dynamicMig": bool, "driverRoot": PATH, "dra": bool, "mps": bool, "mpsRoot": PATH,
"computeModes": bool}

Precedence is the agent's (flag > environment > config file): NVIDIA's values (migStrategy, …)
become NVIDIA's environment variables; the config file is the base's, then the NVIDIA file's
translation, then the chart's own features, then agentConfig.
*/}}
{{- define "gpuagent.plan" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $config := dict
  "version" "v1"
  "socket-dir" "/var/lib/kubelet/device-plugins"
  "pod-resources-socket" "/var/lib/kubelet/pod-resources/kubelet.sock"
  "metrics-address" (toString $v.service.address)
  "resource-name" "nvidia.com/gpu"
  "device-list-strategy" "envvar"
  "device-id-strategy" "uuid"
  "mig-strategy" "none"
  "fail-on-init-error" false
  "log-format" "json"
  "log-level" "info" -}}
{{- with .instance.file -}}
{{- $files := include "gpuagent.nvidiaFiles" $root | fromJson -}}
{{- $where := ternary (printf "config.name %s: %s" $v.config.name .) (printf "config.map.%s" .) (not (empty $v.config.name)) -}}
{{- $config = mergeOverwrite $config (include "gpuagent.translate" (dict "where" $where "text" (get $files .) "mpsRoot" $v.mps.root) | fromJson) -}}
{{- end -}}
{{- $dra := ne (toString $v.dra.gpus) "none" -}}
{{- if $dra -}}
{{- $_ := set $config "dra-gpus" (toString $v.dra.gpus) -}}
{{- $_ := set $config "dra-driver-name" $v.dra.driverName -}}
{{- $_ := set $config "plugins-registry-dir" "/var/lib/kubelet/plugins_registry" -}}
{{- $_ := set $config "plugins-dir" "/var/lib/kubelet/plugins" -}}
{{- if eq $v.dra.mig "dynamic" -}}
{{- $_ := set $config "dra-mig" "dynamic" -}}
{{- end -}}
{{- if eq $v.dra.sharing "mps" -}}
{{- $_ := set $config "dra-sharing" "mps" -}}
{{- end -}}
{{- end -}}
{{- if not $v.gfd.enabled -}}
{{- $_ := set $config "node-labels" false -}}
{{- end -}}
{{- if eq (include "gpuagent.webEnabled" $root) "true" -}}
{{- $_ := set $config "web-config-file" "/etc/gpuagent-web/web-config.yml" -}}
{{- end -}}
{{- /* MPS sharing (docs/sharing.md): where the daemons' directories are and what happens to
the compute mode, from the mps values, when the config with agentConfig shares through MPS. */ -}}
{{- $mps := eq (include "gpuagent.sharesThroughMps" (mergeOverwrite (deepCopy $config) (deepCopy $v.agentConfig))) "true" -}}
{{- $mpsReplicas := eq (include "gpuagent.mpsReplicas" (mergeOverwrite (deepCopy $config) (deepCopy $v.agentConfig))) "true" -}}
{{- if $mps -}}
{{- $_ := set $config "mps-root" (clean $v.mps.root) -}}
{{- $_ := set $config "mps-compute-mode" $v.mps.computeMode -}}
{{- end -}}
{{- $config = mergeOverwrite $config (deepCopy $v.agentConfig) -}}
{{- /* What the environment (NVIDIA's values) and the file make of the strategies. */ -}}
{{- $strategies := get $config "device-list-strategy" -}}
{{- if kindIs "string" $v.deviceListStrategy -}}
{{- $strategies = $v.deviceListStrategy -}}
{{- end -}}
{{- if kindIs "string" $strategies -}}
{{- $strategies = splitList "," $strategies -}}
{{- end -}}
{{- $cdi := false -}}
{{- range $strategies -}}
{{- if hasPrefix "cdi-" (trim (toString .)) -}}
{{- $cdi = true -}}
{{- end -}}
{{- end -}}
{{- $mig := toString (get $config "mig-strategy") -}}
{{- if kindIs "string" $v.migStrategy -}}
{{- $mig = $v.migStrategy -}}
{{- end -}}
{{- if and $mpsReplicas (eq $mig "mixed") -}}
{{- fail (printf "sharing.mps (%s) with migStrategy mixed: MIG devices cannot be shared through MPS (the agent refuses it at start, as NVIDIA's plugin does)" (ternary (printf "config file %s" .instance.file) "agentConfig" (not (empty .instance.file)))) -}}
{{- end -}}
{{- $driverRoot := toString (get $config "nvidia-driver-root" | default "/") -}}
{{- if kindIs "string" $v.nvidiaDriverRoot -}}
{{- $driverRoot = $v.nvidiaDriverRoot -}}
{{- end -}}
{{- /* CDI: the agent reads the driver's files through the host's driver root, mounted read-only
at /driver-root (as NVIDIA's chart mounts it). */ -}}
{{- if and $cdi (not (hasKey $config "driver-root-ctr-path")) -}}
{{- $_ := set $config "driver-root-ctr-path" "/driver-root" -}}
{{- end -}}
{{- /* MPS: the agent's mps-root is a host path mounted at the same path; compute modes
are changed unless mps-compute-mode is unchanged. */ -}}
{{- $mpsRoot := clean (toString (get $config "mps-root" | default "/run/nvidia/mps")) -}}
{{- $computeModes := and $mps (ne (toString (get $config "mps-compute-mode")) "unchanged") -}}
{{- toJson (dict "config" $config "cdi" $cdi "mig" (ne $mig "none") "dynamicMig" (and $dra (eq $v.dra.mig "dynamic")) "driverRoot" $driverRoot "dra" $dra "mps" $mps "mpsRoot" $mpsRoot "computeModes" $computeModes) -}}
{{- end -}}

{{/*
"true" when a config (the agent's keys) shares through MPS, as the agent decides it: the device
plugin's MPS replicas, or DRA GPUs shared through MPS (dra-sharing mps, dra-gpus not none).
*/}}
{{- define "gpuagent.sharesThroughMps" -}}
{{- $draShares := and (eq (toString (get . "dra-sharing")) "mps") (ne (toString (get . "dra-gpus" | default "none")) "none") -}}
{{- or (eq (include "gpuagent.mpsReplicas" .) "true") $draShares -}}
{{- end -}}

{{/*
"true" when a config's sharing block (a mapping, or its YAML text) has MPS resources: the device
plugin's replicas, which MIG devices cannot be (DRA shares are whole GPUs only).
*/}}
{{- define "gpuagent.mpsReplicas" -}}
{{- $sharing := get . "sharing" -}}
{{- if kindIs "string" $sharing -}}
{{- $sharing = fromYaml $sharing -}}
{{- end -}}
{{- $block := dict -}}
{{- if and (kindIs "map" $sharing) (kindIs "map" (get $sharing "mps")) -}}
{{- $block = get $sharing "mps" -}}
{{- end -}}
{{- not (empty (get $block "resources")) -}}
{{- end -}}
