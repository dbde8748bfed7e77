"""A whole load's int8 tier entries on the device as raw bytes, dequantized straight into arena rows.

A load brought up whole (`TierStreams`) has tens of entries. Viewing, joining and dequantizing them
entry by entry costs a dozen torch calls each, which on a GPU is host time in front of the forward
(more than the transfer itself at ~50 entries). Here entries travel as the host bytes they already are:
a host-tier entry's four tensors (K codes, K scales, V codes, V scales) share one buffer, and the disk
tier reads all of a load's files into one buffer as they lie on disk (layer after layer). Each buffer
is copied to the device once; a table of where each entry's tensors start and how far apart its layers
are goes along, and a `PackedInserter` (one device kernel, deployments/triton_adapter) writes every token
of every entry into its arena rows in one launch. `insert_packed` does the same in torch: the path where
no kernel applies, and the kernel's reference.
"""

from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcore.quantize import Quantized
from kvcore.transfers import to_device

ALIGN = 64  # bytes: every buffer starts aligned for any dtype and for vectorized loads
TABLE_COLUMNS = 8  # per entry, in bytes: K codes, K scales, V codes, V scales; codes' and scales' layer strides; tokens; first token


@dataclass(frozen=True)
class RawEntry:
    """An int8 entry `[L, H, T, D]` as bytes of a host buffer: where each tensor's first layer starts and how
    many bytes apart its layers are (within a layer, codes are `[H, T, D]` and scales `[H, 1, D]`, contiguous)."""

    buffer: torch.Tensor  # uint8; shared by the entries read together
    offsets: tuple[int, int, int, int]  # K codes, K scales (float32), V codes, V scales
    codes_stride: int
    scales_stride: int
    tokens: int
    shape: tuple[int, int, int]  # layers, kv heads, head dim


