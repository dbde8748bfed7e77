"""The worker half of injection: each step's records written into the engine's paged caches, layer by layer.

`start` finds each load's records in the device arena (hot facts stay in HBM; a miss copies the exact version
the scheduler half checked, `kvcore/injection_scheduler.py`), sends the step's token index (arena row, position,
cache slot) to the device in one copy and plans the step's writes (`kvcore/step_writes.py`): written whole by
a fused kernel, rotated all layers at once, or rotated per layer in bounded chunks; `load_layer` then writes
that layer. With lower tiers configured, the arena's evictions spill there and loads that need them, or that
the arena cannot hold, are streamed layer by layer (`kvcore/streaming.py`); without them such a load fails.
Loads that fail are reported as block ids (`take_failed_blocks`), never silently skipped, and the engine
recomputes or fails the request by its declared policy.
"""

from __future__ import annotations

import logging
import re
from array import array
from typing import Callable, Sequence

import torch

from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES, ArenaPrecision, DeviceArena, joined_longs
from kvcore.errors import ArenaFullError, IncompatibleRecordsError, KVCoreError, PlanError
from kvcore.injection_scheduler import LoadSpec
from kvcore.load_sources import LoadSources
from kvcore.packed import PackedInserter
from kvcore.paged import CacheTarget, PagedLayout, step_slots
from kvcore.placement import PlacementTracker, Sink
from kvcore.quantize import Quantized
from kvcore.record import FactKV, dtype_name
from kvcore.rope import RopeConfig, RotationTable, table_dtype_of
from kvcore.spills import tier_key
from kvcore.step_writes import (
    StepPlan,
    StepWriter,
    StepWriterFactory,
    WritePath,
    rotate_rows,
    row_width,
    write_rotated,
    write_rows,
)
from kvcore.store import FactStore, Stamp
from kvcore.streaming import TierStreams
from kvcore.tiers import TieredStore
from kvcore.transfers import to_device

log = logging.getLogger(__name__)
# a record just captured: its id, its file's stamp, K and V `[L, H, T, D]` still on the device
Captured = tuple[str, Stamp, torch.Tensor, torch.Tensor]


