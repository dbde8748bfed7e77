"""Engine-agnostic memory injection: the scheduler half decides, the worker half writes K/V.

Scheduler half (`InjectionScheduler`), per request: read the memory plan, check it against the store
(records present, encoded by the serving model, their tokens equal the prompt's memory region, at
least one prompt token left to compute) and claim the part of the region the engine has not already
cached. An unusable plan is handled by the declared policy: `recompute` claims nothing, so the engine
prefills the memory text itself; `fail` claims the region and marks the load invalid, so the worker
reports its blocks as failed and the engine fails the request. Either way no wrong K/V is written.

Worker half (`InjectionWorker`): `start` fetches each request's records (kept on the device in a
byte-bounded cache, so hot facts stay in HBM), concatenates the step's regions and rotates every
layer's keys to their positions in one vectorized call; `load_layer` then scatters that layer's K and
V of all requests into the paged cache with one indexed write each, so a slower tier can later overlap
with compute layer by layer. Loads that fail are reported as block ids (`take_failed_blocks`), never
silently skipped.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from kvcore.errors import KVCoreError, PlanError
from kvcore.paged import PagedLayout, slot_mapping
from kvcore.plan import MemoryPlan
from kvcore.rope import RopeConfig, apply_rotation, cos_sin, table_dtype_of
from kvcore.store import FactStore

log = logging.getLogger(__name__)

Policy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, sent from the scheduler half to the worker half."""

    request_id: str
    plan: MemoryPlan | None  # None only for an invalid load whose plan could not be read
    begin: int  # first prompt position to write
    end: int  # one past the last (the end of the memory region)
    block_ids: tuple[int, ...]  # the request's blocks, from position 0
    valid: bool = True
    reason: str = ""


@dataclass
class _Claim:
    plan: MemoryPlan | None
    begin: int
    end: int
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
            end = self._check(plan, prompt_ids)
        except KVCoreError as exc:
            return self._refuse(request_id, plan, prompt_ids, num_computed, str(exc))
        if num_computed >= end:
            self._report(request_id, plan, 0, None)  # the engine's prefix cache already holds the region
            return 0
        if num_computed < plan.region_start:
            return self._refuse(request_id, plan, prompt_ids, num_computed,
                                f"prompt tokens before the memory region ({plan.region_start}) are not cached")
        self._claims[request_id] = _Claim(plan, num_computed, end, True, "")
        return end - num_computed

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """The engine allocated blocks for a claim: the load can be sent to the workers."""
        claim = self._claims.pop(request_id, None)
        if claim is None or num_external == 0:
            return
        if claim.end - claim.begin != num_external:
            claim = _Claim(claim.plan, claim.begin, claim.begin + num_external, claim.valid, claim.reason)
        self._ready.append(LoadSpec(request_id, claim.plan, claim.begin, claim.end, tuple(block_ids), claim.valid, claim.reason))
        self._report(request_id, claim.plan, num_external if claim.valid else 0, claim.reason or None)

    def take_loads(self) -> list[LoadSpec]:
        ready, self._ready = self._ready, []
        return ready

    def finished(self, request_id: str) -> dict | None:
        """What this request got, for the engine's output (`kv_transfer_params`)."""
        self._claims.pop(request_id, None)
        report = self._reports.pop(request_id, None)
        return {"inferscale": report} if report else None

    def _check(self, plan: MemoryPlan, prompt_ids: Sequence[int]) -> int:
        position = plan.region_start
        for record_id in plan.record_ids:
            info = self.store.info(plan.tenant_id, record_id)
            if info.params.model_fingerprint != self.fingerprint:
                raise PlanError(f"fact {record_id!r} was encoded by model {info.params.model_fingerprint}, "
                                f"the engine serves {self.fingerprint}")
            if tuple(prompt_ids[position : position + len(info.token_ids)]) != info.token_ids:
                raise PlanError(f"prompt tokens at {position} are not the tokens of fact {record_id!r}")
            position += len(info.token_ids)
        if position >= len(prompt_ids):
            raise PlanError("the memory region must be followed by at least one query token")
        return position

    def _refuse(self, request_id: str, plan: MemoryPlan | None, prompt_ids: Sequence[int], num_computed: int, reason: str) -> int:
        log.warning("request %s: memory plan unusable (%s); policy %s", request_id, reason, self.policy)
        end = len(prompt_ids) - 1
        if self.policy == "recompute" or end <= num_computed:
            self._report(request_id, plan, 0, reason)
            return 0
        # fail: claim the rest of the prompt, write nothing, report its blocks as failed
        self._claims[request_id] = _Claim(plan, num_computed, end, False, reason)
        return end - num_computed

    def _report(self, request_id: str, plan: MemoryPlan | None, injected: int, reason: str | None) -> None:
        self._reports[request_id] = {"injected_tokens": injected, "records": len(plan.record_ids) if plan else 0,
                                     "fallback": reason}


@dataclass
class _Part:
    """One request's load: its records' K/V slices (never concatenated across all layers)."""

    ks: list[torch.Tensor]  # each [L, H, t_i, D] pre-RoPE, on the device (views of cached records)
    vs: list[torch.Tensor]
    positions: torch.Tensor  # [sum t_i]
    slots: torch.Tensor


@dataclass
class _Step:
    """What one forward step writes: all requests' tokens, in one order."""

    parts: list[_Part]
    cos: torch.Tensor  # [T, dim/2] float32, shared by every layer
    sin: torch.Tensor
    blocks: torch.Tensor  # [T] cache block of each token
    offsets: torch.Tensor  # [T] offset inside that block
    k_all: torch.Tensor | None = None  # [L, H, T, D] rotated, when small enough to do in one go
    v_all: torch.Tensor | None = None


