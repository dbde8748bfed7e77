"""The disk tier's files: layer-contiguous, a CRC32 per tensor, readable a layer at a time, whole, or raw.

A file holds one entry's K and V (int8 codes and float32 scales, or values) layer after layer, so one layer is
read on its own; every tensor's CRC32 is in the header, and one of the whole data section for whole reads (one
check instead of one per tensor: a load of 50 files holds 6,400), so a flipped, truncated or vanished file raises
`RecordCorruptError` instead of serving garbage. `slab` makes the host buffers that reads land in: an entry's
tensors side by side in one aligned (page-locked) buffer (`kvcore.packed.slab`), so it reaches the device in one copy.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from kvcore.errors import RecordCorruptError
from kvcore.packed import RawEntry, slab
from kvcore.quantize import Quantized
from kvcore.safetensors_io import CRC_KEY, DATA_CRC_KEY, dtype_of, read_header, write_atomic

Key = tuple[str, str]  # (tenant id, record id)


def tier_files(root: Path, keys: list[Key]) -> list[Path]:
    """Where the disk-tier files of these entries would be, in every replica slot under `root` (no listing of
    the slots' contents: a prefetch must not cost more than the files it saves)."""
    try:
        slots = [entry for entry in Path(root).iterdir() if entry.is_dir()]
    except OSError:
        return []
    return [slot / file_name(key) for slot in slots for key in keys]


def file_name(key: Key) -> str:
    """The disk-tier file of an entry, inside its replica slot."""
    return f"{key[0]}__{key[1]}.kv"


def advise_willneed(paths: list[Path]) -> None:
    """Start kernel readahead of whole files, without waiting: a prefetch into the page cache."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone since: the load will notice and fall back
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def write_tier_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """A layer-contiguous file with a CRC32 per tensor; no fsync (a torn file fails its checks and is dropped)."""
    write_atomic(path, tensors, meta, durable=False, checksums=True, data_checksum=True)


class DiskFile:
    """A tier file open for reading: the header parsed once, each layer's tensors read in one call and checked
    against their CRC32s (a layer's tensors are adjacent in the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._handle = open(path, "rb", buffering=0)
            self._header, self._start = read_header(self._handle, path)
            meta = self._header.get("__metadata__", {})
            self._crc_map, self._crcs = meta.get(CRC_KEY, "{}"), None  # parsed when a tensor is checked alone
            self._data_crc = int(meta[DATA_CRC_KEY]) if DATA_CRC_KEY in meta else None
        except (OSError, ValueError) as exc:  # gone, or a header that parses but lies
            self.close()
            raise RecordCorruptError(f"{path}: cannot be read ({exc})") from None
        self._data_end = max(
            (info["data_offsets"][1] for name, info in self._header.items() if name != "__metadata__"), default=0
        )
        self._located: tuple[int, list[tuple[list[str], list[dict]]]] | None = None

    @property
    def quantized(self) -> bool:
        return "k.000.codes" in self._header

    def layer(self, index: int):
        """One layer's K and V (codes and scales when quantized), read in one call and checked."""
        names, infos = self._layer_infos(index)
        first, last = min(i["data_offsets"][0] for i in infos), max(i["data_offsets"][1] for i in infos)
        return self._layer_in(self._read(first, last), first, names, infos)

    def read_all(self, layers: int, pinned: bool = False):
        """Every layer in one read: K and V `[L, H, T, D]` (as `Quantized` when the file holds codes), checked;
        copied straight into page-locked memory when `pinned` (the one copy a device upload needs). The file's
        layers are equal in shape and evenly spaced, so each tensor of all layers is one strided copy, not L views."""
        located = self._all_layers(layers)
        raw = bytearray(self._data_bytes(located))  # the tensors are views of it: no copy after the read
        stride = self._read_checked(located, memoryview(raw))
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        firsts = located[0][1]
        out = slab([((layers, *info["shape"]), dtype_of(info["dtype"])) for info in firsts], pinned)  # one buffer
        for info, dest in zip(firsts, out):
            begin, end = info["data_offsets"]
            dest.view(layers, -1).view(torch.uint8).copy_(flat.as_strided((layers, end - begin), (stride, 1), begin))
        if len(out) == 4:
            return Quantized(out[0], out[1]), Quantized(out[2], out[3])
        return out[0], out[1]

    def data_bytes(self, layers: int) -> int:
        """Bytes of the file's tensors (what `read_raw` reads)."""
        return self._data_bytes(self._all_layers(layers))

    def read_raw(self, layers: int, buffer: torch.Tensor, at: int) -> RawEntry | None:
        """The file's tensors read in one call into `buffer` at `at`, as they lie (layer after layer), checked;
        None if its scales are not 4-byte aligned there (then read another way)."""
        located = self._all_layers(layers)
        firsts = located[0][1]
        if len(firsts) != 4:
            return None
        stride = self._read_checked(located, memoryview(buffer.numpy())[at : at + self._data_bytes(located)])
        offsets = tuple(at + info["data_offsets"][0] for info in firsts)
        if stride % 4 or any(o % 4 for o in offsets[1::2]):
            return None
        heads, tokens, dim = firsts[0]["shape"]
        if firsts[1]["shape"] != [heads, 1, dim] or any(
            dtype_of(i["dtype"]) != d for i, d in zip(firsts, (torch.int8, torch.float32) * 2)
        ):
            raise RecordCorruptError(f"{self.path}: codes and scales do not match")
        return RawEntry(buffer, offsets, stride, stride, tokens, (layers, heads, dim))

    @staticmethod
    def _data_bytes(located: list[tuple[list[str], list[dict]]]) -> int:
        return max(info["data_offsets"][1] for _, infos in located for info in infos)

    def _read_checked(self, located: list[tuple[list[str], list[dict]]], into: memoryview) -> int:
        """Every layer's tensors read in one call into `into` and checked; the distance between layers. A file
        whose layers differ in shape or are not evenly spaced is refused (`_store_packed` never writes one)."""
        stride = layer_stride([infos for _, infos in located])
        if stride is None:
            raise RecordCorruptError(f"{self.path}: layers differ in shape or are not evenly spaced")
        try:
            self._handle.seek(self._start)
            got = self._handle.readinto(into)
        except (OSError, ValueError) as exc:
            raise RecordCorruptError(f"{self.path}: cannot be read ({exc})") from None
        if got != len(into):
            raise RecordCorruptError(f"{self.path}: truncated")
        if self._data_crc is not None and len(into) == self._data_end:  # the whole data section: one check
            if zlib.crc32(into) != self._data_crc:
                raise RecordCorruptError(f"{self.path}: checksum of its data does not match")
            for name, info in zip(*located[0]):  # every layer's tensors match the first's (`layer_stride`)
                _check_size(self.path, name, info, info["data_offsets"][1] - info["data_offsets"][0])
            return stride
        for names, infos in located:
            for name, info in zip(names, infos):
                self._checked(name, info, into, 0)
        return stride

    def _all_layers(self, layers: int) -> list[tuple[list[str], list[dict]]]:
        """Every layer's tensor names and header entries, looked up once per file."""
        if self._located is None or self._located[0] != layers:
            self._located = (layers, [self._layer_infos(index) for index in range(layers)])
        return self._located[1]

    def _layer_infos(self, index: int) -> tuple[list[str], list[dict]]:
        quantized = f"k.{index:03d}.codes" in self._header
        names = [f"{n}.{index:03d}{part}" for n in "kv" for part in ((".codes", ".scales") if quantized else ("",))]
        infos = [self._header.get(name) for name in names]
        if any(info is None for info in infos):
            raise RecordCorruptError(f"{self.path}: layer {index} is missing")
        return names, infos

    def _read(self, first: int, last: int) -> bytearray:
        raw = bytearray(last - first)  # the tensors are views of it: no copy after the read
        try:
            self._handle.seek(self._start + first)
            got = self._handle.readinto(raw)
        except (OSError, ValueError) as exc:
            raise RecordCorruptError(f"{self.path}: cannot be read ({exc})") from None
        if got != last - first:
            raise RecordCorruptError(f"{self.path}: truncated")
        return raw

    def _layer_in(self, raw: bytearray, first: int, names: list[str], infos: list[dict]):
        tensors = [self._tensor(name, info, raw, first) for name, info in zip(names, infos)]
        if len(tensors) == 4:
            return Quantized(tensors[0], tensors[1]), Quantized(tensors[2], tensors[3])
        return tensors[0], tensors[1]

    def _tensor(self, name: str, info: dict, raw: bytearray, first: int) -> torch.Tensor:
        piece, begin, size, dtype = self._checked(name, info, raw, first)
        if (begin - first) % size:  # a view needs aligned storage: copy this one
            return torch.frombuffer(bytearray(piece), dtype=torch.uint8).view(dtype).reshape(info["shape"])
        flat = torch.frombuffer(raw, dtype=torch.uint8, count=len(piece), offset=begin - first)
        return flat.view(dtype).reshape(info["shape"])

    def _checked(self, name: str, info: dict, raw: bytearray, first: int) -> tuple[memoryview, int, int, torch.dtype]:
        """A tensor's bytes in `raw` (which starts at data offset `first`), checked against its CRC32 and shape."""
        begin, end = info["data_offsets"]
        piece = memoryview(raw)[begin - first : end - first]
        if self._crcs is None:
            try:
                self._crcs = json.loads(self._crc_map)
            except ValueError as exc:
                raise RecordCorruptError(f"{self.path}: checksums cannot be read ({exc})") from None
        if zlib.crc32(piece) != self._crcs.get(name):
            raise RecordCorruptError(f"{self.path}: checksum of {name!r} does not match")
        dtype = _check_size(self.path, name, info, len(piece))
        return piece, begin, dtype.itemsize, dtype

    def close(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()
            self._handle = None

    def __enter__(self) -> "DiskFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_size(path: Path, name: str, info: dict, size: int) -> torch.dtype:
    """The tensor's dtype, if `size` bytes hold its shape (and it is not empty)."""
    dtype = dtype_of(info["dtype"])
    if size == 0 or size != math.prod(info["shape"]) * dtype.itemsize:
        raise RecordCorruptError(f"{path}: tensor {name!r} has the wrong size")
    return dtype


def layer_stride(layers: list[list[dict]]) -> int | None:
    """The byte distance between consecutive layers' tensors if every layer's tensors match the first's in dtype
    and shape and sit at the same distance further on (as `_store_packed` writes them), else None."""
    first = layers[0]
    stride = layers[1][0]["data_offsets"][0] - first[0]["data_offsets"][0] if len(layers) > 1 else 0
    for index, infos in enumerate(layers):
        for info, base in zip(infos, first):
            if (info["dtype"], info["shape"]) != (base["dtype"], base["shape"]) or info["data_offsets"][0] != base[
                "data_offsets"
            ][0] + index * stride:
                return None
    return stride
