"""The Ray Serve application: ingress, LLM server replicas and the tenant-affinity request router."""
