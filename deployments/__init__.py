"""Serving: the engine adapters and, later, the Ray Serve deployments.

Lives here: `vllm_adapter` (the KV connector shim and the engine wrapper; the only place vLLM is
imported). May import: kvcore, config, models, tenants. Nothing below it imports this package.
"""
