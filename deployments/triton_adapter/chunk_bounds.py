"""One Triton kernel for the best score bound of every chunk over a question's queries (history mode's choice).

`kvcore.summaries.max_upper_bounds` sums, per (layer and KV head, query, chunk), min(a - b, 0) over the rotary
pairs; torch has no fused form of that sum, so it writes every pair's term (a float64 `[LH, P, Q, C]` block,
~2.7 GB for an 8B model's 2,048-chunk history and an 80-query question) and reads it back: ~4 ms on an H200,
the largest part of choosing. Here each program keeps a tile of (query, chunk) sums in registers and loops over
the pairs, reading the queries' float64 rows and the chunks' summaries (bf16 boxes and norms, copied once a call
to run along chunks), and keeps only the best over the queries: the same float64 bound, written once.

Scope: full rotary (every channel in a pair). Else the torch path.

`accumulate="float32"` sums in float32 (twice the FMA rate of float64, the float64 kernel's floor) and adds a
margin that keeps the result a sound upper bound of the float64 one. Per (query q, chunk c) the float32 total
B32 differs from the exact B by at most γ_n·S, with S = Σ |r|·|x| over every product of a query-side value r
(the 5 rows and the norm row of each pair) and its chunk-side x (high_f, high_s, low_f, low_s, norm; norm):
each a - b is a 5-term chain plus the row's float32 rounding, min(·, 0) is monotone and 1-Lipschitz, the
accumulation over the 2P terms adds γ_2P; n = 2P + 10 covers it all (γ_n = n·u / (1 - n·u), u = 2^-24). By
Cauchy-Schwarz S <= ‖r_q‖·‖x_c‖, so max_q B <= max_q B32 + γ_n·R·X_c with R = max_q ‖r_q‖ and X_c = ‖x_c‖, both
in float64 (the factor 1.01 covers the float64 additions' rounding and the float64 kernel's own, ~1e-16 relative,
so the result is at or above that kernel's bound too). On the GPU a value below float32's smallest normal may be
flushed to zero: each of the ~12P operations of a (query, chunk) may then lose 2^-126, and a flushed input r or x
loses at most 2^-126·|x| or 2^-126·|r| over its products, in all at most 2^-126·√(6P)·(‖r_q‖ + ‖x_c‖) (ℓ1 <= √m·ℓ2
over the 6P products); the margin adds 2^-126·(12P + √(6P)·(R + X_c)). No float32 overflow is assumed (keys and
queries are nowhere near 3e38).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from functools import cached_property

import torch
import triton
import triton.language as tl

from kvcore.rope import RopeConfig
from kvcore.summaries import ChunkSummaries, QueryRows, max_upper_bounds

log = logging.getLogger(__name__)

_LAUNCH = threading.Lock()  # questions are chosen in worker threads: one compiles the kernel, the others wait
_SUMMARY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # widened exactly to float32 and float64
_ACCUMULATORS = {"float64": (torch.float64, tl.float64), "float32": (torch.float32, tl.float32)}
_FLOAT32_ULP = 2.0**-24  # u: float32's unit roundoff
_FLOAT32_TINY = 2.0**-126  # float32's smallest normal: what a flush to zero may lose of one value


@triton.jit(do_not_specialize=["queries"])
def _best_bounds(
    rows_ptr,
    norm_rows_ptr,
    high_ptr,
    low_ptr,
    norms_ptr,
    out_ptr,
    queries,
    query_stride,
    chunks,
    DIM: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIR_STRIDE: tl.constexpr,
    SECOND: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Program (layer and head, block of chunks): max over every query of Σ_pairs min(a - b, 0) + Σ_pairs n·norm,
    summed in `ACC` (the rows' dtype).

    rows `[LH, P, 5, Q]` (q'+ first, q'+ second, q'- first, q'- second, -|q|), norm rows `[LH, P, Q]`; boxes
    `[LH, D, C]` and norms `[LH, P, C]`: every load runs along queries or chunks, one cache line for many lanes. A
    pair's channels are `p * PAIR_STRIDE` and that plus `SECOND`. `query_stride` and `chunks` are padded to
    multiples of 16 and `queries` (a mask's bound alone) is not specialized on, so one compiled kernel serves every
    history and question (Triton compiles anew for each divisibility of an integer argument: ~0.3 s each)."""
    lh = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < chunks
    boxes = lh.to(tl.int64) * DIM * chunks + c  # channel 0 of this layer and head's boxes, at chunk c
    norms_at = lh.to(tl.int64) * PAIRS * chunks + c
    best = tl.full([BLOCK_C], float("-inf"), ACC)
    for q0 in range(0, queries, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        q_ok = q < queries
        total = tl.zeros([BLOCK_Q, BLOCK_C], ACC)
        for p in range(PAIRS):
            row = rows_ptr + (lh.to(tl.int64) * PAIRS + p) * 5 * query_stride + q
            up_f = tl.load(row, mask=q_ok, other=0.0)[:, None]
            up_s = tl.load(row + query_stride, mask=q_ok, other=0.0)[:, None]
            down_f = tl.load(row + 2 * query_stride, mask=q_ok, other=0.0)[:, None]
            down_s = tl.load(row + 3 * query_stride, mask=q_ok, other=0.0)[:, None]
            minus_norm = tl.load(row + 4 * query_stride, mask=q_ok, other=0.0)[:, None]
            norm_row = norm_rows_ptr + (lh.to(tl.int64) * PAIRS + p) * query_stride + q
            scaled_norm = tl.load(norm_row, mask=q_ok, other=0.0)[:, None]
            first = boxes + (p * PAIR_STRIDE) * chunks
            second = first + SECOND * chunks
            high_f = tl.load(high_ptr + first, mask=c_ok, other=0.0).to(tl.float32).to(ACC)[None, :]
            high_s = tl.load(high_ptr + second, mask=c_ok, other=0.0).to(tl.float32).to(ACC)[None, :]
            low_f = tl.load(low_ptr + first, mask=c_ok, other=0.0).to(tl.float32).to(ACC)[None, :]
            low_s = tl.load(low_ptr + second, mask=c_ok, other=0.0).to(tl.float32).to(ACC)[None, :]
            norm = tl.load(norms_ptr + norms_at + p * chunks, mask=c_ok, other=0.0).to(tl.float32).to(ACC)
            a_minus_b = up_f * high_f + up_s * high_s + down_f * low_f + down_s * low_s + minus_norm * norm[None, :]
            total += tl.minimum(a_minus_b, 0.0) + scaled_norm * norm[None, :]
        total = tl.where(q_ok[:, None], total, float("-inf"))
        best = tl.maximum(best, tl.max(total, axis=0))
    tl.store(out_ptr + lh.to(tl.int64) * chunks + c, best, mask=c_ok)


@dataclass(frozen=True)
class Tiling:
    """The kernel's tile of (queries, chunks) and its warps (`benchmarks/chunk_bounds.py` sweeps them)."""

    block_q: int
    block_c: int
    warps: int

    def __post_init__(self) -> None:
        for name, value in (("block_q", self.block_q), ("block_c", self.block_c), ("warps", self.warps)):
            if value < 1 or value & (value - 1):  # Triton's tiles and warp counts are powers of two
                raise ValueError(f"tiling {name} must be a power of two, got {value}")


# Each accumulation's fastest tiling in the sweep at the 8B shape on the H200 (2026-12-05, second lease, the padded
# kernel): float64 8x64/4 1.01 ms of 27 (16x128/2 1.20), float32 16x64/4 0.55 ms of 12 (16x128/2 0.70)
TILINGS = {"float64": Tiling(8, 64, 4), "float32": Tiling(16, 64, 4)}


def fused_max_upper_bounds(
    summaries: ChunkSummaries,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    fact_start: int,
    rope: RopeConfig,
    tiling: Tiling | None = None,
    accumulate: str = "float64",
) -> torch.Tensor:
    """`kvcore.summaries.max_upper_bounds` `[C, L, H]` in one launch (the torch path where the kernel does not apply);
    `accumulate="float32"`: a bound at or above it, faster (the module's docstring); `tiling`: the accumulation's
    measured best unless given."""
    _accumulators(accumulate)
    why = _unsupported(summaries, queries, rope)
    if why:
        log.debug("chunk bounds: torch path (%s)", why)
        return max_upper_bounds(summaries, queries, query_positions, fact_start, rope)
    inputs = BoundsInputs.of(summaries, queries, query_positions, fact_start, rope)
    best = inputs.best(tiling, accumulate)
    return best.T.reshape(inputs.chunks, *summaries.low.shape[1:3]).float()  # rounding is monotone


@dataclass(frozen=True)
class BoundsInputs:
    """What the kernel reads, laid out along queries and chunks (its preparation, timed apart by the benchmark)."""

    rows: torch.Tensor  # [LH, P, 5, Q'] float64, Q' the queries padded to a multiple of 16 (zeros past Q)
    norm_rows: torch.Tensor  # [LH, P, Q'] float64
    high: torch.Tensor  # [LH, D, C'], C' the chunks padded alike
    low: torch.Tensor  # [LH, D, C']
    norms: torch.Tensor  # [LH, P, C']
    neox: bool
    queries: int  # Q
    chunks: int  # C

    @classmethod
    def of(
        cls,
        summaries: ChunkSummaries,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        fact_start: int,
        rope: RopeConfig,
    ) -> "BoundsInputs":
        along = [_padded(along_chunks(t)) for t in (summaries.high, summaries.low, summaries.norms)]
        chunks = summaries.low.shape[0]
        return cls.laid_out(queries, query_positions, fact_start, summaries.span_end, rope, *along, chunks=chunks)

    @classmethod
    def laid_out(
        cls,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
        fact_start: int,
        span_end: int | torch.Tensor,
        rope: RopeConfig,
        high: torch.Tensor,
        low: torch.Tensor,
        norms: torch.Tensor,
        chunks: int | None = None,
    ) -> "BoundsInputs":
        """From summaries already laid along chunks (`along_chunks`, contiguous, the chunks a multiple of 16), the
        first `chunks` of them scored (default: all, as a captured graph's buffers are). `span_end` may be a device
        scalar (the summarized keys' extent, which bounds the rotation angles' rounding)."""
        rows = QueryRows.of(queries, query_positions, fact_start, span_end, rope)
        return cls(
            _padded(rows.per_pair.transpose(2, 3)),
            _padded(rows.norm.transpose(1, 2)),
            high,
            low,
            norms,
            rope.style == "neox",
            queries.shape[0],
            high.shape[-1] if chunks is None else chunks,
        )

    @cached_property
    def float32_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows in float32, converted once for every float32 launch."""
        return self.rows.float(), self.norm_rows.float()

    @cached_property
    def float32_margin(self) -> torch.Tensor:
        """float64 `[LH, C]`: 1.01·(γ_n·R·X_c + 2^-126·(12P + √(6P)·(R + X_c))), what float32 sums may miss of the
        float64 bound (module docstring)."""
        pairs = self.norm_rows.shape[1]
        n_ulps = (2 * pairs + 10) * _FLOAT32_ULP
        gamma = n_ulps / (1 - n_ulps)
        query_sq = _squares(self.rows, (1, 2)) + _squares(self.norm_rows, 1)  # [LH, Q]
        chunk_sq = _squares(self.high, 1) + _squares(self.low, 1) + 2 * _squares(self.norms, 1)  # [LH, C]
        query_norm, chunk_norm = query_sq.amax(-1).sqrt()[:, None], chunk_sq[:, : self.chunks].sqrt()
        flushed = _FLOAT32_TINY * (12 * pairs + math.sqrt(6 * pairs) * (query_norm + chunk_norm))
        return 1.01 * (gamma * query_norm * chunk_norm + flushed)

    def best(self, tiling: Tiling | None = None, accumulate: str = "float64") -> torch.Tensor:
        """float64 `[LH, C]`: each chunk's best bound over the queries, in one launch (summed in `accumulate`; the
        float32 sums plus their margin), at `tiling` (default: `TILINGS[accumulate]`)."""
        dtype, acc = _accumulators(accumulate)
        tiling = tiling or TILINGS[accumulate]
        rows, norm_rows = self.float32_rows if dtype == torch.float32 else (self.rows, self.norm_rows)
        heads, dim, padded_chunks = self.high.shape
        pairs, query_stride = self.norm_rows.shape[1:]
        out = torch.empty(heads, padded_chunks, dtype=dtype, device=self.high.device)
        if self.chunks == 0:
            return out.double()
        on_its_device = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
        with _LAUNCH, on_its_device:
            _best_bounds[(heads, triton.cdiv(padded_chunks, tiling.block_c))](
                rows,
                norm_rows,
                self.high,
                self.low,
                self.norms,
                out,
                self.queries,
                query_stride,
                padded_chunks,
                DIM=dim,
                PAIRS=pairs,
                PAIR_STRIDE=1 if self.neox else 2,
                SECOND=pairs if self.neox else 1,
                BLOCK_Q=tiling.block_q,
                BLOCK_C=tiling.block_c,
                ACC=acc,
                num_warps=tiling.warps,
            )
        out = out[:, : self.chunks]  # the padding's chunks are zero boxes: their bounds mean nothing
        return out if dtype == torch.float64 else out.double() + self.float32_margin


def compiled_variants() -> int:
    """How many compiled versions of the bounds kernel this process holds (one per accumulation dtype and tiling
    is the design: sizes must not add any)."""
    return sum(len(entry[0]) for entry in _best_bounds.device_caches.values())  # per device, its kernel cache first


def _accumulators(accumulate: str) -> tuple[torch.dtype, tl.dtype]:
    """The torch and Triton dtypes that `accumulate` names (refused before the torch path can hide a typo)."""
    if accumulate not in _ACCUMULATORS:
        raise ValueError(f"accumulate must be 'float64' or 'float32', got {accumulate!r}")
    return _ACCUMULATORS[accumulate]


def _squares(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """Σ x² over `dim` in float64: the margin's own rounding stays far inside its 1 %."""
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64).square()


def along_chunks(summary: torch.Tensor) -> torch.Tensor:
    """`[C, L, H, X]` as `[L*H, X, C]` (a view): a history's summaries laid out along chunks, as the kernel reads
    them (copied once a question by `_padded`, ~42 MB at the 8B shape: tens of microseconds of the device's
    bandwidth)."""
    return summary.flatten(1, 2).permute(1, 2, 0)


def _padded(x: torch.Tensor) -> torch.Tensor:
    """`x` contiguous, its last dimension padded with zeros to a multiple of 16 (one copy either way)."""
    size = x.shape[-1]
    out = x.new_zeros(*x.shape[:-1], -(-size // 16) * 16)
    out[..., :size] = x
    return out


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
