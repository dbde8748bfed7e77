"""Fact K/V across three tiers of one replica: device memory, (pinned) host memory and disk.

Every entry lives in exactly one tier. `put` places it as high as its budget allows, spilling the
entries that score lowest (recency, frequency, importance) one tier down; the lower tiers keep int8
codes (`compress_lower`) and the disk keeps layer-contiguous files, so one layer is read on its own.
Loads are two-phase: `begin_load` pins the entry (nothing evicts or moves it) and hands out a reader
of one layer at a time, on the device, so a connector can fetch layer l while layer l-1 computes;
`end_load` unpins it and may promote it. `on_move(key, tier)` reports every placement, None once an entry
leaves (the serving layer records placements in Redis); `TieredStore` reopened on the same folder finds its disk entries again.
Disk files (`kvcore/tier_disk.py`) carry a CRC32 per tensor: a damaged or vanished file raises
`RecordCorruptError` on read (and is dropped at recovery), so a caller falls back to the canonical record
instead of serving garbage. `read_raw` hands a whole load's entries over as host bytes (`kvcore/packed.py`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch

from kvcore.conversation import check_identifier
from kvcore.errors import RecordCorruptError
from kvcore.packed import RawEntry, aligned, raw_entry, slab
from kvcore.quantize import Quantized, dequantize, quantize, quantize_many
from kvcore.safetensors_io import read_header
from kvcore.tier_disk import DiskFile, Key, advise_willneed, file_name, write_tier_file

log = logging.getLogger(__name__)
Tier = Literal["gpu", "cpu", "disk"]
ORDER: tuple[Tier, ...] = ("gpu", "cpu", "disk")


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
        self._file: DiskFile | None = None  # opened at the first layer, kept until the load ends

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[H, T, D]` of one layer, in the entry's original dtype, on the device."""
        return self.to_device(*self.host_layer(index))

    def host_layer(self, index: int) -> tuple[object, object]:
        """One layer's K and V as the tier keeps them (int8 codes or values), where it keeps them."""
        data = self._entry.data
        if self._entry.tier == "disk" and not isinstance(data, _Pending):
            if self._file is None:
                self._file = DiskFile(data)
            return self._file.layer(index)
        k, v = data.packed if isinstance(data, _Pending) else data
        return (k.layer(index), v.layer(index)) if isinstance(k, Quantized) else (k[index], v[index])

    def whole_entry(self, pinned: bool = False) -> tuple[Quantized, Quantized] | None:
        """The whole entry's int8 codes `[L, H, T, D]` in host memory (a disk entry's file read in one call and
        checked; in page-locked memory if `pinned`), or None for an entry kept at full precision."""
        held = self.held()
        if isinstance(held, Path):
            with DiskFile(held) as file:
                return file.read_all(self.layers, pinned=pinned) if file.quantized else None
        return _host_codes(held)

    def held(self) -> Path | tuple[object, object]:
        """Where the entry is now, read once: its disk file, or its K and V in host memory (codes or values). A
        background write moves an entry from memory to its file at any moment, so callers decide on one reading."""
        data = self._entry.data
        return data.packed if isinstance(data, _Pending) else data

    def to_device(self, k: object, v: object) -> tuple[torch.Tensor, torch.Tensor]:
        device, dtype = self._store.device, self._entry.dtype
        if isinstance(k, Quantized):
            k, v = k.to(device, non_blocking=True), v.to(device, non_blocking=True)
            return dequantize(k, dtype), dequantize(v, dtype)
        return k.to(device, non_blocking=True), v.to(device, non_blocking=True)

    @property
    def dtype(self) -> torch.dtype:
        return self._entry.dtype

    @property
    def nbytes(self) -> int:
        """The entry's bytes as its tier keeps them (what a load of it transfers)."""
        return self._entry.nbytes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class BatchedReads:
    """Layer reads of one load's tier entries, on their store's device.

    When the first layer is asked for, every int8 entry goes to the device whole (a disk entry's file read in
    one call, the files side by side; on CUDA through page-locked memory, one transfer each), joined there, and
    each layer of them is then dequantized in one op. A copy and a dequantization per entry and layer would
    cost hundreds of launches a layer for one request's facts, and a read per entry and layer as many system
    calls. Entries kept at full precision are read a layer at a time.
    """

    def __init__(self, readers: list[LayerReader]) -> None:
        self.readers = readers
        self._device = readers[0]._store.device if readers else torch.device("cpu")
        self._resident: _Resident | None = None

    def joined_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Layer `index` of all readers joined along the tokens (K and V `[H, sum T, D]`, reader by reader) and
        where each reader's tokens start (the total last): one tensor a consumer gathers from in one op."""
        if len(self.readers) < 2:
            return _join([reader.layer(index) for reader in self.readers])
        if self._resident is None:
            self._resident = _Resident.upload(self.readers, self._device)
        if len(self._resident.positions) == len(self.readers):  # all in host memory: already joined, in order
            values = self._resident.values(index)
            return values[0], values[1], self._resident.starts
        out = self._resident.layer(index)  # the rest (full precision, or of another shape) read their own layer
        return _join([out[i] if i in out else reader.layer(index) for i, reader in enumerate(self.readers)])


