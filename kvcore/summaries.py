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

import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from kvcore.rope import RopeConfig, device_inverse_frequencies, rotate


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

    @functools.cached_property
    def span_end(self) -> int:
        """Where the last chunk ends inside the fact (0 without chunks): how far its rotation angles reach. Read
        once per summaries (a reduction over every span, which each history question made before)."""
        return int(self.spans[:, 1].max()) if len(self.spans) else 0


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
    `batch` queries at a time (default: as many as a block of float64 pair terms holds)."""
    chunks, layers, heads, _ = summaries.low.shape
    out = torch.empty(queries.shape[0], chunks, layers * heads, device=queries.device)
    for at, lh, bound in _blocks(summaries, queries, query_positions, fact_start, rope, batch):  # [lh, B, C]
        out[at : at + bound.shape[1], :, lh] = bound.permute(1, 2, 0)
    return out.view(-1, chunks, layers, heads)


def max_upper_bounds(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    batch: int | None = None,
) -> torch.Tensor:
    """`upper_bounds(...).amax(0)` `[C, L, H]` without keeping every query's bounds (what ranking chunks needs)."""
    chunks, layers, heads, _ = summaries.low.shape
    best = torch.full((chunks, layers * heads), -torch.inf, dtype=torch.float64, device=queries.device)
    for _, lh, bound in _blocks(summaries, queries, query_positions, fact_start, rope, batch):
        best[:, lh] = torch.maximum(best[:, lh], bound.amax(1).T)
    return best.view(chunks, layers, heads).float()  # rounding is monotone: the max commutes with it


def _pair_slices(rope: RopeConfig) -> tuple[slice, slice]:
    """`pair_index` as slices: views, no gathers."""
    half = rope.dim // 2
    if rope.style == "neox":
        return slice(0, half), slice(half, rope.dim)
    return slice(0, rope.dim, 2), slice(1, rope.dim, 2)