@dataclass
class PackedEntries:
    """Entries of one shape (L, H, D) in one device byte buffer, with their table."""

    flat: torch.Tensor  # uint8: every entry's buffer
    table: torch.Tensor  # int64 [E, TABLE_COLUMNS]
    owner: torch.Tensor  # int64 [sum T]: the entry of each token
    rows: list[tuple[int, ...]]  # the table, on the host
    starts: list[int]  # where each entry's tokens start (the total last)
    layers: int
    heads: int
    dim: int
    dtype: torch.dtype  # what the codes dequantize to (the device arena's, whatever the entries were stored in)

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    def entry(self, index: int) -> tuple[Quantized, Quantized]:
        """Entry `index` as (strided) views of the device buffer."""
        k_codes, k_scales, v_codes, v_scales, codes_stride, scales_stride, count, _ = self.rows[index]
        codes, scales = self.flat.view(torch.int8), self.flat.view(torch.float32)
        heads, dim = self.heads, self.dim

        def of_codes(at: int) -> torch.Tensor:
            return codes.as_strided((self.layers, heads, count, dim), (codes_stride, count * dim, dim, 1), at)

        def of_scales(at: int) -> torch.Tensor:
            return scales.as_strided((self.layers, heads, 1, dim), (scales_stride // 4, dim, dim, 1), at // 4)

        return Quantized(of_codes(k_codes), of_scales(k_scales)), Quantized(of_codes(v_codes), of_scales(v_scales))


class PackedInserter(Protocol):
    """Writes every token of `packed` into the arena's K and V `[L, R, H, D]` at `rows` (int64 `[sum T]`,
    on the device), dequantized to the arena's dtype exactly as `insert_packed` does; into an int8 arena (its
    per-page `scales`, `[L, pages, H, D]` float32 each, and `page_tokens`) the codes as they are, each entry's
    scales into every page its rows fall in."""

    def __call__(
        self,
        packed: PackedEntries,
        rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        page_tokens: int = 0,
    ) -> None: ...


def raw_entry(k: Quantized, v: Quantized) -> RawEntry:
    """An entry's bytes: the host buffer its tensors are views of (a host-tier entry), else a fresh one."""
    tensors = [k.codes, k.scales.float(), v.codes, v.scales.float()]
    shared = _shared_buffer(tensors)
    if shared is None:  # separate host tensors (an unpinned host tier): one buffer made for them
        views = slab([(tuple(t.shape), t.dtype) for t in tensors], pinned=False)
        for view, t in zip(views, tensors):
            view.copy_(t)
        shared = _shared_buffer(views)
    buffer, where = shared
    layers, heads, tokens, dim = k.codes.shape
    return RawEntry(buffer, tuple(where), heads * tokens * dim, heads * dim * 4, tokens, (layers, heads, dim))


def pack(entries: list[RawEntry], dtype: torch.dtype, device: torch.device) -> PackedEntries | None:
    """The entries in one device buffer, each distinct host buffer copied once; None unless all share a shape."""
    if not entries or len({entry.shape for entry in entries}) != 1:
        return None
    layers, heads, dim = entries[0].shape
    placed: dict[int, int] = {}  # host buffer address -> its offset in the device buffer
    sources: list[tuple[int, torch.Tensor]] = []
    size = 0
    for entry in entries:
        address = entry.buffer.data_ptr()
        if address not in placed:
            placed[address] = size
            sources.append((size, entry.buffer))
            size += aligned(entry.buffer.numel())
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for at, source in sources:
        flat[at : at + source.numel()].copy_(source, non_blocking=True)
    starts = [0, *itertools.accumulate(entry.tokens for entry in entries)]
    rows = [
        (*(placed[e.buffer.data_ptr()] + o for o in e.offsets), e.codes_stride, e.scales_stride, e.tokens, first)
        for e, first in zip(entries, starts)
    ]
    owner = array("q")
    for index, entry in enumerate(entries):
        owner.extend(array("q", [index]) * entry.tokens)
    host = torch.frombuffer(array("q", [x for row in rows for x in row]) + owner, dtype=torch.int64)
    moved = to_device(host, device)
    table = moved[: len(rows) * TABLE_COLUMNS].view(len(rows), TABLE_COLUMNS)
    return PackedEntries(flat, table, moved[len(rows) * TABLE_COLUMNS :], rows, starts, layers, heads, dim, dtype)


def insert_packed(
    packed: PackedEntries,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_tokens: int = 0,
) -> None:
    """`PackedInserter` in torch: each entry dequantized (float32 product, rounded to the arena's dtype once)
    and copied into its rows; or, into an int8 arena, its codes and, for each page its rows fall in, its scales."""
    for index, (first, end) in enumerate(zip(packed.starts, packed.starts[1:])):
        k_q, v_q = packed.entry(index)
        at = rows[first:end]
        if scales is None:
            k.index_copy_(1, at, (k_q.codes.float() * k_q.scales).to(k.dtype).permute(0, 2, 1, 3))
            v.index_copy_(1, at, (v_q.codes.float() * v_q.scales).to(v.dtype).permute(0, 2, 1, 3))
            continue
        pages = torch.unique(torch.div(at, page_tokens, rounding_mode="floor"))
        for codes, table, q in ((k, scales[0], k_q), (v, scales[1], v_q)):
            codes.index_copy_(1, at, q.codes.permute(0, 2, 1, 3))
            table.index_copy_(1, pages, q.scales.expand(-1, -1, pages.numel(), -1).permute(0, 2, 1, 3))


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _shared_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The host buffer all `tensors` are contiguous views of (as bytes) and their byte offsets in it, or None."""
    storage = tensors[0].untyped_storage()
    if tensors[0].device.type != "cpu" or any(
        t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors
    ):
        return None
    where = [t.storage_offset() * t.element_size() for t in tensors]
    first = min(where)
    end = max(w + t.numel() * t.element_size() for w, t in zip(where, tensors))
    if end - first > 2 * sum(t.numel() * t.element_size() for t in tensors) + 4 * ALIGN:
        return None  # scattered views: copying the bytes between them would move unrelated ones
    # their span, not the whole storage: a host pool's block is a small part of its segment
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,))
    where = [w - first for w in where]
    if any(w % 4 for w in where[1::2]):
        return None
    return buffer, where


def slab(
    specs: list[tuple[tuple[int, ...], torch.dtype]], pinned: bool, buffer: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Empty host tensors of these (shape, dtype), all views of one (page-locked if `pinned`) buffer, each aligned:
    how the tiers keep an entry, so that it moves to the device in one copy. `buffer`: uint8 bytes to carve them
    from (at least `slab_bytes(specs)`), else a new one."""
    sizes, offsets = _carving(specs)
    if buffer is None:
        buffer = torch.empty(offsets[-1] + sizes[-1], dtype=torch.uint8, pin_memory=pinned)
    return [buffer[o : o + n].view(dtype).view(shape) for (shape, dtype), o, n in zip(specs, offsets, sizes)]


def slab_bytes(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes `slab` carves these tensors from."""
    sizes, offsets = _carving(specs)
    return offsets[-1] + sizes[-1]


def _carving(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], list[int]]:
    """Each tensor's bytes, and where it starts (aligned) in its slab."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    return sizes, [0, *itertools.accumulate(aligned(size) for size in sizes[:-1])]
