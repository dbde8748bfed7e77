"""The transformers side of the KV core: pre-RoPE K/V extraction, and a reference engine for checks.

`HFKVForward` implements the core's `KVForward` two ways, which tests hold against each other:
`projection` hooks each layer's key projection (after its k-norm where the model has one) and value
projection, so keys are pre-RoPE by construction; `cache` runs the model with its own KV cache (which
holds keys after RoPE) and undoes the rotation with the core's inverse RoPE.

`ReferenceEngine` runs a plain full-prompt prefill, or a query on top of composed memory K/V passed as
the model's past; it exists for tests, benchmarks and the demo, not for serving (vLLM serves).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Sequence

import torch

from kvcore.compose import ComposedMemory
from kvcore.rope import rotate
from models.loader import LoadedModel

Method = Literal["projection", "cache"]


class HFKVForward:
    """`KVForward` over a transformers Llama/Qwen2/Mistral-family model."""

    def __init__(self, loaded: LoadedModel, method: Method = "projection") -> None:
        if method not in ("projection", "cache"):
            raise ValueError(f"unknown K/V extraction method {method!r}")
        self._loaded = loaded
        self._method = method

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self._loaded.model.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        with torch.inference_mode():
            if self._method == "projection":
                return self._from_projections(input_ids, attention_mask)
            return self._from_cache(input_ids, attention_mask)

    def _from_projections(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec, base = self._loaded.spec, self._loaded.model.model
        batch, width = input_ids.shape
        keys: list[torch.Tensor | None] = [None] * spec.num_layers
        values: list[torch.Tensor | None] = [None] * spec.num_layers

        def grab(store: list, index: int):
            def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
                # [B, T, H*D] or [B, T, H, D] (after a k-norm) -> [B, H, T, D]
                store[index] = output.reshape(batch, width, spec.num_kv_heads, spec.head_dim).transpose(1, 2)

            return hook

        handles = []
        try:
            for index, layer in enumerate(base.layers):
                attn = layer.self_attn
                key_module = getattr(attn, "k_norm", None) or attn.k_proj
                handles.append(key_module.register_forward_hook(grab(keys, index)))
                handles.append(attn.v_proj.register_forward_hook(grab(values, index)))
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack(keys), torch.stack(values)  # [L, B, H, T, D]

    def _from_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = input_ids.shape[1]
        positions = torch.arange(width, device=input_ids.device)
        out = self._loaded.model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions[None].expand_as(input_ids),
            use_cache=True,
        )
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        keys = torch.stack([layer.keys for layer in cache.layers])  # [L, B, H, T, D], post-RoPE
        values = torch.stack([layer.values for layer in cache.layers])
        return rotate(keys, positions, self._loaded.spec.rope, inverse=True), values


class ReferenceEngine:
    """Greedy decoding on transformers, from a plain prompt or from injected memory K/V."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._model = loaded.model
        # transformers 5.2x renamed `past_key_values` to `cache` (in arguments and outputs); accept both.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(loaded.model.forward).parameters else "past_key_values"
        )
        eos = loaded.tokenizer.eos_token_id
        self._stop = {eos} if isinstance(eos, int) else set(eos or ())

    def prompt_logits(self, ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Logits `[T, vocab]` of a plain prefill of `ids` at positions `start..`."""
        logits, _ = self._forward(list(ids), start, past=None)
        return logits

    def injected_logits(self, memory: ComposedMemory, query_ids: Sequence[int]) -> torch.Tensor:
        """Logits `[Q, vocab]` of the query prefilled on top of the composed memory K/V."""
        logits, _ = self._forward(list(query_ids), memory.end, past=self._cache_from(memory))
        return logits

    def generate_plain(self, ids: Sequence[int], max_new_tokens: int, start: int = 0) -> list[int]:
        logits, cache = self._forward(list(ids), start, past=None)
        return self._greedy(logits, cache, start + len(ids), max_new_tokens)

    def generate_injected(self, memory: ComposedMemory, query_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        logits, cache = self._forward(list(query_ids), memory.end, past=self._cache_from(memory))
        return self._greedy(logits, cache, memory.end + len(query_ids), max_new_tokens)

    def _cache_from(self, memory: ComposedMemory) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache()
        dtype = self._loaded.dtype
        for layer in range(memory.k.shape[0]):
            cache.update(memory.k[layer][None].to(dtype), memory.v[layer][None].to(dtype), layer)
        return cache

    def _forward(self, ids: list[int], start: int, past: Any) -> tuple[torch.Tensor, Any]:
        done = past.get_seq_length() if past is not None else 0
        device = self._model.device
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        with torch.inference_mode():
            out = self._model(
                input_ids=tokens,
                position_ids=positions,
                cache_position=torch.arange(done, done + len(ids), device=device),
                use_cache=True,
                **{self._cache_arg: past},
            )
        return out.logits[0].float(), getattr(out, self._cache_arg)

    def _greedy(self, logits: torch.Tensor, cache: Any, position: int, max_new_tokens: int) -> list[int]:
        produced: list[int] = []
        token = int(logits[-1].argmax())
        while len(produced) < max_new_tokens and token not in self._stop:
            produced.append(token)
            step, cache = self._forward([token], position, past=cache)
            position += 1
            token = int(step[-1].argmax())
        return produced
