"""Encoding with the serving engine: keep the K/V the engine itself computed for chosen prompt spans.

Records encoded by another implementation of the same model (transformers, say) differ from the
engine's own K/V by kernel rounding, which in bf16 flips greedy tokens now and then. Capturing from
the engine's paged cache after a normal prefill gives records with exactly the engine's numerics.

Scheduler half (`CaptureTracker`): remembers which requests carry a `CapturePlan`, follows their
blocks across (possibly chunked) prefill steps, and hands the worker a `CaptureSpec` in the step
that completes the last span. Worker half (`CaptureWorker`): after each layer's attention it reads
the spans' K/V back from the paged cache; once every layer is in, it undoes the engine's rotation
exactly (the inverse of the rounded cos/sin table, in float32) and stores one record per span, in
float32 so that re-rotating to the same position reproduces the cached values bit for bit. It relies
only on the per-layer save hook, not on when the engine calls `start_load_kv` (vLLM 0.32 calls it
after the forward in steps without synchronous loads). With a `record_dtype` (the engine's bf16, say) the
pre-RoPE keys and the values are rounded to it once, after the exact inverse rotation: half the bytes in
every tier, at the cost of that rounding (`benchmarks/injection_equivalence.py` measures what it does to answers).
Where the store holds int8 records (its `precision`), the spans are quantized on the device before they cross to
the host, and the hot copy handed to `on_stored` is those codes, still on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvcore.errors import KVCoreError
from kvcore.paged import PagedLayout, slot_mapping
from kvcore.plan import CapturePlan
from kvcore.quantize import Quantized, quantize_many
from kvcore.record import EncodingParams, FactKV, dtype_name
from kvcore.rope import RopeConfig, apply_rotation, cos_sin, table_dtype_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureSpec:
    """A capture to perform in this step: the plan, the prompt's token ids and its blocks from 0."""

    request_id: str
    plan: CapturePlan
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class _Pending:
    plan: CapturePlan
    token_ids: tuple[int, ...]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class CaptureTracker:
    """Scheduler-side: which requests capture, and when their spans are all in the cache."""

    _pending: dict[str, _Pending] = field(default_factory=dict)

    def add(self, request_id: str, plan: CapturePlan, prompt_ids: Sequence[int]) -> None:
        if plan.end > len(prompt_ids):
            log.warning(
                "request %s: capture spans end at %d, past the prompt (%d)", request_id, plan.end, len(prompt_ids)
            )
            return
        self._pending.setdefault(request_id, _Pending(plan, tuple(prompt_ids)))

    def __bool__(self) -> bool:
        """Whether any request still waits for its spans (serving traffic alone: never)."""
        return bool(self._pending)

    def step(self, scheduled: Sequence[tuple[str, Sequence[int] | None, int, int]]) -> list[CaptureSpec]:
        """`scheduled`: (request id, newly allocated block ids, tokens computed before, tokens this step)."""
        ready = []
        for request_id, new_blocks, computed, count in scheduled:
            pending = self._pending.get(request_id)
            if pending is None:
                continue
            pending.block_ids.extend(new_blocks or ())
            if computed + count >= pending.plan.end:
                ready.append(CaptureSpec(request_id, pending.plan, pending.token_ids, tuple(pending.block_ids)))
                del self._pending[request_id]
        return ready

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)


RELEASE_BYTES = 256 << 20  # captures this large give their cached device blocks back (a fact's are ~MBs)
WRITE_GROUP = 64  # records written (and fsynced) together: a 32k-token history is 2,048 of them

# (tenant id, [(record id, the stored file's stamp, K, V on the device)]): a write group just stored, handed on
# while its K/V are still on the device (the injector keeps them hot: whoever wrote them is about to ask for them)
Stored = Callable[[str, list[tuple[str, tuple[int, ...], torch.Tensor | Quantized, torch.Tensor | Quantized]]], None]


@dataclass
class _Arriving:
    """A capture whose layers are arriving: each is un-rotated into the record's dtype as it comes, so the
    capture never holds more than its records' own bytes (a 32k-token history of an 8B model: 4.3 GB in bf16,
    against ~34 GB when all layers were kept, stacked and un-rotated in float32 at the end)."""

    spec: CaptureSpec
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    seen: list[bool]
    k: torch.Tensor | None = None  # [L, H, T, D], pre-RoPE
    v: torch.Tensor | None = None


