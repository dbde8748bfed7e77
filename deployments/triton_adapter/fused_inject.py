"""One Triton kernel that writes a whole injection step: gather, rotate and scatter, every layer at once.

The torch path (`kvcore.injection`) reads the arena rows, rotates them in float32 through a handful of
elementwise kernels with intermediates, then copies each layer into the cache: about four times the
bytes of one read and one write, and ~40 kernel launches per step. This kernel reads each token's
pre-RoPE K and V once from the arena, rotates K in registers with the engine-rounded cos/sin table,
and writes the `[K | V]` row of its cache slot directly, for all layers in one launch (the layers'
caches are separate tensors, reached through a table of their base addresses).

Scope: caches whose slot rows hold K then V contiguously (vLLM CUDA FlashAttention's NHD layout), the
neox rotation over the whole head, a power-of-two half head. Anything else keeps the torch path.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from kvcore.rope import RopeConfig

log = logging.getLogger(__name__)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _inject_rows(k_ptr, v_ptr, index_ptr, cos_ptr, sin_ptr, dest_table_ptr, tokens,
                 src_layer_stride, src_row_stride, src_head_stride, dest_slot_stride, dest_head_stride,
                 HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                 OUT_DTYPE: tl.constexpr):
    """Program (t, layer): tokens t*BLOCK_T.. of one layer. `index` is [3, tokens]: arena row, position, slot."""
    layer = tl.program_id(1).to(tl.int64)  # layer * stride passes 2**31 elements in large arenas
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    row = tl.load(index_ptr + t, mask=t_ok, other=0)
    position = tl.load(index_ptr + tokens + t, mask=t_ok, other=0)
    slot = tl.load(index_ptr + 2 * tokens + t, mask=t_ok, other=0)
    head = tl.arange(0, HEADS_POW2)
    channel = tl.arange(0, HALF)
    ok = t_ok[:, None, None] & (head < HEADS)[None, :, None]

    src = (layer * src_layer_stride + row[:, None, None] * src_row_stride
           + head[None, :, None] * src_head_stride + channel[None, None, :])
    angle = position[:, None, None] * HALF + channel[None, None, :]
    cos = tl.load(cos_ptr + angle, mask=t_ok[:, None, None], other=0.0)
    sin = tl.load(sin_ptr + angle, mask=t_ok[:, None, None], other=0.0)
    k1 = tl.load(k_ptr + src, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + src + HALF, mask=ok, other=0.0).to(tl.float32)

    dest_base = tl.load(dest_table_ptr + layer).to(tl.pointer_type(OUT_DTYPE))
    dest = slot[:, None, None] * dest_slot_stride + head[None, :, None] * dest_head_stride + channel[None, None, :]
    tl.store(dest_base + dest, (k1 * cos - k2 * sin).to(OUT_DTYPE), mask=ok)
    tl.store(dest_base + dest + HALF, (k2 * cos + k1 * sin).to(OUT_DTYPE), mask=ok)
    v1 = tl.load(v_ptr + src, mask=ok, other=0.0)
    v2 = tl.load(v_ptr + src + HALF, mask=ok, other=0.0)
    tl.store(dest_base + dest + 2 * HALF, v1.to(OUT_DTYPE), mask=ok)
    tl.store(dest_base + dest + 3 * HALF, v2.to(OUT_DTYPE), mask=ok)


# (elements of one loaded tile, warps) a writer times on its first large step; the first is the default
_CONFIGS = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16))
_TUNE_MIN_TOKENS = 4096  # steps this large (about three k=50 requests) decide the configuration
_TUNE_RUNS = 3


class FusedRowWriter:
    """Writes a step's tokens from an arena `[L, R, H, D]` into every layer's joint `[slots, H, 2D]` rows.

    The kernel is bound by memory traffic (each token of each layer: its K and V read once, its cache row
    written once), and how close it comes to the device's bandwidth depends on the tile each program moves and
    its warps. On the first step of at least `_TUNE_MIN_TOKENS` tokens on CUDA the writer times each of
    `_CONFIGS` on that step itself (a write is idempotent: the same rows get the same values) and keeps the
    fastest for the rest of its life."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        first = rows[0]
        self._heads, self._half = first.shape[1], first.shape[2] // 4
        self._slot_stride, self._head_stride = first.stride(0), first.stride(1)
        self._dtype = _TL_DTYPES[first.dtype]
        self._table = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=first.device)
        self._keep = list(rows)  # the addresses in the table stay valid while the caches live
        self._heads_pow2 = triton.next_power_of_2(self._heads)
        self._config: tuple[int, int] | None = None if first.device.type == "cuda" else _CONFIGS[0]
        self.timings_ms: dict[tuple[int, int], float] = {}  # what the tuning step measured, per configuration

    @property
    def config(self) -> tuple[int, int]:
        """(tile elements, warps) in use: the tuned one, or the default until a step was large enough to tune."""
        return self._config or _CONFIGS[0]

    def __call__(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """`k`, `v` the arena `[L, R, H, D]`; `index` `[3, T]` int64 (row, position, slot); `cos`/`sin` `[N, D/2]` float32."""
        tokens = index.shape[1]
        if tokens == 0:
            return
        if self._config is None and tokens >= _TUNE_MIN_TOKENS:
            self._config = self._tune(k, v, index, cos, sin)
        self._launch(self.config, k, v, index, cos, sin)

    def _launch(self, config: tuple[int, int], k, v, index, cos, sin) -> None:
        tile, warps = config
        tokens, layers = index.shape[1], k.shape[0]
        block_t = max(1, tile // (self._heads_pow2 * self._half))
        _inject_rows[(triton.cdiv(tokens, block_t), layers)](
            k, v, index, cos, sin, self._table, tokens,
            k.stride(0), k.stride(1), k.stride(2), self._slot_stride, self._head_stride,
            HEADS=self._heads, HEADS_POW2=self._heads_pow2, HALF=self._half, BLOCK_T=block_t,
            OUT_DTYPE=self._dtype, num_warps=warps)

    def _tune(self, k, v, index, cos, sin) -> tuple[int, int]:
        usable = []
        for config in _CONFIGS:
            try:
                self._launch(config, k, v, index, cos, sin)  # compiles it
                usable.append(config)
            except Exception as exc:  # noqa: BLE001 - a configuration the device cannot run is skipped, not fatal
                log.warning("fused injection kernel: tile %d, %d warps unusable here: %s", *config, exc)
        for config in usable:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_TUNE_RUNS):
                self._launch(config, k, v, index, cos, sin)
            end.record()
            end.synchronize()
            self.timings_ms[config] = start.elapsed_time(end) / _TUNE_RUNS
        if _CONFIGS[0] not in self.timings_ms:
            return _CONFIGS[0]  # the default raises as it always would; nothing to choose from
        best = min(self.timings_ms, key=self.timings_ms.__getitem__)
        log.info("fused injection kernel: tile %d elements, %d warps (%.2f ms for %d tokens; default %.2f ms)",
                 best[0], best[1], self.timings_ms[best], index.shape[1], self.timings_ms[_CONFIGS[0]])
        return best


def fused_row_writer(rows: Sequence[torch.Tensor], rope: RopeConfig) -> FusedRowWriter | None:
    """A fused writer for these caches, or None when they are outside the kernel's scope (torch path then)."""
    first = rows[0] if rows else None
    why = _unsupported(rows, rope)
    if why:
        log.info("fused injection kernel not used: %s", why)
        return None
    log.info("fused injection kernel: %d layers, %d kv heads, head dim %d, %s", len(rows), first.shape[1],
             first.shape[2] // 2, first.dtype)
    return FusedRowWriter(rows)


def _unsupported(rows: Sequence[torch.Tensor], rope: RopeConfig) -> str:
    if not rows:
        return "no caches"
    first = rows[0]
    if first.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"caches on {first.device.type}"
    if first.dtype not in _TL_DTYPES:
        return f"cache dtype {first.dtype}"
    if rope.style != "neox" or rope.dim != rope.head_dim:
        return f"rope style {rope.style} over {rope.dim} of {rope.head_dim} channels"
    half = rope.head_dim // 2
    if half & (half - 1) or first.shape[2] != 2 * rope.head_dim or first.stride(2) != 1:
        return f"row shape {tuple(first.shape)} strides {first.stride()}"
    if any(r.shape != first.shape or r.stride() != first.stride() or r.dtype != first.dtype for r in rows):
        return "layers differ in shape, strides or dtype"
    return ""