def _by_pair(x: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Rotated channels `[..., D]` as `[..., 2, P]` (first channels, then second), a view."""
    rotated = x[..., : rope.dim]
    if rope.style == "neox":
        return rotated.unflatten(-1, (2, rope.dim // 2))
    return rotated.unflatten(-1, (rope.dim // 2, 2)).transpose(-1, -2)


@dataclass(frozen=True)
class QueryRows:
    """The queries' side of the bound, float64, as rows against each (layer, head, pair)'s key columns (the
    torch path's blocks and the fused kernel of `deployments/triton_adapter/chunk_bounds.py` read the same rows).

    Per pair, with a the box term and b the norm bound, min(a, b) = min(a - b, 0) + b. The box is highest at
    its corner high where q' >= 0 and low where q' < 0, so a = q'+ · high + q'- · low (one of each two
    products is zero: exactly the max(q'·low, q'·high) of each channel), and a - b is a 5-term product per
    (query, chunk, pair) against the columns (high_f, high_s, low_f, low_s, norm). The b terms and the
    rounding slack are linear in the norms: one matmul over pairs sums them.
    """

    per_pair: torch.Tensor  # [L*H, P, Q, 5]: rows giving a - b
    norm: torch.Tensor  # [L*H, Q, P]: (1 + slack) |q_pair|, against the norms
    rest: torch.Tensor  # [L*H, Q, 2R]: the box term of the unrotated channels, against (high, low)

    @classmethod
    def of(
        cls,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        fact_start: int,
        span_end: int | torch.Tensor,
        rope: RopeConfig,
    ) -> "QueryRows":
        """The rows of queries `[Q, L, H, D]` at `query_positions` against keys summarized up to `span_end` after
        `fact_start` (a device scalar too: a captured graph serves facts of any extent)."""
        q = queries.double()
        positions = query_positions.to(q.device)
        relative = (positions - fact_start).view(-1, 1, 1).expand(*q.shape[:-1])  # one angle per query
        q_rel = rotate(q[..., None, :], relative[..., None], rope)[..., 0, :]  # [Q, L, H, D]
        first, second = _pair_slices(rope)
        q_norm = torch.sqrt(q[..., first] ** 2 + q[..., second] ** 2)  # [Q, L, H, P]
        # float32 angles p*theta in the engine: a few ulps of the largest angle, times each pair's norm bound
        reach = (abs(fact_start) + span_end + positions.abs()).double()[:, None]
        inv = device_inverse_frequencies(rope, q.device).double()
        slack = (4 * 2.0**-23 * reach * inv + 1e-7)[:, None, None]  # [Q, 1, 1, P]
        up, down = q_rel.clamp(min=0), q_rel.clamp(max=0)
        per_pair = torch.cat((_by_pair(up, rope), _by_pair(down, rope), -q_norm[..., None, :]), dim=-2)
        rest = torch.cat((up[..., rope.dim :], down[..., rope.dim :]), dim=-1)  # [Q, L, H, 2R]
        return cls(
            per_pair.flatten(1, 2).permute(1, 3, 0, 2).contiguous(),
            ((1 + slack) * q_norm).flatten(1, 2).transpose(0, 1).contiguous(),
            rest.flatten(1, 2).transpose(0, 1).contiguous(),
        )


def _key_columns(summaries: ChunkSummaries, lh: slice, rope: RopeConfig, out: torch.Tensor) -> torch.Tensor:
    """The key columns `[lh, P, 5, C]` float64 of some (layer, head)s, written into `out`: made block by block,
    so a CPU casts and transposes them in its cache (all at once, that copy took as long as the bound)."""
    high, low = summaries.high.flatten(1, 2)[:, lh], summaries.low.flatten(1, 2)[:, lh]  # [C, lh, D]
    columns = out.view(high.shape[1], rope.dim // 2, 5, high.shape[0])
    columns[:, :, 0:2].copy_(_by_pair(high, rope).permute(1, 3, 2, 0))
    columns[:, :, 2:4].copy_(_by_pair(low, rope).permute(1, 3, 2, 0))
    columns[:, :, 4].copy_(summaries.norms.flatten(1, 2)[:, lh].permute(1, 2, 0))
    return columns


# float64 pair terms materialised at once. A CPU's stay in its cache (8 MiB measured best: a sweep through memory
# is several times slower); a GPU's take 512 MiB, so the 8B shape's request (80 queries, 2,048 chunks, 32 heads)
# is 6 blocks of large kernels
_CACHED_BLOCK, _DEVICE_BLOCK = 1 << 20, 1 << 26


def _blocks(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    batch: int | None,
    cached: bool | None = None,
    block: int | None = None,
) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """float64 bounds `[lh, B, C]` of blocks of ((layer, head), query): each block's first query and its heads.

    Blocks hold about `block` pair terms. Σ_pairs min(a - b, 0) is one clamp and one sum where a block stays
    `cached` (default: on a CPU); where it does not (a GPU's), it is (Σ (a - b) - Σ |a - b|) / 2: one fused
    read (an L1 norm) and a matmul.
    """
    cached = queries.device.type == "cpu" if cached is None else cached
    rows = QueryRows.of(queries, query_positions, fact_start, summaries.span_end, rope)
    heads, pairs, count, _ = rows.per_pair.shape
    chunks = summaries.low.shape[0]
    size = block or (_CACHED_BLOCK if cached else _DEVICE_BLOCK)
    step = batch or max(1, min(count, size // (pairs * max(chunks, 1))))
    lh_step = max(1, min(heads, size // (pairs * step * max(chunks, 1))))
    columns = torch.empty(lh_step * pairs * 5 * chunks, dtype=torch.float64, device=queries.device)
    scratch = torch.empty(lh_step * pairs * min(count, step) * chunks, dtype=torch.float64, device=queries.device)
    rest = torch.cat((summaries.high[..., rope.dim :], summaries.low[..., rope.dim :]), dim=-1).flatten(1, 2)
    for h in range(0, heads, lh_step):  # each head's columns made once
        lh = slice(h, min(h + lh_step, heads))
        keys = _key_columns(summaries, lh, rope, columns[: (lh.stop - h) * pairs * 5 * chunks])
        rest_keys = rest[:, lh].permute(1, 2, 0).double()  # [lh, 2R, C]
        for at in range(0, count, step):
            ask = slice(at, at + step)
            per_pair = rows.per_pair[lh, :, ask]  # [lh, P, B, 5]
            diff = scratch[: per_pair[..., 0].numel() * chunks].view(*per_pair.shape[:-1], chunks)
            torch.matmul(per_pair, keys, out=diff)  # [lh, P, B, C]: a - b per pair
            if cached:
                bound = diff.clamp_(max=0).sum(1)  # [lh, B, C]
            else:
                spread = torch.linalg.vector_norm(diff, ord=1, dim=1)
                flat = per_pair.transpose(1, 2).flatten(2)  # [lh, B, 5P]
                bound = torch.baddbmm(spread, flat, keys.flatten(1, 2), beta=-0.5, alpha=0.5)
            bound.baddbmm_(rows.norm[lh, ask], keys[:, :, 4])
            if rest_keys.shape[1]:
                bound.baddbmm_(rows.rest[lh, ask], rest_keys)
            yield at, lh, bound


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