class CaptureWorker:
    """Worker-side: read spans from the paged cache layer by layer, store them as records."""

    def __init__(
        self,
        store,
        fingerprint: str,
        rope: RopeConfig,
        record_dtype: torch.dtype | None = torch.float32,
        on_stored: Stored | None = None,
    ) -> None:
        """`record_dtype`: what records are stored in; None: the engine cache's own dtype; `on_stored` gets the
        records of a plan that asks to keep them hot a write group at a time, once their files are written, with
        each file's stamp and the K/V still on the device (a fact's capture is stored under a scratch name first:
        nothing to keep hot)."""
        self._store = store
        self._on_stored = on_stored
        self._record_dtype = record_dtype
        self._fingerprint = fingerprint
        self._rope = rope
        self._layout: PagedLayout | None = None
        self._layer_of: dict[str, int] = {}
        self._active: dict[str, _Arriving] = {}
        self._dropped: set[str] = set()  # captures of this step the device had no room for
        self._release = False  # a large capture ended this step: give the cached blocks back at its end

    def register(self, layer_of: dict[str, int], layout: PagedLayout) -> None:
        self._layer_of, self._layout = dict(layer_of), layout

    def save_layer(self, layer_name: str, cache: torch.Tensor, captures: Sequence[CaptureSpec]) -> None:
        """Read this layer's spans of every capture of the step; store the captures that are complete. A capture
        the device has no room for is dropped (no record written: its history write answers 503), never raised
        into the engine's forward, which would end the engine."""
        index = self._layer_of.get(layer_name)
        if index is None:
            return
        for spec in captures:
            if spec.request_id in self._dropped:
                continue
            try:
                self._save(spec, index, cache)
            except torch.OutOfMemoryError:
                log.error("request %s: no device memory for its capture; no record written", spec.request_id)
                self._active.pop(spec.request_id, None)
                self._dropped.add(spec.request_id)
                self._release = True

    def _save(self, spec: CaptureSpec, index: int, cache: torch.Tensor) -> None:
        arriving = self._active.get(spec.request_id) or self._start(spec, cache.device)
        k, v = self._layout.gather(cache, arriving.slots)  # [H, T, D], post-RoPE as the engine stored them
        if arriving.k is None:
            dtype, layers = self._record_dtype or k.dtype, len(self._layer_of)
            arriving.k = torch.empty((layers, *k.shape), dtype=dtype, device=k.device)
            arriving.v = torch.empty((layers, *v.shape), dtype=dtype, device=v.device)
        table = table_dtype_of(k.dtype)  # float32 math and result, rounded once into the record's dtype
        arriving.k[index] = apply_rotation(
            k.float(), arriving.cos, arriving.sin, self._rope, table_dtype=table, invert=True
        )
        arriving.v[index] = v
        arriving.seen[index] = True
        if all(arriving.seen):
            del self._active[spec.request_id]
            self._finish(arriving)
            big = arriving.k.is_cuda and arriving.k.nbytes + arriving.v.nbytes >= RELEASE_BYTES
            self._release = self._release or big

    def end_step(self) -> None:
        """Captures still incomplete at the end of their step never will be: drop them loudly. After a large
        capture (a history), the device's cached blocks go back to it, for the other processes that share it."""
        for request_id in list(self._active):
            log.error("request %s: capture saw only some layers; no record written", request_id)
        self._active.clear()
        self._dropped.clear()
        if self._release:
            self._release = False
            torch.cuda.empty_cache()

    def _start(self, spec: CaptureSpec, device: torch.device) -> _Arriving:
        slots = slot_mapping(spec.block_ids, 0, spec.plan.end, self._layout.block_size).to(device)
        cos, sin = cos_sin(torch.arange(spec.plan.end, device=device), self._rope)
        arriving = _Arriving(spec, slots, cos, sin, [False] * len(self._layer_of))
        self._active[spec.request_id] = arriving
        return arriving

    def _finish(self, arriving: _Arriving) -> None:
        try:
            self._store_spec(arriving.spec, arriving.k, arriving.v)
        except (KVCoreError, OSError, RuntimeError) as exc:
            log.error("request %s: capture failed (%s); no record written", arriving.spec.request_id, exc)

    def _store_spec(self, spec: CaptureSpec, pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        """Write the spans of a whole capture (`pre_rope`, `v`: [L, H, T, D] in the record dtype) as records."""
        dtype = pre_rope.dtype
        params = EncodingParams(
            window=spec.plan.window, model_fingerprint=self._fingerprint, rope=self._rope, dtype=dtype_name(dtype)
        )
        tenant, spans = spec.plan.tenant_id, spec.plan.spans
        coded = self._store.precision == "int8"  # the store's setting, read once a capture
        for first in range(0, len(spans), WRITE_GROUP):  # a group's files and their fsyncs go out together
            group = spans[first : first + WRITE_GROUP]
            kv = [(pre_rope[:, :, s.begin : s.end].contiguous(), v[:, :, s.begin : s.end].contiguous()) for s in group]
            stored, kv = _coded(kv) if coded else ([(k.cpu(), v.cpu()) for k, v in kv], kv)
            self._store.put_many(
                [
                    FactKV(
                        tenant_id=tenant,
                        fact_id=span.fact_id,
                        token_ids=spec.token_ids[span.begin : span.end],
                        k=k_span,
                        v=v_span,
                        params=params,
                        version=spec.plan.version,
                        meta={"encoder": "engine", "position": str(span.begin)},
                    )
                    for span, (k_span, v_span) in zip(group, stored)
                ]
            )
            if self._on_stored is not None and spec.plan.keep_hot:
                self._on_stored(
                    tenant,
                    [(span.fact_id, self._store.stamp(tenant, span.fact_id), *pair) for span, pair in zip(group, kv)],
                )
        if len(spans) > WRITE_GROUP:  # the earlier groups' headers, known at their own write's marker
            self._store.revalidate(tenant, [span.fact_id for span in spans])


def _coded(
    kv: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[tuple[Quantized, Quantized]], list[tuple[Quantized, Quantized]]]:
    """Spans' K/V as int8 codes for the store, quantized where they lie (on the device: a quarter of float32's
    bytes cross to the host), and the same codes where they lie as the hot copy: the arena decodes them, or keeps
    them as they are, so a fact answers the same from the arena as from its file."""
    codes = list(zip(quantize_many([k for k, _ in kv]), quantize_many([v for _, v in kv])))
    return [(k.to("cpu"), v.to("cpu")) for k, v in codes], codes
