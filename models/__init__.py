"""Model loading and the transformers adapter: everything that touches transformers lives here.

Lives here: locating and converting the bundled SmolLM2 GGUF (`loader`), splitting a chat template
around the memory region (`chat`), the `KVForward` that extracts pre-RoPE K/V and the reference engine
that runs a query on composed K/V (`transformers_adapter`).

May import: kvcore, config, torch, transformers (and gguf through it). Never tenants, deployments or
cluster.
"""
