"""A whole load's int8 tier entries on the device as raw bytes, dequantized straight into arena rows.

A load brought up whole (`TierStreams`) has tens of entries. Viewing, joining and dequantizing them
entry by entry costs a dozen torch calls each, which on a GPU is host time in front of the forward
(more than the transfer itself at ~50 entries). Here each entry's four tensors (K codes, K scales,
V codes, V scales), which the tiers keep in one host buffer, are copied into one device buffer with one
copy per entry; a table of their byte offsets goes along, and a `PackedInserter` (one device kernel,
deployments/triton_adapter) writes every token of every entry into its arena rows in one launch.
`insert_packed` does the same in torch: the path where no kernel applies, and the kernel's reference.
"""

from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcore.quantize import Quantized

_ALIGN = 64  # bytes: every entry's buffer starts aligned for any dtype and for vectorized loads
TABLE_COLUMNS = 6  # per entry: byte offsets of K codes, K scales, V codes, V scales; tokens; first token


@dataclass
class PackedEntries:
    """Entries `[L, H, T_i, D]` (int8 codes, float32 scales `[L, H, 1, D]`) in one device byte buffer."""

    flat: torch.Tensor  # uint8: every entry's tensors
    table: torch.Tensor  # int64 [E, TABLE_COLUMNS]
    owner: torch.Tensor  # int64 [sum T]: the entry of each token
    rows: list[tuple[int, ...]]  # the table, on the host
    starts: list[int]  # where each entry's tokens start (the total last)
    layers: int
    heads: int
    dim: int
    dtype: torch.dtype  # what the codes dequantize to (the records' own dtype)

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    def entry(self, index: int) -> tuple[Quantized, Quantized]:
        """Entry `index` as views of the device buffer."""
        k_codes, k_scales, v_codes, v_scales, count, _ = self.rows[index]
        codes = (self.layers, self.heads, count, self.dim)
        scales = (self.layers, self.heads, 1, self.dim)
        return (Quantized(self._view(k_codes, codes, torch.int8), self._view(k_scales, scales, torch.float32)),
                Quantized(self._view(v_codes, codes, torch.int8), self._view(v_scales, scales, torch.float32)))

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.flat[offset : offset + size].view(dtype).view(shape)


class PackedInserter(Protocol):
    """Writes every token of `packed` into the arena's K and V `[L, R, H, D]` at `rows` (int64 `[sum T]`,
    on the device), dequantized to the arena's dtype exactly as `insert_packed` does."""

    def __call__(self, packed: PackedEntries, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


def pack(entries: list[tuple[Quantized, Quantized]], dtype: torch.dtype, device: torch.device) -> PackedEntries | None:
    """The entries in one device buffer (None unless all are int8 of one layer, head and channel shape): one
    copy per entry whose tensors share a host buffer (what the tiers keep), one per tensor otherwise."""
    if not entries or not all(isinstance(k, Quantized) and isinstance(v, Quantized) for k, v in entries):
        return None
    layers, heads, _, dim = entries[0][0].codes.shape
    for pair in entries:
        for q in pair:
            count = q.codes.shape[2]
            if q.codes.dtype != torch.int8 or q.codes.shape != (layers, heads, count, dim) or q.scales.shape != (layers, heads, 1, dim):
                return None
    sources, rows, offset = [], [], 0
    starts = [0, *itertools.accumulate(k.codes.shape[2] for k, _ in entries)]
    for (k, v), first in zip(entries, starts):
        tensors = [k.codes, k.scales.float(), v.codes, v.scales.float()]
        base = _shared_buffer(tensors)
        if base is not None:
            buffer, where = base
            sources.append((offset, buffer))
            rows.append((*(offset + w for w in where), k.codes.shape[2], first))
            offset += _aligned(buffer.numel())
            continue
        where = []
        for t in tensors:
            sources.append((offset, t.contiguous().view(-1).view(torch.uint8)))
            where.append(offset)
            offset += _aligned(t.numel() * t.element_size())
        rows.append((*where, k.codes.shape[2], first))
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for at, source in sources:
        flat[at : at + source.numel()].copy_(source, non_blocking=True)
    owner = array("q")
    for index, (a, b) in enumerate(zip(starts, starts[1:])):
        owner.extend(array("q", [index]) * (b - a))
    host = torch.frombuffer(array("q", [x for row in rows for x in row]) + owner, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    table = moved[: len(rows) * TABLE_COLUMNS].view(len(rows), TABLE_COLUMNS)
    return PackedEntries(flat, table, moved[len(rows) * TABLE_COLUMNS :], rows, starts, layers, heads, dim, dtype)


def insert_packed(packed: PackedEntries, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`PackedInserter` in torch: each entry dequantized (float32 product, rounded to the arena's dtype once)
    and copied into its rows."""
    for index, (first, end) in enumerate(zip(packed.starts, packed.starts[1:])):
        k_q, v_q = packed.entry(index)
        at = rows[first:end]
        k.index_copy_(1, at, (k_q.codes.float() * k_q.scales).to(k.dtype).permute(0, 2, 1, 3))
        v.index_copy_(1, at, (v_q.codes.float() * v_q.scales).to(v.dtype).permute(0, 2, 1, 3))


def _shared_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The host buffer all `tensors` are contiguous views of (as bytes) and their byte offsets in it, or None."""
    storage = tensors[0].untyped_storage()
    if tensors[0].device.type != "cpu" or any(
            t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors):
        return None
    if storage.nbytes() > 2 * sum(t.numel() * t.element_size() for t in tensors) + 4 * _ALIGN:
        return None  # views of something larger: copying all of it would move unrelated bytes
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    return buffer, [t.storage_offset() * t.element_size() for t in tensors]


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
