"""Build a vLLM engine with the inferscale connector, and turn memory plans into requests.

A request with memory carries its prompt as token ids `[memory region][query]`, the plan in
`sampling_params.extra_args["kv_transfer_params"]` and the plan's prefix-cache salt, so its blocks are
reused only by requests of the same tenant and store version. Engine knobs pass through untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES
from kvcore.plan import CapturePlan, MemoryPlan

CONNECTOR_CLASS = "InferscaleConnector"
CONNECTOR_MODULE = "deployments.vllm_adapter.connector"


def kv_transfer_config(store_root: Path, fingerprint: str, on_load_failure: Literal["recompute", "fail"] = "recompute",
                       device_cache_bytes: int = DEFAULT_DEVICE_CACHE_BYTES, tiers: dict[str, Any] | None = None,
                       fused_kernel: bool = True, device_tenant_bytes: int | None = None) -> KVTransferConfig:
    """The `KVTransferConfig` that loads `InferscaleConnector` out of tree (`tiers`: `disk_cache_dir`,
    `host_cache_bytes`, `compress_lower`; `fused_kernel`: the Triton step writer on CUDA)."""
    return KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy=on_load_failure,
        kv_connector_extra_config={"store_root": str(store_root), "fingerprint": fingerprint,
                                   "on_load_failure": on_load_failure, "device_cache_bytes": device_cache_bytes,
                                   "fused_kernel": fused_kernel,
                                   **({"device_tenant_bytes": device_tenant_bytes} if device_tenant_bytes else {}),
                                   **{k: str(v) if isinstance(v, Path) else v for k, v in (tiers or {}).items()}},
    )


def build_llm(model: str | Path, store_root: Path, fingerprint: str, *,
              on_load_failure: Literal["recompute", "fail"] = "recompute", device_cache_bytes: int = DEFAULT_DEVICE_CACHE_BYTES,
              tiers: dict[str, Any] | None = None, fused_kernel: bool = True, **engine_kwargs: Any) -> LLM:
    """An offline `LLM` with prefix caching on and KV injection wired in."""
    engine_kwargs.setdefault("enable_prefix_caching", True)
    config = kv_transfer_config(store_root, fingerprint, on_load_failure, device_cache_bytes, tiers, fused_kernel)
    return LLM(model=str(model), kv_transfer_config=config, **engine_kwargs)


def memory_request(prompt_ids: Sequence[int], plan: MemoryPlan | None, params: SamplingParams) -> tuple[TokensPrompt, SamplingParams]:
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
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_clone=True,
                            extra_args={"kv_transfer_params": plan.to_params()})
    return TokensPrompt(prompt_token_ids=list(prompt_ids)), params
