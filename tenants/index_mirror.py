"""A copy of tenants' retrieval vectors where questions are embedded, so a chat's search runs beside its forward.

The ingress embeds questions in a process of its own, on the GPU where there is one. Its own search read the
tenant's host matrix after the embedding came back: on the H200 host that took 0.41 ms inside the serving run,
a matrix gone cold in the ~30 ms between chats, against ~0.05 ms repeated at once. Searched where the question's
vector is, right after its forward, the product is a few µs of device time and the reply carries ids and scores.

`TenantIndexes` (the ingress's, kept current from Redis's change log) stays the source of truth. It hands each
tenant's changes since the copy last saw it, or the whole tenant, ahead of the questions that search it, in the
same ordered stream, so a search sees every change committed before its batch started. `MirrorLedger` is the
owner's account of what the copy holds (within a byte budget, least recently used tenants dropped first);
`MirrorIndexes` is the copy. The owner checks each answer against the tenant's generation and searches its own
matrix when the tenant changed meanwhile or the copy did not search (no room, a restarted process).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch

from tenants.search_graphs import SearchGraphs
from tenants.vector_index import ExactIndex

log = logging.getLogger(__name__)
UpdateKind = Literal["snapshot", "upsert", "remove", "drop", "clear"]
_COUNT = struct.Struct("<i")
CAPTURE_BACKOFF_S = 10.0  # after a capture found the device full, noted graphs wait this long
Hits = list["tuple[np.ndarray, np.ndarray] | None"]  # per question (scores, ids), None where it was not searched


@dataclass(frozen=True)
class IndexUpdate:
    """One change to a tenant's copy: its whole content (`snapshot`), rows added or replaced, rows removed, the
    tenant dropped from the copy, or every tenant dropped (`clear`: the owner lost track of what the copy holds)."""

    tenant_id: str
    kind: UpdateKind
    ids: np.ndarray  # int64 [n]
    vectors: np.ndarray | None = None  # float32 [n, dim]: snapshot and upsert

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (self.vectors.nbytes if self.vectors is not None else 0)


@dataclass(frozen=True)
class SearchAsk:
    """A question's search: its tenant and how many facts."""

    tenant_id: str
    k: int


@dataclass(frozen=True)
class Found:
    """What the copy found for one question, best first, and the generation of the tenant's vectors it searched."""

    scores: np.ndarray
    ids: np.ndarray
    generation: int


