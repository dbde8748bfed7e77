"""Factories for records and a deterministic fake model, for the core's unit tests."""

from __future__ import annotations

import torch

from kvcore.protocols import ModelSpec
from kvcore.record import EncodingParams, FactKV
from kvcore.rope import RopeConfig

ROPE = RopeConfig(head_dim=8, theta=10000.0)
SPEC = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, rope=ROPE, fingerprint="f" * 24)


def make_record(
    fact_id: str = "f1",
    tokens: int = 5,
    *,
    seed: int = 0,
    dtype=torch.float32,
    fingerprint: str = "f" * 24,
    tenant_id: str = "t1",
    layers: int = 3,
) -> FactKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, tokens, 8)
    return FactKV(
        tenant_id=tenant_id,
        fact_id=fact_id,
        token_ids=tuple(range(100 + seed, 100 + seed + tokens)),
        k=torch.randn(shape, generator=gen).to(dtype),
        v=torch.randn(shape, generator=gen).to(dtype),
        params=EncodingParams(window=2, model_fingerprint=fingerprint, rope=ROPE, dtype=str(dtype).split(".")[-1]),
        version=3,
    )


class CausalSumForward:
    """A fake `KVForward`: each position's K/V is a causal function of the ids before it (cumsum).

    Any padding leak, position mix-up or wrong slice changes the numbers, which is all the batching
    tests need from a model.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.calls.append(tuple(input_ids.shape))
        x = (input_ids.float() * attention_mask).cumsum(dim=1)  # [B, T]
        base = x[None, :, None, :, None] * torch.arange(1, 4).float()[:, None, None, None, None]
        k = base.expand(3, -1, 2, -1, 8) + torch.arange(8).float()
        return k.contiguous(), (k * 2).contiguous()
