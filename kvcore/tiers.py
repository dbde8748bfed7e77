"""Fact K/V across three tiers of one replica: device memory, (pinned) host memory and disk.

Every entry lives in exactly one tier. `put` places it as high as its budget allows, spilling the
entries that score lowest (recency, frequency, importance) one tier down; the lower tiers keep int8
codes (`compress_lower`) and the disk keeps layer-contiguous files, so one layer is read on its own.
Loads are two-phase: `begin_load` pins the entry (nothing evicts or moves it) and hands out a reader
of one layer at a time, on the device, so a connector can fetch layer l while layer l-1 computes;
`end_load` unpins it and may promote it. `on_move(key, tier)` reports every placement, None once an entry
leaves (the serving layer records placements in Redis); `TieredStore` reopened on the same folder finds its disk entries again.
Disk files carry a CRC32 per tensor: a damaged or vanished file raises `RecordCorruptError` on read (and
is dropped at recovery), so a caller falls back to the canonical record instead of serving garbage.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from kvcore.conversation import check_identifier
from kvcore.errors import RecordCorruptError
from kvcore.quantize import Quantized, dequantize, quantize
from kvcore.safetensors_io import dtype_of, read_header, write_atomic

log = logging.getLogger(__name__)
Tier = Literal["gpu", "cpu", "disk"]
ORDER: tuple[Tier, ...] = ("gpu", "cpu", "disk")
Key = tuple[str, str]  # (tenant id, record id)


@dataclass
class _Entry:
    tier: Tier
    data: object  # (k, v) tensors, (Quantized, Quantized), or a Path on disk
    nbytes: int
    layers: int
    dtype: torch.dtype
    importance: float = 0.0
    hits: int = 0
    last_use: float = 0.0
    loading: int = 0
    label: str = ""  # the caller's name for the entry (kept in the disk file, so it survives a restart)


@dataclass
class _Pending:
    """A disk entry whose file a background thread is still writing: reads use the codes kept here."""

    path: Path
    packed: tuple[object, object]
    cancelled: bool = False
    written: bool = False


class LayerReader:
    """One pinned entry's K/V, a layer at a time, on the store's device."""

    def __init__(self, store: "TieredStore", key: Key, entry: _Entry) -> None:
        self._store, self.key, self._entry = store, key, entry
        self.tier, self.layers = entry.tier, entry.layers
        self._file: _DiskFile | None = None  # opened at the first layer, kept until the load ends

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[H, T, D]` of one layer, in the entry's original dtype, on the device."""
        entry, device = self._entry, self._store.device
        data = entry.data
        if entry.tier == "disk" and not isinstance(data, _Pending):
            if self._file is None:
                self._file = _DiskFile(data)
            k, v = self._file.layer(index)
        else:
            k, v = data.packed if isinstance(data, _Pending) else data
            k, v = (k.layer(index), v.layer(index)) if isinstance(k, Quantized) else (k[index], v[index])
        if isinstance(k, Quantized):
            k, v = k.to(device, non_blocking=True), v.to(device, non_blocking=True)
            return dequantize(k, entry.dtype), dequantize(v, entry.dtype)
        return k.to(device, non_blocking=True), v.to(device, non_blocking=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TieredStore:
    def __init__(self, device: torch.device | str, gpu_bytes: int, cpu_bytes: int, disk_dir: Path, *,
                 compress_lower: bool = True, age_scale_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 on_move: Callable[[Key, Tier | None], None] = lambda key, tier: None, write_behind: bool = False) -> None:
        self.device = torch.device(device)
        self._budget = {"gpu": gpu_bytes, "cpu": cpu_bytes, "disk": math.inf}
        self._used = {"gpu": 0, "cpu": 0, "disk": 0}
        self._dir = Path(disk_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._compress, self._age, self._clock, self._on_move = compress_lower, age_scale_s, clock, on_move
        self._entries: dict[Key, _Entry] = {}
        self._lock = threading.Lock()  # between the caller and the background writer of disk files
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tier-writer") if write_behind else None
        self._recover()

    # ---- queries ----
    def tier_of(self, key: Key) -> Tier | None:
        entry = self._entries.get(key)
        return entry.tier if entry else None

    def used(self, tier: Tier) -> int:
        return self._used[tier]

    def label_of(self, key: Key) -> str:
        entry = self._entries.get(key)
        return entry.label if entry else ""

    def entries(self) -> list[tuple[Key, Tier, str]]:
        """Every entry's key, tier and label (what a restarted replica reports as its placement)."""
        return [(key, e.tier, e.label) for key, e in self._entries.items()]

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def listen(self, on_move: Callable[[Key, Tier | None], None]) -> None:
        """Report placements to `on_move` from now on (replacing the constructor's listener)."""
        self._on_move = on_move

    def prefetch(self, keys: list[Key]) -> None:
        """Ask the kernel to start reading the disk entries among `keys` now (layer reads then hit memory)."""
        advise_willneed([e.data for e in (self._entries.get(k) for k in keys) if e is not None and isinstance(e.data, Path)])

    def flush(self) -> None:
        """Wait until every disk file queued so far is written."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # ---- writes ----
    def put(self, key: Key, k: torch.Tensor, v: torch.Tensor, importance: float = 0.0, label: str = "") -> Tier:
        """Store a fact's K/V `[L, H, T, D]` as high as room can be made; return where it went."""
        _check_key(key)
        if key in self._entries:
            self.remove(key)
        entry = _Entry("disk", None, 0, k.shape[0], k.dtype, importance, 0, self._clock(), label=label)
        self._entries[key] = entry
        entry.loading += 1  # protected while it finds its place
        try:
            for tier in ORDER:
                if tier == "disk" or self._make_room(tier, self._size_in(tier, k), keep=key):
                    self._place(key, entry, tier, *self._encode(key, k, v, tier))
                    return tier
        finally:
            entry.loading -= 1
        raise AssertionError("unreachable: the disk tier always has room")

    def remove(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.loading:
            self._entries[key] = entry
            raise RuntimeError(f"{key} is being loaded and cannot be removed")
        self._release(entry)
        self._on_move(key, None)

    def discard_damaged(self, reader: LayerReader) -> None:
        """Drop an entry whose reads failed, pinned by `reader` or not: the caller serves the canonical record."""
        reader.close()
        if self._entries.get(reader.key) is reader._entry:
            self._drop(reader.key)

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        log.warning("tier entry %s on %s was damaged or missing; dropped", key, entry.tier)
        self._release(entry)
        self._on_move(key, None)

    def touch(self, key: Key, importance: float | None = None) -> None:
        """A retrieval hit: raises the entry's recency and frequency (and importance, if higher)."""
        entry = self._entries[key]
        entry.hits += 1
        entry.last_use = self._clock()
        if importance is not None:
            entry.importance = max(entry.importance, importance)

    def read(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole entry `[L, H, T, D]` in its original dtype (dequantized), on the host or device it is on."""
        return self._decode(self._entries[key])

    # ---- two-phase loads ----
    def begin_load(self, key: Key) -> LayerReader:
        entry = self._entries[key]
        entry.loading += 1
        self.touch(key)
        return LayerReader(self, key, entry)

    def end_load(self, reader: LayerReader, promote: bool = True) -> None:
        reader.close()
        entry = self._entries.get(reader.key)
        if entry is None:
            return
        entry.loading -= 1
        if promote and entry.loading == 0 and entry.tier != "gpu":
            self.promote(reader.key)

    def promote(self, key: Key) -> Tier | None:
        """Move an entry to the highest tier above it where room can be made by spilling lower-scoring entries.

        None if the entry proved damaged on the way up (it is dropped)."""
        entry = self._entries[key]
        if entry.tier == "gpu" or entry.loading:
            return entry.tier
        try:
            k, v = self._decode(entry)
        except RecordCorruptError:
            self._drop(key)
            return None
        entry.loading += 1
        try:
            for up in ORDER[: ORDER.index(entry.tier)]:
                data, nbytes = self._encode(key, k, v, up)
                if self._make_room(up, nbytes, keep=key):
                    old = (entry.tier, entry.data, entry.nbytes)
                    self._place(key, entry, up, data, nbytes)
                    self._free(*old)
                    break
        finally:
            entry.loading -= 1
        return entry.tier

    # ---- internals ----
    def _score(self, entry: _Entry) -> float:
        return entry.importance + math.log1p(entry.hits) - (self._clock() - entry.last_use) / self._age

    def _make_room(self, tier: Tier, nbytes: int, keep: Key) -> bool:
        if nbytes > self._budget[tier]:
            return False
        while self._used[tier] + nbytes > self._budget[tier]:
            movable = [(self._score(e), key) for key, e in self._entries.items()
                       if e.tier == tier and not e.loading and key != keep and e.data is not None]
            if not movable:
                return False
            _, victim = min(movable)
            self._demote(victim)
        return True

    def _demote(self, key: Key) -> None:
        entry = self._entries[key]
        down = ORDER[ORDER.index(entry.tier) + 1]
        k, v = self._decode(entry)
        entry.loading += 1
        try:
            if down != "disk" and not self._make_room(down, self._size_in(down, k), keep=key):
                down = "disk"
            data, nbytes = self._encode(key, k, v, down)
            old = (entry.tier, entry.data, entry.nbytes)
            self._place(key, entry, down, data, nbytes)
            self._free(*old)
        finally:
            entry.loading -= 1

    def _place(self, key: Key, entry: _Entry, tier: Tier, data: object, nbytes: int) -> None:
        with self._lock:  # the writer thread swaps a pending entry's data under the same lock
            entry.tier, entry.data, entry.nbytes = tier, data, nbytes
        self._used[tier] += nbytes
        self._on_move(key, tier)

    def _free(self, tier: Tier, data: object, nbytes: int) -> None:
        self._used[tier] -= nbytes
        if tier == "disk" and isinstance(data, Path):
            if self._writer is not None:  # off the caller's path too, in order with the writes
                self._writer.submit(data.unlink, missing_ok=True)
            else:
                data.unlink(missing_ok=True)
        elif isinstance(data, _Pending):
            with self._lock:
                data.cancelled = True
                if data.written:
                    data.path.unlink(missing_ok=True)

    def _release(self, entry: _Entry) -> None:
        self._free(entry.tier, entry.data, entry.nbytes)

    def _size_in(self, tier: Tier, k: torch.Tensor) -> int:
        """Bytes K and V of this shape take in `tier` (what `_encode` will count), known before encoding."""
        if tier == "gpu" or not self._compress:
            return 2 * k.numel() * k.element_size()
        layers, heads, _, dim = k.shape
        return 2 * (k.numel() + layers * heads * dim * 4)  # int8 codes and float32 scales per channel

    def _encode(self, key: Key, k: torch.Tensor, v: torch.Tensor, tier: Tier) -> tuple[object, int]:
        if tier == "gpu":
            k, v = k.to(self.device), v.to(self.device)
            return (k, v), _nbytes(k) + _nbytes(v)
        packed = (quantize(k), quantize(v)) if self._compress else (k.cpu(), v.cpu())
        if tier == "cpu":
            if self.device.type == "cuda":
                packed = tuple(_pin(x) for x in packed)
            return packed, sum(_nbytes(x) for x in packed)
        path = self._dir / file_name(key)
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(k.shape[0]):
            for name, x in zip("kv", packed):
                if isinstance(x, Quantized):
                    tensors[f"{name}.{layer:03d}.codes"], tensors[f"{name}.{layer:03d}.scales"] = x.codes[layer], x.scales[layer]
                else:
                    tensors[f"{name}.{layer:03d}"] = x[layer].contiguous()
        meta = {"tenant": key[0], "record": key[1], "layers": str(k.shape[0]), "dtype": str(k.dtype).split(".")[-1],
                "quantized": str(self._compress), "label": self._entries[key].label if key in self._entries else ""}
        if self._writer is None:
            _write_tier_file(path, tensors, meta)
            return path, path.stat().st_size
        pending = _Pending(path, packed)
        self._writer.submit(self._write_behind, key, pending, tensors, meta)
        return pending, sum(_nbytes(x) for x in packed)

    def _write_behind(self, key: Key, pending: _Pending, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """On the writer thread: write the file, then point the entry at it (unless it left the disk meanwhile)."""
        if pending.cancelled:
            return
        try:
            _write_tier_file(pending.path, tensors, meta)
        except OSError as exc:
            log.warning("tier file %s not written (%s); the entry stays in memory", pending.path, exc)
            return
        with self._lock:
            pending.written = True
            entry = self._entries.get(key)
            if pending.cancelled or entry is None or entry.data is not pending:
                pending.path.unlink(missing_ok=True)
            else:
                entry.data = pending.path

    def _decode(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(entry.data, _Pending):
            k, v = entry.data.packed
        elif entry.tier == "disk":
            with _DiskFile(entry.data) as file:
                layers = [file.layer(i) for i in range(entry.layers)]
            ks, vs = zip(*layers)
            if isinstance(ks[0], Quantized):
                return (torch.stack([dequantize(x, entry.dtype) for x in ks]), torch.stack([dequantize(x, entry.dtype) for x in vs]))
            return torch.stack(ks), torch.stack(vs)
        else:
            k, v = entry.data
        if isinstance(k, Quantized):
            return dequantize(k, entry.dtype), dequantize(v, entry.dtype)
        return k, v

    def _recover(self) -> None:
        """Entries a previous store left on disk are this store's disk tier."""
        for path in sorted(self._dir.glob("*.kv")):
            try:
                with open(path, "rb") as handle:
                    meta = read_header(handle, path)[0].get("__metadata__", {})
                key = (meta["tenant"], meta["record"])
                _check_key(key)
                dtype = getattr(torch, meta["dtype"])
                layers = int(meta["layers"])
                json.loads(meta["crc32"])
            except (RecordCorruptError, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
                log.warning("tier file %s is unreadable (%s); removed", path, exc)
                path.unlink(missing_ok=True)
                continue
            self._entries[key] = _Entry("disk", path, path.stat().st_size, layers, dtype,
                                        last_use=self._clock(), label=meta.get("label", ""))
            self._used["disk"] += path.stat().st_size


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


def _write_tier_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """A layer-contiguous file with a CRC32 per tensor; no fsync (a torn file fails its checks and is dropped)."""
    write_atomic(path, tensors, meta, durable=False, checksums=True)


class _DiskFile:
    """A tier file open for reading: the header parsed once, each layer's tensors read in one call and checked
    against their CRC32s (a layer's tensors are adjacent in the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._handle = open(path, "rb", buffering=0)
            self._header, self._start = read_header(self._handle, path)
            self._crcs = json.loads(self._header.get("__metadata__", {}).get("crc32", "{}"))
        except (OSError, ValueError) as exc:  # gone, or a header that parses but lies
            self.close()
            raise RecordCorruptError(f"{path}: cannot be read ({exc})") from None

    def layer(self, index: int):
        quantized = f"k.{index:03d}.codes" in self._header
        names = [f"{n}.{index:03d}{part}" for n in "kv" for part in ((".codes", ".scales") if quantized else ("",))]
        infos = [self._header.get(name) for name in names]
        if any(info is None for info in infos):
            raise RecordCorruptError(f"{self.path}: layer {index} is missing")
        first, last = min(i["data_offsets"][0] for i in infos), max(i["data_offsets"][1] for i in infos)
        try:
            self._handle.seek(self._start + first)
            raw = self._handle.read(last - first)
        except (OSError, ValueError) as exc:
            raise RecordCorruptError(f"{self.path}: cannot be read ({exc})") from None
        if len(raw) != last - first:
            raise RecordCorruptError(f"{self.path}: layer {index} is truncated")
        tensors = [self._tensor(name, info, raw, first) for name, info in zip(names, infos)]
        if quantized:
            return Quantized(tensors[0], tensors[1]), Quantized(tensors[2], tensors[3])
        return tensors[0], tensors[1]

    def _tensor(self, name: str, info: dict, raw: bytes, first: int) -> torch.Tensor:
        begin, end = info["data_offsets"]
        piece = memoryview(raw)[begin - first : end - first]
        if zlib.crc32(piece) != self._crcs.get(name):
            raise RecordCorruptError(f"{self.path}: checksum of {name!r} does not match")
        dtype = dtype_of(info["dtype"])
        if len(piece) != torch.Size(info["shape"]).numel() * torch.empty((), dtype=dtype).element_size():
            raise RecordCorruptError(f"{self.path}: tensor {name!r} has the wrong size")
        return torch.frombuffer(bytearray(piece), dtype=torch.uint8).view(dtype).reshape(info["shape"])

    def close(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()
            self._handle = None

    def __enter__(self) -> "_DiskFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_key(key: Key) -> None:
    check_identifier("tenant id", key[0])
    check_identifier("record id", key[1])


def _nbytes(x: object) -> int:
    return x.nbytes if isinstance(x, Quantized) else x.numel() * x.element_size()


def _pin(x: object) -> object:
    return Quantized(x.codes.pin_memory(), x.scales.pin_memory()) if isinstance(x, Quantized) else x.pin_memory()
