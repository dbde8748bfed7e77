"""One Triton kernel that writes a whole injection step: gather, rotate and scatter, every layer at once.

The torch path (`kvcore.injection`) reads the arena rows, rotates them in float32 through a handful of
elementwise kernels with intermediates, then copies each layer into the cache: about four times the
bytes of one read and one write, and ~40 kernel launches per step. This kernel reads each token's
pre-RoPE K and V once from the arena, rotates K in registers with the engine-rounded cos/sin table,
and writes the `[K | V]` row of its cache slot directly, for all layers in one launch (the layers'
caches are separate tensors, reached through a table of their base addresses).

An int8 arena's codes are decoded in the same pass (code times its page's scale, in float32, before the rotation).

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


# `tokens` changes every step: unspecialized, one compiled kernel serves every step (Triton would otherwise
# compile again for each new divisibility class of the count, inside serving: seen on the H200)
@triton.jit(do_not_specialize=["tokens"])
def _inject_rows(
    k_ptr,
    v_ptr,
    k_scales_ptr,
    v_scales_ptr,
    index_ptr,
    cos_ptr,
    sin_ptr,
    dest_table_ptr,
    tokens,
    src_layer_stride,
    src_row_stride,
    src_head_stride,
    scales_layer_stride,
    scales_page_stride,
    dest_slot_stride,
    dest_head_stride,
    HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Program (t, layer): tokens t*BLOCK_T.. of one layer. `index` is [3, tokens]: arena row, position, slot.
    With PAGE, the arena holds int8 codes and each PAGE-token page its float32 scales `[L, pages, H, D]`: each
    value is decoded (code times scale, in float32) as it is read."""
    layer = tl.program_id(1).to(tl.int64)  # layer * stride passes 2**31 elements in large arenas
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    row = tl.load(index_ptr + t, mask=t_ok, other=0)
    position = tl.load(index_ptr + tokens + t, mask=t_ok, other=0)
    slot = tl.load(index_ptr + 2 * tokens + t, mask=t_ok, other=0)
    head = tl.arange(0, HEADS_POW2)
    channel = tl.arange(0, HALF)
    ok = t_ok[:, None, None] & (head < HEADS)[None, :, None]

    src = (
        layer * src_layer_stride
        + row[:, None, None] * src_row_stride
        + head[None, :, None] * src_head_stride
        + channel[None, None, :]
    )
    angle = position[:, None, None] * HALF + channel[None, None, :]
    cos = tl.load(cos_ptr + angle, mask=t_ok[:, None, None], other=0.0)
    sin = tl.load(sin_ptr + angle, mask=t_ok[:, None, None], other=0.0)
    k1 = tl.load(k_ptr + src, mask=ok, other=0).to(tl.float32)
    k2 = tl.load(k_ptr + src + HALF, mask=ok, other=0).to(tl.float32)
    v1 = tl.load(v_ptr + src, mask=ok, other=0)
    v2 = tl.load(v_ptr + src + HALF, mask=ok, other=0)
    if PAGE:
        at = (
            layer * scales_layer_stride
            + (row // PAGE)[:, None, None] * scales_page_stride
            + head[None, :, None] * (2 * HALF)
            + channel[None, None, :]
        )
        k1 = k1 * tl.load(k_scales_ptr + at, mask=ok, other=0.0)
        k2 = k2 * tl.load(k_scales_ptr + at + HALF, mask=ok, other=0.0)
        v1 = v1.to(tl.float32) * tl.load(v_scales_ptr + at, mask=ok, other=0.0)
        v2 = v2.to(tl.float32) * tl.load(v_scales_ptr + at + HALF, mask=ok, other=0.0)

    dest_base = tl.load(dest_table_ptr + layer).to(tl.pointer_type(OUT_DTYPE))
    dest = slot[:, None, None] * dest_slot_stride + head[None, :, None] * dest_head_stride + channel[None, None, :]
    tl.store(dest_base + dest, (k1 * cos - k2 * sin).to(OUT_DTYPE), mask=ok)
    tl.store(dest_base + dest + HALF, (k2 * cos + k1 * sin).to(OUT_DTYPE), mask=ok)
    tl.store(dest_base + dest + 2 * HALF, v1.to(OUT_DTYPE), mask=ok)
    tl.store(dest_base + dest + 3 * HALF, v2.to(OUT_DTYPE), mask=ok)


DEFAULT_TILE, DEFAULT_WARPS = 2048, 4  # elements one program loads per tensor, and its warps


class FusedRowWriter:
    """Writes a step's tokens from an arena `[L, R, H, D]` into every layer's joint `[slots, H, 2D]` rows.

    The kernel is bound by memory traffic (each token of each layer: its K and V read once, its cache row
    written once). At the default tile and warps it moves a 100-request step of the 8B shape at 1.06 of the
    device's own copy rate on an H200 (`benchmarks/inject_kernel.py`, which times the other tiles and warps:
    0.83-1.00)."""

    def __init__(self, rows: Sequence[torch.Tensor], tile: int = DEFAULT_TILE, warps: int = DEFAULT_WARPS) -> None:
        first = rows[0]
        self._heads, self._half = first.shape[1], first.shape[2] // 4
        self._slot_stride, self._head_stride = first.stride(0), first.stride(1)
        self._dtype = _TL_DTYPES[first.dtype]
        self._table = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=first.device)
        self._keep = list(rows)  # the addresses in the table stay valid while the caches live
        self._heads_pow2 = triton.next_power_of_2(self._heads)
        self._block_t = max(1, tile // (self._heads_pow2 * self._half))
        self._warps = warps

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        page_tokens: int = 0,
    ) -> None:
        """`k`, `v` the arena `[L, R, H, D]`; `index` `[3, T]` int64 (row, position, slot); `cos`/`sin` `[N, D/2]`
        float32. An int8 arena's codes come with its per-page `scales` (`[L, pages, H, D]` float32) and page size."""
        tokens = index.shape[1]
        if tokens == 0:
            return
        k_scales, v_scales = scales if scales is not None else (k, v)  # unread without PAGE
        _inject_rows[(triton.cdiv(tokens, self._block_t), k.shape[0])](
            k,
            v,
            k_scales,
            v_scales,
            index,
            cos,
            sin,
            self._table,
            tokens,
            k.stride(0),
            k.stride(1),
            k.stride(2),
            k_scales.stride(0),
            k_scales.stride(1),
            self._slot_stride,
            self._head_stride,
            HEADS=self._heads,
            HEADS_POW2=self._heads_pow2,
            HALF=self._half,
            BLOCK_T=self._block_t,
            OUT_DTYPE=self._dtype,
            PAGE=page_tokens if scales is not None else 0,
            num_warps=self._warps,
        )


def fused_row_writer(
    rows: Sequence[torch.Tensor], rope: RopeConfig, tile: int = DEFAULT_TILE, warps: int = DEFAULT_WARPS
) -> FusedRowWriter | None:
    """A fused writer for these caches, or None when they are outside the kernel's scope (torch path then)."""
    first = rows[0] if rows else None
    why = _unsupported(rows, rope)
    if why:
        log.info("fused injection kernel not used: %s", why)
        return None
    log.info(
        "fused injection kernel: %d layers, %d kv heads, head dim %d, %s",
        len(rows),
        first.shape[1],
        first.shape[2] // 2,
        first.dtype,
    )
    return FusedRowWriter(rows, tile, warps)


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
