//! Sources of cluster state: a YAML directory, or Kubernetes.
