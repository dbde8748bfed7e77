"""The device arena: pre-RoPE fact K/V resident on the serving device, so a hot fact is never re-copied.

One pair of tensors `[layers, capacity, kv_heads, head_dim]` (K and V) holds many records, each in
whole pages of `page_tokens` rows. A step gathers the rows of all its records with one indexed read
per tensor, whatever the number of records. Records are kept least-recently-used first and evicted
to make room, except those the current step already uses (their rows are in the step's index). A
record is identified by its store key *and* the stamp the scheduler checked, so a rewritten fact is
never served from its old rows.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from kvcore.errors import ArenaAllocationError, ArenaFullError, IncompatibleRecordsError
from kvcore.quantize import Quantized, dequantize
from kvcore.transfers import to_device

log = logging.getLogger(__name__)
DEFAULT_DEVICE_CACHE_BYTES = 1 << 30  # the arena's size wherever a caller does not choose one
DEVICE_HEADROOM_BYTES = 1 << 30  # left free beside a CUDA arena: the engine still captures its graphs after it


@dataclass
class _Entry:
    stamp: Hashable
    pages: list[int]
    rows: array  # the record's rows in the arena, in token order (int64: a step joins them as bytes)
    step: int  # the last step that used it


class DeviceArena:
    """A byte-bounded, paged pool of records' K/V on one device (allocated by `allocate`, or at the first insert).

    The arena holds one dtype, the engine's record dtype (`dtype`): a record stored in another (written before
    the deployment's record dtype changed, say) is converted as it comes in, so a store that mixes dtypes serves
    the same whatever order its records are loaded in. Evicted records are handed to `on_evict` with a thunk
    that reads their K/V, so a listener that already keeps a copy (a lower tier) costs the device nothing.
    With `tenant_bytes`, no tenant (the first part of a `(tenant, record)` key) holds more than that: a tenant
    at its share makes room from its own least recently used records, so one busy tenant cannot push every
    other tenant's facts out of HBM."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        capacity_bytes: int,
        dtype: torch.dtype,
        page_tokens: int = 16,
        on_evict: Callable[[Hashable, Hashable, Callable[[], tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
        on_change: Callable[[Hashable, Hashable, bool], None] | None = None,
        tenant_bytes: int | None = None,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.device, self.page_tokens = torch.device(device), page_tokens
        self._capacity_bytes, self.dtype = capacity_bytes, dtype
        self._tenant_bytes = tenant_bytes
        self._tenant_pages_cap: int | None = None  # tenant_bytes in pages, once the page size is known
        self._tenant_pages: dict[Hashable, int] = {}
        self.evictions = 0  # records pushed out to make room (a working set larger than the arena re-reads them)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._free: list[int] = []
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._step = 0
        self._on_evict = on_evict  # (key, stamp, read K/V [L, H, T, D]) of a record about to leave the arena
        self._on_change = on_change  # (key, stamp, resident?) after a record enters or leaves

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def records(self) -> int:
        return len(self._entries)

    def begin_step(self) -> None:
        """Records used from here on are kept until the next step begins."""
        self._step += 1

    def holds(self, key: Hashable, stamp: Hashable) -> bool:
        """Whether the record is resident at `stamp` (a look, not a use)."""
        entry = self._entries.get(key)
        return entry is not None and entry.stamp == stamp

    def rows(self, key: Hashable, stamp: Hashable) -> array | None:
        """The record's rows if it is resident at `stamp` (and mark it used by this step), else None."""
        entry = self._entries.get(key)
        if entry is None or entry.stamp != stamp:
            return None
        self._entries.move_to_end(key)
        entry.step = self._step
        return entry.rows

    def insert(
        self, key: Hashable, stamp: Hashable, k: torch.Tensor | Quantized, v: torch.Tensor | Quantized
    ) -> list[int]:
        """Copy a record's K/V `[layers, kv_heads, tokens, head_dim]` in; return its rows. An int8 record's codes
        and scales go to the device as they are and are decoded there (a decode on the host costs more than the
        whole read of a bf16 record).

        Raises `ArenaFullError` when the room can only come from records this step uses (or, with a
        per-tenant share, from the tenant's own such records), and `IncompatibleRecordsError` when the
        record's shape is not the engine's.
        """
        if isinstance(k, Quantized):
            k, v = (
                dequantize(
                    Quantized(to_device(side.codes, self.device), to_device(side.scales, self.device)), self.dtype
                )
                for side in (k, v)
            )
        self.insert_many([(key, stamp)], k, v, [0, k.shape[2]])
        return self._entries[key].rows

    def insert_many(
        self, items: list[tuple[Hashable, Hashable]], k: torch.Tensor, v: torch.Tensor, starts: list[int]
    ) -> None:
        """Copy several records in at once: `items` (key, stamp), their K/V joined along the tokens
        `[layers, kv_heads, sum T, head_dim]`, record i's tokens at `starts[i]:starts[i + 1]`. One index and one
        copy per tensor for all of them; `ArenaFullError` as `insert` (records placed before it stay)."""
        self.check_shape(k.shape[0], k.shape[1], k.shape[3])
        if v.shape != k.shape:
            raise IncompatibleRecordsError(f"record K {tuple(k.shape)} and V {tuple(v.shape)} differ")
        self.allocate()
        rows: list[int] = []
        placed: list[tuple[Hashable, Hashable]] = []
        try:
            for (key, stamp), a, b in zip(items, starts, starts[1:]):
                rows += self._place(key, stamp, b - a)
                placed.append((key, stamp))
        finally:
            if rows:
                index = to_device(long_tensor(rows), self.device)
                for arena_side, side in ((self.k, k), (self.v, v)):
                    values = to_device(side[:, :, : len(rows)], self.device).to(arena_side.dtype)
                    arena_side.index_copy_(1, index, values.permute(0, 2, 1, 3))
            self._announce(placed)

    def reserve_many(self, items: list[tuple[Hashable, Hashable]], lengths: list[int]) -> list[int]:
        """Rows for several records of `lengths` tokens, all or none (`ArenaFullError`), for a caller that
        writes their K/V itself, in the arena's dtype (a device kernel, `kvcore.packed`), before anything reads them."""
        self.allocate()
        rows: list[int] = []
        placed: list[tuple[Hashable, Hashable]] = []
        try:
            for (key, stamp), count in zip(items, lengths):
                rows += self._place(key, stamp, count)
                placed.append((key, stamp))
        except ArenaFullError:
            for key, _ in placed:
                self._release(key, announce=False)
            raise
        self._announce(placed)
        return rows

    def check_shape(self, layers: int, kv_heads: int, head_dim: int) -> None:
        """`IncompatibleRecordsError` unless records of this shape fit the engine's arena."""
        if (layers, kv_heads, head_dim) != (self.layers, self.kv_heads, self.head_dim):
            raise IncompatibleRecordsError(
                f"record K/V of {layers} layers x {kv_heads} kv heads x head dim {head_dim} "
                f"do not fit the engine's {self.layers} x {self.kv_heads} x {self.head_dim}"
            )

    def _place(self, key: Hashable, stamp: Hashable, count: int) -> list[int]:
        """Pages for one record of `count` tokens (replacing an older version), and its rows in token order."""
        old = self._entries.get(key)
        if old is not None:
            if old.step == self._step:
                raise ArenaFullError(f"record {key} changed while this step still uses its old version")
            self._release(key)
        pages = self._take(-(-count // self.page_tokens), _tenant_of(key))
        size = self.page_tokens
        rows = array("q", [row for page in pages for row in range(page * size, page * size + size)][:count])
        self._entries[key] = _Entry(stamp, pages, rows, self._step)
        return list(rows)

    def _announce(self, placed: list[tuple[Hashable, Hashable]]) -> None:
        if self._on_change is not None:
            for key, stamp in placed:
                self._on_change(key, stamp, True)

    def allocate(self) -> None:
        """Claim the arena's memory now (the engine calls this as it starts): on a CUDA device, a size that does
        not fit in what is free, less `DEVICE_HEADROOM_BYTES`, is an `ArenaAllocationError` that names both, so
        a misconfiguration stops the start instead of failing every later load. Both tensors or neither."""
        if self.k is not None:
            return
        dtype = self.dtype
        per_token = self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size() * 2
        pages = self._capacity_bytes // (per_token * self.page_tokens)
        if pages < 1:
            raise ArenaFullError(
                f"device arena of {self._capacity_bytes} bytes holds not even one page of {self.page_tokens} tokens"
            )
        shape = (self.layers, pages * self.page_tokens, self.kv_heads, self.head_dim)
        nbytes = pages * self.page_tokens * per_token
        self._check_fits(nbytes)
        try:
            k = torch.empty(shape, dtype=dtype, device=self.device)
            v = torch.empty(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise ArenaAllocationError(f"the device arena ({_gib(nbytes)}) is out of memory: {exc}") from exc
        self.k, self.v = k, v
        self._free = list(range(pages - 1, -1, -1))
        if self._tenant_bytes is not None:
            self._tenant_pages_cap = self._tenant_bytes // (per_token * self.page_tokens)
        log.info("device arena: %d tokens (%.1f MiB) on %s", shape[1], 2 * self.k.nbytes / 2**20, self.device)

    def _check_fits(self, nbytes: int) -> None:
        if self.device.type != "cuda":
            return  # host memory is claimed page by page as it is written
        free, total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # torch's cache
        if nbytes + DEVICE_HEADROOM_BYTES > free:
            raise ArenaAllocationError(
                f"the device arena (device_cache_bytes: {_gib(nbytes)}) does not fit on {self.device}: "
                f"{_gib(free)} of its {_gib(total)} are free beside the engine, and {_gib(DEVICE_HEADROOM_BYTES)} "
                "must stay free; lower device_cache_bytes or the engine's gpu_memory_utilization"
            )

    def _take(self, count: int, tenant: Hashable = None) -> list[int]:
        if count * self.page_tokens > self.capacity_tokens:
            raise ArenaFullError(f"a record of {count} pages exceeds the device arena ({self.capacity_tokens} tokens)")
        cap = self._tenant_pages_cap
        if cap is not None and tenant is not None:
            if count > cap:
                raise ArenaFullError(f"a record of {count} pages exceeds a tenant's share of the arena ({cap} pages)")
            while self._tenant_pages.get(tenant, 0) + count > cap:
                self._evict(lambda key: _tenant_of(key) == tenant, "the tenant's share of the arena")
        while len(self._free) < count:
            self._evict(lambda key: True, "the device arena")
        taken, self._free = self._free[-count:][::-1], self._free[:-count]
        if tenant is not None:
            self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + count
        return taken

    def _evict(self, eligible: Callable[[Hashable], bool], where: str) -> None:
        """Evict the least recently used eligible record that the current step does not use."""
        victim = next((key for key, entry in self._entries.items() if entry.step != self._step and eligible(key)), None)
        if victim is None:
            raise ArenaFullError(f"{where} ({self.capacity_tokens} tokens in all) is full with this step's records")
        if self._on_evict is not None:
            self._on_evict(victim, self._entries[victim].stamp, self._reader(self._entries[victim].rows))
        self.evictions += 1
        self._release(victim)

    def _reader(self, rows: array) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Reads rows' K/V `[L, H, T, D]` (copies: called before the rows are reused)."""

        def read() -> tuple[torch.Tensor, torch.Tensor]:
            index = to_device(long_tensor(rows), self.device)
            return self.k.index_select(1, index).permute(0, 2, 1, 3), self.v.index_select(1, index).permute(0, 2, 1, 3)

        return read

    def _release(self, key: Hashable, announce: bool = True) -> None:
        entry = self._entries.pop(key)
        self._free.extend(entry.pages)
        tenant = _tenant_of(key)
        if tenant is not None and tenant in self._tenant_pages:
            self._tenant_pages[tenant] -= len(entry.pages)
            if self._tenant_pages[tenant] <= 0:
                del self._tenant_pages[tenant]
        if announce and self._on_change is not None:
            self._on_change(key, entry.stamp, False)


def long_tensor(values: list[int] | array) -> torch.Tensor:
    """A host int64 tensor of `values` (through an array: ~10x faster than `torch.tensor` on long lists)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if len(values) else torch.empty(0, dtype=torch.int64)


def joined_longs(parts: list[array | memoryview | bytes]) -> torch.Tensor:
    """One host int64 tensor of int64 runs (arrays or their slices) laid end to end: one join, no Python ints."""
    data = b"".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.int64) if data else torch.empty(0, dtype=torch.int64)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _tenant_of(key: Hashable) -> Hashable:
    """The tenant of a `(tenant, record)` key (None for other keys: they count against no tenant's share)."""
    return key[0] if isinstance(key, tuple) and len(key) == 2 else None
