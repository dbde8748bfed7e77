"""Reads of pinned lower-tier entries: one layer at a time, or a whole load's entries joined on the device.

`LayerReader` reads one entry's layers (host codes or values where they lie, a disk file a layer per call,
checked). `read_raw` hands a load's int8 entries over as host bytes (host entries as they lie; disk files
opened and read side by side into one buffer, as they are on disk), the one form in which whole entries
reach the device (`kvcore/packed.py`): `BatchedReads` uploads them so, joins them and dequantizes each
layer of all of them in one op, where a copy and a dequantization per entry and layer would cost hundreds
of launches a layer. A damaged or vanished file raises `RecordCorruptError`, never returns garbage.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcore.packed import PackedEntries, RawEntry, aligned, pack, raw_entry
from kvcore.quantize import Quantized, dequantize
from kvcore.tier_disk import DiskFile, Key, advise_willneed
from kvcore.tier_media import HostKV, in_hand
from kvcore.tier_policy import TierEntry

if TYPE_CHECKING:
    from kvcore.tiers import TieredStore

Joined = tuple[torch.Tensor, torch.Tensor, list[int]]  # K and V `[H, sum T, D]` of several entries, their starts


class LayerReader:
    """One pinned entry's K/V, a layer at a time, on the store's device."""

    def __init__(self, key: Key, entry: TierEntry, device: torch.device) -> None:
        self.key, self.entry, self.device = key, entry, device
        self.tier, self.layers = entry.tier, entry.layers
        self._file: DiskFile | None = None  # opened at the first layer, kept until the load ends

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[H, T, D]` of one layer, in the entry's original dtype, on the device."""
        return self.to_device(*self.host_layer(index))

    def host_layer(self, index: int) -> tuple[Quantized | torch.Tensor, Quantized | torch.Tensor]:
        """One layer's K and V as the tier keeps them (int8 codes or values), where it keeps them."""
        held = self.held()
        if isinstance(held, Path):
            if self._file is None:
                self._file = DiskFile(held)
            return self._file.layer(index)
        return held.layer(index)

    def held(self) -> Path | HostKV:
        """Where the entry is now, read once: its disk file, or its K and V in host memory. A background write
        moves an entry from memory to its file at any moment, so callers decide on one reading."""
        return in_hand(self.entry.held)

    def to_device(self, k: Quantized | torch.Tensor, v: Quantized | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(k, Quantized):
            k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
            return dequantize(k, self.dtype), dequantize(v, self.dtype)
        return k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def nbytes(self) -> int:
        """The entry's bytes as its tier keeps them (what a load of it transfers)."""
        return self.entry.nbytes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_raw(readers: list[LayerReader], pinned: bool, pool: ThreadPoolExecutor | None) -> list[RawEntry] | None:
    """Every reader's int8 entry as host bytes, or None if one is kept at full precision or its file is laid out
    unevenly: host entries as they lie, disk files opened and read (on `pool`'s threads when given) into one
    buffer (page-locked if `pinned`), as they are on disk, checked. `RecordCorruptError` for a damaged file."""
    held = [reader.held() for reader in readers]
    files = [(reader, where) for reader, where in zip(readers, held) if isinstance(where, Path)]
    from_files = iter(_read_files(files, pinned, pool) if files else [])
    out = []
    for where in held:
        if isinstance(where, Path):
            entry = next(from_files)
        else:
            codes = where.host_codes()
            entry = raw_entry(*codes) if codes is not None else None
        if entry is None:
            return None
        out.append(entry)
    return out


def _read_files(
    files: list[tuple[LayerReader, Path]], pinned: bool, pool: ThreadPoolExecutor | None
) -> list[RawEntry | None]:
    """Each file read into its slot of one buffer (slots sized by the entries' recorded bytes, which bound
    their files' tensors), after the kernel was asked to read all of them ahead."""
    starts = [0, *itertools.accumulate(aligned(reader.nbytes) for reader, _ in files)]
    buffer = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pinned)
    advise_willneed([path for _, path in files])

    def read(job: tuple[tuple[LayerReader, Path], int, int]) -> RawEntry | None:
        (reader, path), at, end = job
        with DiskFile(path) as file:
            if not file.quantized or file.data_bytes(reader.layers) > end - at:
                return None
            return file.read_raw(reader.layers, buffer, at)

    jobs = list(zip(files, starts, starts[1:]))
    return list(pool.map(read, jobs)) if pool is not None and len(jobs) > 1 else list(map(read, jobs))


