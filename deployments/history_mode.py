"""History mode in an LLM replica: a tenant's captured history, and the chunks one question attends to.

The engine captures a history as chunk records (`kvcore/history_index.py`); this keeps each history's index (chunk
spans, record ids, early-layer summaries) in memory, rebuilt from the record store when a replica first meets it,
and runs the question's own pass through the model's first layers from the served checkpoint
(`models/early_layers.py`, loaded on first use) to choose the chunks within a request's budget: up to half of it
to the chunks of the turns whose retrieval embedding (MiniLM, as facts are retrieved) is nearest the question's, the
rest by the summaries' bounds (`docs/history-selection.md`: the bounds alone miss evidence that retrieval finds).
A turn is a line of the history (its speaker and what was said). The chosen chunks become memory items in position
order, injected at contiguous positions after the chat frame.

On a GPU replica the question's pass (bf16), the turns' embeddings and the indexes' summaries live on the GPU: the
bounds of a 32k-token history's 2,048 chunks at the 8B shape are ~10^9 multiply-adds, seconds on a CPU core. There
the question's pass and the chunks' order are CUDA graph replays (`deployments/choice_graphs.py`), retrieval's half
runs on a second stream beside them, and nothing in a question's path reads a value back before the selection.
Each choice reports its pieces' times (`Choice`), so a chat's usage says what choosing cost it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from deployments.app_args import SCORING_LAYERS
from deployments.choice_graphs import BOUNDS_ACCUMULATE, OrderGraphs, QuestionPass, RetrievalGraph
from deployments.memory_prompt import MemoryItem
from deployments.triton_adapter import optional_kernel
from kvcore.history import MaxBounds, Span
from kvcore.history_index import HistoryIndex, chunk_prefix
from kvcore.query_pass import EarlyLayers
from kvcore.record import FactKV
from kvcore.store import LocalFactStore
from kvcore.summaries import max_upper_bounds
from models.early_layers import load_early_layers
from models.minilm import MiniLMEmbedder

log = logging.getLogger(__name__)

CACHED_INDEX_BYTES = 2 << 30  # what a replica's kept indexes may take (~42 MB each: a 32k-token history, 8B shape)

# The wall's pieces, one after another on the host: the index and the question's tokens; the question's pass and the
# chunks' order queued; retrieval queued while the device runs them (the question's embedding: its tokens and graph
# replay; then the turns' similarities and the chunks' order by them); the selection (it waits for the device); the
# memory items
HOST_PARTS = ("prepare", "order", "embed", "similarity", "select", "items")


@dataclass(frozen=True)
class Choice:
    """The chunks chosen for a question, as memory items in position order, and what each step took (ms)."""

    items: list[MemoryItem]
    index_ms: float  # the history's index: from memory, or rebuilt from its chunk records
    question_ms: float  # the question's pass through the first layers
    retrieval_ms: float  # its embedding and the turns' similarities
    bounds_ms: float  # every chunk's bound and the chunks' order by them (queued on a GPU)
    selection_ms: float  # the heads of both orders back on the host, and the chunks within the budget
    wall_ms: float  # the whole choice on the host's clock: the steps, waiting for the device, the items
    retrieval_beside: bool = False  # on a GPU retrieval runs on a stream of its own, beside the question's pass
    host_ms: dict[str, float] = field(default_factory=dict)  # the wall's pieces on the host's clock (`HOST_PARTS`)

    def timings(self) -> dict[str, float]:
        """Each step's ms and their `total`: the steps one after another (retrieval only where it did not run
        beside the question's pass); the wall, and its pieces on the host's clock as `host_<piece>`."""
        parts = {"index": self.index_ms, "question": self.question_ms, "retrieval": self.retrieval_ms}
        parts |= {"bounds": self.bounds_ms, "selection": self.selection_ms}
        total = sum(parts.values()) - (self.retrieval_ms if self.retrieval_beside else 0.0)
        every = {**parts, "total": total, "wall": self.wall_ms}
        every |= {f"host_{piece}": ms for piece, ms in self.host_ms.items()}
        return {name: round(ms, 3) for name, ms in every.items()}


class _StepMarks:
    """Times of consecutive steps: host clocks on a CPU; on a GPU events on the current stream, read once the last
    step is done, so timing a step does not make the host wait for the device between steps."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._marks: list = []
        self.mark()

    def mark(self) -> None:
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Each step's ms, from one mark to the next."""
        if self._device.type != "cuda":
            return [(after - before) * 1000 for before, after in zip(self._marks, self._marks[1:])]
        self._marks[-1].synchronize()
        return [before.elapsed_time(after) for before, after in zip(self._marks, self._marks[1:])]


