"""The Kubernetes API adapter: ResourceClaims read and ResourceSlices published (DRA); the Node's
GPUHealthy condition, GPU health events and the optional taint written (nodehealth)."""