class MirrorIndexes:
    """The copy: one `ExactIndex` per tenant on `device`, changed by updates in their order, searched in batches.
    `graphs`: on a CUDA device, each tenant's search is captured as a CUDA graph for `replay_plan`."""

    def __init__(self, device: str | torch.device = "cpu", graphs: bool = False) -> None:
        self.device = torch.device(device)
        self._indexes: dict[str, ExactIndex] = {}
        self._graphs = SearchGraphs(self.device) if graphs and self.device.type == "cuda" else None
        self._capture_after = 0.0  # monotonic time before which noted graphs are not captured (a full device)

    def __contains__(self, tenant_id: str) -> bool:
        return tenant_id in self._indexes

    def clear(self) -> None:
        self._indexes.clear()
        graphs = self._graphs  # read once: the capture thread may turn them off meanwhile
        if graphs is not None:
            graphs.forget()

    def apply(self, updates: Sequence[IndexUpdate]) -> None:
        """Changes for a tenant the copy does not hold are skipped: its searches then answer None, and the owner
        searches itself (and sends the whole tenant next time)."""
        for update in updates:
            if update.kind == "clear":
                self.clear()
                continue
            if update.kind in ("drop", "snapshot"):
                self._replace(update)
            elif (index := self._indexes.get(update.tenant_id)) is not None:
                if update.kind == "upsert":
                    index.upsert(update.ids, update.vectors)
                else:
                    index.remove(update.ids)

    def _replace(self, update: IndexUpdate) -> None:
        """A tenant's copy dropped or sent whole, then its graphs forgotten: in that order, a capture in another
        thread keeps its graph only for the index held now (`SearchGraphs.capture_wanted`)."""
        if update.kind == "drop":
            self._indexes.pop(update.tenant_id, None)
        else:
            assert update.vectors is not None
            index = ExactIndex(update.vectors.shape[1], self.device, capacity=len(update.ids))
            index.upsert(update.ids, update.vectors)
            self._indexes[update.tenant_id] = index
        graphs = self._graphs
        if graphs is not None:
            graphs.forget(update.tenant_id)

    def replay_plan(
        self, queries: torch.Tensor | None, asks: Sequence[SearchAsk | None], capture: bool = True
    ) -> "Callable[[], Callable[[], tuple[torch.Tensor, Hits]]] | None":
        """Where every question asks for a tenant the copy holds, and `queries` (`[questions, dim]`, the captured
        embedder's output buffer, at one address every call) is given: the launch of their searches as captured
        graphs, each bringing its question's vector and hits to pinned memory (`SearchGraphs.plan`). None where
        any question cannot, or the graphs are off; a capture the driver refuses turns them off, logged. Without
        `capture` (an event loop's call), graphs not captured yet are left to `capture_wanted` and the plan is None."""
        graphs = self._graphs
        if graphs is None or queries is None or not asks:
            return None
        indexes = []
        for ask in asks:
            index = self._indexes.get(ask.tenant_id) if ask is not None else None
            if index is None:
                return None
            indexes.append((ask.tenant_id, index, ask.k))  # type: ignore[union-attr]
        try:
            return graphs.plan(indexes, queries, capture)  # type: ignore[return-value]
        except torch.OutOfMemoryError:
            raise  # a full device, for now: the caller's copy fails, and is started over smaller
        except Exception as exc:  # noqa: BLE001 - a capture refused: the searches are launched call by call
            self._graphs_failed(exc)
            return None

    @property
    def wants_captures(self) -> bool:
        """Whether plans made without capturing left graphs for `capture_wanted` (not for a while after a capture
        found the device full)."""
        graphs = self._graphs  # read once: the capture thread may turn them off meanwhile
        return graphs is not None and graphs.wanted and time.monotonic() >= self._capture_after

    def capture_wanted(self) -> None:
        """Capture the graphs that plans without capture found missing, here (a thread beside the event loop that
        plans); one whose tenant's copy changed meanwhile is dropped. A full device leaves them for
        `CAPTURE_BACKOFF_S`, searched call by call meanwhile."""
        graphs = self._graphs
        if graphs is None:
            return
        try:
            kept = graphs.capture_wanted(lambda tenant_id, index: self._indexes.get(tenant_id) is index)
            log.debug("captured %d search graphs off the loop", kept)
        except torch.OutOfMemoryError:
            self._capture_after = time.monotonic() + CAPTURE_BACKOFF_S
            log.warning(
                "no device memory to capture a tenant's search as a CUDA graph; searched call by call for %g s",
                CAPTURE_BACKOFF_S,
            )
        except Exception as exc:  # noqa: BLE001 - a capture refused: the searches are launched call by call
            self._graphs_failed(exc)

    def _graphs_failed(self, exc: Exception) -> None:
        log.warning("capturing a tenant's search as a CUDA graph failed (%s); searching without graphs", exc)
        self._graphs = None

    def search(self, vectors: torch.Tensor, asks: Sequence[SearchAsk | None]) -> Hits:
        """Per question (row of `vectors`), (scores, ids) of its tenant's nearest, or None where it asked for no
        search or the copy does not hold its tenant; every top-k stays on the device until one read-back."""
        return self.search_started(vectors, asks)()

    def search_started(
        self, vectors: torch.Tensor, asks: Sequence[SearchAsk | None], caller_waits: bool = False
    ) -> "Callable[[], Hits]":
        """`search` with its read-back started and not waited for: the call returned makes the hits once the
        device's stream has reached this point (on a CUDA copy the host copies land in pinned memory). With
        `caller_waits`, no event of its own: the caller has the host wait for the stream past this point (an event
        it records after its own copies) before it calls it, one event where there were two."""
        tops: list[tuple[ExactIndex, int] | None] = []
        values, rows = [], []
        for vector, ask in zip(vectors, asks):
            index = self._indexes.get(ask.tenant_id) if ask is not None else None
            if index is None:
                tops.append(None)
                continue
            scores, top = index.top_rows(vector, ask.k)  # type: ignore[union-attr]
            tops.append((index, scores.shape[0]))
            values.append(scores)  # float32, as the index's vectors
            rows.append(top)
        if not values:
            return lambda: [None] * len(tops)
        on_host = self.device.type == "cpu"
        if len(values) == 1:  # one question: nothing to join (each operation is a host call on its path)
            scores_on, rows_on = values[0], rows[0]
        else:
            scores_on, rows_on = torch.cat(values), torch.cat(rows)
        scores_back = scores_on.to("cpu", non_blocking=not on_host)  # pinned where non-blocking
        rows_back = rows_on.to("cpu", non_blocking=not on_host)

        def hits() -> Hits:
            scores, found_rows = scores_back.numpy(), rows_back.numpy()
            out: Hits = []
            at = 0
            for top in tops:
                if top is None:
                    out.append(None)
                    continue
                index, n = top
                out.append((scores[at : at + n], index.ids_at(found_rows[at : at + n])))
                at += n
            return out

        if on_host or caller_waits:
            return hits
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.device))

        def hits_landed() -> Hits:
            landed.synchronize()
            return hits()

        return hits_landed