class BatchedReads:
    """Layer reads of one load's tier entries, joined along the tokens, on their store's device.

    At the first layer asked for, the int8 entries go to the device whole as raw bytes (`read_raw`, `pack`),
    are joined there, and each layer of all of them is then dequantized in one op. Loads that cannot go so
    (an entry at full precision, shapes or dtypes that differ) are read a layer at a time, entry by entry.
    """

    def __init__(self, readers: list[LayerReader], tiers: "TieredStore", dtype: torch.dtype) -> None:
        """`dtype`: what the layers come in (the device arena's, whatever each entry was stored in)."""
        self.readers, self._tiers, self.dtype = readers, tiers, dtype
        self._uploaded: _Uploaded | bool | None = None  # None: not tried yet; False: not possible

    def joined_layer(self, index: int) -> Joined:
        """Layer `index` of all readers joined along the tokens (K and V `[H, sum T, D]`, reader by reader) and
        where each reader's tokens start (the total last): one tensor a consumer gathers from in one op."""
        if len(self.readers) > 1 and self._uploaded is None:
            self._uploaded = self._upload() or False
        if self._uploaded:
            values = self._uploaded.values(index)
            return values[0], values[1], self._uploaded.starts
        return join([_as(self.dtype, *reader.layer(index)) for reader in self.readers])

    def _upload(self) -> _Uploaded | None:
        packed = upload(self._tiers, self.readers, self.dtype)
        return _Uploaded.of(packed) if packed is not None else None


def upload(tiers: "TieredStore", readers: list[LayerReader], dtype: torch.dtype) -> PackedEntries | None:
    """The readers' int8 entries on the store's device as one packed buffer (`read_raw`, then `pack`; through
    page-locked memory on CUDA) that dequantizes to `dtype` (the arena's: int8 codes of entries stored in other
    dtypes join one buffer), or None when they cannot go so: an entry at full precision, or shapes that differ.
    `RecordCorruptError` for a damaged file."""
    entries = tiers.read_raw(readers, pinned=tiers.device.type == "cuda")
    return pack(entries, dtype, tiers.device) if entries is not None else None


def _as(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k.to(dtype), v.to(dtype)


def join(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Joined:
    """One layer of several entries joined along the tokens, and where each one's tokens start."""
    starts = [0, *itertools.accumulate(k.shape[1] for k, _ in layers)]
    if len(layers) == 1:
        return layers[0][0], layers[0][1], starts
    return torch.cat([k for k, _ in layers], dim=1), torch.cat([v for _, v in layers], dim=1), starts


@dataclass
class _Uploaded:
    """A load's int8 entries on the device, joined: codes `[2, L, H, sum T, D]`, scales `[2, L, H, E, D]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    owner: torch.Tensor  # token -> entry
    starts: list[int]
    dtype: torch.dtype

    @classmethod
    def of(cls, packed: PackedEntries) -> "_Uploaded":
        entries = [packed.entry(i) for i in range(len(packed.starts) - 1)]
        shape = (2, packed.layers, packed.heads)
        device = packed.flat.device
        codes = torch.empty((*shape, packed.tokens, packed.dim), dtype=torch.int8, device=device)
        scales = torch.empty((*shape, len(entries), packed.dim), dtype=torch.float32, device=device)
        for side in (0, 1):
            torch.cat([entry[side].codes for entry in entries], dim=2, out=codes[side])
            torch.cat([entry[side].scales for entry in entries], dim=2, out=scales[side])
        return cls(codes, scales, packed.owner, packed.starts, packed.dtype)

    def values(self, index: int) -> torch.Tensor:
        """Layer `index` of every entry, dequantized in one op: `[2, H, sum T, D]`."""
        return (self.codes[:, index].float() * self.scales[:, index].index_select(2, self.owner)).to(self.dtype)
