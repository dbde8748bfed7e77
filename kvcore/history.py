"""Choosing which chunks of a long conversation history a request attends to (LeoAM's idea, with sound bounds).

A tenant's history is cut into chunks (`fixed_spans`: 16 tokens measured best, `docs/history-selection.md`),
each summarised over a few early layers (`kvcore/summaries.py`, kept in bf16 by `compact`). For a question,
its own queries at those layers (the question alone through the model's first layers: no history needed)
give every chunk an estimated attention mass (`chunk_mass`: each layer's bound over the chunk's keys, as a
softmax over chunks). `select_chunks` then keeps the attention sink and the newest turns, gives up to half the
token budget to the chunks of the turns retrieval ranks best, and the rest to the chunks by mass; the chosen
chunks come back in position order, as they are injected.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Mapping, Sequence

import torch

from kvcore.rope import RopeConfig
from kvcore.summaries import ChunkSummaries, max_upper_bounds

Span = tuple[int, int]  # [start, end) in the history's tokens
# `max_upper_bounds`'s signature (summaries, queries, query positions, fact start, rope) -> [C, L, H]: the torch
# path, or a fused kernel an adapter supplies (`deployments/triton_adapter/chunk_bounds.py`)
MaxBounds = Callable[[ChunkSummaries, torch.Tensor, torch.Tensor, int, RopeConfig], torch.Tensor]


def fixed_spans(length: int, size: int) -> list[Span]:
    """Chunks of `size` tokens over a history of `length` (the last one shorter)."""
    if size <= 0:
        raise ValueError(f"chunk size must be positive, got {size}")
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def layers_of(summaries: ChunkSummaries, layers: torch.Tensor) -> ChunkSummaries:
    """The summaries of some layers only (what a node keeps when it scores those)."""
    return ChunkSummaries(
        summaries.spans, summaries.norms[:, layers], summaries.low[:, layers], summaries.high[:, layers]
    )


def chunk_mass(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    first_position: int,
    rope: RopeConfig,
    group: int,
    bounds: MaxBounds = max_upper_bounds,
) -> torch.Tensor:
    """Estimated attention mass per chunk `[L, C]` for queries `[L, H, Q, D]` (pre-RoPE, the question's tokens
    at `first_position` onwards): each layer's bound, max over the question's tokens and each KV head's query
    group, turned into a softmax over chunks (scaled as attention is), averaged over KV heads."""
    layers, heads, tokens, dim = queries.shape
    kv_heads = heads // group
    # every (question token, member of the group) as one query per KV head: [tokens * group, L, KVH, D]
    grouped = (
        queries.view(layers, kv_heads, group, tokens, dim).permute(3, 2, 0, 1, 4).reshape(-1, layers, kv_heads, dim)
    )
    positions = (first_position + torch.arange(tokens, device=queries.device)).repeat_interleave(group)
    best = bounds(summaries, grouped, positions, 0, rope)  # [C, L, KVH]
    mass = torch.softmax(best / math.sqrt(dim), dim=0)  # over chunks
    return mass.mean(-1).transpose(0, 1)  # [L, C]


def turn_chunk_pairs(spans: Sequence[Span], turns: Sequence[Span]) -> tuple[list[int], list[int]]:
    """Every (turn, chunk) that overlap, as two lists (turn indexes, chunk indexes). Chunks do not overlap, so each
    turn finds its chunks by bisection: a 32k-token history's ~1,500 turns against its 2,048 chunks in a few ms."""
    order = sorted(range(len(spans)), key=lambda c: spans[c][0])
    starts, ends = [spans[c][0] for c in order], [spans[c][1] for c in order]
    if any(ends[i] > starts[i + 1] for i in range(len(order) - 1)):
        raise ValueError("chunks must not overlap")
    pair_turns, pair_chunks = [], []
    for t, (start, end) in enumerate(turns):
        for at in range(bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)):
            pair_turns.append(t)
            pair_chunks.append(order[at])
    return pair_turns, pair_chunks


def chunks_by_turn_score(spans: Sequence[Span], turns: Mapping[str, Span], scores: Mapping[str, float]) -> list[int]:
    """Chunks by the best retrieval score of a turn they hold part of (best first, ties in chunk order; chunks of no
    scored turn last). `HistoryIndex.by_retrieval` does the same on the index's device."""
    names = [name for name in turns if name in scores]
    best = [float("-inf")] * len(spans)
    for t, c in zip(*turn_chunk_pairs(spans, [turns[name] for name in names])):
        best[c] = max(best[c], scores[names[t]])
    return sorted(range(len(spans)), key=lambda c: -best[c])


def retrieval_then_mass(
    by_retrieval: Sequence[int], by_mass: Sequence[int], spans: Sequence[Span], budget: int
) -> list[int]:
    """The order chunks are taken in: the best-retrieved turns' chunks while they fit half the budget, then the
    rest by mass."""
    first, used = [], 0
    for c in by_retrieval:
        size = spans[c][1] - spans[c][0]
        if used + size > budget // 2:
            break
        first.append(c)
        used += size
    taken = set(first)
    return first + [c for c in by_mass if c not in taken]


def take_in_order(order: Sequence[int], spans: Sequence[Span], budget: int) -> set[int]:
    """Chunks in `order` while they fit `budget` tokens (the first always does; a chunk too big is skipped)."""
    chosen: set[int] = set()
    used = 0
    for c in order:
        size = spans[c][1] - spans[c][0]
        if c in chosen or used + size > budget and chosen:
            continue
        chosen.add(c)
        used += size
    return chosen


def select_chunks(
    spans: Sequence[Span],
    budget: int,
    by_mass: Sequence[int],
    by_retrieval: Sequence[int] = (),
    recent: int = 1,
) -> list[int]:
    """The chunks a request attends to, in position order: the first (the attention sink) and the `recent` newest
    always, then `retrieval_then_mass` while `budget` tokens last."""
    if not spans:
        return []
    must = [0, *range(max(len(spans) - recent, 1), len(spans))]
    return sorted(take_in_order(must + retrieval_then_mass(by_retrieval, by_mass, spans, budget), spans, budget))


def select_from_heads(
    spans: Sequence[Span],
    budget: int,
    by_mass: torch.Tensor | Sequence[int],
    by_retrieval: torch.Tensor | Sequence[int] = (),
    recent: int = 1,
) -> list[int]:
    """`select_chunks` reading only the heads of both orders that `budget` can reach (orders on a device: only those
    heads are copied to the host), and the whole orders only when a chunk past the heads might still have fit."""
    sizes = [end - start for start, end in spans]
    if not sizes:
        return []
    kept = min(sizes[1 : len(sizes) - recent] or sizes)  # the smallest of the chunks not always taken
    always = 1 + recent  # the sink and the newest: any size, each at most once in an order
    # retrieval's half ends within `always` + budget / 2 / kept + 1 of its chunks; the mass order's head then holds
    # every chunk the budget can take, those retrieval took and the always-kept ones
    retrieval_head = always + budget // 2 // kept + 1
    heads = (retrieval_head, retrieval_head + always + budget // kept + 1)
    chosen = select_chunks(spans, budget, _listed(by_mass[: heads[1]]), _listed(by_retrieval[: heads[0]]), recent)
    if budget - sum(sizes[c] for c in chosen) >= kept and len(by_mass) > heads[1]:
        chosen = select_chunks(spans, budget, _listed(by_mass), _listed(by_retrieval), recent)
    return chosen


def _listed(order: torch.Tensor | Sequence[int]) -> list[int]:
    return order.tolist() if isinstance(order, torch.Tensor) else list(order)
