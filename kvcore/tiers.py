"""Fact K/V in the lower tiers of one replica, below its device arena: (pinned) host memory and disk.

Every entry lives in exactly one tier. `put_many` places entries in host memory as far as its budget allows,
moving the entries that score lowest (`kvcore/tier_policy.py`) down to disk; the lower tiers keep int8 codes
(`compress_lower`) and the disk keeps layer-contiguous files (`kvcore/tier_media.py`), so one layer is read on
its own. Loads are two-phase: `begin_load` pins the entry (nothing moves or drops it) and hands out a reader
(`kvcore/tier_reads.py`), `end_load` unpins it. `on_move(key, tier, label)` reports every placement, tier None once an
entry leaves (the serving layer records placements in Redis); a store reopened on the same folder finds its
disk entries again. A damaged or vanished file raises `RecordCorruptError` on read (and is dropped at
recovery), so a caller falls back to the canonical record instead of serving garbage.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from kvcore.host_pool import HostPool
from kvcore.packed import RawEntry
from kvcore.quantize import Quantized, quantize_many
from kvcore.tier_disk import DiskFile, Key, advise_willneed
from kvcore.tier_media import Arrival, DiskMedium, HostKV, PendingFile, check_key, host_copy, in_hand
from kvcore.tier_policy import ScorePolicy, Tier, TierEntry
from kvcore.tier_reads import LayerReader, read_raw

log = logging.getLogger(__name__)
KV = tuple[Key, torch.Tensor | Quantized, torch.Tensor | Quantized, str]  # key, K and V `[L, H, T, D]`, label


class TieredStore:
    """Entries in pinned host memory and on disk, placed by score, loaded a layer at a time or whole."""

    def __init__(
        self,
        device: torch.device | str,
        host_bytes: int,
        disk_dir: os.PathLike | str,
        *,
        compress_lower: bool = True,
        age_scale_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_move: Callable[[Key, Tier | None, str], None] = lambda key, tier, label: None,
        write_behind: bool = False,
        disk_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        # the disk tier is a cache too (every record is canonical in the fact store): past `disk_bytes` its
        # lowest-scoring entries are dropped, so a long-lived replica never fills its volume
        self._budget = {"cpu": host_bytes, "disk": math.inf if disk_bytes is None else disk_bytes}
        self._used = {"cpu": 0, "disk": 0}
        self._compress = compress_lower
        # on a GPU, host entries are carved from page-locked segments (exact sizes; one driver call a segment),
        # with a sixteenth to spare for the gaps between blocks
        self._pool = (
            HostPool(host_bytes + host_bytes // 16, sync=lambda: torch.cuda.synchronize(self.device))
            if self.device.type == "cuda" and host_bytes > 0
            else None
        )
        # on a GPU, the stream that spills' copies to the host go down on (made when first needed)
        self._copy_stream: torch.cuda.Stream | None = None
        self.on_move = on_move  # replaceable: a worker points it at its placement tracker once it has one
        self._entries: dict[Key, TierEntry] = {}
        self._policy = ScorePolicy(age_scale_s, clock, self._entries)
        self.entries_added = 0  # entries put since the start (a spill or a record read for a load)
        self._lock = threading.Lock()  # between the caller and the background writer of disk files
        self._disk = DiskMedium(disk_dir, write_behind, self._lock, self._settle)
        # whole files read side by side (the reads, checksums and copies release the GIL); on a machine of few
        # cores the threads would only contend with each other and the engine, so files are read in turn there
        readers = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._file_pool = ThreadPoolExecutor(readers, thread_name_prefix="tier-file-reader") if readers > 1 else None
        for found in self._disk.recover():
            self._entries[found.key] = TierEntry(
                "disk", found.path, found.nbytes, found.layers, found.dtype, last_use=clock(), label=found.label
            )
            self._used["disk"] += found.nbytes
            self._policy.track(found.key, self._entries[found.key])

    # ---- queries ----
    def tier_of(self, key: Key) -> Tier | None:
        entry = self._entries.get(key)
        return entry.tier if entry else None

    def used(self, tier: Tier) -> int:
        return self._used[tier]

    def entries(self) -> list[tuple[Key, Tier, str]]:
        """Every entry's key, tier and label (what a restarted replica reports as its placement)."""
        return [(key, e.tier, e.label) for key, e in self._entries.items()]

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    @property
    def keeps_codes(self) -> bool:
        """Whether entries are held as int8 codes (`compress_lower`), so codes can come down as they are."""
        return self._compress

    # ---- reads ----
    def begin_load(self, key: Key, importance: float | None = None) -> LayerReader:
        """Pin the entry and count a retrieval hit; its reader."""
        entry = self._entries[key]
        entry.loading += 1
        self._policy.touch(key, entry, importance)
        return LayerReader(key, entry, self.device)

    def end_load(self, reader: LayerReader) -> None:
        reader.close()
        entry = self._entries.get(reader.key)
        if entry is reader.entry:
            entry.loading -= 1

    def read(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole entry `[L, H, T, D]` in its original dtype (dequantized), on the host; a file in one read."""
        return self._held(key).decode(self._entries[key].dtype)

    def read_held(self, key: Key) -> tuple[Quantized | torch.Tensor, Quantized | torch.Tensor]:
        """The whole entry as its tier keeps it (int8 codes or values), on the host: an int8 arena takes codes as
        they are, and quantizes values as they come."""
        held = self._held(key)
        held.wait()
        return held.k, held.v

    def _held(self, key: Key) -> HostKV:
        entry = self._entries[key]
        held = in_hand(entry.held)
        if isinstance(held, Path):
            with DiskFile(held) as file:
                held = HostKV(*file.read_all(entry.layers))
        return held

    def read_raw(self, readers: list[LayerReader], pinned: bool) -> list[RawEntry] | None:
        """The readers' int8 entries as host bytes, files read side by side (`kvcore.tier_reads.read_raw`)."""
        return read_raw(readers, pinned, self._file_pool)

    def prefetch(self, keys: list[Key]) -> None:
        """Ask the kernel to start reading the disk entries among `keys` now (layer reads then hit memory)."""
        entries = (self._entries.get(key) for key in keys)
        advise_willneed([e.held for e in entries if e is not None and isinstance(e.held, Path)])

    @property
    def host_segments(self) -> int:
        """The host pool's page-locked segments (0 without a pool)."""
        return self._pool.segments if self._pool is not None else 0

    # ---- writes ----
    def reserve_host(self) -> float:
        """Page-lock the host tier's whole budget now (on a GPU; nothing to do elsewhere): seconds it took. Call it
        before serving, so that no step pays for page-locking the segments its spills need (`kvcore/host_pool.py`)."""
        if self._pool is None:
            return 0.0
        started = time.perf_counter()
        added = self._pool.reserve()
        seconds = time.perf_counter() - started
        log.info("host tier: %d segments (%.1f GiB) page-locked in %.1f s", added, self._pool.reserved / 2**30, seconds)
        return seconds

    def put(self, key: Key, k: torch.Tensor, v: torch.Tensor, importance: float = 0.0, label: str = "") -> Tier:
        """Store one fact's K/V `[L, H, T, D]`; where it went."""
        self.put_many([(key, k, v, label)], [importance])
        return self._entries[key].tier

    def put_codes(
        self, key: Key, k: Quantized, v: Quantized, dtype: torch.dtype, importance: float = 0.0, label: str = ""
    ) -> Tier:
        """Store K/V already held as int8 codes on the host (an int8 fact record read from the store) as they are:
        no decode and quantization again, no wait for the device. `dtype`: what they decode to when loaded.
        Only where the tiers keep codes (`keeps_codes`)."""
        if not self._compress:
            raise ValueError("these tiers keep values, not int8 codes")
        self._add(key, host_copy(k, v, pinned=self.device.type == "cuda", pool=self._pool), dtype, label, importance)
        return self._entries[key].tier

    def put_many(
        self, items: list[KV], importance: list[float] | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Entries (a step's evictions from the device, or records read for a load; optionally each one's
        importance) into host memory where room can be made there, else to disk: quantized together on the tiers'
        device (values read on the host too: a GPU's few kernels, not a host core's tens of ms for a 30-token record
        of the 8B shape) and copied to the host, queued on a copy stream (`_copy_down`): the step that spilled them
        goes on while they travel, and a reader of an entry waits for them (`HostKV.wait`). Entries already held as
        int8 codes (an int8 arena's evictions: its own precision) go down as they are, in tiers of values too,
        decoding to `dtype` when loaded."""
        if not items:
            return
        codes = [isinstance(k, Quantized) for _, k, _, _ in items]
        if any(codes) and dtype is None:
            raise ValueError("entries of int8 codes need the dtype they decode to")
        ks, vs = [k for _, k, _, _ in items], [v for _, _, v, _ in items]
        if self._compress:
            values = [i for i, is_codes in enumerate(codes) if not is_codes]
            quantized = zip(
                quantize_many([ks[i].to(self.device) for i in values]),
                quantize_many([vs[i].to(self.device) for i in values]),
            )
            for i, (k, v) in zip(values, quantized):
                ks[i], vs[i] = k, v
        packed = list(zip(ks, vs))
        device = next((d for d in map(_device_of, ks) if d.type == "cuda"), None)
        if device is not None:
            hosts = self._copy_down(packed, device)
        else:
            pinned = self.device.type == "cuda"
            hosts = [host_copy(k, v, pinned=pinned, pool=self._pool) for k, v in packed]
        for (key, k, _, label), host, weight in zip(items, hosts, importance or [0.0] * len(items)):
            self._add(key, host, dtype if isinstance(k, Quantized) else k.dtype, label, weight)

    def _copy_down(self, packed: list[tuple[Quantized | torch.Tensor, ...]], device: torch.device) -> list[HostKV]:
        """Device K/V (codes or values) into page-locked host entries, copied on a stream of their own: the copies
        wait for the kernels that made them, the step's forward does not wait for the copies (the copy engine moves
        them beside its compute). The entries' readers wait for the `Arrival` recorded behind them."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(device))
        ready = Arrival(torch.cuda.Event())
        with torch.cuda.stream(stream):
            hosts = [host_copy(k, v, pinned=True, non_blocking=True, pool=self._pool, ready=ready) for k, v in packed]
        for pair in packed:  # made on the compute stream, read on this one: not reused before these copies end
            for side in pair:
                for tensor in (side.codes, side.scales) if isinstance(side, Quantized) else (side,):
                    if tensor.is_cuda:
                        tensor.record_stream(stream)
        ready.record(stream)
        return hosts

    def remove(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.loading:
            raise RuntimeError(f"{key} is being loaded and cannot be removed")
        self._forget(key)

    def discard_damaged(self, reader: LayerReader) -> None:
        """Drop an entry whose reads failed, pinned by `reader` or not: the caller serves the canonical record."""
        reader.close()
        if self._entries.get(reader.key) is reader.entry:
            log.warning("tier entry %s on %s was damaged or missing; dropped", reader.key, reader.entry.tier)
            self._forget(reader.key)

    def flush(self) -> None:
        """Wait until every disk file queued so far is written."""
        self._disk.flush()

    def close(self) -> None:
        self._disk.close()
        if self._file_pool is not None:
            self._file_pool.shutdown(wait=True)

    # ---- placement ----
    def _add(self, key: Key, host: HostKV, dtype: torch.dtype, label: str, importance: float) -> None:
        """A fresh entry under `key` (replacing any old one), in host memory if room can be made, else on disk."""
        check_key(key)
        self.remove(key)
        self.entries_added += 1
        entry = TierEntry("cpu", None, 0, host.layers, dtype, importance, last_use=self._policy.clock(), label=label)
        self._entries[key] = entry
        entry.loading += 1  # protected from eviction while it finds its place
        try:
            if self._make_room("cpu", host.nbytes, keep=key):
                self._place(key, entry, "cpu", host, host.nbytes)
            else:
                self._place(key, entry, "disk", *self._disk.write(key, host, dtype, label))
        finally:
            entry.loading -= 1

    def _make_room(self, tier: Tier, nbytes: int, keep: Key) -> bool:
        """Move (host memory) or drop (disk) the lowest-scoring entries until `nbytes` fit; False if they cannot."""
        if nbytes > self._budget[tier]:
            return False
        while self._used[tier] + nbytes > self._budget[tier]:
            victim = self._policy.victim(tier, keep)
            if victim is None:
                return False
            if tier == "cpu":  # host codes (or values) go to their file as they are
                entry = self._entries[victim]
                host, freed = entry.held, entry.nbytes
                entry.loading += 1
                try:
                    self._place(victim, entry, "disk", *self._disk.write(victim, host, entry.dtype, entry.label))
                finally:
                    entry.loading -= 1
                self._used["cpu"] -= freed
            else:  # a dropped record is read from the fact store when next needed
                self._forget(victim)
        return True

    def _place(self, key: Key, entry: TierEntry, tier: Tier, held: object, nbytes: int) -> None:
        with self._lock:  # the writer thread swaps a pending entry's file in under the same lock
            entry.tier, entry.held, entry.nbytes = tier, held, nbytes
        self._used[tier] += nbytes
        self._policy.track(key, entry)
        self.on_move(key, tier, entry.label)
        if tier == "disk":
            self._make_room("disk", 0, keep=key)

    def _settle(self, key: Key, pending: PendingFile) -> bool:
        """The writer thread's file for a pending entry, under the lock: taken if the entry still holds it."""
        entry = self._entries.get(key)
        if entry is None or entry.held is not pending:
            return False
        entry.held = pending.path
        return True

    def _forget(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self._used[entry.tier] -= entry.nbytes
        if entry.tier == "disk":
            self._disk.remove(entry.held)
        self.on_move(key, None, entry.label)


def _device_of(x: torch.Tensor | Quantized) -> torch.device:
    return x.codes.device if isinstance(x, Quantized) else x.device
