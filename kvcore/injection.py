"""Engine-agnostic memory injection: the scheduler half decides, the worker half writes K/V.

Scheduler half (`InjectionScheduler`), per request: read the memory plan, check it against the store
(records present, encoded by the serving model, their tokens equal the prompt's memory region, at
least one prompt token left to compute) and claim the part of the region the engine has not already
cached. An unusable plan is handled by the declared policy: `recompute` claims nothing, so the engine
prefills the memory text itself; `fail` claims the region and marks the load invalid, so the worker
reports its blocks as failed and the engine fails the request. Either way no wrong K/V is written.

Worker half (`InjectionWorker`): `start` finds each request's records in the device arena (hot facts
stay in HBM; a miss copies the exact version the scheduler checked), sends the step's token index
(arena row, position, cache slot) to the device in one copy and, for latency-sized steps, gathers and
rotates every layer's keys with a handful of kernels; `load_layer` then writes that layer's K and V of
all requests with one indexed copy, so a slower tier can later overlap with compute layer by layer.
Large steps gather and rotate per layer in bounded chunks. Given a `StepWriter` (a fused device kernel, on
caches whose slot rows hold `[K | V]`), an arena-only step is instead written whole, all layers, in `start`.
With lower tiers configured, the arena's
evictions spill there and loads that need them are streamed layer by layer (`kvcore/streaming.py`).
Loads that fail are reported as block ids (`take_failed_blocks`), never silently skipped.
"""

from __future__ import annotations

import logging
import re
from array import array
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

import torch

from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES, DeviceArena, joined_longs
from kvcore.errors import ArenaFullError, KVCoreError, PlanError
from kvcore.packed import PackedInserter
from kvcore.paged import CacheTarget, PagedLayout, step_slots
from kvcore.placement import PlacementTracker, Sink
from kvcore.plan import MemoryPlan
from kvcore.record import FactKV
from kvcore.rope import RopeConfig, RotationTable, rotate_into, table_dtype_of
from kvcore.store import FactStore, Stamp
from kvcore.streaming import TierStreams
from kvcore.tiers import TieredStore

log = logging.getLogger(__name__)

Policy = Literal["recompute", "fail"]


