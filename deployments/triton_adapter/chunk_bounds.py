"""One Triton kernel for the best score bound of every chunk over a question's queries (history mode's choice).

`kvcore.summaries.max_upper_bounds` sums, per (layer and KV head, query, chunk), min(a - b, 0) over the rotary
pairs; torch has no fused form of that sum, so it writes every pair's term (a float64 `[LH, P, Q, C]` block,
~2.7 GB for an 8B model's 2,048-chunk history and an 80-query question) and reads it back: ~4 ms on an H200,
the largest part of choosing. Here each program keeps a tile of (query, chunk) sums in registers and loops over
the pairs, reading the queries' float64 rows and the chunks' summaries (bf16 boxes and norms, copied once a call
to run along chunks), and keeps only the best over the queries: the same float64 bound, written once.

Scope: full rotary (every channel in a pair). Else the torch path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore.rope import RopeConfig
from kvcore.summaries import ChunkSummaries, QueryRows, max_upper_bounds

log = logging.getLogger(__name__)

_LAUNCH = threading.Lock()  # questions are chosen in worker threads: one compiles the kernel, the others wait
_SUMMARY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # widened exactly to float64 in the kernel


@triton.jit
def _best_bounds(
    rows_ptr,
    norm_rows_ptr,
    high_ptr,
    low_ptr,
    norms_ptr,
    out_ptr,
    queries,
    chunks,
    DIM: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIR_STRIDE: tl.constexpr,
    SECOND: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (layer and head, block of chunks): max over every query of Σ_pairs min(a - b, 0) + Σ_pairs n·norm.

    rows `[LH, P, 5, Q]` (q'+ first, q'+ second, q'- first, q'- second, -|q|), norm rows `[LH, P, Q]`; boxes
    `[LH, D, C]` and norms `[LH, P, C]`: every load runs along queries or chunks, one cache line for many lanes. A
    pair's channels are `p * PAIR_STRIDE` and that plus `SECOND`."""
    lh = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < chunks
    boxes = lh.to(tl.int64) * DIM * chunks + c  # channel 0 of this layer and head's boxes, at chunk c
    norms_at = lh.to(tl.int64) * PAIRS * chunks + c
    best = tl.full([BLOCK_C], float("-inf"), tl.float64)
    for q0 in range(0, queries, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        q_ok = q < queries
        total = tl.zeros([BLOCK_Q, BLOCK_C], tl.float64)
        for p in range(PAIRS):
            row = rows_ptr + (lh.to(tl.int64) * PAIRS + p) * 5 * queries + q
            up_f = tl.load(row, mask=q_ok, other=0.0)[:, None]
            up_s = tl.load(row + queries, mask=q_ok, other=0.0)[:, None]
            down_f = tl.load(row + 2 * queries, mask=q_ok, other=0.0)[:, None]
            down_s = tl.load(row + 3 * queries, mask=q_ok, other=0.0)[:, None]
            minus_norm = tl.load(row + 4 * queries, mask=q_ok, other=0.0)[:, None]
            norm_row = norm_rows_ptr + (lh.to(tl.int64) * PAIRS + p) * queries + q
            scaled_norm = tl.load(norm_row, mask=q_ok, other=0.0)[:, None]
            first = boxes + (p * PAIR_STRIDE) * chunks
            second = first + SECOND * chunks
            high_f = tl.load(high_ptr + first, mask=c_ok, other=0.0).to(tl.float32).to(tl.float64)[None, :]
            high_s = tl.load(high_ptr + second, mask=c_ok, other=0.0).to(tl.float32).to(tl.float64)[None, :]
            low_f = tl.load(low_ptr + first, mask=c_ok, other=0.0).to(tl.float32).to(tl.float64)[None, :]
            low_s = tl.load(low_ptr + second, mask=c_ok, other=0.0).to(tl.float32).to(tl.float64)[None, :]
            norm = tl.load(norms_ptr + norms_at + p * chunks, mask=c_ok, other=0.0).to(tl.float32).to(tl.float64)
            a_minus_b = up_f * high_f + up_s * high_s + down_f * low_f + down_s * low_s + minus_norm * norm[None, :]
            total += tl.minimum(a_minus_b, 0.0) + scaled_norm * norm[None, :]
        total = tl.where(q_ok[:, None], total, float("-inf"))
        best = tl.maximum(best, tl.max(total, axis=0))
    tl.store(out_ptr + lh.to(tl.int64) * chunks + c, best, mask=c_ok)


@dataclass(frozen=True)
class Tiling:
    """The kernel's tile of (queries, chunks) and its warps (`benchmarks/chunk_bounds.py` sweeps them)."""

    block_q: int = 16
    block_c: int = 64
    warps: int = 4

    def __post_init__(self) -> None:
        for name, value in (("block_q", self.block_q), ("block_c", self.block_c), ("warps", self.warps)):
            if value < 1 or value & (value - 1):  # Triton's tiles and warp counts are powers of two
                raise ValueError(f"tiling {name} must be a power of two, got {value}")


def fused_max_upper_bounds(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    tiling: Tiling = Tiling(),
) -> torch.Tensor:
    """`kvcore.summaries.max_upper_bounds` `[C, L, H]` in one launch (the torch path where the kernel does not apply)."""
    why = _unsupported(summaries, queries, rope)
    if why:
        log.debug("chunk bounds: torch path (%s)", why)
        return max_upper_bounds(summaries, queries, query_positions, fact_start, rope)
    inputs = BoundsInputs.of(summaries, queries, query_positions, fact_start, rope)
    return inputs.best(tiling).T.reshape(inputs.chunks, *summaries.low.shape[1:3]).float()  # rounding is monotone


@dataclass(frozen=True)
class BoundsInputs:
    """What the kernel reads, laid out along queries and chunks (its preparation, timed apart by the benchmark)."""

    rows: torch.Tensor  # [LH, P, 5, Q] float64
    norm_rows: torch.Tensor  # [LH, P, Q] float64
    high: torch.Tensor  # [LH, D, C]
    low: torch.Tensor  # [LH, D, C]
    norms: torch.Tensor  # [LH, P, C]
    neox: bool

    @property
    def chunks(self) -> int:
        return self.high.shape[-1]

    @classmethod
    def of(
        cls,
        summaries: ChunkSummaries,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        fact_start: int,
        rope: RopeConfig,
    ) -> "BoundsInputs":
        rows = QueryRows.of(queries, query_positions, fact_start, summaries.span_end, rope)
        return cls(
            rows.per_pair.transpose(2, 3).contiguous(),
            rows.norm.transpose(1, 2).contiguous(),
            _along_chunks(summaries.high),
            _along_chunks(summaries.low),
            _along_chunks(summaries.norms),
            rope.style == "neox",
        )

    def best(self, tiling: Tiling = Tiling()) -> torch.Tensor:
        """float64 `[LH, C]`: each chunk's best bound over the queries, in one launch."""
        heads, dim, chunks = self.high.shape
        pairs, queries = self.norm_rows.shape[1:]
        out = torch.empty(heads, chunks, dtype=torch.float64, device=self.high.device)
        if chunks == 0:
            return out
        on_its_device = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
        with _LAUNCH, on_its_device:
            _best_bounds[(heads, triton.cdiv(chunks, tiling.block_c))](
                self.rows,
                self.norm_rows,
                self.high,
                self.low,
                self.norms,
                out,
                queries,
                chunks,
                DIM=dim,
                PAIRS=pairs,
                PAIR_STRIDE=1 if self.neox else 2,
                SECOND=pairs if self.neox else 1,
                BLOCK_Q=tiling.block_q,
                BLOCK_C=tiling.block_c,
                num_warps=tiling.warps,
            )
        return out


def _along_chunks(summary: torch.Tensor) -> torch.Tensor:
    """`[C, L, H, X]` as `[L*H, X, C]`, contiguous: a history's summaries laid out along chunks (one copy of ~42 MB
    a question at the 8B shape: tens of microseconds of the device's bandwidth; kept with the index if it shows)."""
    return summary.flatten(1, 2).permute(1, 2, 0).contiguous()


def _unsupported(summaries: ChunkSummaries, queries: torch.Tensor, rope: RopeConfig) -> str:
    if queries.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"queries on {queries.device.type}"
    if rope.dim != summaries.low.shape[-1]:
        return f"partial rotary ({rope.dim} of {summaries.low.shape[-1]} channels)"
    if any(t.dtype not in _SUMMARY_DTYPES for t in (summaries.low, summaries.high, summaries.norms)):
        return f"summaries in {summaries.low.dtype}"
    if any(t.device != queries.device for t in (summaries.low, summaries.high, summaries.norms)):
        return f"summaries on {summaries.low.device}, queries on {queries.device}"
    return ""
