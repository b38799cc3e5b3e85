"""The Kubernetes API adapter (DRA only): ResourceClaims read, ResourceSlices published."""
