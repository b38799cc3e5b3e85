{{/*
NVIDIA's config files (config.map, or the ConfigMap config.name) and which DaemonSet runs which.
*/}}

{{/* The files by name, as JSON. config.name is read at install time (lookup). */}}
{{- define "gpuagent.nvidiaFiles" -}}
{{- if and .Values.config.name .Values.config.map -}}
{{- fail "config.name and config.map: set one of them (NVIDIA's chart refuses both too)" -}}
{{- end -}}
{{- if .Values.config.name -}}
{{- $found := lookup "v1" "ConfigMap" (include "gpuagent.namespace" .) .Values.config.name -}}
{{- if not $found -}}
{{- fail (printf "config.name: ConfigMap %s/%s was not found. The chart translates NVIDIA's config files into the agent's when it is installed, so the ConfigMap must exist first; `helm template` and client-side dry runs cannot read it (put the files in config.map instead)." (include "gpuagent.namespace" .) .Values.config.name) -}}
{{- end -}}
{{- toJson (default dict $found.data) -}}
{{- else -}}
{{- toJson .Values.config.map -}}
{{- end -}}
{{- end -}}

{{/*
The default file's name as NVIDIA's chart picks it: config.default, else the fallback strategies
in order ("named": a file called default; "single": the only file; "empty": none). JSON:
{"name": NAME} or {"name": ""} for no file.
*/}}
{{- define "gpuagent.defaultConfig" -}}
{{- $files := include "gpuagent.nvidiaFiles" . | fromJson -}}
{{- $chosen := "" -}}
{{- $found := false -}}
{{- if .Values.config.default -}}
{{- if not (hasKey $files .Values.config.default) -}}
{{- fail (printf "config.default: %q is not one of the config files (%s)" .Values.config.default (keys $files | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $chosen = .Values.config.default -}}
{{- $found = true -}}
{{- else if $files -}}
{{- range .Values.config.fallbackStrategies -}}
{{- if not $found -}}
{{- if and (eq . "named") (hasKey $files "default") -}}
{{- $chosen = "default" -}}
{{- $found = true -}}
{{- else if and (eq . "single") (eq (len $files) 1) -}}
{{- $chosen = keys $files | first -}}
{{- $found = true -}}
{{- else if eq . "empty" -}}
{{- $found = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "config.default: no default among the config files %s: set config.default, or a fallback strategy in config.fallbackStrategies (now %s) that finds one: named (a file called default), single (one file only) or empty (no file)" (keys $files | sortAlpha | join ", ") (join ", " .Values.config.fallbackStrategies)) -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "name" $chosen) -}}
{{- end -}}

{{/*
The DaemonSets, as JSON {"list": [...]}: one for the default file, on nodes whose label
nvidia.com/device-plugin.config names no other file; one per other file, on the nodes labelled
with its name. Each: {"file": NAME or "", "suffix": "" or "-NAME", "operator": In/NotIn,
"values": [...]} (no operator: every node).
*/}}
{{- define "gpuagent.instances" -}}
{{- $files := include "gpuagent.nvidiaFiles" . | fromJson -}}
{{- $default := (include "gpuagent.defaultConfig" . | fromJson).name -}}
{{- $others := list -}}
{{- range $name := keys $files | sortAlpha -}}
{{- if ne $name $default -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "config.map.%s: a file other than the default runs as its own DaemonSet named after it: use a name of lower-case letters, digits and '-'" $name) -}}
{{- end -}}
{{- $others = append $others $name -}}
{{- end -}}
{{- end -}}
{{- $first := dict "file" $default "suffix" "" -}}
{{- if $others -}}
{{- $_ := set $first "operator" "NotIn" -}}
{{- $_ := set $first "values" $others -}}
{{- end -}}
{{- $list := list $first -}}
{{- range $others -}}
{{- $list = append $list (dict "file" . "suffix" (printf "-%s" .) "operator" "In" "values" (list .)) -}}
{{- end -}}
{{- toJson (dict "list" $list) -}}
{{- end -}}

