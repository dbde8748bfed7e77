"""A question's search in the copy beside the query embedder, captured as a CUDA graph: one host call, not ten.

On the question's path every torch call is host time, on a core whose caches the ~30 ms between chats emptied (H100,
2026-12-07: the launch took 1.84 ms of host time in the serving run, against 0.36 back to back). Launched call by
call, a search is the query's reshape, the product, the top-k and three copies into pinned memory, each allocating.
Captured once for a tenant's matrix, the question's row of the embedder's output (a captured graph's buffer, at one
address every call) and a top-k size, it is one replay that also brings the question's vector back to the host.

A graph reads the tenant's matrix where it was captured: rows written in place (upserts, removals) are seen, and a
matrix that grew (a new tensor) makes the graph stale; it is captured again at its next use. The graphs of one copy
share a memory pool, which is safe because they replay one after another on one stream, never at once.

A caller that must not stall (an event loop: a capture takes ~1 ms or more, with its pinned buffers) plans without
capturing: a missing graph is noted and the plan refused, the batch is searched call by call, and
`capture_wanted` captures the noted graphs in another thread (thread-local capture leaves other threads free to
launch and replay). A graph is kept only where its tenant's index is still the copy's when it is done. One limit
of capturing beside a working thread, as the query embedder's own captures already do: should that thread's
allocation find the device full while a capture is under way, PyTorch's allocator cannot free its cache then and
fails that allocation (the batch fails; the next one runs).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from tenants.vector_index import ExactIndex

log = logging.getLogger(__name__)


class SearchGraph:
    """One tenant's top-`k` search of one query buffer, with its results and the query copied to pinned memory."""

    def __init__(self, index: ExactIndex, query: torch.Tensor, k: int, pool: tuple, stream: torch.cuda.Stream) -> None:
        """`query`: `[dim]` on the device, the buffer every replay reads; `stream`: a side stream to capture on."""
        self.matrix, self.floor = index.storage  # held: the graph reads them where they are
        self.query, self.k = query, k
        self.scores = torch.empty(k, dtype=torch.float32).pin_memory()
        self.rows = torch.empty(k, dtype=torch.long).pin_memory()
        self.vector = torch.empty(query.shape[0], dtype=torch.float32).pin_memory()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):  # no device work is done by a capture: nothing to order against
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # other threads use the device
            try:
                top = torch.topk(torch.addmv(self.floor, self.matrix, query), k)  # free rows score -inf
                self.scores.copy_(top.values, non_blocking=True)
                self.rows.copy_(top.indices, non_blocking=True)
                self.vector.copy_(query, non_blocking=True)
            finally:
                self.graph.capture_end()

    def current(self, index: ExactIndex) -> bool:
        """Whether the index's matrix is still the one captured (it has not grown since)."""
        matrix, floor = index.storage
        return matrix is self.matrix and floor is self.floor

    def read(self, index: ExactIndex, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `n` (<= k), copied out of the pinned buffers, once the replay has landed."""
        scores = self.scores.numpy()[:n].copy()
        return scores, index.ids_at(self.rows.numpy()[:n])


@dataclass(frozen=True)
class _Planned:
    index: ExactIndex
    graph: SearchGraph
    n: int  # results to read: the question's k, or fewer where the tenant holds fewer


@dataclass(frozen=True)
class _Wanted:
    """A graph a plan found missing or stale, to capture off the caller's thread."""

    tenant_id: str
    index: ExactIndex
    query: torch.Tensor  # the row of the query buffer it reads
    key: tuple[int, int]  # (the row's address, top-k size)


class SearchGraphs:
    """A copy's captured searches, by tenant and then by (query buffer, top-k size); dropped with their tenant."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        self._by_tenant: dict[str, dict[tuple[int, int], SearchGraph]] = {}
        self._wanted: dict[tuple[str, tuple[int, int]], _Wanted] = {}
        self._lock = threading.Lock()  # held briefly, never over a capture: the dicts shared with a capturing thread
        self._warmed = False

    @property
    def wanted(self) -> bool:
        """Whether a plan that did not capture found graphs missing (`capture_wanted` captures them)."""
        return bool(self._wanted)

    def forget(self, tenant_id: str | None = None) -> None:
        """A tenant's graphs (every tenant's with None) go: its copy was replaced or dropped."""
        with self._lock:
            if tenant_id is None:
                self._by_tenant.clear()
                self._wanted.clear()
            else:
                self._by_tenant.pop(tenant_id, None)
                self._wanted = {key: w for key, w in self._wanted.items() if w.tenant_id != tenant_id}

    def plan(
        self, indexes: Sequence[tuple[str, ExactIndex, int]], queries: torch.Tensor, capture: bool = True
    ) -> Callable[[], Callable[[], tuple[torch.Tensor, list[tuple[np.ndarray, np.ndarray]]]]] | None:
        """For question `i` (tenant, its index, k) searching row `i` of `queries` (a buffer at a fixed address):
        the launch of their replays, which returns the read of (the vectors on the host, each question's hits)
        once the stream has passed the replays. None where a question finds its tenant empty (nothing to capture).
        Graphs missing or stale are captured now, before anything is launched; without `capture`, they are noted
        for `capture_wanted` and the plan is None."""
        planned, missing = [], False
        for row, (tenant_id, index, k) in enumerate(indexes):
            n = min(k, len(index))
            if n <= 0:
                return None
            graph = self._graph(tenant_id, index, queries, row, n, capture)
            if graph is None:
                missing = True  # the others are noted too: one capture job takes them all
            elif not missing:
                planned.append(_Planned(index, graph, n))
        if missing:
            return None

        def launch() -> Callable[[], tuple[torch.Tensor, list[tuple[np.ndarray, np.ndarray]]]]:
            for p in planned:
                p.graph.graph.replay()
            return lambda: (
                torch.from_numpy(np.stack([p.graph.vector.numpy() for p in planned])),
                [p.graph.read(p.index, p.n) for p in planned],
            )

        return launch

    def capture_wanted(self, still_held: Callable[[str, ExactIndex], bool]) -> int:
        """Capture the graphs plans noted as missing (in a thread other than the planner's); one is kept only where
        `still_held(tenant, index)`, asked under the lock that `forget` takes. Returns how many were kept."""
        kept = 0
        while True:
            with self._lock:
                if not self._wanted:
                    return kept
                _, wanted = self._wanted.popitem()
            if not still_held(wanted.tenant_id, wanted.index):
                continue
            graph = self._capture(wanted.index, wanted.query, wanted.key[1])
            with self._lock:
                if still_held(wanted.tenant_id, wanted.index):
                    self._store(wanted.tenant_id, wanted.index, wanted.key, graph)
                    kept += 1

    def _graph(
        self, tenant_id: str, index: ExactIndex, queries: torch.Tensor, row: int, n: int, capture: bool = True
    ) -> SearchGraph | None:
        """The tenant's graph for row `row` of this query buffer and a top-k of at least `n` (a power of two, at most
        the matrix's rows, so a few sizes serve every k), or None where it is missing and not to be captured here
        (noted instead). Found by the row's address, with no tensor made: on the question's path each torch call
        counts."""
        rows = index.storage[0].shape[0]
        k = min(1 << (n - 1).bit_length(), rows)
        graphs = self._by_tenant.get(tenant_id)
        key = (queries.data_ptr() + row * queries.stride(0) * queries.element_size(), k)
        graph = graphs.get(key) if graphs is not None else None
        if graph is not None and graph.current(index):
            return graph
        if not capture:
            with self._lock:
                self._wanted[(tenant_id, key)] = _Wanted(tenant_id, index, queries[row], key)
            return None
        graph = self._capture(index, queries[row], k)
        self._store(tenant_id, index, key, graph)
        return graph

    def _store(self, tenant_id: str, index: ExactIndex, key: tuple[int, int], graph: SearchGraph) -> None:
        """Keep `graph` among the tenant's, whose graphs over an older matrix (the index grew since) go."""
        graphs = self._by_tenant.setdefault(tenant_id, {})
        if any(not g.current(index) for g in graphs.values()):
            graphs.clear()
        graphs[key] = graph

    def _capture(self, index: ExactIndex, query: torch.Tensor, k: int) -> SearchGraph:
        self._warm(index, query)
        graph = SearchGraph(index, query, k, self._pool, self._stream)
        log.debug("captured a search graph (k %d over %d rows)", k, index.storage[0].shape[0])
        return graph

    def _warm(self, index: ExactIndex, query: torch.Tensor) -> None:
        """Once per copy: the product and top-k run eagerly on the capture stream first, so their libraries'
        per-stream state (cuBLAS's handle and workspace) exists before a capture. Its result is dropped, so it is
        ordered after nothing: the matrix and the query may be mid-write on the stream that searches them."""
        if self._warmed:
            return
        with torch.cuda.stream(self._stream):
            matrix, floor = index.storage
            torch.topk(torch.addmv(floor, matrix, query), 1)
        self._stream.synchronize()  # done before the capture that follows on this stream
        self._warmed = True
