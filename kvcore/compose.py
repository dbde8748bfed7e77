"""Composition: ordered fact records (and an optional prefix) become one injectable memory region.

The region occupies contiguous positions `start .. start+M-1`: prefix first, then each fact in order.
Pre-RoPE keys are concatenated and rotated to those positions in one vectorized call (chunked RoPE), so
any subset of facts in any order lands exactly where the prompt puts its tokens. The prompt the engine
sees is `memory.token_ids + query_ids`; only the query is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvcore.errors import IncompatibleRecordsError
from kvcore.record import FactKV, check_compatible
from kvcore.rope import rotate_to


@dataclass(frozen=True)
class Span:
    """Where one record sits inside the memory region (offsets relative to the region's start)."""

    fact_id: str
    begin: int
    end: int


@dataclass(frozen=True, eq=False)
class ComposedMemory:
    """K (rotated) and V `[layers, kv_heads, M, head_dim]` for positions `start .. start+M-1`."""

    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    start: int
    spans: tuple[Span, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """The first position after the memory region: where the query begins."""
        return self.start + self.num_tokens


def compose(
    records: Sequence[FactKV],
    prefix: FactKV | None = None,
    *,
    start: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    rotate: bool = True,
) -> ComposedMemory:
    """Concatenate `prefix` and `records` and rotate the keys to their serving positions.

    `rotate=False` leaves keys at the positions they were computed with, which is wrong unless they were
    already post-RoPE at exactly these positions; it exists so tests can show why chunked RoPE is needed.
    """
    parts = [part.dense() for part in ([prefix] if prefix is not None else []) + list(records)]
    if not parts:
        raise IncompatibleRecordsError("nothing to compose: no prefix and no records")
    check_compatible(parts)
    if start < 0:
        raise ValueError(f"start position must be >= 0, got {start}")
    spans, token_ids, cursor = [], [], 0
    for part in parts:
        spans.append(Span(part.fact_id, cursor, cursor + part.num_tokens))
        token_ids.extend(part.token_ids)
        cursor += part.num_tokens
    target_dtype = dtype or parts[0].k.dtype
    k = torch.cat([p.k.to(device=device) for p in parts], dim=2)  # [L, H, M, D], pre-RoPE
    v = torch.cat([p.v.to(device=device) for p in parts], dim=2)
    if rotate:
        k = rotate_to(k, start, parts[0].params.rope)
    return ComposedMemory(tuple(token_ids), k.to(target_dtype), v.to(target_dtype), start, tuple(spans))