{{/*
One NVIDIA config file translated into the agent's config keys, as JSON.
(dict "where" WHERE "text" TEXT "mpsRoot" MPS.ROOT)
*/}}
{{- define "gpuagent.translate" -}}
{{- $where := .where -}}
{{- $in := fromYaml .text -}}
{{- if and (hasKey $in "Error") (eq (len $in) 1) -}}
{{- fail (printf "%s: not a YAML mapping: %s" $where (get $in "Error")) -}}
{{- end -}}
{{- range $key, $_ := $in -}}
{{- if not (has $key (list "version" "flags" "sharing" "resources" "imex")) -}}
{{- fail (printf "%s.%s: unknown key (NVIDIA's config file has version, flags, sharing, resources and imex)" $where $key) -}}
{{- end -}}
{{- end -}}
{{- if ne (toString $in.version) "v1" -}}
{{- fail (printf "%s.version: %v: NVIDIA's config file format is version v1" $where $in.version) -}}
{{- end -}}
{{- $out := dict -}}
{{- $flags := default dict $in.flags -}}
{{- include "gpuagent.translateKeys" (dict "where" (printf "%s.flags" $where) "in" $flags "out" $out
  "keys" (dict "migStrategy" "mig-strategy" "failOnInitError" "fail-on-init-error" "nvidiaDriverRoot" "nvidia-driver-root")
  "ignored" (list "mpsRoot" "nvidiaDevRoot" "useNodeFeatureAPI" "plugin" "gfd" "deviceDiscoveryStrategy")
  "refusedWhenTrue" (dict "gdrcopyEnabled" "GDRCopy" "gdsEnabled" "GPUDirect Storage (GDS)" "mofedEnabled" "MOFED")) -}}
{{- /* NVIDIA's chart sets MPS_ROOT from mps.root over the file's flags.mpsRoot, and mounts
mps.root: the file may only repeat it. */ -}}
{{- if and (hasKey $flags "mpsRoot") (not (kindIs "invalid" $flags.mpsRoot)) -}}
{{- if ne (clean (toString $flags.mpsRoot)) (clean .mpsRoot) -}}
{{- fail (printf "%s.flags.mpsRoot: %v is not mps.root (%s), which NVIDIA's chart sets over it (MPS_ROOT) and this chart mounts: set mps.root instead" $where $flags.mpsRoot .mpsRoot) -}}
{{- end -}}
{{- end -}}
{{- $discovery := toString (default "auto" $flags.deviceDiscoveryStrategy) -}}
{{- if not (has $discovery (list "auto" "nvml")) -}}
{{- fail (printf "%s.flags.deviceDiscoveryStrategy: %s: gpuagent finds GPUs through NVML only (auto or nvml)" $where $discovery) -}}
{{- end -}}
{{- include "gpuagent.translateKeys" (dict "where" (printf "%s.flags.plugin" $where) "in" (default dict $flags.plugin) "out" $out
  "keys" (dict "passDeviceSpecs" "pass-device-specs" "deviceListStrategy" "device-list-strategy" "deviceIDStrategy" "device-id-strategy" "cdiAnnotationPrefix" "cdi-annotation-prefix" "nvidiaCTKPath" "nvidia-cdi-hook-path" "containerDriverRoot" "driver-root-ctr-path" "sharedDevicesAllocationPolicy" "shared-devices-allocation-policy")
  "ignored" list "refusedWhenTrue" dict) -}}
{{- $gfd := default dict $flags.gfd -}}
{{- include "gpuagent.translateKeys" (dict "where" (printf "%s.flags.gfd" $where) "in" $gfd "out" $out
  "keys" (dict "machineTypeFile" "machine-type-file" "outputFile" "node-labels-file")
  "ignored" (list "oneshot" "noTimestamp" "sleepInterval") "refusedWhenTrue" dict) -}}
{{- if and $gfd.outputFile (ne (dir $gfd.outputFile) "/etc/kubernetes/node-feature-discovery/features.d") -}}
{{- fail (printf "%s.flags.gfd.outputFile: %s is outside /etc/kubernetes/node-feature-discovery/features.d, the directory the chart mounts (NFD reads feature files there)" $where $gfd.outputFile) -}}
{{- end -}}
{{- with $in.imex -}}
{{- if .channelIDs -}}
{{- fail (printf "%s.imex.channelIDs: gpuagent injects no IMEX channels" $where) -}}
{{- end -}}
{{- end -}}
{{- /* sharing (timeSlicing, mps) is the agent's own format. */ -}}
{{- with $in.sharing -}}
{{- $_ := set $out "sharing" . -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
Copies the keys of .in named in .keys to .out under their new names; .ignored are left out
(docs/migration.md lists them); .refusedWhenTrue fail when true; any other key fails.
*/}}
{{- define "gpuagent.translateKeys" -}}
{{- $ctx := . -}}
{{- range $key, $value := .in -}}
{{- if hasKey $ctx.keys $key -}}
{{- if not (kindIs "invalid" $value) -}}
{{- $_ := set $ctx.out (get $ctx.keys $key) $value -}}
{{- end -}}
{{- else if hasKey $ctx.refusedWhenTrue $key -}}
{{- if eq (toString $value) "true" -}}
{{- fail (printf "%s.%s: gpuagent injects no %s devices" $ctx.where $key (get $ctx.refusedWhenTrue $key)) -}}
{{- end -}}
{{- else if not (has $key $ctx.ignored) -}}
{{- fail (printf "%s.%s: unknown key" $ctx.where $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