class InjectionWorker:
    """Worker-side loads into one engine's paged caches, from a device arena of hot records."""

    def __init__(
        self,
        store: FactStore,
        fingerprint: str,
        rope: RopeConfig,
        device_cache_bytes: int = DEFAULT_DEVICE_CACHE_BYTES,
        rotate_bytes: int = 256 << 20,
        tiers: TieredStore | None = None,
        step_writer: StepWriterFactory | None = None,
        placement: Sink | None = None,
        whole_load_bytes: int = 1 << 30,
        device_tenant_bytes: int | None = None,
        packed_inserter: PackedInserter | None = None,
        record_dtype: torch.dtype | None = torch.float32,
        arena_precision: ArenaPrecision = "dense",
    ) -> None:
        """`record_dtype`: the records' dtype, which the device arena holds them in (None: the engine cache's own,
        as `CaptureWorker` reads it); a record stored in another is converted as the arena takes it.
        `arena_precision`: the arena's rows as values, or as int8 codes with per-page scales (~1.6x the facts)."""
        self._store = store
        self._arena_precision = arena_precision
        self._record_dtype = record_dtype
        self._fingerprint = fingerprint
        self._rope = rope
        self._device_cache_bytes = device_cache_bytes
        self._admit_captures = True  # off after an arena failure that is not a full arena (admit_captured)
        self._device_tenant_bytes = device_tenant_bytes  # one tenant's share of the arena (None: no cap)
        self._rotate_bytes = rotate_bytes  # float32 working set of one rotation call
        self._targets: dict[str, CacheTarget] = {}
        self._layer_of: dict[str, int] = {}
        self._layout: PagedLayout | None = None
        self._joint = False
        self._arena: DeviceArena | None = None
        self._table: RotationTable | None = None
        self._step: StepPlan | None = None
        self._tiers = tiers  # lower tiers below the arena: evicted records spill there, and come back
        self._whole_load_bytes = whole_load_bytes  # tier loads up to this size come up before the forward
        self._packed_inserter = packed_inserter  # a device kernel for them, when there is one
        self._streams: TierStreams | None = None
        self._failed: set[int] = set()
        self._writer_factory = step_writer
        self._writer: StepWriter | None = None  # a fused kernel for arena-only steps, when the caches allow one
        self._placement = PlacementTracker(placement) if placement is not None else None
        self._thrash_warned = -1
        self.sources = LoadSources()  # where loads found their records, when a benchmark turns counting on

    def register(self, caches: dict[str, torch.Tensor], layout: PagedLayout) -> None:
        """Keep the engine's per-layer caches (ordered by the layer number in their names) and size the arena."""
        names = sorted(caches, key=_layer_number)
        self._layer_of = {name: index for index, name in enumerate(names)}
        self._targets = {name: layout.target(caches[name]) for name in names}
        self._joint = all(target.kv_rows is not None for target in self._targets.values())
        self._layout = layout
        if self._joint and self._writer_factory is not None:
            self._writer = self._writer_factory([self._targets[name].kv_rows for name in names], self._rope)
        first = caches[names[0]]
        if self._record_dtype is None:  # `engine`: a quantized cache's dtype (fp8) is refused as a record's is
            dtype_name(first.dtype)
        self._table = RotationTable(self._rope, first.device, table_dtype_of(first.dtype))
        tracker = self._placement
        on_change = tracker.arena_changed if tracker is not None else None
        if self._tiers is not None and tracker is not None:  # an evicted record is reported once its tier entry exists
            on_change = lambda key, stamp, resident: self._streams.spills.arena_changed(key, stamp, resident)  # noqa: E731
        self._arena = DeviceArena(
            len(names),
            layout.num_kv_heads,
            layout.head_dim,
            first.device,
            self._device_cache_bytes,
            self._record_dtype or first.dtype,
            on_evict=self._spill if self._tiers is not None else None,
            on_change=on_change,
            tenant_bytes=self._device_tenant_bytes,
            precision=self._arena_precision,
        )
        try:
            self._arena.allocate()  # its memory claimed as the engine starts: a size that cannot fit stops the start
        except ArenaFullError as exc:  # too small for one page: loads go through the lower tiers, or fail, by name
            log.warning("%s", exc)
        if self._tiers is not None:
            self._streams = TierStreams(
                self._tiers,
                self._arena,
                self._rope,
                layout,
                self._table,
                self._fail,
                whole_load_bytes=self._whole_load_bytes,
                packed_inserter=self._packed_inserter,
                on_arena_change=tracker.arena_changed if tracker is not None else None,
            )
            if tracker is not None:
                tiers = self._tiers
                tiers.on_move = tracker.tier_moved
                tracker.recovered(tiers.entries())

    def admit_captured(self, tenant_id: str, records: Sequence[Captured]) -> None:
        """Records this engine just captured (a write group), their K/V still on the device, into the arena: their
        first load then reads no file (a history's chunks, chosen by the next questions; a fact just encoded).
        With lower tiers, each also gets its copy there now, as a record coming up from them keeps one, so that
        when a later step pushes it out of the arena it leaves for free, where the step that needs its room would
        pay its spill (a history's chat bringing up its chunks, `docs/injection.md`). A record the arena has no room for
        outside the current step's records (a history longer than the arena) only goes down to the tiers. Without
        tiers it is not kept. Never fails the capture."""
        if self._arena is None or not self._admit_captures:
            return
        try:
            for record_id, stamp, k, v in records:
                if not self._keep_captured(tenant_id, record_id, stamp, k, v):
                    break
        finally:
            self._flush_spills()  # the group's copies go down together: one quantization, one wait

    def _keep_captured(
        self, tenant_id: str, record_id: str, stamp: Stamp, k: torch.Tensor | Quantized, v: torch.Tensor | Quantized
    ) -> bool:
        """One captured record (values, or an int8 store's codes) into the arena and its copy to the tiers; False
        once the arena should not be asked again."""
        dtype = self._arena.dtype
        try:
            self._arena.insert((tenant_id, record_id), stamp, k, v)
        except ArenaFullError as exc:
            if self._streams is None:
                log.debug("captured record %s/%s not kept in the arena: %s", tenant_id, record_id, exc)
                return True
        except IncompatibleRecordsError as exc:
            log.debug("captured record %s/%s not kept in the arena: %s", tenant_id, record_id, exc)
            return True
        except Exception:  # noqa: BLE001 - e.g. the device out of memory for the copy: stop trying
            self._admit_captures = False
            log.warning("captured records are no longer kept in the device arena", exc_info=True)
            return False
        if self._streams is not None:
            coded = isinstance(k, Quantized)
            self._streams.spills.copy_down(
                (tenant_id, record_id), stamp, lambda: (k, v) if coded else (k.to(dtype), v.to(dtype))
            )
        return True

    def tier_counters(self) -> dict[str, int]:
        """Running counts of what moves below a load (a benchmark takes them around one request): records evicted
        from the arena, entries put into the tiers, the host pool's page-locked segments."""
        tiers = self._tiers
        return {
            "evictions": self._arena.evictions if self._arena is not None else 0,
            "tier_entries": tiers.entries_added if tiers is not None else 0,
            "host_segments": tiers.host_segments if tiers is not None else 0,
        }

    @property
    def layer_index(self) -> dict[str, int]:
        return dict(self._layer_of)

    def start(self, loads: Sequence[LoadSpec]) -> None:
        """Index every valid load's tokens and (for small steps) rotate all layers at once."""
        try:
            self._start(loads)
        finally:
            self._flush_spills()  # records the step's arena inserts evicted go down to the tiers together

    def _start(self, loads: Sequence[LoadSpec]) -> None:
        self._step = None
        if self._arena is None:
            return
        self._arena.begin_step()  # every engine step: the last one's records may leave the arena now (a capture's room)
        if not loads:
            return
        runs: list[array] = []
        in_arena: list[LoadSpec] = []
        for load in loads:
            if not load.valid:
                self._fail(load, load.reason)
                continue
            try:
                if self.sources.enabled:
                    self._count_sources(load)
                if self._streams is not None and self._streams.begin(load, list(self._spans(load)), self._fetch):
                    continue
                try:
                    runs += self._arena_rows(load)
                except ArenaFullError as exc:
                    if self._overflow(load, exc):
                        continue
                    runs += self._arena_rows(load)  # brought into the arena whole after all
                in_arena.append(load)
            except (KVCoreError, OSError) as exc:
                self._fail(load, str(exc))
        if in_arena:
            self._step = self._plan(joined_longs(runs), in_arena)

    def _count_sources(self, load: LoadSpec) -> None:
        """Where this load's records are before it runs (a spill still queued counts in its tier)."""
        self._flush_spills()
        tiers = self._tiers
        self.sources.count(
            load.plan.tenant_id,
            self._spans(load),
            self._arena.holds,
            lambda tenant, record_id, stamp: tiers.tier_of(tier_key(tenant, record_id, stamp)) if tiers else None,
        )

    def _overflow(self, load: LoadSpec, exc: ArenaFullError) -> bool:
        """A load the arena cannot hold this step: streamed through the lower tiers (True, or False if they
        brought it into the arena whole after all); without them it fails (`ArenaFullError` raised again)."""
        if self._streams is None:
            raise ArenaFullError(f"{exc}; raise device_cache_bytes or configure lower tiers") from exc
        log.info("request %s: %s; streaming it through the lower tiers", load.request_id, exc)
        return self._streams.begin(load, list(self._spans(load)), self._fetch, overflow=True)

    def _flush_spills(self) -> None:
        if self._streams is not None:
            self._streams.spills.flush()

    def load_layer(self, layer_name: str) -> None:
        """Write this layer's rotated K and V of every staged token into the paged cache."""
        index = self._layer_of.get(layer_name)
        if index is None:
            return
        target = self._targets[layer_name]
        if self._streams is not None and self._streams.active:
            self._streams.write_layer(index, target)
        step = self._step
        if step is None or step.path is WritePath.FUSED:
            return
        if step.path is WritePath.ALL_LAYERS:
            values = step.values[index] if step.values else None
            where = step.where(self._layout) if target.kv_rows is None else None
            write_rows(target, step.rows[index], values, step.index[2], where)
        else:
            self._write_in_chunks(step, index, target)

    def _write_in_chunks(self, step: StepPlan, index: int, target: CacheTarget) -> None:
        """A large step's layer (the throughput case), gathered once and rotated in chunks of bounded size."""
        keys, values = self._gather(step.index[0], index)
        tokens, heads, dim = keys.shape
        chunk = max(1, self._rotate_bytes // (4 * heads * dim))
        width = row_width(target, dim)
        buffer = torch.empty(min(chunk, tokens), heads, width, dtype=target.k_view.dtype, device=keys.device)
        where = step.where(self._layout) if target.kv_rows is None else None
        for first in range(0, tokens, chunk):
            part = slice(first, first + chunk)
            at = (where[0][part], where[1][part]) if where is not None else None
            write_rotated(
                target,
                keys[part],
                values[part],
                step.cos[part],
                step.sin[part],
                self._rope,
                step.index[2, part],
                at,
                buffer,
            )

    def finish_step(self) -> None:
        self._step = None
        if self._streams is not None:
            self._streams.finish()

    def _spill(self, key: tuple[str, str], stamp: Stamp, read: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._streams.spills.spill(key, stamp, read)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def _plan(self, rows: torch.Tensor, loads: list[LoadSpec]) -> StepPlan:
        """Move the step's token index to the device in one copy and choose its write path: the fused kernel
        writes the whole step here; a small step is rotated here, all layers at once; a large one per layer."""
        device = self._arena.device
        positions, slots = step_slots(loads, self._layout.block_size, device)
        index = torch.stack((to_device(rows, device), positions, slots))
        self._table.reserve(max(load.end for load in loads))
        if self._writer is not None:
            arena = self._arena
            self._writer(arena.k, arena.v, index, *self._table.tables, arena.scales, arena.page_tokens)
            return StepPlan(WritePath.FUSED, index)
        cos, sin = self._table.lookup(index[1])
        step = StepPlan(WritePath.CHUNKED, index, cos[:, None], sin[:, None])
        layers, _, heads, dim = self._arena.k.shape
        if layers * index.shape[1] * heads * dim * 4 <= self._rotate_bytes:  # the latency case: all layers at once
            keys, values = self._gather(index[0], None)
            target = next(iter(self._targets.values()))
            out = torch.empty(*keys.shape[:-1], row_width(target, dim), dtype=target.k_view.dtype, device=keys.device)
            step.rows = rotate_rows(out, keys, values, step.cos, step.sin, self._rope).unbind(0)
            step.values = () if self._joint else values.unbind(0)
            step.path = WritePath.ALL_LAYERS
        return step

    def _gather(self, rows: torch.Tensor, layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the step's arena rows: `[L, T, H, D]` for all layers, or `[T, H, D]` for one."""
        return self._arena.gather(rows, layer)

    def _spans(self, load: LoadSpec):
        """(record id, stamp, first token, end token) of each record inside the load's [begin, end)."""
        plan, cursor, total = load.plan, load.plan.region_start, 0
        for record_id, stamp, length in zip(plan.record_ids, load.stamps, load.lengths):
            lo, hi = max(load.begin - cursor, 0), min(load.end - cursor, length)
            if lo < hi:
                total += hi - lo
                yield record_id, stamp, lo, hi
            cursor += length
        if total != load.end - load.begin:
            raise PlanError(f"records cover {total} tokens, the load needs {load.end - load.begin}")

    def _fetch(self, tenant_id: str, record_id: str, stamp: Stamp, span: int) -> FactKV:
        record = self._store.get(tenant_id, record_id, stamp)
        if record.params.model_fingerprint != self._fingerprint:
            raise PlanError(f"fact {record_id!r} was encoded by another model")
        if record.num_tokens < span:
            raise PlanError(f"fact {record_id!r} has {record.num_tokens} tokens, the plan needs {span}")
        return record

    def _arena_rows(self, load: LoadSpec) -> list[array]:
        """Arena rows of the load's tokens (runs, in token order), copying records that are not resident yet.
        A load of its whole region (the usual case) takes every record whole, without cutting spans."""
        tenant, plan, rows, runs = load.plan.tenant_id, load.plan, self._arena.rows, []
        if load.begin == plan.region_start and load.end == plan.region_start + sum(load.lengths):
            for record_id, stamp, length in zip(plan.record_ids, load.stamps, load.lengths):
                found = rows((tenant, record_id), stamp)
                if found is None:
                    found = self._admit(tenant, record_id, stamp, length)
                runs.append(found if len(found) == length else found[:length])
            return runs
        for record_id, stamp, lo, hi in self._spans(load):
            found = rows((tenant, record_id), stamp)
            if found is None:
                found = self._admit(tenant, record_id, stamp, hi)
            runs.append(found if lo == 0 and hi == len(found) else found[lo:hi])
        return runs

    def _admit(self, tenant: str, record_id: str, stamp: Stamp, span: int) -> array:
        """Copy a record that is not resident into the arena; its rows."""
        self._warn_thrash()
        record = self._fetch(tenant, record_id, stamp, span)
        return self._arena.insert((tenant, record_id), stamp, record.k, record.v)

    def _warn_thrash(self) -> None:
        """Say so (once per thousand) when, with no lower tier, records evicted from the arena are read again from
        the fact store: the working set exceeds `device_cache_bytes`, and every such load pays a record read."""
        evictions = self._arena.evictions
        if self._tiers is None and evictions and evictions // 1000 != self._thrash_warned:
            self._thrash_warned = evictions // 1000
            log.warning(
                "device arena (%d tokens) evicted %d records that are read again from the fact store: raise "
                "device_cache_bytes or configure lower tiers",
                self._arena.capacity_tokens,
                evictions,
            )

    def _fail(self, load: LoadSpec, reason: str) -> None:
        size = self._layout.block_size if self._layout else 1
        first, last = load.begin // size, (max(load.end, load.begin + 1) - 1) // size
        blocks = set(load.block_ids[first : last + 1])
        log.warning("request %s: injection failed (%s); %d blocks reported", load.request_id, reason, len(blocks))
        self._failed |= blocks


def _layer_number(name: str) -> tuple[int, str]:
    found = re.search(r"\d+", name)
    return (int(found.group()) if found else -1, name)
