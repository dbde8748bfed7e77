"""The Triton packed-insert kernel against `kvcore.packed.insert_packed`, on the same packed tier entries.

Run as a module (`python -m tests.kernels.packed_check DEVICE DTYPE`) so the CPU check can set TRITON_INTERPRET
before Triton is imported; prints one JSON line with what the test asserts on.
"""

from __future__ import annotations

import json
import sys

import torch

from kvcore.packed import RawEntry, aligned, insert_packed, pack, raw_entry, slab
from kvcore.quantize import Quantized, quantize

LAYERS, HEADS, DIM, ROWS = 3, 3, 16, 64  # 3 heads: exercises the padded head dimension


def _entries() -> tuple[list[RawEntry], list[tuple[Quantized, Quantized]]]:
    """Five entries of different lengths: host-tier ones (one buffer each, or not), and two laid out as the
    disk tier reads its files (one shared buffer, layer after layer)."""
    entries, raws = [], []
    for i, tokens in enumerate((5, 1, 9, 4, 12)):
        gen = torch.Generator().manual_seed(i)
        k = quantize(torch.randn(LAYERS, HEADS, tokens, DIM, generator=gen) * torch.rand(DIM, generator=gen) * 6)
        entries.append((k, quantize(torch.randn(LAYERS, HEADS, tokens, DIM, generator=gen))))
    for k, v in entries[:3]:
        parts = [k.codes, k.scales, v.codes, v.scales]
        views = slab([(tuple(t.shape), t.dtype) for t in parts], pinned=False)
        for view, t in zip(views, parts):
            view.copy_(t)
        raws.append(raw_entry(Quantized(views[0], views[1]), Quantized(views[2], views[3])))
    blobs, layout = [], []
    for k, v in entries[3:]:
        at = sum(b.numel() for b in blobs)
        layer = [
            t[i].contiguous().view(-1).view(torch.uint8)
            for i in range(LAYERS)
            for t in (k.codes, k.scales, v.codes, v.scales)
        ]
        sizes = [x.numel() for x in layer[:4]]
        layout.append(((at, at + sizes[0], at + sum(sizes[:2]), at + sum(sizes[:3])), sum(sizes), k.codes.shape[2]))
        blob = torch.cat(layer)
        blobs.append(torch.cat([blob, torch.zeros(aligned(blob.numel()) - blob.numel(), dtype=torch.uint8)]))
    buffer = torch.cat(blobs)
    raws += [
        RawEntry(buffer, offsets, stride, stride, tokens, (LAYERS, HEADS, DIM)) for offsets, stride, tokens in layout
    ]
    return raws, entries


def codes_main(device: str) -> None:
    """An int8 arena of 4-token pages: each entry's rows in pages of its own, in a shuffled page order."""
    from deployments.triton_adapter.packed_insert import _unsupported, insert_packed_kernel

    page = 4
    packed = pack(_entries()[0], torch.bfloat16, torch.device(device))
    order = torch.randperm(ROWS // page, generator=torch.Generator().manual_seed(7)).tolist()
    rows: list[int] = []
    for first, end in zip(packed.starts, packed.starts[1:]):
        pages, order = order[: -(-(end - first) // page)], order[-(-(end - first) // page) :]
        rows += [p * page + j for p in pages for j in range(page)][: end - first]
    rows = torch.tensor(rows, device=device)
    arenas = []
    for insert in (insert_packed_kernel, insert_packed):  # -128 and NaN mark what was not written
        codes = [torch.full((LAYERS, ROWS, HEADS, DIM), -128, dtype=torch.int8, device=device) for _ in "kv"]
        tables = [torch.full((LAYERS, ROWS // page, HEADS, DIM), float("nan"), device=device) for _ in "kv"]
        insert(packed, rows, *codes, tuple(tables), page)
        arenas.append((torch.stack(codes), torch.stack(tables)))
    (codes, tables), (want_codes, want_tables) = arenas
    written = codes != -128
    scaled = ~tables.isnan()
    print(
        json.dumps(
            {
                "kernel_used": _unsupported(packed, codes[0], codes[1], tuple(tables)) == "",
                "written": int(written.sum()),
                "scales_written": int(scaled.sum()),
                "equal": bool(torch.equal(codes, want_codes) and torch.equal(written, want_codes != -128)),
                "scales_equal": bool(
                    torch.equal(scaled, ~want_tables.isnan()) and torch.equal(tables[scaled], want_tables[scaled])
                ),
            }
        )
    )


def main(device: str, dtype_name: str) -> None:
    if dtype_name == "int8":
        codes_main(device)
        return
    from deployments.triton_adapter.packed_insert import (
        _unsupported,
        insert_packed_kernel,
    )

    dtype = getattr(torch, dtype_name)
    packed = pack(_entries()[0], dtype, torch.device(device))
    rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(7))[: packed.tokens].to(device)
    arenas = []
    for insert in (insert_packed_kernel, insert_packed):  # NaN marks rows not written (no dequantized value is NaN)
        k = torch.full((LAYERS, ROWS, HEADS, DIM), float("nan"), dtype=dtype, device=device)
        v = torch.full((LAYERS, ROWS, HEADS, DIM), float("nan"), dtype=dtype, device=device)
        insert(packed, rows, k, v)
        arenas.append(torch.stack((k, v)))
    kernel, reference = arenas
    written = ~kernel.isnan()
    got, want = kernel[written].float(), reference[written].float()
    ulps = ((got - want).abs() / (want.abs() * torch.finfo(dtype).eps).clamp(min=1e-30)).max().item()
    print(
        json.dumps(
            {
                "kernel_used": _unsupported(packed, kernel[0], kernel[1], None) == "",
                "written": int(written.sum()),
                "same_rows": bool(torch.equal(written, ~reference.isnan())),
                "equal": bool(torch.equal(got, want)),
                "max_ulps": ulps,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
