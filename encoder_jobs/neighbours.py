"""The facts a fact is encoded behind when its context is its neighbours (FusionRAG-style).

At serving time a fact's K/V sits in a memory region among the other facts its question retrieved, which
are mostly facts close to it in embedding space. Encoding it behind those neighbours lets its K/V carry
what a joint prefill of them would have linked; the turns before it (its window) only approximate that.
"""

from __future__ import annotations

from typing import Sequence

import torch


def nearest_texts(
    texts: Sequence[str], vectors: torch.Tensor, stored: Sequence[Sequence[tuple[str, float]]], count: int
) -> list[list[str]]:
    """For each of `texts` (rows of `vectors`, normalised), the `count` most similar other texts among
    `texts` and its own `stored` candidates (text, similarity: the tenant's facts near it), least similar
    first so the nearest sits next to the fact. A text never neighbours itself or appears twice."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count == 0 or not texts:
        return [[] for _ in texts]
    similar = (vectors.float() @ vectors.float().T).tolist()
    out = []
    for i, text in enumerate(texts):
        best: dict[str, float] = {}
        candidates = [(other, similar[i][j]) for j, other in enumerate(texts) if j != i] + list(
            stored[i] if stored else ()
        )
        for other, score in candidates:
            if other != text and score > best.get(other, float("-inf")):
                best[other] = score
        chosen = sorted(best.items(), key=lambda item: item[1], reverse=True)[:count]
        out.append([other for other, _ in reversed(chosen)])
    return out
