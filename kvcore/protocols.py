"""The two seams through which a model enters the pure core, and the facts about it the core needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvcore.rope import RopeConfig


@dataclass(frozen=True)
class ModelSpec:
    """Shape and identity of the model whose K/V the core handles."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    fingerprint: str


class TokenEncoder(Protocol):
    """Turns text into token ids, without adding special tokens."""

    def encode_text(self, text: str) -> list[int]: ...


class KVForward(Protocol):
    """Runs the model over a right-padded batch and returns every layer's keys (pre-RoPE) and values.

    `input_ids` and `attention_mask` are `[batch, tokens]`; real tokens sit at positions 0..len-1 of
    their row. Returns `(keys, values)`, each `[layers, batch, kv_heads, tokens, head_dim]`.
    """

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