class HistoryError(ValueError):
    """A history that cannot be served (none written, or its chunks are gone)."""


class HistoryChooser:
    """Histories' indexes by (tenant, history id), and the choice of chunks for a question."""

    def __init__(
        self,
        model_dir: Path,
        store: LocalFactStore,
        tokenizer,
        device: str = "cpu",
        cached_bytes: int = CACHED_INDEX_BYTES,
        scoring_layers: int = SCORING_LAYERS,
    ) -> None:
        """`scoring_layers`: the first layers whose queries and summaries score the chunks (`SCORING_LAYERS`)."""
        if scoring_layers < 1:
            raise ValueError("history mode scores with at least one layer")
        self._model_dir, self._store, self._tokenizer = model_dir, store, tokenizer
        self.scoring_layers = scoring_layers
        self.device = torch.device(device)
        self._cached_bytes = cached_bytes
        self._early: EarlyLayers | None = None
        self._question_pass: QuestionPass | None = None
        self._order_graphs: OrderGraphs | None = None
        self._embedder: MiniLMEmbedder | None = None
        self._indexes: OrderedDict[tuple[str, str], HistoryIndex] = OrderedDict()
        self._items: dict[tuple[str, str], tuple[HistoryIndex, list[MemoryItem]]] = {}  # `_chunk_items`, per kept index
        self._retrievals: dict[tuple[str, str], tuple[HistoryIndex, RetrievalGraph | None]] = {}  # per kept index
        self._lock = threading.Lock()  # the choice runs in worker threads
        self._bounds = chunk_bounds_for(self.device)
        self._side: torch.cuda.Stream | None = None  # a GPU chooser's second stream (`_beside`)

    @property
    def early(self) -> EarlyLayers:
        with self._lock:
            if self._early is None:
                dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16  # as the engine computes
                self._early = load_early_layers(self._model_dir, self.scoring_layers, dtype, str(self.device))
            return self._early

    @property
    def question_pass(self) -> QuestionPass:
        early = self.early
        with self._lock:
            if self._question_pass is None:
                self._question_pass = QuestionPass(early)
            return self._question_pass

    @property
    def order_graphs(self) -> OrderGraphs | None:
        """The choice's graphs on a GPU with the bounds kernel (None elsewhere: the eager path)."""
        question_pass, rope = self.question_pass, self.early.rope  # each takes the lock: before it is held here
        with self._lock:
            if self._order_graphs is None and question_pass.graphed:
                inputs = optional_kernel("chunk_bounds", "BoundsInputs")
                if inputs is not None:
                    along = optional_kernel("chunk_bounds", "along_chunks")
                    self._order_graphs = OrderGraphs(question_pass, rope, self.scoring_layers, inputs, along)
            return self._order_graphs

    @property
    def embedder(self) -> MiniLMEmbedder:
        with self._lock:
            if self._embedder is None:
                self._embedder = MiniLMEmbedder(device=str(self.device))
            return self._embedder

    def index_records(self, tenant_id: str, history_id: str, records: list[FactKV]) -> HistoryIndex:
        """Index a history just captured (its records in chunk order), its turns embedded, and keep it."""
        return self._keep((tenant_id, history_id), self._build(records))

    def index(self, tenant_id: str, history_id: str) -> HistoryIndex:
        """The history's index, from memory or rebuilt from its chunk records."""
        key = (tenant_id, history_id)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
        ids = self.chunk_ids(tenant_id, history_id)
        if not ids:
            raise HistoryError(f"the history {history_id} has no chunks in the record store")
        log.info("rebuilding the index of history %s from its %d chunk records", history_id, len(ids))
        return self._keep(key, self._build([self._store.get(tenant_id, r) for r in ids]))

    def choose(self, tenant_id: str, history_id: str, question: str, budget: int) -> Choice:
        """The chunks `question` attends to within `budget` tokens, and what choosing them took.

        On a GPU the question's pass and the chunks' order are two graph replays (`deployments/choice_graphs.py`;
        eager where they do not serve), retrieval runs beside them on a second stream, and only the selection waits
        for the device; each step's time comes from events on the device's timeline.
        """
        began = time.perf_counter()
        index = self.index(tenant_id, history_id)
        index_ms = (time.perf_counter() - began) * 1000
        ids = self._tokenizer.encode(question, add_special_tokens=False) or [self._tokenizer.eos_token_id]
        host = [began, time.perf_counter()]  # the host's clock at the end of each of `HOST_PARTS`
        inputs_ready = self._queued_so_far()  # what the thread queued before (the index, if built just now)
        marks = _StepMarks(self.device)
        graphs = self.order_graphs
        by_mass = graphs.order(index, ids, marks.mark) if graphs is not None else None  # two replays on a GPU
        if by_mass is None:
            queries = self.question_pass(ids)
            marks.mark()
            by_mass = index.mass_order(queries)
            marks.mark()
        host.append(time.perf_counter())
        with self._beside(inputs_ready) as side:  # on a GPU the device runs the order's replays meanwhile
            retrieval = _StepMarks(self.device)
            vector = self.embedder.embed_tensor([question])[0] if question else None
            host.append(time.perf_counter())
            by_retrieval = self._by_retrieval((tenant_id, history_id), index, vector) if vector is not None else []
            retrieval.mark()
        if side is not None:  # the selection reads retrieval's order: the device waits for it, the host does not
            torch.cuda.current_stream(self.device).wait_stream(side)
        marks.mark()  # the order's end to here: the wait for retrieval, not the selection's
        host.append(time.perf_counter())
        chosen = index.select(by_mass, budget, by_retrieval)  # the heads of both orders come back to the host
        marks.mark()
        host.append(time.perf_counter())
        every = self._chunk_items((tenant_id, history_id), index)
        items = [every[c] for c in chosen]
        host.append(time.perf_counter())
        question_ms, bounds_ms, _, selection_ms = marks.spans_ms()
        (retrieval_ms,) = retrieval.spans_ms()
        wall_ms = (time.perf_counter() - began) * 1000
        return Choice(
            items,
            index_ms,
            question_ms,
            retrieval_ms,
            bounds_ms,
            selection_ms,
            wall_ms,
            retrieval_beside=side is not None,
            host_ms={piece: (after - before) * 1000 for piece, before, after in zip(HOST_PARTS, host, host[1:])},
        )

    def _queued_so_far(self) -> torch.cuda.Event | None:
        """On a GPU, an event after what this thread queued so far on its stream; None elsewhere."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def _beside(self, inputs_ready: torch.cuda.Event | None) -> Iterator[torch.cuda.Stream | None]:
        """On a GPU, this chooser's second stream as the current one, after `inputs_ready` but not after what
        the first stream queued since (the question's embedding and the turns' similarities run there while
        the question's pass and the chunks' order run on the first); elsewhere nothing changes."""
        if inputs_ready is None:
            yield None
            return
        with self._lock:
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
        self._side.wait_event(inputs_ready)
        with torch.cuda.stream(self._side):
            yield self._side

    def turn_spans(self, token_ids: tuple[int, ...]) -> list[Span]:
        """The history's lines as token spans: a turn ends with the token that holds its newline."""
        spans, start = [], 0
        for i, text in enumerate(self._tokenizer.batch_decode([[t] for t in token_ids])):
            if "\n" in text:
                spans.append((start, i + 1))
                start = i + 1
        if start < len(token_ids):
            spans.append((start, len(token_ids)))
        return spans

    def _build(self, records: list[FactKV]) -> HistoryIndex:
        """A history's index from its chunk records in order: summaries, then its turns embedded."""
        index = HistoryIndex.of_records(records, self.early.rope, self.scoring_layers, self.device, self._bounds)
        turns = [span for span in self.turn_spans(index.token_ids) if span[1] - span[0] > 1]  # not blank lines
        if not turns:
            return index
        texts = [self._tokenizer.decode(index.token_ids[s:e]).strip() for s, e in turns]
        return index.with_turns(turns, self.embedder.embed_tensor(texts))

    def chunk_ids(self, tenant_id: str, history_id: str) -> list[str]:
        prefix = chunk_prefix(history_id)
        return sorted(r for r in self._store.record_ids(tenant_id) if r.startswith(prefix))

    def _chunk_items(self, key: tuple[str, str], index: HistoryIndex) -> list[MemoryItem]:
        """Every chunk of a kept index as its memory item, built once with the index: a history chat takes ~128 of
        them, and building those each time took 0.28 ms of the choice on the H100's host (2026-12-06)."""
        with self._lock:
            kept = self._items.get(key)
        if kept is not None and kept[0] is index:
            return kept[1]
        items = [MemoryItem(record, index.chunk_tokens(c), record) for c, record in enumerate(index.record_ids)]
        with self._lock:
            if self._indexes.get(key) is index:  # only a kept index keeps its items
                self._items[key] = (index, items)
        return items

    def _by_retrieval(self, key: tuple[str, str], index: HistoryIndex, vector: torch.Tensor) -> torch.Tensor:
        """`index.by_retrieval(vector)`: the kept index's graph replayed on a GPU, else eagerly."""
        with self._lock:
            kept = self._retrievals.get(key)
        graph = kept[1] if kept is not None and kept[0] is index else None
        return graph.order(vector) if graph is not None else index.by_retrieval(vector)

    def drop(self, tenant_id: str, history_id: str) -> int:
        """Forget a history and delete its chunk records; returns how many were deleted."""
        with self._lock:
            self._indexes.pop((tenant_id, history_id), None)
            self._items.pop((tenant_id, history_id), None)
            self._retrievals.pop((tenant_id, history_id), None)
        return sum(self._store.delete(tenant_id, r) for r in self.chunk_ids(tenant_id, history_id))

    def _keep(self, key: tuple[str, str], index: HistoryIndex) -> HistoryIndex:
        with self._lock:
            self._indexes[key] = index
            self._indexes.move_to_end(key)
            held = sum(i.nbytes for i in self._indexes.values())
            while held > self._cached_bytes and len(self._indexes) > 1:  # the newest always stays
                gone, dropped = self._indexes.popitem(last=False)
                self._items.pop(gone, None)
                self._retrievals.pop(gone, None)
                held -= dropped.nbytes
        self._chunk_items(key, index)  # here, not in its first question's path
        graph = RetrievalGraph.for_index(index)  # likewise (None: retrieval stays eager)
        with self._lock:
            if self._indexes.get(key) is index:
                self._retrievals[key] = (index, graph)
        return index


def chunk_bounds_for(device: torch.device) -> MaxBounds:
    """The fused Triton kernel for the chunks' bounds on a GPU (one launch, where torch writes and reads back a
    float64 term per pair: ~4 ms of a 2,048-chunk history's choice on an H200), summing in float32 plus the margin
    that keeps each bound at or above the float64 one (its kernel 0.55 ms against 1.01 at the 8B shape on the H200,
    the bounds looser by 4e-5 of the largest: `benchmarks/chunk_bounds.py`, 2026-12-05); the torch path elsewhere."""
    fused = optional_kernel("chunk_bounds", "fused_max_upper_bounds") if device.type == "cuda" else None
    return functools.partial(fused, accumulate=BOUNDS_ACCUMULATE) if fused else max_upper_bounds
