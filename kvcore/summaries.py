"""Chunk summaries of a fact's keys, with an upper bound on q·k that stays sound wherever the fact is placed.

Keys are stored before RoPE and rotated to whatever positions the fact gets at serving: key j of a fact
placed at s sits at p = s + j, and its score against a query at t is q·R(θ(p − t))k_j, which depends
only on p − t = j − (t − s). So the summary keeps, per chunk, layer and KV head, the box (component-wise
min and max) of the keys rotated to their offsets j *inside the fact*, and the largest norm of each
rotary pair; at query time the query is rotated by t − s, the same relative angle the engine will
produce, and

    bound = Σ_pairs min(|q_i|·max|k_i|, Σ_{c in pair} max(q'_c·min_c, q'_c·max_c)) + box of unrotated channels

bounds every key of the chunk (a linear function on a box peaks at a corner; a pair's rotation keeps its
norm). Used with the query rotated to its absolute position instead, the same box (Quest's) is not a
bound once the fact moves; LeoAM's element-wise q·max is not one even in place when query signs are
mixed. Engines compute angles p·θ in float32: a slack term of a few ulps of the largest angle per pair
covers that rounding.

Its tests prove the bound; `kvcore/history.py` chooses a long history's chunks by it,
`benchmarks/history_selection.py` measures that choice against SmolLM2's real attention
(`docs/history-selection.md`), and `kvcore/history_index.py` keeps it for a history captured as chunk records
(history mode: `deployments/history_mode.py`; the real engine injects the chosen chunks,
`tests/vllm/test_history_mode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.rope import RopeConfig, inverse_frequencies, rotate


@dataclass(frozen=True)
class ChunkSummaries:
    """Summaries of C chunks of one fact: norms `[C, L, H, P]`, boxes `[C, L, H, D]`, spans `[C, 2]`."""

    spans: torch.Tensor  # token [start, end) of each chunk inside the fact
    norms: torch.Tensor  # max |k_pair| over the chunk's tokens
    low: torch.Tensor  # component-wise min of the chunk's keys
    high: torch.Tensor  # component-wise max

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.spans, self.norms, self.low, self.high))


def pair_index(rope: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices (first, second) of each rotary pair, neox or GPT-J style."""
    half = rope.dim // 2
    if rope.style == "neox":
        return torch.arange(half), torch.arange(half) + half
    return torch.arange(0, rope.dim, 2), torch.arange(1, rope.dim, 2)


def summarize(keys: torch.Tensor, spans: list[tuple[int, int]], rope: RopeConfig) -> ChunkSummaries:
    """Summaries of pre-RoPE `keys` `[L, H, T, D]` for the chunks `spans` (float32, any device)."""
    first, second = pair_index(rope)
    relative = rotate(keys.float(), torch.arange(keys.shape[2], device=keys.device), rope)  # keys at offsets j
    norms, low, high = [], [], []
    for start, end in spans:
        if not 0 <= start < end <= keys.shape[2]:
            raise ValueError(f"chunk [{start}, {end}) is outside the fact's {keys.shape[2]} tokens")
        chunk = keys[:, :, start:end].float()
        norms.append(torch.sqrt(chunk[..., first] ** 2 + chunk[..., second] ** 2).amax(dim=2))
        low.append(relative[:, :, start:end].amin(dim=2))
        high.append(relative[:, :, start:end].amax(dim=2))
    return ChunkSummaries(
        torch.tensor(spans, dtype=torch.long), torch.stack(norms), torch.stack(low), torch.stack(high)
    )


def upper_bound(
    summaries: ChunkSummaries, query: torch.Tensor, query_position: int, fact_start: int, rope: RopeConfig
) -> torch.Tensor:
    """Upper bound `[C, L, H]` of max q·k over each chunk's keys, the fact placed at `fact_start`.

    `query` `[L, H, D]` is the pre-RoPE query (one per KV head: take the max over a GQA group outside).
    """
    return upper_bounds(summaries, query[None], torch.tensor([query_position]), fact_start, rope)[0]