class InjectionWorker:
    """Worker-side loads into one engine's paged caches."""

    def __init__(self, store: FactStore, fingerprint: str, rope: RopeConfig, device_cache_bytes: int = 1 << 30,
                 prerotate_bytes: int = 256 << 20) -> None:
        self._store = store
        self._fingerprint = fingerprint
        self._rope = rope
        self._device_cache: OrderedDict[tuple[str, str], tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = OrderedDict()
        self._device_cache_bytes = device_cache_bytes
        self._device_held = 0
        self._prerotate_bytes = prerotate_bytes
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._layout: PagedLayout | None = None
        self._table_dtype: torch.dtype | None = None
        self._step: _Step | None = None
        self._failed: set[int] = set()

    def register(self, caches: dict[str, torch.Tensor], layout: PagedLayout) -> None:
        """Keep the engine's per-layer cache tensors, ordered by the layer number in their names."""
        self._caches = dict(caches)
        self._layer_of = {name: index for index, name in enumerate(sorted(caches, key=_layer_number))}
        self._layout = layout
        self._table_dtype = table_dtype_of(next(iter(caches.values())).dtype)

    @property
    def layer_index(self) -> dict[str, int]:
        return dict(self._layer_of)

    def start(self, loads: Sequence[LoadSpec]) -> None:
        """Fetch every valid load's K/V onto the device; failed ones become failed block ids."""
        parts: list[_Part] = []
        device = next(iter(self._caches.values())).device if self._caches else torch.device("cpu")
        for load in loads:
            if not load.valid:
                self._fail(load, load.reason)
                continue
            try:
                parts.append(self._stage(load, device))
            except (KVCoreError, OSError) as exc:
                self._fail(load, str(exc))
        if not parts:
            self._step = None
            return
        positions = _cat([p.positions for p in parts], dim=0)
        cos, sin = cos_sin(positions, self._rope)
        step = _Step(parts, cos, sin, *self._layout.split(_cat([p.slots for p in parts], dim=0)))
        layers, heads, _, dim = parts[0].ks[0].shape
        if layers * heads * positions.numel() * dim * 4 <= self._prerotate_bytes:
            # small step (the latency case): rotate every layer at once, few kernel launches
            k = _cat([k for p in parts for k in p.ks], dim=2)
            step.k_all = apply_rotation(k, cos, sin, self._rope, table_dtype=self._table_dtype)
            step.v_all = _cat([v for p in parts for v in p.vs], dim=2)
        self._step = step

    def load_layer(self, layer_name: str) -> None:
        """Write this layer's rotated K and V of every staged request into the paged cache."""
        step = self._step
        if step is None or layer_name not in self._layer_of:
            return
        index = self._layer_of[layer_name]
        if step.k_all is not None:
            keys, values = step.k_all[index], step.v_all[index]
        else:  # large step (the throughput case): one layer at a time bounds the memory used
            keys = _cat([k[index] for p in step.parts for k in p.ks], dim=1)
            values = _cat([v[index] for p in step.parts for v in p.vs], dim=1)
            keys = apply_rotation(keys, step.cos, step.sin, self._rope, table_dtype=self._table_dtype)
        self._layout.write(self._caches[layer_name], keys, values, step.blocks, step.offsets)

    def finish_step(self) -> None:
        self._step = None

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def _stage(self, load: LoadSpec, device: torch.device) -> _Part:
        plan = load.plan
        ks, vs, cursor = [], [], plan.region_start  # keep the slice of each record inside [begin, end)
        for record_id in plan.record_ids:
            k, v = self._on_device(plan.tenant_id, record_id, device)
            lo, hi = max(load.begin - cursor, 0), min(load.end - cursor, k.shape[2])
            if lo < hi:
                ks.append(k[:, :, lo:hi])
                vs.append(v[:, :, lo:hi])
            cursor += k.shape[2]
        if cursor < load.end or sum(k.shape[2] for k in ks) != load.end - load.begin:
            raise PlanError(f"records end at {cursor}, the load needs positions up to {load.end}")
        positions = torch.arange(load.begin, load.end, device=device)
        slots = slot_mapping(load.block_ids, load.begin, load.end, self._layout.block_size).to(device)
        return _Part(ks, vs, positions, slots)

    def _on_device(self, tenant_id: str, record_id: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A record's K/V on `device`; kept in a byte-bounded device cache while the stored file is unchanged."""
        key = (tenant_id, record_id)
        stamp = self._store.stamp(tenant_id, record_id)
        hit = self._device_cache.get(key)
        if hit is not None and hit[0] == stamp:
            self._device_cache.move_to_end(key)
            return hit[1], hit[2]
        record = self._store.get(tenant_id, record_id)
        if record.params.model_fingerprint != self._fingerprint:
            raise PlanError(f"fact {record_id!r} was encoded by another model")
        k, v = record.k.to(device, non_blocking=True), record.v.to(device, non_blocking=True)
        if device.type != "cpu":
            self._evict(key)
            self._device_cache[key] = (stamp, k, v)
            self._device_held += record.nbytes
            while self._device_held > self._device_cache_bytes and len(self._device_cache) > 1:
                self._evict(next(iter(self._device_cache)))
        return k, v

    def _evict(self, key: tuple[str, str]) -> None:
        hit = self._device_cache.pop(key, None)
        if hit is not None:
            self._device_held -= hit[1].numel() * hit[1].element_size() * 2

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
