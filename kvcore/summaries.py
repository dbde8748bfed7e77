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
from typing import Iterator

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
    batch: int | None = None,
) -> torch.Tensor:
    """`upper_bound` of Q queries `[Q, L, H, D]` at `query_positions` `[Q]` at once: `[Q, C, L, H]`, computed
    `batch` queries at a time (default: as many as `_BLOCK` float64 pair terms allow)."""
    keys = _KeyOperands.of(summaries, rope)
    out = torch.empty(queries.shape[0], keys.chunks, keys.layers, keys.heads, device=queries.device)
    for at, bound in _bound_batches(keys, queries, query_positions, fact_start, rope, batch):
        out[at : at + bound.shape[0]] = bound.float()
    return out


def max_upper_bounds(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    batch: int | None = None,
) -> torch.Tensor:
    """`upper_bounds(...).amax(0)` `[C, L, H]` without keeping every query's bounds (what ranking chunks needs)."""
    keys = _KeyOperands.of(summaries, rope)
    best = torch.full((keys.chunks, keys.layers, keys.heads), -torch.inf, dtype=torch.float64, device=queries.device)
    for _, bound in _bound_batches(keys, queries, query_positions, fact_start, rope, batch):
        torch.maximum(best, bound.amax(0), out=best)
    return best.float()  # rounding is monotone: the max of the rounded bounds


# float64 pair terms `[L*H, P, batch, C]` materialised at once: 32 MiB keeps a GPU's kernels few and large
_BLOCK = 1 << 22


def _pair_slices(rope: RopeConfig) -> tuple[slice, slice]:
    """`pair_index` as slices: views, no gathers."""
    half = rope.dim // 2
    if rope.style == "neox":
        return slice(0, half), slice(half, rope.dim)
    return slice(0, rope.dim, 2), slice(1, rope.dim, 2)


@dataclass(frozen=True)
class _KeyOperands:
    """A fact's summaries laid out once per call as float64 matmul operands, one matrix per (layer, head, pair)."""

    pairs: torch.Tensor  # [L*H, P, 5, C]: high and low of each pair's channels, then the pair's norm
    rest: torch.Tensor  # [L*H, 2R, C]: high and low of the R unrotated channels
    layers: int
    heads: int
    span_end: int

    @property
    def chunks(self) -> int:
        return self.pairs.shape[-1]

    @classmethod
    def of(cls, summaries: ChunkSummaries, rope: RopeConfig) -> "_KeyOperands":
        chunks, layers, heads, dim = summaries.low.shape
        first, second = _pair_slices(rope)
        by_chunk = [summaries.high[..., first], summaries.low[..., first]]
        by_chunk += [summaries.high[..., second], summaries.low[..., second], summaries.norms]
        pairs = torch.empty(layers, heads, rope.dim // 2, 5, chunks, dtype=torch.float64, device=summaries.low.device)
        for slot, part in enumerate(by_chunk):  # [C, L, H, P] -> [L, H, P, C], cast and transposed in one copy
            pairs[..., slot, :].copy_(part.permute(1, 2, 3, 0))
        rest = torch.cat((summaries.high[..., rope.dim :], summaries.low[..., rope.dim :]), dim=-1)
        rest = rest.permute(1, 2, 3, 0).to(torch.float64).reshape(layers * heads, -1, chunks)
        span_end = int(summaries.spans[:, 1].max()) if len(summaries.spans) else 0
        return cls(pairs.view(layers * heads, rope.dim // 2, 5, chunks), rest, layers, heads, span_end)


def _bound_batches(
    keys: _KeyOperands,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    batch: int | None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """float64 bounds `[B, C, L, H]` of successive batches of queries, with the index of each batch's first.

    Per pair, min(a, b) = (a + b - |a - b|) / 2: a = the box term, b = the norm bound. Every sum over pairs
    except that of |a - b| is linear in the keys, so one matmul over (pair, operand) gives it; |a - b| needs
    each pair's own value, a 5-term product per (query, chunk, pair), reduced over pairs by an L1 norm.
    """
    pairs, chunks = rope.dim // 2, keys.chunks
    q = queries.double()
    positions = query_positions.to(q.device)
    relative = (positions - fact_start).view(-1, 1, 1).expand(*q.shape[:-1])  # one angle per query
    q_rel = rotate(q[..., None, :], relative[..., None], rope)[..., 0, :]  # [Q, L, H, D]
    first, second = _pair_slices(rope)
    q_norm = torch.sqrt(q[..., first] ** 2 + q[..., second] ** 2)  # [Q, L, H, P]
    # float32 angles p*theta in the engine: a few ulps of the largest angle, times each pair's norm bound
    reach = (abs(fact_start) + keys.span_end + positions.abs()).double()[:, None]
    inv = inverse_frequencies(rope).double().to(q.device)
    slack = (4 * 2.0**-23 * reach * inv + 1e-7)[:, None, None]  # [Q, 1, 1, P]
    up, down = q_rel.clamp(min=0), q_rel.clamp(max=0)  # a corner of the box: high where q >= 0, low where q < 0
    corner = [up[..., first], down[..., first], up[..., second], down[..., second]]
    per_pair = torch.stack([*corner, -q_norm], dim=-1)  # . [high_f, low_f, high_s, low_s, norm] = a - b
    linear = torch.stack([*(0.5 * c for c in corner), (0.5 + slack) * q_norm], dim=-1)  # = a/2 + b/2 + slack
    rest = torch.cat((up[..., rope.dim :], down[..., rope.dim :]), dim=-1)  # [Q, L, H, 2R]
    per_pair = per_pair.flatten(1, 2).permute(1, 2, 0, 3)  # [L*H, P, Q, 5]
    linear, rest = linear.flatten(1, 2).flatten(-2).transpose(0, 1), rest.flatten(1, 2).transpose(0, 1)
    step = batch or max(1, _BLOCK // max(1, keys.pairs[..., 0, :].numel()))
    for at in range(0, q.shape[0], step):
        b = min(step, q.shape[0] - at)
        diff = torch.matmul(per_pair[:, :, at : at + b], keys.pairs)  # [L*H, P, B, C]: a - b per pair
        bound = torch.linalg.vector_norm(diff, ord=1, dim=1)  # [L*H, B, C]
        bound = torch.baddbmm(bound, linear[:, at : at + b], keys.pairs.view(-1, 5 * pairs, chunks), beta=-0.5)
        if rest.shape[-1]:
            bound = torch.baddbmm(bound, rest[:, at : at + b], keys.rest)
        yield at, bound.view(keys.layers, keys.heads, b, chunks).permute(2, 3, 0, 1)


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
