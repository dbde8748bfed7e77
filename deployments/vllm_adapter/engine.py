"""Build a vLLM engine with the inferscale connector, and turn memory plans into requests.

A request with memory carries its prompt as token ids `[memory region][query]`, the plan in
`sampling_params.extra_args["kv_transfer_params"]` and the plan's prefix-cache salt, so its blocks are
reused only by requests of the same tenant and store version. Engine knobs pass through untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

from config.connector import ConnectorConfig
from deployments.vllm_adapter.worker_extension import WORKER_EXTENSION
from kvcore.plan import CapturePlan, MemoryPlan

CONNECTOR_CLASS = "InferscaleConnector"
CONNECTOR_MODULE = "deployments.vllm_adapter.connector"


def kv_transfer_config(connector: ConnectorConfig) -> KVTransferConfig:
    """The `KVTransferConfig` that loads `InferscaleConnector` out of tree with `connector` as its extra config."""
    return KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy=connector.on_load_failure,
        kv_connector_extra_config=connector.to_extra(),
    )


def build_llm(model: str | Path, connector: ConnectorConfig, **engine_kwargs: Any) -> LLM:
    """An offline `LLM` with prefix caching on, KV injection wired in and the workers' inferscale methods
    (`worker_extension.py`) callable through `collective_rpc`."""
    engine_kwargs.setdefault("enable_prefix_caching", True)
    engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
    return LLM(model=str(model), kv_transfer_config=kv_transfer_config(connector), **engine_kwargs)


def memory_request(
    prompt_ids: Sequence[int], plan: MemoryPlan | None, params: SamplingParams
) -> tuple[TokensPrompt, SamplingParams]:
    """A token prompt and sampling params carrying `plan` (or a plain request when `plan` is None)."""
    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if plan is None:
        return prompt, params
    prompt["cache_salt"] = plan.cache_salt
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": plan.to_params()}
    params.skip_clone = True  # this request's own copy: vLLM need not deep-copy it, plan and all, again
    return prompt, params


def capture_request(prompt_ids: Sequence[int], plan: CapturePlan) -> tuple[TokensPrompt, SamplingParams]:
    """A one-token request whose prefill stores the K/V of `plan`'s spans as records (engine encoding)."""
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        skip_clone=True,
        extra_args={"kv_transfer_params": plan.to_params()},
    )
    return TokensPrompt(prompt_token_ids=list(prompt_ids)), params
