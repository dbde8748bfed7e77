"""Loads whose records sit in the lower tiers (pinned host, disk): brought up before the forward, or streamed.

A record evicted from the device arena goes down to the tiers under its exact version (`kvcore/spills.py`).
When a later load needs tier records, or the arena cannot hold a load this step: a small one
(`whole_load_bytes`) is brought into the arena whole before the forward (`kvcore/whole_loads.py`) and the step
is then written like any arena step; a large one is streamed: `begin` pins its tier entries (two-phase load),
each layer of its tier records is read as one joined batch (host/disk -> device, dequantized; on the reader
thread, ahead of the layer, where that pays), and every `write_layer` gathers the layer's tokens from the
arena and that batch in one op, rotates the keys to their positions and writes the layer into the paged
cache; `finish` unpins and promotes the records into the arena.
A tier entry that turns out damaged or gone mid-load is dropped and the canonical record is read from
the fact store for the remaining layers (the layers already written came from verified bytes); if that
fails too, the load is reported failed, so the engine recomputes or fails the request, never serves garbage.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvcore.arena import DeviceArena, long_tensor
from kvcore.errors import ArenaFullError, KVCoreError, RecordCorruptError
from kvcore.layer_ahead import LayerAhead
from kvcore.packed import PackedInserter, insert_packed
from kvcore.paged import CacheTarget, PagedLayout, slot_mapping
from kvcore.placement import tier_label
from kvcore.record import FactKV
from kvcore.rope import RopeConfig, RotationTable
from kvcore.spills import ArenaChange, SpillQueue, tier_key
from kvcore.step_writes import write_rotated
from kvcore.store import Stamp
from kvcore.tier_reads import BatchedReads, Joined, LayerReader
from kvcore.tiers import TieredStore
from kvcore.transfers import to_device
from kvcore.whole_loads import load_whole

log = logging.getLogger(__name__)
Span = tuple[str, Stamp, int, int]  # record id, stamp, first and end token inside the record
Fetch = Callable[[str, str, Stamp, int], FactKV]  # tenant, record, stamp, tokens needed -> record


@dataclass
class _Part:
    """One record of a streamed load: its arena rows, or a reader of the tier that holds it."""

    record_id: str
    stamp: Stamp
    lo: int
    hi: int
    rows: torch.Tensor | None
    reader: LayerReader | None
    record: FactKV | None = None  # the canonical record, once its tier entry proved damaged
    read: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # layers streamed, kept for promotion


@dataclass
class _Stream:
    load: object  # the LoadSpec being streamed
    fetch: Fetch
    parts: list[_Part]
    slots: torch.Tensor
    cos: torch.Tensor  # [T, 1, dim/2]
    sin: torch.Tensor
    failed: bool = False
    ahead: tuple[int, Future] | None = None  # (layer, the batch's read of it in flight on the reader thread)
    batch: tuple[list[_Part], BatchedReads] | None = None  # the tier parts, and their joined reads
    ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # id(part) -> this layer
    joined: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # the batch's layers, for promotion
    starts: list[int] = field(default_factory=list)  # where each batch part's tokens start in them
    order: tuple[torch.Tensor | None, torch.Tensor] | None = None  # (arena rows, gather order) of the joined path

    @property
    def tenant_id(self) -> str:
        return self.load.plan.tenant_id


class TierStreams:
    """A step's loads whose records sit in the lower tiers: brought up whole, or streamed a layer at a time."""

    def __init__(
        self,
        tiers: TieredStore,
        arena: DeviceArena,
        rope: RopeConfig,
        layout: PagedLayout,
        table: RotationTable,
        on_fail: Callable[[object, str], None],
        on_arena_change: ArenaChange | None = None,
        whole_load_bytes: int = 1 << 30,
        packed_inserter: PackedInserter | None = None,
    ) -> None:
        self._tiers, self._arena, self._rope, self._layout, self._table = tiers, arena, rope, layout, table
        self._whole_load_bytes = whole_load_bytes  # tier bytes of a load below which it is loaded before the forward
        self._insert: PackedInserter = packed_inserter or insert_packed
        self._on_fail = on_fail  # (load, reason): its blocks are reported failed
        self._streams: list[_Stream] = []
        self._ahead = LayerAhead(arena.device)
        self.spills = SpillQueue(tiers, on_arena_change, arena.dtype)

    @property
    def active(self) -> bool:
        return bool(self._streams)

    def begin(self, load, spans: Sequence[Span], fetch: Fetch, overflow: bool = False) -> bool:
        """Stream `load` if one of its records is held only in the tiers, or if it is an `overflow` (a load the
        arena cannot hold this step): True; else leave it to the arena."""
        self.spills.flush()  # a record evicted by an earlier load of this step is found in the tiers
        tenant = load.plan.tenant_id
        weights = self.spills.weigh(load.plan)
        resident = [self._arena.rows((tenant, record_id), stamp) for record_id, stamp, _, _ in spans]
        if not overflow and not any(
            rows is None and tier_key(tenant, r, st) in self._tiers for rows, (r, st, _, _) in zip(resident, spans)
        ):
            return False
        parts: list[_Part] = []
        try:
            for rows, (record_id, stamp, lo, hi) in zip(resident, spans):
                if rows is not None:
                    parts.append(
                        _Part(record_id, stamp, lo, hi, to_device(long_tensor(rows[lo:hi]), self._arena.device), None)
                    )
                    continue
                key = tier_key(tenant, record_id, stamp)
                weight = weights.get(record_id)
                if key not in self._tiers:  # neither here nor there: it joins the load through the tiers
                    record = fetch(tenant, record_id, stamp, hi)
                    self._put_record(key, record, weight or 0.0, tier_label(record_id, stamp))
                parts.append(_Part(record_id, stamp, lo, hi, None, self._tiers.begin_load(key, weight)))
        except BaseException:
            self._unpin(parts)
            raise
        tiered = [(p.record_id, p.stamp, p.reader) for p in parts if p.reader is not None]
        if load_whole(self._tiers, self._arena, self._insert, self._whole_load_bytes, tenant, tiered):
            self._unpin(parts)
            return False
        self._tiers.prefetch(
            [part.reader.key for part in parts if part.reader is not None]
        )  # all files read ahead at once
        device = self._arena.device
        slots = to_device(slot_mapping(load.block_ids, load.begin, load.end, self._layout.block_size), device)
        self._table.reserve(load.end)
        cos, sin = self._table.lookup(torch.arange(load.begin, load.end, device=device))
        stream = _Stream(load, fetch, parts, slots, cos[:, None], sin[:, None])
        self._streams.append(stream)
        self._read_ahead(stream, 0)
        return True

    def _put_record(self, key: tuple, record: FactKV, importance: float, label: str) -> None:
        """A record read from the fact store, into the tiers in the arena's dtype (as a spill would be). An int8
        record's codes go down as they are where the tiers keep codes: the same codes the arena would decode, with
        no device round trip (decoded there, quantized again, copied back, waited for) per record; for tiers of
        values they are decoded on the device, as the arena decodes them."""
        if record.precision == "int8":
            if self._tiers.keeps_codes:
                self._tiers.put_codes(key, record.k, record.v, self._arena.dtype, importance=importance, label=label)
                return
            record = record.dense(self._arena.device)
        k, v = record.k.to(self._arena.dtype), record.v.to(self._arena.dtype)
        self._tiers.put(key, k, v, importance=importance, label=label)

    def _read_ahead(self, stream: _Stream, index: int) -> None:
        """Keep the stream's batch of tier parts current, and start reading its layer `index` on the reader
        thread while the engine computes the layer before, where that pays (`LayerAhead.worth_it`)."""
        parts = [p for p in stream.parts if p.reader is not None and index < p.reader.layers]
        if not parts:
            return
        if stream.batch is None or [id(p) for p in stream.batch[0]] != [id(p) for p in parts]:  # a part dropped since
            stream.batch = (parts, BatchedReads([p.reader for p in parts], self._tiers, self._arena.dtype))
            stream.joined, stream.order = [], None
        if any(self._ahead.worth_it(p.reader) for p in parts):
            stream.ahead = (index, self._ahead.submit(stream.batch[1], index))

    def _joined_layer(self, stream: _Stream, index: int) -> Joined | None:
        """This layer of the stream's batch, joined: the read that ran ahead, else read now. None if the read
        failed: the parts are then read one by one, where a damaged entry is found and replaced."""
        stream.ready = {}
        try:
            if stream.ahead is not None and stream.ahead[0] == index:
                future, stream.ahead = stream.ahead[1], None
                return self._ahead.take(future)
            if stream.batch is not None:
                return stream.batch[1].joined_layer(index)
        except (KVCoreError, OSError):
            pass
        return None

    def write_layer(self, index: int, target: CacheTarget) -> None:
        """Write this layer of every stream: its tokens gathered from the arena and the joined batch in one op
        (part by part only when an entry failed), rotated to their positions, into the paged cache."""
        for stream in self._streams:
            if stream.failed:
                continue
            try:
                joined = self._joined_layer(stream, index)
                if joined is not None and self._joinable(stream):
                    keys, values = self._gather_joined(stream, index, joined)
                else:
                    if joined is not None:  # a part was replaced by its record: the batch's layers serve the rest
                        k, v, starts = joined
                        stream.ready = {
                            id(p): (k[:, a:b], v[:, a:b]) for p, a, b in zip(stream.batch[0], starts, starts[1:])
                        }
                    keys, values = self._gather_parts(stream, index)
            except (KVCoreError, OSError) as exc:
                stream.failed = True
                self._on_fail(stream.load, f"tier load failed: {exc}")
                continue
            self._read_ahead(stream, index + 1)
            write_rotated(target, keys, values, stream.cos, stream.sin, self._rope, stream.slots)

    @staticmethod
    def _joinable(stream: _Stream) -> bool:
        """Every tier part of the stream is in the batch that ran ahead (the rest sit in the arena)."""
        batched = {id(p) for p in stream.batch[0]}
        return all(p.rows is not None or id(p) in batched for p in stream.parts)

    def _gather_joined(self, stream: _Stream, index: int, joined) -> tuple[torch.Tensor, torch.Tensor]:
        """The load's tokens of this layer, `[N, H, D]`, from the arena rows and the joined batch in one gather."""
        k, v, starts = joined
        stream.joined.append((k, v))
        if stream.order is None:
            stream.starts, stream.order = starts, self._order(stream, starts)
        rows, order = stream.order
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if rows is not None:
            in_arena = self._arena.gather(rows, index)
            k, v = torch.cat([in_arena[0], k]), torch.cat([in_arena[1], v])
        return k.index_select(0, order), v.index_select(0, order)

    def _order(self, stream: _Stream, starts: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Arena rows of the stream's arena parts, and where each of the load's tokens sits in [those rows; the
        joined batch's tokens]."""
        in_arena = [p.rows for p in stream.parts if p.rows is not None]
        taken = sum(len(rows) for rows in in_arena)
        position = {id(p): j for j, p in enumerate(stream.batch[0])}
        order, seen = [], 0
        for part in stream.parts:
            if part.rows is not None:
                order.append(torch.arange(seen, seen + len(part.rows)))
                seen += len(part.rows)
            else:
                first = taken + starts[position[id(part)]]
                order.append(torch.arange(first + part.lo, first + part.hi))
        device = self._arena.device
        return (torch.cat(in_arena) if in_arena else None), to_device(torch.cat(order), device)

    def _gather_parts(self, stream: _Stream, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The load's tokens of this layer, part by part (some parts read in place, or a damaged one replaced)."""
        stream.joined, stream.order = [], None  # promotion then takes each part's own layers
        keys, values = [], []
        for part in stream.parts:
            if part.rows is not None:
                k, v = self._arena.gather(part.rows, index)
                keys.append(k)
                values.append(v)
                continue
            k, v = self._layer_of(stream, part, index)  # host or disk tier: this layer only, on the device
            keys.append(k[:, part.lo : part.hi].transpose(0, 1).to(self._arena.dtype))
            values.append(v[:, part.lo : part.hi].transpose(0, 1).to(self._arena.dtype))
        return torch.cat(keys), torch.cat(values)

    def _layer_of(self, stream: _Stream, part: _Part, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a tier part; a damaged tier entry is swapped for the canonical record, once."""
        if part.reader is not None:
            try:
                layer = stream.ready.pop(id(part), None) or part.reader.layer(index)
                part.read.append(layer)
                return layer
            except RecordCorruptError as exc:
                log.warning("request %s: %s; reading the record from the fact store", stream.load.request_id, exc)
                self._tiers.discard_damaged(part.reader)
                part.reader = None
                part.record = stream.fetch(stream.tenant_id, part.record_id, part.stamp, part.hi)
        return part.record.layer(index, self._arena.device)

    def finish(self) -> None:
        """Unpin the step's tier entries and bring what they held into the arena (spilling colder records)."""
        streams, self._streams = self._streams, []
        for stream in streams:
            self._settle(stream)
            self._unpin(stream.parts)
        for stream in streams:
            streamed = {} if self._arena.quantized else self._streamed(stream)  # an int8 arena takes tier codes
            for part in stream.parts:
                if part.reader is not None and part.reader.key in self._tiers:
                    self._promote(stream.tenant_id, part, streamed.get(id(part)))
                elif part.record is not None and not stream.failed:
                    self._admit(stream.tenant_id, part)
        self.spills.flush()

    @staticmethod
    def _streamed(stream: _Stream) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each batch part's K/V `[L, H, T, D]` from the joined layers, if the step streamed all of them."""
        readers = [p.reader for p in stream.batch[0]] if stream.batch is not None else []
        if not stream.joined or any(r is None for r in readers) or len(stream.joined) != readers[0].layers:
            return {}
        k = torch.stack([k for k, _ in stream.joined])
        v = torch.stack([v for _, v in stream.joined])
        starts = stream.starts
        return {id(p): (k[:, :, a:b], v[:, :, a:b]) for p, a, b in zip(stream.batch[0], starts, starts[1:])}

    def _promote(self, tenant_id: str, part: _Part, streamed: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Into the arena, from the layers this step streamed (or, if the step stopped early, from the tier); an
        int8 arena takes the entry as the tier holds it, codes as they are (quantizing the decoded layers again
        would move codes)."""
        try:
            if self._arena.quantized:
                k, v = self._tiers.read_held(part.reader.key)
            elif streamed is not None:
                k, v = streamed
            elif len(part.read) == part.reader.layers:
                k, v = torch.stack([k for k, _ in part.read]), torch.stack([v for _, v in part.read])
            else:
                k, v = self._tiers.read(part.reader.key)
        except RecordCorruptError as exc:
            log.warning("%s; the entry is dropped", exc)
            self._tiers.discard_damaged(part.reader)
            return
        part.read = []
        try:
            self._arena.insert((tenant_id, part.record_id), part.stamp, k, v)
        except ArenaFullError:
            pass

    def _admit(self, tenant_id: str, part: _Part) -> None:
        """A record read from the fact store after its tier entry failed goes into the arena if there is room."""
        try:
            self._arena.insert((tenant_id, part.record_id), part.stamp, part.record.k, part.record.v)
        except ArenaFullError:
            pass

    def _settle(self, stream: _Stream) -> None:
        """Wait out a read still in flight (a failed stream stops early) before its entries are unpinned."""
        if stream.ahead is not None:
            stream.ahead[1].exception()
            stream.ahead = None
        stream.ready = {}

    def _unpin(self, parts: list[_Part]) -> None:
        for part in parts:
            if part.reader is not None:
                self._tiers.end_load(part.reader)