def copy_bytes(rows: int, dim: int) -> int:
    """What a tenant of `rows` vectors costs the copy: its matrix at the capacity it will have grown to (built at
    its size, doubled as rows come), the live mask and the row ids, with a floor for a tenant's own overhead."""
    capacity = 1 << max(4, (max(rows, 1) - 1).bit_length())
    return capacity * (dim * 4 + 1 + 8) + 4096


class MirrorLedger:
    """The owner's account of the copy: which tenants it holds, by last use, within `budget_bytes`. `reset` when
    the copy is new (its process restarted): everything is sent whole again."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._held: OrderedDict[str, int] = OrderedDict()  # tenant -> bytes, least recently used first
        self.held_bytes = 0

    def holds(self, tenant_id: str) -> bool:
        return tenant_id in self._held

    def reset(self) -> None:
        self._held.clear()
        self.held_bytes = 0

    def admit(self, tenant_id: str, nbytes: int, keep: set[str]) -> tuple[bool, list[IndexUpdate]]:
        """Count `tenant_id` as held (and just used) at `nbytes`: whether it fits, and the drops to send first,
        the least recently used tenants not in `keep` that make room for it, or, where nothing makes enough, the
        tenant's own older copy."""
        self.forget(tenant_id)
        free = self.budget_bytes - self.held_bytes + sum(b for t, b in self._held.items() if t not in keep)
        if nbytes > free:
            return False, [_drop(tenant_id)]
        drops = []
        for other in [t for t in self._held if t not in keep]:
            if self.held_bytes + nbytes <= self.budget_bytes:
                break
            self.forget(other)
            drops.append(_drop(other))
        self._held[tenant_id] = nbytes
        self.held_bytes += nbytes
        return True, drops

    def forget(self, tenant_id: str) -> None:
        """Count it as not held: it is sent whole next time."""
        self.held_bytes -= self._held.pop(tenant_id, 0)


def _drop(tenant_id: str) -> IndexUpdate:
    return IndexUpdate(tenant_id, "drop", np.empty(0, np.int64))


CLEAR = IndexUpdate("", "clear", np.empty(0, np.int64))  # every tenant out of the copy


def pack_updates(updates: Sequence[IndexUpdate]) -> tuple[list[list], bytes]:
    """Each update's header ([tenant, kind, rows, dim]) and their ids and vectors as one blob, in order."""
    headers, parts = [], []
    for u in updates:
        dim = u.vectors.shape[1] if u.vectors is not None else 0
        headers.append([u.tenant_id, u.kind, len(u.ids), dim])
        parts.append(np.ascontiguousarray(u.ids, dtype=np.int64).tobytes())
        if u.vectors is not None:
            parts.append(np.ascontiguousarray(u.vectors, dtype=np.float32).tobytes())
    return headers, b"".join(parts)


def unpack_updates(headers: list[list], blob: bytes | memoryview) -> list[IndexUpdate]:
    updates, at = [], 0
    for tenant_id, kind, rows, dim in headers:
        ids = np.frombuffer(blob, dtype=np.int64, count=rows, offset=at).copy()  # writable, as torch wants
        at += ids.nbytes
        vectors = None
        if kind in ("snapshot", "upsert"):
            vectors = np.frombuffer(blob, dtype=np.float32, count=rows * dim, offset=at).reshape(rows, dim).copy()
            at += vectors.nbytes
        updates.append(IndexUpdate(tenant_id, kind, ids, vectors))
    return updates


def pack_hits(hits: Hits) -> bytes:
    """Per question its count (-1: no search), then every score, then every id."""
    counts = b"".join(_COUNT.pack(-1 if h is None else len(h[0])) for h in hits)
    scores = b"".join(np.asarray(h[0], dtype=np.float32).tobytes() for h in hits if h is not None)
    ids = b"".join(np.asarray(h[1], dtype=np.int64).tobytes() for h in hits if h is not None)
    return counts + scores + ids


def unpack_hits(data: bytes | memoryview, questions: int) -> Hits:
    counts = [_COUNT.unpack_from(data, i * _COUNT.size)[0] for i in range(questions)]
    total = sum(c for c in counts if c > 0)
    at = questions * _COUNT.size
    scores = np.frombuffer(data, dtype=np.float32, count=total, offset=at)
    ids = np.frombuffer(data, dtype=np.int64, count=total, offset=at + scores.nbytes)
    out: Hits = []
    start = 0
    for count in counts:
        if count < 0:
            out.append(None)
        else:
            out.append((scores[start : start + count], ids[start : start + count]))
            start += count
    return out
