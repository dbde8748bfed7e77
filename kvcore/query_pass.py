"""A question's own pass through a Llama-family model's first layers: its pre-RoPE queries, for choosing chunks.

History mode scores every chunk's summary against the question's queries at the first few layers
(`docs/history-selection.md`: the question alone through layers 0-3 chooses as well as queries that saw the
whole history). The engine's weights live in its own process, so the LLM replica runs this small pass itself:
the embedding, then per layer RMSNorm, the q/k/v projections, causal attention over the question's own tokens
(RoPE at positions 0..Q-1: attention among them depends on their distances only), the output projection and
the SiLU-gated MLP; the last layer stops at its queries. Weights come from the model's checkpoint
(`models/early_layers.py`); the result is checked against the model's own forward (tests/model/test_query_pass.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kvcore.rope import RopeConfig, rotate


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer's weights (projections as `[out, in]`, as checkpoints store them)."""

    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class EarlyLayers:
    """The token embedding and the first layers of a model, with what shapes their attention."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: tuple[DecoderLayer, ...]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope: RopeConfig

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("at least one layer is needed")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads cannot share {self.kv_heads} KV heads evenly")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama computes it: in float32, then back to the activations' dtype before the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int) -> torch.Tensor:
    """`[Q, hidden]` -> `[heads, Q, head_dim]`."""
    out = F.linear(x, weight, bias)
    return out.view(x.shape[0], heads, -1).transpose(0, 1)


@torch.inference_mode()
def question_queries(weights: EarlyLayers, token_ids: Sequence[int]) -> torch.Tensor:
    """Pre-RoPE queries `[L, H, Q, D]` of the question's tokens at each of `weights`' layers."""
    if not token_ids:
        raise ValueError("the question has no tokens")
    return queries_of(weights, torch.as_tensor(list(token_ids), dtype=torch.long, device=weights.embed_tokens.device))


def queries_of(weights: EarlyLayers, ids: torch.Tensor) -> torch.Tensor:
    """`question_queries` of token ids already on the weights' device `[Q]`. Causal: the queries of the first n
    tokens do not depend on any token after them, so a question padded at its end keeps its own (what a CUDA
    graph of a fixed length relies on)."""
    device = ids.device
    x = weights.embed_tokens[ids]  # [Q, hidden]
    tokens = x.shape[0]
    positions = torch.arange(tokens, device=device)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    group = weights.heads // weights.kv_heads
    out = []
    for index, layer in enumerate(weights.layers):
        h = _rms_norm(x, layer.input_norm, weights.eps)
        q = _project(h, layer.q_proj, layer.q_bias, weights.heads)
        out.append(q)
        if index == len(weights.layers) - 1:
            break
        k = _project(h, layer.k_proj, layer.k_bias, weights.kv_heads)
        v = _project(h, layer.v_proj, layer.v_bias, weights.kv_heads)
        q_rot, k_rot = rotate(q, positions, weights.rope), rotate(k, positions, weights.rope)
        k_rot, v = k_rot.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q_rot @ k_rot.transpose(-1, -2)).float() / math.sqrt(weights.head_dim)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).to(v.dtype)
        attended = (probs @ v).transpose(0, 1).reshape(tokens, -1)  # [Q, H * D]
        x = x + F.linear(attended, layer.o_proj)
        h = _rms_norm(x, layer.post_norm, weights.eps)
        x = x + F.linear(F.silu(F.linear(h, layer.gate_proj)) * F.linear(h, layer.up_proj), layer.down_proj)
    return torch.stack(out)