class StepWriter(Protocol):
    """Writes every layer of a step from the arena into joint `[K | V]` cache rows, rotating K on the way.

    Called with the arena's K and V `[L, R, H, D]`, the step index `[3, T]` (arena row, position, slot)
    and the float32 cos/sin tables `[N, D/2]`. A device kernel (deployments/triton_adapter) implements it.
    """

    def __call__(
        self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None: ...


# Given every layer's joint rows `[slots, H, 2D]` and the rope, a StepWriter for them, or None (torch path).
StepWriterFactory = Callable[[Sequence[torch.Tensor], RopeConfig], StepWriter | None]


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, sent from the scheduler half to the worker half."""

    request_id: str
    plan: MemoryPlan | None  # None only for an invalid load whose plan could not be read
    begin: int  # first prompt position to write
    end: int  # one past the last (the end of the memory region)
    block_ids: tuple[int, ...]  # the request's blocks, from position 0
    stamps: tuple[Stamp, ...] = ()  # the record versions the scheduler checked, one per plan record
    lengths: tuple[int, ...] = ()  # their token counts
    valid: bool = True
    reason: str = ""


@dataclass
class _Claim:
    plan: MemoryPlan | None
    begin: int
    end: int
    stamps: tuple[Stamp, ...]
    lengths: tuple[int, ...]
    valid: bool
    reason: str


@dataclass
class InjectionScheduler:
    """Scheduler-side bookkeeping; holds no tensors."""

    store: FactStore
    fingerprint: str
    policy: Policy = "recompute"
    _claims: dict[str, _Claim] = field(default_factory=dict)
    _ready: list[LoadSpec] = field(default_factory=list)
    _reports: dict[str, dict] = field(default_factory=dict)

    def match(self, request_id: str, prompt_ids: Sequence[int], params: dict | None, num_computed: int) -> int:
        """Tokens beyond `num_computed` this connector will provide (0 when there is nothing to inject)."""
        try:
            plan = MemoryPlan.from_params(params)
        except PlanError as exc:
            return self._refuse(request_id, None, prompt_ids, num_computed, str(exc))
        if plan is None:
            return 0
        try:
            end, stamps, lengths = self._check(plan, prompt_ids)
        except KVCoreError as exc:
            return self._refuse(request_id, plan, prompt_ids, num_computed, str(exc))
        if num_computed >= end:
            self._report(request_id, plan, 0, None)  # the engine's prefix cache already holds the region
            return 0
        if num_computed < plan.region_start:
            return self._refuse(
                request_id,
                plan,
                prompt_ids,
                num_computed,
                f"prompt tokens before the memory region ({plan.region_start}) are not cached",
            )
        self._claims[request_id] = _Claim(plan, num_computed, end, stamps, lengths, True, "")
        return end - num_computed

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """The engine allocated blocks for a claim: the load can be sent to the workers."""
        claim = self._claims.pop(request_id, None)
        if claim is None or num_external == 0:
            return
        end = claim.begin + num_external
        self._ready.append(
            LoadSpec(
                request_id,
                claim.plan,
                claim.begin,
                end,
                tuple(block_ids),
                claim.stamps,
                claim.lengths,
                claim.valid,
                claim.reason,
            )
        )
        self._report(request_id, claim.plan, num_external if claim.valid else 0, claim.reason or None)

    def take_loads(self) -> list[LoadSpec]:
        ready, self._ready = self._ready, []
        return ready

    def finished(self, request_id: str) -> dict | None:
        """What this request got, for the engine's output (`kv_transfer_params`)."""
        self._claims.pop(request_id, None)
        report = self._reports.pop(request_id, None)
        return {"inferscale": report} if report else None

    def _check(self, plan: MemoryPlan, prompt_ids: Sequence[int]) -> tuple[int, tuple[Stamp, ...], tuple[int, ...]]:
        """The region's end and the checked versions and lengths of its records; `PlanError` if they do not fit.
        The region is compared with the records' tokens in one list comparison (the per-record walk only names
        a mismatch): this runs in the engine's scheduler for every request, ~50 records each."""
        checked = self.store.checked_infos(plan.tenant_id, plan.record_ids)
        fingerprint, joined, stamps, lengths = self.fingerprint, [], [], []
        for record_id, (stamp, info) in zip(plan.record_ids, checked):
            if info.params.model_fingerprint != fingerprint:
                raise PlanError(
                    f"fact {record_id!r} was encoded by model {info.params.model_fingerprint}, "
                    f"the engine serves {fingerprint}"
                )
            joined += info.token_ids
            stamps.append(stamp)
            lengths.append(len(info.token_ids))
        end = plan.region_start + len(joined)
        region = prompt_ids[plan.region_start : end]
        if (region if isinstance(region, list) else list(region)) != joined:
            position = plan.region_start
            for record_id, (_, info) in zip(plan.record_ids, checked):
                if tuple(prompt_ids[position : position + len(info.token_ids)]) != info.token_ids:
                    raise PlanError(f"prompt tokens at {position} are not the tokens of fact {record_id!r}")
                position += len(info.token_ids)
        if end >= len(prompt_ids):
            raise PlanError("the memory region must be followed by at least one query token")
        return end, tuple(stamps), tuple(lengths)

    def _refuse(
        self, request_id: str, plan: MemoryPlan | None, prompt_ids: Sequence[int], num_computed: int, reason: str
    ) -> int:
        log.warning("request %s: memory plan unusable (%s); policy %s", request_id, reason, self.policy)
        end = len(prompt_ids) - 1
        if self.policy == "recompute" or end <= num_computed:
            self._report(request_id, plan, 0, reason)
            return 0
        # fail: claim the rest of the prompt, write nothing, report its blocks as failed
        self._claims[request_id] = _Claim(plan, num_computed, end, (), (), False, reason)
        return end - num_computed

    def _report(self, request_id: str, plan: MemoryPlan | None, injected: int, reason: str | None) -> None:
        self._reports[request_id] = {
            "injected_tokens": injected,
            "records": len(plan.record_ids) if plan else 0,
            "fallback": reason,
        }


@dataclass
class _Source:
    """Where consecutive tokens of a step are read from: the arena, or a load's own copy when it is full."""

    k: torch.Tensor  # [layers, rows, kv_heads, head_dim], pre-RoPE
    v: torch.Tensor
    count: int


@dataclass
class _Step:
    """What one forward step writes: every load's tokens, in one order, indexed on the device."""

    sources: list[_Source]
    index: torch.Tensor  # [3, T] on the device: source row, position, cache slot of each token
    cos: torch.Tensor  # [T, 1, dim/2] float32
    sin: torch.Tensor
    joint: tuple[torch.Tensor, ...] | None = None  # per layer [T, H, 2D] rotated K | V (joint row caches)
    keys: tuple[torch.Tensor, ...] | None = None  # per layer [T, H, D] rotated K, for the other caches
    values: tuple[torch.Tensor, ...] | None = None
    _where: tuple[torch.Tensor, torch.Tensor] | None = None

    def where(self, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each token, for caches written through two views."""
        if self._where is None:
            self._where = layout.split(self.index[2])
        return self._where


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
    ) -> None:
        self._store = store
        self._fingerprint = fingerprint
        self._rope = rope
        self._device_cache_bytes = device_cache_bytes
        self._device_tenant_bytes = device_tenant_bytes  # one tenant's share of the arena (None: no cap)
        self._rotate_bytes = rotate_bytes  # float32 working set of one rotation call
        self._targets: dict[str, CacheTarget] = {}
        self._layer_of: dict[str, int] = {}
        self._layout: PagedLayout | None = None
        self._joint = False
        self._arena: DeviceArena | None = None
        self._table: RotationTable | None = None
        self._step: _Step | None = None
        self._tiers = tiers  # lower tiers below the arena: evicted records spill there, and come back
        self._whole_load_bytes = whole_load_bytes  # tier loads up to this size come up before the forward
        self._packed_inserter = packed_inserter  # a device kernel for them, when there is one
        self._streams: TierStreams | None = None
        self._failed: set[int] = set()
        self._writer_factory = step_writer
        self._writer: StepWriter | None = None  # a fused kernel for arena-only steps, when the caches allow one
        self._placement = PlacementTracker(placement) if placement is not None else None
        self._thrash_warned = -1

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
        self._table = RotationTable(self._rope, first.device, table_dtype_of(first.dtype))
        tracker = self._placement
        on_change = tracker.arena_changed if tracker is not None else None
        if self._tiers is not None and tracker is not None:  # an evicted record is reported once its tier entry exists
            on_change = lambda key, stamp, resident: self._streams.arena_changed(key, stamp, resident)  # noqa: E731
        self._arena = DeviceArena(
            len(names),
            layout.num_kv_heads,
            layout.head_dim,
            first.device,
            self._device_cache_bytes,
            on_evict=self._spill if self._tiers is not None else None,
            on_change=on_change,
            tenant_bytes=self._device_tenant_bytes,
        )
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
                tiers.listen(lambda key, tier: tracker.tier_moved(key, tier, tiers.label_of(key)))
                tracker.recovered(tiers.entries())

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
        if not loads or self._arena is None:
            return
        self._arena.begin_step()
        arena_parts: list[tuple[list[array], LoadSpec]] = []
        own: list[tuple[_Source, LoadSpec]] = []
        for load in loads:
            if not load.valid:
                self._fail(load, load.reason)
                continue
            try:
                if self._streams is not None and self._streams.begin(load, list(self._spans(load)), self._fetch):
                    continue
                try:
                    arena_parts.append((self._arena_rows(load), load))
                except ArenaFullError as exc:
                    log.info("request %s: %s; staging its records on their own", load.request_id, exc)
                    own.append((self._own_copy(load), load))
            except (KVCoreError, OSError) as exc:
                self._fail(load, str(exc))
        if not arena_parts and not own:
            return
        sources = (
            [_Source(self._arena.k, self._arena.v, sum(load.end - load.begin for _, load in arena_parts))]
            if arena_parts
            else []
        )
        sources += [source for source, _ in own]
        ordered = [load for _, load in arena_parts] + [load for _, load in own]
        rows = [run for runs, _ in arena_parts for run in runs] + [array("q", range(source.count)) for source, _ in own]
        self._step = self._index(sources, joined_longs(rows), ordered)

    def _flush_spills(self) -> None:
        if self._streams is not None:
            self._streams.flush_spills()

    def load_layer(self, layer_name: str) -> None:
        """Write this layer's rotated K and V of every staged token into the paged cache."""
        step = self._step
        streaming = self._streams is not None and self._streams.active
        if step is None and not streaming:
            return
        index = self._layer_of.get(layer_name)
        if index is None:
            return
        target = self._targets[layer_name]
        if streaming:
            self._streams.write_layer(index, target)
        if step is None:
            return
        if step.joint is not None:
            target.kv_rows.index_copy_(0, step.index[2], step.joint[index])
        elif step.keys is not None:
            target.write(step.keys[index], step.values[index], *step.where(self._layout))
        else:  # a large step (the throughput case): one layer at a time, rotated in bounded chunks
            self._write_in_chunks(step, index, target)

    def _write_in_chunks(self, step: _Step, index: int, target: CacheTarget) -> None:
        keys, values = self._gather(step, index)
        tokens, heads, dim = keys.shape
        chunk = max(1, self._rotate_bytes // (4 * heads * dim))
        width = 2 * dim if target.kv_rows is not None else dim
        buffer = torch.empty(min(chunk, tokens), heads, width, dtype=target.k_view.dtype, device=keys.device)
        for first in range(0, tokens, chunk):
            part = slice(first, first + chunk)
            out = buffer[: keys[part].shape[0]]
            rotate_into(out[..., :dim], keys[part], step.cos[part], step.sin[part], self._rope)
            if target.kv_rows is not None:
                out[..., dim:] = values[part]
                target.kv_rows.index_copy_(0, step.index[2, part], out)
            else:
                blocks, offsets = step.where(self._layout)
                target.write(out, values[part], blocks[part], offsets[part])

    def finish_step(self) -> None:
        self._step = None
        if self._streams is not None:
            self._streams.finish()

    def _spill(self, key: tuple[str, str], stamp: Stamp, read: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._streams.spill(key, stamp, read)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def _index(self, sources: list[_Source], rows: torch.Tensor, loads: list[LoadSpec]) -> _Step | None:
        """Move the step's token index to the device in one copy, then look up its rotation angles.

        With a fused writer and every token in the arena, the whole step is written here (None returned)."""
        device = self._arena.device
        positions, slots = step_slots(loads, self._layout.block_size, device)
        if device.type == "cuda":
            rows = rows.pin_memory()
        index = torch.stack((rows.to(device, non_blocking=True), positions, slots))
        self._table.reserve(max(load.end for load in loads))
        if self._writer is not None and len(sources) == 1 and sources[0].k is self._arena.k:
            self._writer(self._arena.k, self._arena.v, index, *self._table.tables)
            return None
        cos, sin = self._table.lookup(index[1])
        step = _Step(sources, index, cos[:, None], sin[:, None])
        layers, _, heads, dim = sources[0].k.shape
        if layers * index.shape[1] * heads * dim * 4 <= self._rotate_bytes:  # the latency case: all layers at once
            keys, values = self._gather(step, None)
            dtype = self._targets[next(iter(self._targets))].k_view.dtype
            if self._joint:  # [L, T, H, K | V], in the cache's dtype: one copy per layer later
                joint = torch.empty(*keys.shape[:-1], 2 * dim, dtype=dtype, device=keys.device)
                rotate_into(joint[..., :dim], keys, step.cos, step.sin, self._rope)
                joint[..., dim:] = values
                step.joint = joint.unbind(0)
            else:
                rotated = torch.empty_like(keys, dtype=dtype)
                rotate_into(rotated, keys, step.cos, step.sin, self._rope)
                step.keys, step.values = rotated.unbind(0), values.unbind(0)
        return step

    def _gather(self, step: _Step, layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the step's tokens `[(L,) T, H, D]`: one indexed read per source and tensor."""
        keys, values, first = [], [], 0
        for source in step.sources:
            rows = step.index[0, first : first + source.count]
            first += source.count
            if layer is None:
                keys.append(source.k.index_select(1, rows))
                values.append(source.v.index_select(1, rows))
            else:
                keys.append(source.k[layer].index_select(0, rows))
                values.append(source.v[layer].index_select(0, rows))
        dim = 1 if layer is None else 0
        return _cat(keys, dim), _cat(values, dim)

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

    def _own_copy(self, load: LoadSpec) -> _Source:
        """The load's K/V copied to the device for this step only (when the arena cannot take them)."""
        tenant, ks, vs = load.plan.tenant_id, [], []
        for record_id, stamp, lo, hi in self._spans(load):
            record = self._fetch(tenant, record_id, stamp, hi)
            ks.append(record.k[:, :, lo:hi])
            vs.append(record.v[:, :, lo:hi])
        dtype = self._arena.k.dtype if self._arena.k is not None else ks[0].dtype
        k = _cat(ks, dim=2).to(self._arena.device, dtype).permute(0, 2, 1, 3).contiguous()
        v = _cat(vs, dim=2).to(self._arena.device, dtype).permute(0, 2, 1, 3).contiguous()
        return _Source(k, v, k.shape[1])

    def _fail(self, load: LoadSpec, reason: str) -> None:
        size = self._layout.block_size if self._layout else 1
        first, last = load.begin // size, (max(load.end, load.begin + 1) - 1) // size
        blocks = set(load.block_ids[first : last + 1])
        log.warning("request %s: injection failed (%s); %d blocks reported", load.request_id, reason, len(blocks))
        self._failed |= blocks


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _layer_number(name: str) -> tuple[int, str]:
    found = re.search(r"\d+", name)
    return (int(found.group()) if found else -1, name)
