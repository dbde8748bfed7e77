"""One Triton kernel that dequantizes a whole tier load into the device arena.

`kvcore.packed.insert_packed` views, dequantizes and copies each entry with a handful of torch calls:
at ~50 entries a load that is host time in front of the forward, more than the transfer it follows.
This kernel reads every entry's int8 codes and float32 scales from the packed device buffer through the
entry table (where each tensor starts, how far apart its layers lie: host-tier entries and disk files differ)
and writes each token's dequantized K and V into its arena row, all entries and layers in
one launch. Values are the float32 product rounded once to the arena's dtype, as in the torch path.

An int8 arena (`kvcore.arena`, precision int8) takes the codes as they are, and each entry's scales go into the
pages its rows fall in.

Scope: arenas `[L, R, H, D]` with contiguous heads and a power-of-two head dim. Else the torch path.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from kvcore.packed import TABLE_COLUMNS, PackedEntries

log = logging.getLogger(__name__)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dequant_rows(
    flat_ptr,
    table_ptr,
    owner_ptr,
    rows_ptr,
    k_ptr,
    v_ptr,
    k_table_ptr,
    v_table_ptr,
    layer_stride,
    row_stride,
    table_layer_stride,
    HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    DIM: tl.constexpr,
    COLUMNS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Program (token, layer): one token of one entry, every head and channel of that layer, K and V. With PAGE
    (an int8 arena of PAGE-token pages) the codes go in as they are and the scales into the token's page (every
    token of a page writes the same ones)."""
    token = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    entry = tl.load(owner_ptr + token)
    meta = table_ptr + entry * COLUMNS
    codes_stride, scales_stride = tl.load(meta + 4), tl.load(meta + 5)
    count, first = tl.load(meta + 6), tl.load(meta + 7)
    k_codes = tl.load(meta) + layer * codes_stride  # this layer's [H, T, D] codes and [H, 1, D] scales, in bytes
    k_scales = tl.load(meta + 1) + layer * scales_stride
    v_codes = tl.load(meta + 2) + layer * codes_stride
    v_scales = tl.load(meta + 3) + layer * scales_stride
    t = token - first
    row = tl.load(rows_ptr + token)

    head = tl.arange(0, HEADS_POW2)
    channel = tl.arange(0, DIM)
    ok = (head < HEADS)[:, None]
    code_at = (head[:, None] * count + t) * DIM + channel[None, :]
    scale_at = head[:, None] * DIM + channel[None, :]
    dest = layer * layer_stride + row * row_stride + head[:, None] * DIM + channel[None, :]

    k_code = tl.load((flat_ptr + k_codes).to(tl.pointer_type(tl.int8)) + code_at, mask=ok, other=0)
    k_scale = tl.load((flat_ptr + k_scales).to(tl.pointer_type(tl.float32)) + scale_at, mask=ok, other=0.0)
    v_code = tl.load((flat_ptr + v_codes).to(tl.pointer_type(tl.int8)) + code_at, mask=ok, other=0)
    v_scale = tl.load((flat_ptr + v_scales).to(tl.pointer_type(tl.float32)) + scale_at, mask=ok, other=0.0)
    if PAGE:
        tl.store(k_ptr + dest, k_code, mask=ok)
        tl.store(v_ptr + dest, v_code, mask=ok)
        page_at = layer * table_layer_stride + (row // PAGE) * HEADS * DIM + scale_at
        tl.store(k_table_ptr + page_at, k_scale, mask=ok)
        tl.store(v_table_ptr + page_at, v_scale, mask=ok)
    else:
        tl.store(k_ptr + dest, (k_code.to(tl.float32) * k_scale).to(OUT_DTYPE), mask=ok)
        tl.store(v_ptr + dest, (v_code.to(tl.float32) * v_scale).to(OUT_DTYPE), mask=ok)


def insert_packed_kernel(
    packed: PackedEntries,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_tokens: int = 0,
) -> None:
    """`kvcore.packed.PackedInserter` in one launch; the torch path where the arena is outside the scope."""
    if packed.tokens == 0:
        return
    why = _unsupported(packed, k, v, scales)
    if why:
        from kvcore.packed import insert_packed

        log.debug("packed insert kernel not used: %s", why)
        insert_packed(packed, rows, k, v, scales, page_tokens)
        return
    heads_pow2 = triton.next_power_of_2(packed.heads)
    k_table, v_table = scales if scales is not None else (k, v)  # unread without PAGE
    _dequant_rows[(packed.tokens, packed.layers)](
        packed.flat,
        packed.table,
        packed.owner,
        rows,
        k,
        v,
        k_table,
        v_table,
        k.stride(0),
        k.stride(1),
        k_table.stride(0),
        HEADS=packed.heads,
        HEADS_POW2=heads_pow2,
        DIM=packed.dim,
        COLUMNS=TABLE_COLUMNS,
        OUT_DTYPE=_TL_DTYPES.get(k.dtype, tl.int8),
        PAGE=page_tokens if scales is not None else 0,
    )


def _unsupported(
    packed: PackedEntries, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> str:
    if k.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"arena on {k.device.type}"
    allowed = (torch.int8,) if scales is not None else tuple(_TL_DTYPES)
    if k.dtype not in allowed or v.dtype != k.dtype:
        return f"arena dtype {k.dtype}"
    if packed.dim & (packed.dim - 1):
        return f"head dim {packed.dim}"
    if k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != packed.dim:
        return f"arena strides {k.stride()}"
    if scales is not None and any(
        t.dtype != torch.float32 or t.stride()[1:] != (packed.heads * packed.dim, packed.dim, 1) for t in scales
    ):
        return "scale tables not float32 [L, pages, H, D] with contiguous pages"
    return ""