def _join(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    starts = [0, *itertools.accumulate(k.shape[1] for k, _ in layers)]
    if len(layers) == 1:
        return layers[0][0], layers[0][1], starts
    return torch.cat([k for k, _ in layers], dim=1), torch.cat([v for _, v in layers], dim=1), starts


@dataclass
class _Resident:
    """Host-memory entries of one load, uploaded whole: codes `[2, L, H, sum T, D]`, scales `[2, L, H, n, D]`."""

    positions: list[int]
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    owner: torch.Tensor | None = None  # token -> entry
    starts: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32

    @classmethod
    def upload(cls, readers: list[LayerReader], device: torch.device) -> "_Resident":
        wholes = readers[0]._store.read_whole(readers, pinned=device.type == "cuda")
        entries = {i: entry for i, entry in enumerate(wholes) if entry is not None}
        kinds = {_shape_key(readers[i].dtype, entry[0]) for i, entry in entries.items()}
        if not entries or len(kinds) != 1:
            return cls([])
        positions = sorted(entries)
        first = entries[positions[0]][0].codes
        lengths = [entries[i][0].codes.shape[2] for i in positions]
        codes = torch.empty(
            (2, first.shape[0], first.shape[1], sum(lengths), first.shape[3]), dtype=torch.int8, device=device
        )
        scales = torch.empty((2, first.shape[0], first.shape[1], len(positions), first.shape[3]), device=device)
        moved = [_to_device(entries[i], device) for i in positions]
        for side in (0, 1):
            torch.cat([entry[side].codes for entry in moved], dim=2, out=codes[side])
            torch.cat([entry[side].scales for entry in moved], dim=2, out=scales[side])
        owner = torch.repeat_interleave(torch.arange(len(positions)), torch.tensor(lengths)).to(
            device, non_blocking=True
        )
        return cls(positions, codes, scales, owner, [0, *itertools.accumulate(lengths)], readers[positions[0]].dtype)

    def values(self, index: int) -> torch.Tensor:
        """Layer `index` of every uploaded entry, dequantized in one op: `[2, H, sum T, D]`."""
        return (self.codes[:, index].float() * self.scales[:, index].index_select(2, self.owner)).to(self.dtype)

    def layer(self, index: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if not self.positions:
            return {}
        values = self.values(index)
        return {
            i: (values[0, :, a:b], values[1, :, a:b]) for i, a, b in zip(self.positions, self.starts, self.starts[1:])
        }


def _shape_key(dtype: torch.dtype, codes: Quantized) -> tuple:
    """What entries `[L, H, T, D]` must share to be joined: their dtype and every dim but the tokens."""
    shape = codes.codes.shape
    return dtype, shape[0], shape[1], shape[3]


class TieredStore:
    def __init__(
        self,
        device: torch.device | str,
        gpu_bytes: int,
        cpu_bytes: int,
        disk_dir: Path,
        *,
        compress_lower: bool = True,
        age_scale_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_move: Callable[[Key, Tier | None], None] = lambda key, tier: None,
        write_behind: bool = False,
        disk_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        # the disk tier is a cache too (every record is canonical in the fact store): past `disk_bytes` its
        # lowest-scoring entries are dropped, so a long-lived replica never fills its volume
        self._budget = {"gpu": gpu_bytes, "cpu": cpu_bytes, "disk": math.inf if disk_bytes is None else disk_bytes}
        self._used = {"gpu": 0, "cpu": 0, "disk": 0}
        self._dir = Path(disk_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._compress, self._age, self._clock, self._on_move = compress_lower, age_scale_s, clock, on_move
        self._entries: dict[Key, _Entry] = {}
        self._lock = threading.Lock()  # between the caller and the background writer of disk files
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tier-writer") if write_behind else None
        # whole files read side by side (the reads, checksums and copies release the GIL); on a machine of few
        # cores the threads would only contend with each other and the engine, so files are read in turn there
        self._reader_count = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._file_readers = ThreadPoolExecutor(self._reader_count, thread_name_prefix="tier-file-reader")
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
        advise_willneed(
            [e.data for e in (self._entries.get(k) for k in keys) if e is not None and isinstance(e.data, Path)]
        )

    def flush(self) -> None:
        """Wait until every disk file queued so far is written."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._file_readers.shutdown(wait=True)

    def read_whole(self, readers: list[LayerReader], pinned: bool) -> list[tuple[Quantized, Quantized] | None]:
        """`whole_entry` of each reader; disk files are read side by side when there are several, after the
        kernel was asked to read all of them ahead (its readahead keeps each file's I/O large and sequential)."""
        self.prefetch([reader.key for reader in readers if reader.tier == "disk"])
        if self._reader_count < 2 or sum(reader.tier == "disk" for reader in readers) < 2:
            return [reader.whole_entry(pinned) for reader in readers]
        return list(self._file_readers.map(lambda reader: reader.whole_entry(pinned), readers))

    def read_raw(self, readers: list[LayerReader], pinned: bool) -> list[RawEntry] | None:
        """Every reader's int8 entry as host bytes (`kvcore.packed`), or None if one is kept at full precision or
        its file is laid out unevenly: host entries as they lie, disk files opened and read side by side, as they
        are on disk, into one buffer (page-locked if `pinned`), checked. `RecordCorruptError` for a damaged file."""
        held = [reader.held() for reader in readers]
        files = [(reader, where) for reader, where in zip(readers, held) if isinstance(where, Path)]
        from_files = iter(self._read_files(files, pinned) if files else [])
        out = []
        for where in held:
            if isinstance(where, Path):
                entry = next(from_files)
            else:
                codes = _host_codes(where)
                entry = raw_entry(*codes) if codes is not None else None
            if entry is None:
                return None
            out.append(entry)
        return out

    def _read_files(self, files: list[tuple[LayerReader, Path]], pinned: bool) -> list[RawEntry | None]:
        """Each file read into its slot of one buffer (slots sized by the entries' recorded bytes, which bound
        their files' tensors); the files are opened, checked and read on the reader threads."""
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
        return (
            list(self._file_readers.map(read, jobs))
            if self._reader_count > 1 and len(jobs) > 1
            else list(map(read, jobs))
        )

    # ---- writes ----
    def put(self, key: Key, k: torch.Tensor, v: torch.Tensor, importance: float = 0.0, label: str = "") -> Tier:
        """Store a fact's K/V `[L, H, T, D]` as high as room can be made; return where it went."""
        with self._new_entry(key, k.shape[0], k.dtype, label, importance) as entry:
            for tier in ORDER:
                if tier == "disk" or self._make_room(tier, self._size_in(tier, k), keep=key):
                    self._place(key, entry, tier, *self._encode(key, k, v, tier))
                    return tier
        raise AssertionError("unreachable: the disk tier always has room")

    @contextmanager
    def _new_entry(
        self, key: Key, layers: int, dtype: torch.dtype, label: str, importance: float = 0.0
    ) -> Iterator[_Entry]:
        """A fresh entry under `key` (replacing any old one), protected from eviction while it finds its place."""
        _check_key(key)
        if key in self._entries:
            self.remove(key)
        entry = _Entry("disk", None, 0, layers, dtype, importance, 0, self._clock(), label=label)
        self._entries[key] = entry
        entry.loading += 1
        try:
            yield entry
        finally:
            entry.loading -= 1

    def spill_many(
        self, items: list[tuple[Key, torch.Tensor, torch.Tensor, str]], importance: list[float] | None = None
    ) -> None:
        """Entries leaving the device (a step's evictions: key, K, V `[L, H, T, D]`, label; optionally each one's
        importance) into host memory or disk: quantized together where they lie and copied to the host with one
        wait at the end, instead of a quantization and a synchronizing copy each."""
        if not items:
            return
        ks, vs = [k for _, k, _, _ in items], [v for _, _, v, _ in items]
        packed = list(zip(quantize_many(ks), quantize_many(vs))) if self._compress else list(zip(ks, vs))
        pinned = self.device.type == "cuda"
        hosts = [_host(pair, pinned=pinned, non_blocking=True) for pair in packed]
        if any(k.is_cuda for k in ks):
            torch.cuda.synchronize(ks[0].device)  # the copies above were queued, not waited for
        weights = importance or [0.0] * len(items)
        for (key, k, _, label), host, weight in zip(items, hosts, weights):
            self._put_packed(key, host, k.shape[0], k.dtype, label, weight)

    def _put_packed(
        self,
        key: Key,
        packed: tuple[object, object],
        layers: int,
        dtype: torch.dtype,
        label: str,
        importance: float = 0.0,
    ) -> Tier:
        """A host-side entry into host memory if room can be made there, else to disk."""
        with self._new_entry(key, layers, dtype, label, importance) as entry:
            tier: Tier = "cpu" if self._make_room("cpu", sum(_nbytes(x) for x in packed), keep=key) else "disk"
            self._place(key, entry, tier, *self._store_packed(key, packed, tier))
        return tier

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
    def begin_load(self, key: Key, importance: float | None = None) -> LayerReader:
        entry = self._entries[key]
        entry.loading += 1
        self.touch(key, importance)
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
            movable = [
                (self._score(e), key)
                for key, e in self._entries.items()
                if e.tier == tier and not e.loading and key != keep and e.data is not None
            ]
            if not movable:
                return False
            _, victim = min(movable)
            self._demote(victim)
        return True

    def _demote(self, key: Key) -> None:
        entry = self._entries[key]
        down = ORDER[ORDER.index(entry.tier) + 1]
        entry.loading += 1
        try:
            if entry.tier == "cpu":  # host codes (or values) go to their file as they are
                data, nbytes = self._store_packed(key, entry.data, "disk")
            else:
                k, v = self._decode(entry)
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
        if tier == "disk":
            self._trim_disk(keep=key)

    def _trim_disk(self, keep: Key) -> None:
        """Drop the lowest-scoring disk entries (never one being loaded, nor `keep`) until the disk tier is
        within its budget; a dropped record is read from the fact store when next needed."""
        while self._used["disk"] > self._budget["disk"]:
            movable = [
                (self._score(e), key)
                for key, e in self._entries.items()
                if e.tier == "disk" and not e.loading and key != keep and e.data is not None
            ]
            if not movable:
                return
            self.remove(min(movable)[1])

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
        """K/V `[L, H, T, D]` (on any device) in the form `tier` keeps; quantized where they lie, so a spill from
        the device moves int8 codes, not the full-precision values, and costs the host no arithmetic."""
        if tier == "gpu":
            k, v = k.to(self.device), v.to(self.device)
            return (k, v), _nbytes(k) + _nbytes(v)
        packed = (quantize(k), quantize(v)) if self._compress else (k, v)
        return self._store_packed(key, _host(packed, pinned=tier == "cpu" and self.device.type == "cuda"), tier)

    def _store_packed(self, key: Key, packed: tuple[object, object], tier: Tier) -> tuple[object, int]:
        """Host-side (codes or values) K/V kept in host memory, or written to the entry's disk file."""
        if tier == "cpu":
            return packed, sum(_nbytes(x) for x in packed)
        path = self._dir / file_name(key)
        first = packed[0].codes if isinstance(packed[0], Quantized) else packed[0]
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(first.shape[0]):
            for name, x in zip("kv", packed):
                if isinstance(x, Quantized):
                    tensors[f"{name}.{layer:03d}.codes"], tensors[f"{name}.{layer:03d}.scales"] = (
                        x.codes[layer],
                        x.scales[layer],
                    )
                else:
                    tensors[f"{name}.{layer:03d}"] = x[layer].contiguous()
        entry = self._entries.get(key)
        dtype = entry.dtype if entry is not None else first.dtype
        meta = {
            "tenant": key[0],
            "record": key[1],
            "layers": str(first.shape[0]),
            "dtype": str(dtype).split(".")[-1],
            "quantized": str(isinstance(packed[0], Quantized)),
            "label": entry.label if entry is not None else "",
        }
        if self._writer is None:
            write_tier_file(path, tensors, meta)
            return path, path.stat().st_size
        pending = _Pending(path, packed)
        self._writer.submit(self._write_behind, key, pending, tensors, meta)
        return pending, sum(_nbytes(x) for x in packed)

    def _write_behind(
        self, key: Key, pending: _Pending, tensors: dict[str, torch.Tensor], meta: dict[str, str]
    ) -> None:
        """On the writer thread: write the file, then point the entry at it (unless it left the disk meanwhile)."""
        if pending.cancelled:
            return
        try:
            write_tier_file(pending.path, tensors, meta)
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
            with DiskFile(entry.data) as file:
                k, v = file.read_all(entry.layers)
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
            self._entries[key] = _Entry(
                "disk", path, path.stat().st_size, layers, dtype, last_use=self._clock(), label=meta.get("label", "")
            )
            self._used["disk"] += path.stat().st_size


def _host_codes(held: tuple[object, object]) -> tuple[Quantized, Quantized] | None:
    """An entry held in host memory as int8 codes, else None (kept at full precision, or on the device)."""
    k, v = held
    return (k, v) if isinstance(k, Quantized) and k.codes.device.type == "cpu" else None


def _check_key(key: Key) -> None:
    check_identifier("tenant id", key[0])
    check_identifier("record id", key[1])


def _nbytes(x: object) -> int:
    return x.nbytes if isinstance(x, Quantized) else x.numel() * x.element_size()


def _host(packed: tuple[object, object], pinned: bool, non_blocking: bool = False) -> tuple[object, object]:
    """Contiguous host copies of K and V (codes or values), in page-locked memory if `pinned`; with
    `non_blocking`, copies from the device are only queued (the caller waits for them). Pinned int8 entries
    get one buffer for their four tensors, so a load moves each to the device in one copy (`_to_device`)."""
    if pinned and all(isinstance(x, Quantized) for x in packed):
        k, v = packed
        views = slab([(tuple(t.shape), t.dtype) for t in (k.codes, k.scales, v.codes, v.scales)], pinned=True)
        for view, t in zip(views, (k.codes, k.scales, v.codes, v.scales)):
            view.copy_(t, non_blocking=non_blocking)
        return Quantized(views[0], views[1]), Quantized(views[2], views[3])

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and t.is_contiguous() and (t.is_pinned() or not pinned):
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        return out.copy_(t, non_blocking=non_blocking and pinned)

    return tuple(Quantized(copy(x.codes), copy(x.scales)) if isinstance(x, Quantized) else copy(x) for x in packed)


def _to_device(entry: tuple[Quantized, Quantized], device: torch.device) -> tuple[Quantized, Quantized]:
    """An int8 entry on `device`: in one transfer when its four tensors share one host buffer (`slab`), else
    one each. Non-blocking: from page-locked memory the copy is only queued."""
    tensors = [entry[0].codes, entry[0].scales, entry[1].codes, entry[1].scales]
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors):
        moved = [t.to(device, non_blocking=True) for t in tensors]
    else:
        whole = torch.empty(0, dtype=torch.uint8).set_(storage).to(device, non_blocking=True)
        moved = []
        for t in tensors:
            start = t.storage_offset() * t.element_size()
            moved.append(whole[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
    return Quantized(moved[0], moved[1]), Quantized(moved[2], moved[3])