def upper_bounds(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    batch: int = 8,
) -> torch.Tensor:
    """`upper_bound` of Q queries `[Q, L, H, D]` at `query_positions` `[Q]` at once: `[Q, C, L, H]`, computed
    `batch` queries at a time (the work is `[batch, C, L, H, D]` in float64)."""
    first, second = pair_index(rope)
    low, high, norms = summaries.low.double(), summaries.high.double(), summaries.norms.double()
    inv = inverse_frequencies(rope).double().to(queries.device)
    span_end = int(summaries.spans[:, 1].max())
    out = []
    for at in range(0, queries.shape[0], batch):
        q = queries[at : at + batch].double()  # [B, L, H, D]
        positions = query_positions[at : at + batch].to(q.device)
        relative = (positions - fact_start).view(-1, 1, 1).expand(*q.shape[:-1])  # one angle per query
        q_rel = rotate(q[..., None, :], relative[..., None], rope)[..., 0, :]
        q_rel = q_rel[:, None]  # [B, 1, L, H, D] against the chunks' [C, L, H, D]
        channel = torch.maximum(q_rel * low, q_rel * high)  # the box bound, channel by channel
        q_norm = torch.sqrt(q[..., first] ** 2 + q[..., second] ** 2)[:, None]  # [B, 1, L, H, P]
        norm_bound = q_norm * norms  # [B, C, L, H, P]
        pairs = torch.minimum(norm_bound, channel[..., first] + channel[..., second]).sum(-1)
        passthrough = channel[..., rope.dim :].sum(-1)
        # float32 angles p*theta in the engine: a few ulps of the largest angle, times each pair's norm bound
        reach = (abs(fact_start) + span_end + positions.abs()).double().view(-1, 1, 1, 1, 1)
        rounding = (4 * 2.0**-23 * reach * inv + 1e-7) * norm_bound
        out.append((pairs + passthrough + rounding.sum(-1)).float())
    return torch.cat(out)


def compact(summaries: ChunkSummaries, dtype: torch.dtype = torch.bfloat16) -> ChunkSummaries:
    """The same summaries in a narrower float type, rounded outwards so every bound stays sound: box minima
    down, maxima and norms up (half the bytes at bf16; the bounds loosen by under 1 %)."""
    return ChunkSummaries(
        summaries.spans.to(torch.int32),
        _rounded(summaries.norms, dtype, up=True),
        _rounded(summaries.low, dtype, up=False),
        _rounded(summaries.high, dtype, up=True),
    )


def _rounded(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """`x` in `dtype`, moved one step of `dtype` outwards wherever rounding to nearest went the wrong way (the
    step, eps times the value's power of two, lands exactly on a `dtype` value)."""
    narrow = x.to(dtype)
    wide = narrow.float()
    wrong = wide < x if up else wide > x
    info = torch.finfo(dtype)
    step = info.eps * torch.exp2(torch.floor(torch.log2(wide.abs().clamp(min=info.tiny))))
    return torch.where(wrong, (wide + step if up else wide - step).to(dtype), narrow)


def exact_max_scores(
    keys: torch.Tensor,
    spans: list[tuple[int, int]],
    query: torch.Tensor,
    query_position: int,
    fact_start: int,
    rope: RopeConfig,
) -> torch.Tensor:
    """The true max of q·k over each chunk `[C, L, H]` with both rotated to their positions (for tests)."""
    positions = torch.arange(keys.shape[2], device=keys.device) + fact_start
    rotated_k = rotate(keys.double(), positions, rope)  # [L, H, T, D]
    rotated_q = rotate(query.double()[..., None, :], torch.tensor([query_position], device=keys.device), rope)[
        ..., 0, :
    ]
    scores = torch.einsum("lhtd,lhd->lht", rotated_k, rotated_q)
    return torch.stack([scores[..., s:e].amax(-1) for s, e in spans]).float()


def adaptive_spans(
    importance: torch.Tensor, min_size: int = 4, max_size: int = 32, share: float = 0.25
) -> list[tuple[int, int]]:
    """Chunk a fact so important regions get small chunks (tight bounds) and quiet runs big ones.

    A span is split in half while it is longer than `max_size`, or holds more than `share` of the fact's
    importance and is longer than `min_size`; what remains are the leaves of that tree, in order.
    """
    weights = importance.double().clamp(min=0)
    total = float(weights.sum()) or 1.0
    spans, stack = [], [(0, int(weights.numel()))]
    while stack:
        start, end = stack.pop()
        size = end - start
        heavy = float(weights[start:end].sum()) / total > share
        if size > max_size or (heavy and size > min_size):
            middle = start + size // 2
            stack += [(middle, end), (start, middle)]
        else:
            spans.append((start, end))
    return spans
